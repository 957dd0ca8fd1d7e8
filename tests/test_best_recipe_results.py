"""RESULTS.md §5 and the dated log's §0.14 quote their raw records: `--recipe best`'s perplexities in
three views beside auto-round (benchmarks/quality/blockround_best.json, the auto-round rerun), the
defaults on the whole split (§5.2), and the earlier, projected real-size cost (log §0.14,
benchmarks/gpu/h200_2026-12-02f, rendered by benchmarks/scripts/blockround_cost.py)."""
import json
import re

from amct_ext.algorithms.recipe import named_recipe, parse_algo, recipe_label
from tests.conftest import REPO, load_script

BENCH = REPO / "benchmarks"
LOG = BENCH / "history" / "RESULTS-2026-12-04.md"


def _section(title: str, next_title: str, path=BENCH / "RESULTS.md") -> str:
    text = path.read_text(encoding="utf-8")
    return text[text.index(title):text.index(next_title)]


def _pct(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+.2f} %"


def test_best_views_are_todays_best_recipe_and_its_headlines():
    best = json.loads((BENCH / "quality" / "blockround_best.json").read_text())
    heads = {h["name"]: h for h in json.loads((BENCH / "quality" / "headlines.json").read_text())["headlines"]}
    assert set(best["schemes"]) == {"w4a16-g128", "w3a16-g128", "w4a16"}
    for s, e in best["schemes"].items():
        algo, prop = named_recipe(s, "best")
        assert e["recipe"] == recipe_label(parse_algo(algo).settings()) + f"@{prop}", s
        assert (e["reported"]["windows"], e["reported"]["first_window"]) == (64, 0)
        assert (e["dev"]["windows"], e["dev"]["first_window"]) == (64, 64)
        assert (e["all"]["windows"], e["all"]["first_window"]) == (1487, 0)
        if f"{s}-best" in heads:          # the 0-63 view is the same run as the headline
            assert heads[f"{s}-best"]["value"] == e["reported"]["ppl"], s
            assert heads[f"{s}-best"]["recipe"] == e["recipe"], s


def test_section_3_4_quotes_the_records():
    record = json.loads((BENCH / "quality" / "blockround_best.json").read_text())
    best = record["schemes"]
    rerun = json.loads((BENCH / "quality" / "peer_autoround_rerun.json").read_text())
    avx512 = json.loads((BENCH / "quality" / "peer_autoround_avx512.json").read_text())
    fs = rerun["full_split"]
    sec = _section("### 5.1 `--recipe best`", "### 5.2 ")
    rows = [r for r in sec.splitlines() if re.match(r"^\| w\d", r)]
    assert [r.split("|")[1].strip() for r in rows] == list(best)
    for row in rows:
        cols = [c.strip() for c in row.strip("|").split("|")]
        s, e, c = cols[0], best[cols[0]], rerun["cells"][cols[0]]
        ours = (e["reported"]["ppl"], e["dev"]["ppl"], e["all"]["ppl"])
        peer = (c["ppl"], c["ppl_dev"], fs["peer"][s]["ppl"])
        assert cols[1] == f"{peer[0]:.4f}" and cols[3] == f"{peer[1]:.4f}" and cols[5] == f"{peer[2]:.4f}", row
        assert cols[2] == f"{ours[0]:.4f} ({_pct(ours[0], peer[0])})", row
        assert cols[4] == f"{ours[1]:.4f} ({_pct(ours[1], peer[1])})", row
        assert cols[6] == f"**{ours[2]:.4f}** ({_pct(ours[2], peer[2])})", row
        same_cpu = avx512["cells"][s]["ppl"]
        assert cols[7] == f"{same_cpu:.4f} (ours {_pct(ours[2], same_cpu)})", row
        old = fs["ours"][f"{s}|best"]["ppl"]
        assert cols[8] == f"{old:.4f} ({_pct(ours[2], old)})", row
        # the section's claim: ahead of auto-round (either machine's) and of the old best on the whole split
        assert ours[2] < peer[2] and ours[2] < same_cpu and ours[2] < old, s
    # the same-CPU rerun is the same protocol on the CPU class of our runs
    assert avx512["machine"]["cpu_class"] == record["machine"]["cpu_class"]
    assert avx512["protocol"]["eval_windows_sha256"] == fs["eval_windows_sha256"]
    assert avx512["protocol"]["calib_windows_sha256"] == fs["calib_windows_sha256"]
    assert all(c["quantized_modules"]["agree"] and c["quantized_modules"]["total"] == 126
               for c in avx512["cells"].values())


def test_section_0_14_is_the_rendered_cost_table():
    cost = load_script("benchmarks/scripts/blockround_cost.py")
    recs = cost.records()
    block = cost.render(recs)
    assert block in _section("### 0.14 `--recipe best`", "## 1. Empty-weight", LOG)
    # the projection, another way: the measured layer plus the steps it did not run
    for r in recs:
        assert abs(r["layer200_s"] - (r["layer_s"] + (200 - r["iters"]) * r["step_s"])) < 1e-6, r["run"]
    # what §0.14 says of memory: the last lease (main's MoE stacks) still over the 64 GB bound
    last = [x for x in recs if x["lease"] == "leaseC"]
    assert last and all(x["block_peak_gib"] > cost.DEVICE_BOUND_GIB for x in last)
    assert all(x["block_peak_gib"] < 61.0 for x in last)
