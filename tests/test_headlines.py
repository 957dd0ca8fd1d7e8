"""The headline speed figures of README.md and RESULTS.md §0 are the medians over the recorded
runs (benchmarks/summarize_runs.py over benchmarks/gpu/*.json), not the best run (issue 17, item 6)."""
import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import summarize_runs  # noqa: E402


def summary():
    return summarize_runs.summarize(summarize_runs.load_runs())


def test_medians_from_the_recorded_runs():
    s = summary()
    assert s["eager"]["n"] == 7 and s["replay"]["n"] == 7 and s["transformers"]["n"] == 3
    # the numbers: the best eager run is 10.4 ms, the median of the seven 13.2 ms
    assert round(s["eager"]["min"], 1) == 10.4 and round(s["eager"]["median"], 1) == 13.2
    assert round(s["replay"]["median"], 1) == 10.1
    rows = {r["file"]: r for r in summarize_runs.load_runs()}
    assert round(rows["layer_run9_checks"]["floor"], 3) == 3.687     # not run 7's 3.543


def test_readme_and_results_quote_the_medians():
    s = summary()
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    results = (REPO / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    e, r, t = s["eager"], s["replay"], s["transformers"]
    for text in (readme, results):
        assert f"{r['median']:.1f} ms" in text and f"{e['median']:.1f} ms" in text
        assert f"{s['transformers_over_replay']:.1f}x" in text and f"{s['transformers_over_eager']:.1f}x" in text
        assert f"{e['min']:.1f}-{e['max']:.1f} ms" in text
    assert f"| ours, eager | **{e['median']:.1f} ms** | {e['min']:.1f}-{e['max']:.1f} ms | {e['n']} |" in results
    assert f"| ours, replay | **{r['median']:.1f} ms** | {r['min']:.2f}-{r['max']:.2f} ms | {r['n']} |" in results
    assert f"| transformers, eager (`grouped_mm`) | {t['median']:.1f} ms |" in results
    # the per-run table (run 9's floor corrected to its JSON's) stays in the dated log RESULTS.md was
    log = (REPO / "benchmarks" / "history" / "RESULTS-2026-12-04.md").read_text(encoding="utf-8")
    assert "| run 9 (`layer_run9_checks`) | 3.687 |" in log
    # the best run is never the headline
    assert "10.4 ms eager" not in readme and "10.0 ms replayed" not in readme
