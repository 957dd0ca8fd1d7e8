"""w8a8's default from the release (issue 35.3) follows from its record: the rule of
amct_ext/algorithms/recipe.py (the lowest whole-split mean over calibration seeds among exportable
candidates) applied to benchmarks/results/release-testbed-w8a8.json picks the release's default
(models/deepseek_v4/plan.py RELEASE_DEFAULTS) and, on the bf16 testbed, the table's default; the
release table's w8a8 cell is that run; the results page carries the rendered table."""
import json

from amct_ext.algorithms.recipe import named_recipe, parse_algo
from models.deepseek_v4.plan import RELEASE_DEFAULTS
from tests.conftest import REPO, load_script

RESULTS = REPO / "benchmarks" / "results"


def _same(a: str, b: str) -> bool:
    return parse_algo(a).settings() == parse_algo(b).settings()


def test_the_rule_picks_each_sources_default():
    s = load_script("benchmarks/scripts/release_w8a8_choice.py")
    rec = json.loads(s.RECORD.read_text())
    for m, cell in rec["cells"].items():       # every run is w8a8 on its model, on the whole split or the dev windows
        for c, views in cell.items():
            for key, runs in views.items():
                for seed, v in runs.items():
                    assert v["scheme"] == "w8a8" and v["model"] == s.MODELS[m] and v["seed"] == int(seed)
                    assert (v["windows"], v["first_window"]) == ((1487, 0) if key == "whole" else (64, 64))
                    assert v["recipe"] == json.loads(json.dumps(parse_algo(rec["candidates"][c]["algo"]).settings()))
    rel, bf = s.choice(rec, "rel"), s.choice(rec, "bf")
    assert _same(rec["candidates"][rel]["algo"], RELEASE_DEFAULTS["w8a8"][0])
    assert _same(rec["candidates"][bf]["algo"], named_recipe("w8a8")[0])


def test_release_table_cell_is_the_chosen_run():
    s = load_script("benchmarks/scripts/release_w8a8_choice.py")
    rec = json.loads(s.RECORD.read_text())
    cell = json.loads((RESULTS / "release-testbed.json").read_text())["w8a8-default"]
    chosen = rec["cells"]["rel"][s.choice(rec, "rel")]["whole"]["0"]
    assert cell["ppl"] == chosen["ppl"] and cell["recipe"]["algorithms"] == chosen["recipe"]


def test_results_page_carries_the_table():
    s = load_script("benchmarks/scripts/release_w8a8_choice.py")
    rec = json.loads(s.RECORD.read_text())
    text = (RESULTS / "release-testbed.md").read_text()
    block = text.split("<!-- release-w8a8-choice:begin -->", 1)[1].split("<!-- release-w8a8-choice:end -->", 1)[0]
    assert block.strip() == s.table(rec)


def test_real_size_times_are_results_rows():
    """A candidate's real-size seconds are the capture + solve of its row in RESULTS §2 (itself
    checked against its run record by tests/test_layer_speed_index.py)."""
    s = load_script("benchmarks/scripts/release_w8a8_choice.py")
    rows = [line for line in (REPO / "benchmarks" / "RESULTS.md").read_text().splitlines() if line.startswith("| `")]
    for c, (algo, _, secs, run) in s.CANDIDATES.items():
        if secs is None:
            continue
        folder, tag = run.split()
        (row,) = [r for r in rows if f"`{folder}` {tag} |" in r]
        cells = [x.strip() for x in row.strip().strip("|").split("|")]
        assert cells[2] == f"{secs:.1f}" and "w8a8" in cells[1], (c, row)


def test_results_index_quotes_before_and_after():
    """RESULTS §3.1: w8a8's default from the release before (RTN) and after (the rule's choice), and
    the bf16 default's figure, on the whole split."""
    s = load_script("benchmarks/scripts/release_w8a8_choice.py")
    rec = json.loads(s.RECORD.read_text())
    rel, bf = s.means(rec, "rel"), s.means(rec, "bf")
    text = " ".join((REPO / "benchmarks" / "RESULTS.md").read_text().split())
    assert (f"before / after 2026-12-06: {rel['rtn']:.3f} / {rel[s.choice(rec, 'rel')]:.3f}, "
            f"bf16 {bf[s.choice(rec, 'bf')]:.3f} unchanged") in text
