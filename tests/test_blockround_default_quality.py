"""Block-wise rounding as the weight-only default (issue 34, items 2-3): the record
benchmarks/quality/blockround_default.json is today's default and `--recipe best`, it holds every
seed of both sides on one protocol, the claims the results file makes follow from it, and the file
carries the rendered table (benchmarks/scripts/blockround_default_quality.py)."""
import json

import pytest

from amct_ext.algorithms.recipe import named_recipe, parse_algo
from tests.conftest import REPO, load_script

BENCH = REPO / "benchmarks"
DOC = BENCH / "results" / "block-rounding.md"


@pytest.fixture(scope="module")
def q():
    return load_script("benchmarks/scripts/blockround_default_quality.py")


@pytest.fixture(scope="module")
def rec(q):
    return json.loads(q.RECORD.read_text())


def _same(algo_a: str, algo_b: str) -> bool:
    return parse_algo(algo_a).settings() == parse_algo(algo_b).settings()


def test_record_measures_todays_default_and_best(q, rec):
    for s in q.SCHEMES:
        d_algo, d_prop = named_recipe(s, "default")
        assert _same(d_algo, rec["recipes"]["ours100"]["algo"]) and d_prop == rec["recipes"]["ours100"]["propagate"], s
        b_algo, b_prop = named_recipe(s, "best")
        assert _same(b_algo, rec["recipes"]["best200"]["algo"]) and b_prop == rec["recipes"]["best200"]["propagate"], s
    for r, spec in rec["recipes"].items():       # every folder ran the recipe the record names
        want = json.loads(json.dumps(parse_algo(spec["algo"]).settings()))
        for s in q.SCHEMES:
            for seed, views in rec["cells"][s][r].items():
                for v in views.values():
                    assert v["recipe"] == want and v["seed"] == int(seed) and v["propagate"] == spec["propagate"]


def test_every_seed_on_one_protocol(q, rec):
    """Both sides at seeds 0-2, auto-round on one set of windows and one version, all 126 Linears."""
    for s in q.SCHEMES:
        c = rec["cells"][s]
        assert sorted(c["ar"]) == ["0", "1", "2"], s
        for r in ("ours100", "best200"):
            assert sorted(c[r]) == ["0", "1", "2"] and all("all" in v for v in c[r].values()), (s, r)
        assert len({a["eval_windows_sha256"] for a in c["ar"].values()}) == 1
        assert {a["versions"]["auto-round"] for a in c["ar"].values()} == {"0.16.1"}
        assert all(a["quantized_modules"] == 126 for a in c["ar"].values())
    shas = {a["eval_windows_sha256"] for s in q.SCHEMES for a in rec["cells"][s]["ar"].values()}
    assert len(shas) == 1


def test_claims(q, rec):
    """The defaults at least as good as auto-round on the mean of the whole split, `--recipe best`
    ahead of it; no default worse than turn-3 main on windows 0-63 (seed 0, the reported headline's
    draw)."""
    for s in q.SCHEMES:
        c = rec["cells"][s]
        assert q.mean(c["ours100"], "all") <= q.mean(c["ar"]), s
        assert q.mean(c["best200"], "all") < q.mean(c["ar"]), s
        assert c["ours100"]["0"]["reported"]["ppl"] <= q.TURN3_LIMITS[s], s


def test_results_file_carries_the_rendered_table(q, rec):
    assert q.render(rec) in DOC.read_text(encoding="utf-8")
    assert q.render_before_after(rec) in DOC.read_text(encoding="utf-8")


def test_no_changed_default_got_worse(q, rec):
    """§3: the replaced defaults (main ba169f2, seed 0, whole split, same CPU) against today's."""
    assert sorted(rec["before"]) == sorted(q.SCHEMES)
    for s, b in rec["before"].items():
        assert rec["cells"][s]["ours100"]["0"]["all"]["ppl"] < b["ppl"], s


def test_recompute_units_rerun_equals_the_record(rec):
    """recompute_units=false (the default since 2026-12-06) moves intermediates between memory and
    recomputation only: the whole-split reruns of the five block-rounding defaults after it equal the
    records measured before it, to the last digit (same recipe settings, seed, windows)."""
    rerun = json.loads((BENCH / "quality" / "recompute_units_rerun.json").read_text())
    w4a8 = json.loads((BENCH / "quality" / "w4a8_default.json").read_text())
    before = {s: rec["cells"][s]["ours100"]["0"]["all"] for s in ("w4a16-g128", "w3a16-g128", "w4a16", "w2a16-g64")}
    before["w4a8"] = w4a8["cells"]["tiny-trained"]["block-wise rounding (default since 2026-12-06)"]["0"]
    assert sorted(rerun["runs"]) == sorted(before)
    for s, run in rerun["runs"].items():
        assert run["scheme"] == s and run["windows"] == 1487 and run["seed"] == 0
        assert run["recipe"] == before[s]["recipe"] and run["propagate"] == before[s]["propagate"], s
        assert run["ppl"] == before[s]["ppl"], s
    _assert_results_row("recompute_units_rerun.json", {s: before[s]["ppl"] for s in before}, rerun)


