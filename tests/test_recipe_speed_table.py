"""benchmarks/scripts/recipe_speed_table.py: the GPTQ floor it prints and how it reads repeats, and the
dated log's §0.10-0.13 (benchmarks/history/RESULTS-2026-12-04.md) quote its rows of the committed runs."""
from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import REPO, load_script


def _table():
    return load_script("benchmarks/scripts/recipe_speed_table.py")


def test_gptq_floor_of_the_flash_experts_is_the_hand_count_of_results_0_9():
    """RESULTS §0.9 counts the 256 V4-Flash experts' GPTQ by hand: per expert w1 | w3 stacked
    (R 4096, C 4096) and w2 (R 4096, C 2048), (4/3) C^3 + R C^2 / 2 multiply-adds each: 7.5e13 FLOP."""
    from models.deepseek_v4.configuration import DeepseekV4Config
    from models.deepseek_v4.synthetic import synthetic_config_dict

    t = _table()
    sh = t.layer_shapes(DeepseekV4Config(**synthetic_config_dict("v4-flash", 3)), 2)
    assert sh["w1"] == (2048, 4096) and sh["w2"] == (4096, 2048) and sh["experts"] == 256
    per_expert_mac = (4 / 3) * 4096 ** 3 + 4096 * 4096 ** 2 / 2 + (4 / 3) * 2048 ** 3 + 4096 * 2048 ** 2 / 2
    parts = t.gptq_solve_flop_parts(sh)
    assert abs(parts["experts"] - 2 * 256 * per_expert_mac) <= 1e-9 * parts["experts"]
    assert 7.4e13 < parts["experts"] < 7.6e13
    # the grouped wo_a: one Hessian per output group (8 of 4096 columns), not one of 32768
    assert sh["wo_a"] == (8 * 1024, 4096) and sh["groups"] == 8


def _bench_json(path: Path, layer: int, capture: float, solve: float, total: float, anon: int) -> None:
    rec = {"phases": {"capture": {"seconds": capture}, "solve:recipe": {"seconds": solve}}, "seconds": total,
           "host_peak_bytes": 2 * anon, "host_anon_peak_bytes": anon, "device_peak_bytes": 3 * anon,
           "floors": {"solve_flops_floor_s": 1.0, "h2d_floor_s": 0.5}, "unit_seconds_by_kind": {}}
    path.write_text(json.dumps({"args": {"algo": "gptq:sequential=false", "extra": ["--scheme", "w8a8"]},
                                "ptq": {"per_layer": {str(layer): rec}, "outside_layers_s": 30.0,
                                        "float_predecessors": {"seconds": 20.0},
                                        "report": {"calibration": {"samples": 8, "seq_len": 64}}}}))


def test_repeats_give_median_and_spread_and_a_stopped_run_is_listed(tmp_path):
    t = _table()
    for r, (c, s, tot) in enumerate([(1.0, 10.0, 12.0), (3.0, 12.0, 40.0), (2.0, 50.0, 25.0)], start=1):
        _bench_json(tmp_path / f"ours_gptq-nseq-8.r{r}.json", 2, c, s, tot, 2 ** 30)
    (tmp_path / "ours_gptq-nseq-8.r4.json").write_text(json.dumps({"args": {}}))   # stopped: no "ptq"
    (tmp_path / "ours_gptq-nseq-8.r4.log").write_text("[phase] layer 2 capture: 7.50 s, device peak 1.0 GiB, "
                                                     "host RSS 2.0 GiB (anon 1.0) {'ended_by': 'KeyboardInterrupt'}\n")
    (row,) = t.ours_rows(tmp_path, 2, {}, None)
    assert row["runs"] == 3 and row["solve_s"] == {"median": 12.0, "min": 10.0, "max": 50.0, "n": 3}
    assert row["capture_solve_s"]["median"] == 15.0   # per run: 11, 15, 52
    # projection: 43 x the layer + what runs once outside the layers, less the float predecessors
    assert abs(row["projection_min"]["median"] - (43 * 25.0 + 10.0) / 60) < 1e-9
    assert len(row["stopped"]) == 1 and "capture 7.5 s (stopped here)" in row["stopped"][0]
    md = t.markdown([row], {}, None, "")
    assert "12.0 [10.0-50.0]" in md and "1 run(s) stopped" in md


def test_a_run_killed_before_its_json_is_listed_from_its_log(tmp_path):
    """bench_ptq killed by its limit after the layer, before it wrote its JSON (casebook i24-or-6):
    the row is still there, stopped, with the phases of its log and the recipe of its meta.json."""
    t = _table()
    (tmp_path / "ours_gptq-seq-128.r1.log").write_text(
        "[phase] layer 2 capture: 24.89 s, device peak 36.3 GiB, host RSS 30.9 GiB (anon 17.4)\n"
        "[phase] layer 2 solve:recipe: 16.51 s, device peak 49.9 GiB, host RSS 31.0 GiB (anon 17.5) {'device': 'cuda:0'}\n")
    (tmp_path / "ours_gptq-seq-128.r1.meta.json").write_text(json.dumps(
        {"scheme": "w8a8", "solver": {"recipe": [{"name": "gptq", "sequential": True}]}}))
    (row,) = t.ours_rows(tmp_path, 2, {}, None)
    assert row["tag"] == "gptq-seq-128" and row["runs"] == 0 and row["scheme"] == "w8a8"
    assert row["algo"] == "`gptq`"
    assert len(row["stopped"]) == 1 and "capture 24.9 s" in row["stopped"][0] and "solve:recipe 16.5 s" in row["stopped"][0]
    assert "no JSON written" in row["stopped"][0]