SCHEMES = ("w4a16-g128", "w3a16-g128", "w4a16", "w2a16-g64", "w4a8")


def _assert_results_row(after_file: str, before_ppl: dict, after: dict, before_file: str | None = None,
                        label: str | None = None) -> None:
    """RESULTS §4's tiny-table row for ``after_file`` (one row a change) names the records and the
    host, and quotes each scheme's before / after perplexity in its column."""
    rows = [line for line in (BENCH / "RESULTS.md").read_text().splitlines()
            if line.lstrip().startswith("|") and f"→ `{after_file}` |" in line]
    assert len(rows) == 1, after_file
    cells = [c.strip() for c in rows[0].strip().strip("|").split("|")]
    assert cells[1] == after["cpu_class"], after_file
    assert before_file is None or cells[2] == f"`{before_file}` → `{after_file}`", after_file
    assert label is None or label in cells[0], (after_file, label)
    assert cells[3:] == [f"{before_ppl[s]:.4f} / {after['runs'][s]['ppl']:.4f}" for s in SCHEMES], after_file


def _assert_rerun_equals(rerun_file: str, before_file: str, quoted_after: str) -> None:
    """A whole-split rerun record of the five block-rounding defaults equals the record before to
    the last digit (same scheme, windows, seed, recipe); RESULTS §4's row for the change (labelled
    with ``quoted_after``) quotes both sides."""
    rerun = json.loads((BENCH / "quality" / rerun_file).read_text())
    before = json.loads((BENCH / "quality" / before_file).read_text())["runs"]
    assert sorted(rerun["runs"]) == sorted(before)
    for s, run in rerun["runs"].items():
        assert (run["scheme"], run["windows"], run["first_window"], run["seed"]) == (s, 1487, 0, 0)
        assert run["recipe"] == before[s]["recipe"] and run["propagate"] == before[s]["propagate"], s
        assert run["ppl"] == before[s]["ppl"], s
    _assert_results_row(rerun_file, {s: r["ppl"] for s, r in before.items()}, rerun, before_file, quoted_after)


def test_prefetch_rerun_equals_the_record(rec):
    """``prefetch`` (each step's samples copied a step ahead, the default since 2026-12-06) and the
    fused kernels' launch shape (CUDA only) change no CPU number: the whole-split reruns of the five
    block-rounding defaults after them equal the records from before, to the last digit; RESULTS
    quotes both sides."""
    _assert_rerun_equals("prefetch_rerun.json", "recompute_units_rerun.json", "prefetch and the launch shape")


def test_hc_autograd_rerun_equals_the_record(rec):
    """The hc ends' own backward on the kernels (CUDA only) changes no CPU number: the whole-split
    reruns of the five block-rounding defaults after it equal the records from before, to the last
    digit; RESULTS quotes both sides."""
    _assert_rerun_equals("hc_autograd_rerun.json", "prefetch_rerun.json", "the hc ends' own backward")


def test_banded_attention_rerun_equals_the_record_on_its_host(rec):
    """The sparse attention's own backward (CUDA only) changes no CPU number: the whole-split reruns
    of the five block-rounding defaults after it equal main's before it on the same host, to the last
    digit (an earlier host of the same class gave other digits, casebook i34-12); RESULTS quotes both
    sides."""
    _assert_rerun_equals("banded_attention_rerun.json", "banded_attention_before.json", "the attention's own backward")


def test_slot_combine_rerun_equals_the_record_on_its_host(rec):
    """The routed experts' combine with its own backward (``fused_moe.SlotCombine``: on the CPU the
    same forward ops, a backward of one gather) changes no CPU number: the whole-split reruns of the
    five block-rounding defaults after it equal main's before it on the same host, to the last digit;
    RESULTS quotes both sides."""
    _assert_rerun_equals("slot_combine_rerun.json", "slot_combine_before.json", "the routed experts' combine")