def _committed_rows(tmp_path, folder: str) -> list[str]:
    """The table rows recipe_speed_table.py makes of a committed H200 run folder."""
    import shutil
    import subprocess
    import sys

    work = tmp_path / folder
    shutil.copytree(REPO / "benchmarks" / "gpu" / folder / "res", work)
    md = tmp_path / f"{folder}.md"
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "scripts" / "recipe_speed_table.py"), "--results", str(work),
                    "--layer", "2", "--gptq-scheme", "w8a8", "--md", str(md), "--json", str(tmp_path / f"{folder}.json")],
                   check=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, capture_output=True)
    return [r for r in md.read_text().splitlines() if r.startswith(ROW_PREFIXES)]


ROW_PREFIXES = ("| def-", "| gptq-", "| llmc-", "| alt-")
#: the sections this file checks are dated: they stay in the log RESULTS.md was until 2026-12-04
LOG = REPO / "benchmarks" / "history" / "RESULTS-2026-12-04.md"


def _quoted_rows(start: str, end: str) -> list[str]:
    text = LOG.read_text(encoding="utf-8")
    sec = text[text.index(start):text.index(end)]
    return [r for r in sec.splitlines() if r.startswith(ROW_PREFIXES)]


def test_results_0_10_is_the_table_of_the_committed_h200_runs(tmp_path):
    """RESULTS §0.10 quotes, row by row, what recipe_speed_table.py makes of the committed H200 JSONs
    (benchmarks/gpu/h200_2026-12-02/res): a number edited by hand, or a run's JSON changed, fails."""
    rows = _committed_rows(tmp_path, "h200_2026-12-02")
    assert len(rows) == 12 and _quoted_rows("### 0.10 ", "### 0.11 ") == rows


def test_results_0_11_is_the_table_of_the_committed_h200_runs(tmp_path):
    """The same for §0.11 (benchmarks/gpu/h200_2026-12-02b/res: sequential GPTQ on statistics,
    the fp8 / mxfp8 / w4a16-g128 defaults, llm-compressor at 8 and 32, --recipe best)."""
    rows = _committed_rows(tmp_path, "h200_2026-12-02b")
    assert len(rows) == 10 and _quoted_rows("### 0.11 ", "### 0.12 ") == rows
    seq = [r for r in rows if r.startswith("| gptq-seq-")]
    assert len(seq) == 3 and all("3 re-runs of the layer" in r for r in seq)


def test_results_0_12_is_the_table_of_the_committed_h200_runs(tmp_path):
    """The same for §0.12's two leases (benchmarks/gpu/h200_2026-12-02c/res: re-runs that stop
    and pinned hidden states; h200_2026-12-02d/res: the Triton sweep, gptq-seq-128 three times)."""
    lease1 = _committed_rows(tmp_path, "h200_2026-12-02c")
    lease2 = _committed_rows(tmp_path, "h200_2026-12-02d")
    assert len(lease1) == 5 and len(lease2) == 7
    assert _quoted_rows("**Lease 1**", "**Lease 2**") == lease1
    assert _quoted_rows("**Lease 2**", "Against issue 24's targets:\n\n| target | measured | verdict |\n| --- | --- | --- |\n"
                        "| `gptq` (sequential) solve <= 20 s at 8 / 32 / 128") == lease2
    seq128 = next(r for r in lease2 if r.startswith("| gptq-seq-128 |"))
    # a median over three runs, each re-run's time split out
    assert "14.7 [14.5-15.0]" in seq128 and "(expert+shared_expert 2.5, attn 0.7, attn 1.3)" in seq128


def test_results_0_13_is_the_table_of_the_committed_h200_runs(tmp_path):
    """The same for §0.13 (benchmarks/gpu/h200_2026-12-02e/res: GPTQ and llm-compressor at 8 / 32 /
    128 windows, the new w4a16-g128 default, w4a16's --recipe best cut by its limit)."""
    rows = _committed_rows(tmp_path, "h200_2026-12-02e")
    assert len(rows) == 9 and _quoted_rows("### 0.13 ", "## 1. Empty-weight") == rows
    seq128 = next(r for r in rows if r.startswith("| gptq-seq-128 |"))
    assert "capture 24.9 s" in seq128 and "solve:recipe 16.5 s" in seq128 and "no JSON written" in seq128
    alt1 = next(r for r in rows if r.startswith("| alt-1 |"))
    assert "| 46.6 |" in alt1 and "hclip:sweeps=2,gptq:sequential=false" in alt1