def test_build_stacks_rerun_equals_the_record_on_its_host(rec):
    """A layer's build decoding its experts into the grouped-GEMM stacks (casebook i34-14) and the
    quantized MoE's chunked fake-quant path (i34-15, never taken on the CPU) change no CPU number:
    the whole-split reruns of the five block-rounding defaults after them equal main's before them
    on the same host, to the last digit; RESULTS quotes both sides."""
    _assert_rerun_equals("build_stacks_rerun.json", "build_stacks_before.json", "holds its experts once")



def test_turns_rerun_equals_the_record_on_its_host(rec):
    """The experts tuned in turns where they do not fit the device (casebook i34-17; one turn on the
    CPU) and the routed experts' forward split into segments change no CPU number: the whole-split
    reruns of the five block-rounding defaults equal the record before, on the same host."""
    _assert_rerun_equals("turns_rerun.json", "build_stacks_rerun.json", "The experts in turns")


@pytest.mark.parametrize("after_file, before_file", [("step_once_rerun.json", "turns_rerun.json"),
                                                     ("review_mend_rerun.json", "step_once_rerun.json"),
                                                     ("pro_end_rerun.json", "review_mend_rerun.json"),
                                                     ("pro_end_turns4.json", "turns4.json"),
                                                     ("review2_rerun.json", "pro_end_rerun.json"),
                                                     ("review2_turns4.json", "pro_end_turns4.json"),
                                                     ("lean_end_rerun.json", "review2_rerun.json"),
                                                     ("lean_end_turns4.json", "review2_turns4.json"),
                                                     ("review3_rerun.json", "lean_end_rerun.json"),
                                                     ("review3_turns4.json", "lean_end_turns4.json"),
                                                     ("hoststack_rerun.json", "review3_rerun.json"),
                                                     ("hoststack_turns4.json", "review3_turns4.json"),
                                                     ("hclip_fit_rerun.json", "hoststack_rerun.json"),
                                                     ("tip13_rerun.json", "hclip_fit_rerun.json"),
                                                     ("tip13_turns4.json", "hoststack_turns4.json"),
                                                     ("tip14_rerun.json", "tip13_rerun.json"),
                                                     ("tip14_turns4.json", "tip13_turns4.json"),
                                                     ("tip15_rerun.json", "base518_rerun.json"),
                                                     ("tip15_turns4.json", "base518_turns4.json")])
def test_later_reruns_equal_the_turns_record(rec, after_file, before_file):
    """The offsets stepping once a batch where samples run apart (casebook i34-19), ``micro_batch``,
    the review mend (one fold check, ``formats.fixed_grid``), and the turns' end settled in a new
    order with the folded experts run on their weights (casebook i34-20; four turns too) change no
    number where the samples concatenate: each whole-split rerun of the five defaults equals the one before it on the same
    host, to the last digit; RESULTS names both records."""
    after = json.loads((BENCH / "quality" / after_file).read_text())
    before = json.loads((BENCH / "quality" / before_file).read_text())
    assert after["cpu_class"] == before["cpu_class"] and sorted(after["runs"]) == sorted(before["runs"])
    for s, run in after["runs"].items():
        assert (run["windows"], run["seed"], run["recipe"]) == (1487, 0, before["runs"][s]["recipe"]), s
        assert run["ppl"] == before["runs"][s]["ppl"], s
    _assert_results_row(after_file, {s: r["ppl"] for s, r in before["runs"].items()}, after, before_file)



def test_the_whole_change_since_6756be4_quoted(rec):
    """The algorithm changes since 6756be4 (review3 records) to the tip (tip14 records): the same
    digits, the five defaults and four turns, as RESULTS §4 quotes them before / after."""
    results = " ".join((BENCH / "RESULTS.md").read_text().split())
    quote = results.split("Across the algorithm changes since 6756be4", 1)[1].split(". ", 2)
    quote = ". ".join(quote[:2])
    for before_file, after_file, lead in (("review3_rerun.json", "tip14_rerun.json", ""),
                                          ("review3_turns4.json", "tip14_turns4.json", "four turns")):
        before = json.loads((BENCH / "quality" / before_file).read_text())
        after = json.loads((BENCH / "quality" / after_file).read_text())
        assert before["cpu_class"] == after["cpu_class"] and f"`{before_file}`" in quote and f"`{after_file}`" in quote
        cells = [f"{before['runs'][s]['ppl']:.4f} / {after['runs'][s]['ppl']:.4f}" for s in SCHEMES]
        for s, c in zip(SCHEMES, cells):
            assert after["runs"][s]["ppl"] == before["runs"][s]["ppl"], (after_file, s)
            assert (f"{s} {c}" if not lead else c) in quote, (after_file, s)
        if lead:
            assert f"{lead} {', '.join(cells)}" in quote
