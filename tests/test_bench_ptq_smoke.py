"""benchmarks/bench_ptq.py --smoke: the job's own entry point (run_job) on a tiny synthetic checkpoint with the
V4-Flash layer pattern, timed per phase, with the statistics capture and projections."""
import json
import sys

from tests.conftest import REPO


def test_bench_ptq_smoke(tmp_path, one_thread):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_ptq
    from amct_ext.pipeline import job_runner

    calls = []
    real_run = job_runner.run_job
    job_runner.run_job = lambda job, phases=None, t_start=None: calls.append(job) or real_run(
        job, phases=phases, t_start=t_start)
    try:
        out = tmp_path / "r.json"
        assert bench_ptq.main(["--smoke", "--workdir", str(tmp_path / "w"), "--keep", "--json", str(out)]) == 0
    finally:
        job_runner.run_job = real_run
    assert len(calls) == 1                                  # the job's own entry point ran, once
    r = json.loads(out.read_text())
    per = r["ptq"]["per_layer"]
    assert sorted(per) == ["0", "1", "2", "3"]
    for i, rec in per.items():
        assert {"build", "capture", "write"} <= set(rec["phases"]) and rec["seconds"] > 0
        # the default recipe solves a layer's units together; the legacy solver one unit at a time
        assert "solve:recipe" in rec["phases"] or rec["phases"]["solve:expert"]["count"] == 8
        assert rec["phases"]["write"]["count"] == 10
        assert rec["host_peak_bytes"] >= rec["host_anon_peak_bytes"] > 0
        # w8a8's default recipe (rtn) replays no calls: the capture stores none, only per-leaf
        # Hessians (the statistics path); spilling of stored calls: tests/test_ptq_runtime.py
        assert rec["capture_bytes"] == 0 and rec["spilled_bytes"] == 0 and rec["hessian_bytes"] > 0
    assert r["ptq"]["units"] == 4 * 10
    # the per-layer phases cover the PTQ loop: their sum never exceeds the job's wall time
    assert sum(rec["seconds"] for rec in per.values()) <= r["ptq"]["wall_s"]
    pr = r["projection"]
    assert pr["v4-flash"]["layers"] == 43 and pr["v4-pro"]["layers"] == 61
    assert pr["v4-flash"]["unmeasured_ratios"] == [] and pr["v4-flash"]["total_s"] > 0
    params = list((tmp_path / "w" / "ptq_out" / "ptq_params").glob("layer_*.pt"))
    assert len(params) == 40
    assert not any((tmp_path / "w" / "ptq_out").glob(".scratch/**/*.safetensors"))   # spill files removed


def test_memory_bounds_are_read_from_the_runs_own_accounting(tmp_path, one_thread):
    """bench_ptq --max-device-gib / --max-host-anon-extra-gib: the run's phase records decide.
    A bound below the smoke run's own peaks fails it (exit 3, the layer and the phase named); one
    above them passes; the record lists the layer weights the host bound is counted from."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_ptq

    rec = {"device_peak_bytes": 61 * 2 ** 30, "host_anon_peak_bytes": 20 * 2 ** 30,
           "phases": {"capture": {"device_peak_bytes": 40 * 2 ** 30}, "solve:block": {"device_peak_bytes": 61 * 2 ** 30}}}
    lines = bench_ptq.bound_violations({2: rec}, {2: 6 * 2 ** 30}, 60.0, 16.0)
    assert len(lines) == 1 and "device peak 61.0 GiB (phase solve:block) > 60 GiB" in lines[0]
    lines = bench_ptq.bound_violations({2: rec}, {2: 3 * 2 ** 30}, 61.5, 16.0)
    assert len(lines) == 1 and "host anonymous peak 20.0 GiB" in lines[0]
    assert bench_ptq.bound_violations({2: rec}, {2: 6 * 2 ** 30}, 61.5, 16.0) == []
    # the smoke run: its host peak is far above 0 GiB of extra, far below 1000
    out = tmp_path / "r.json"
    assert bench_ptq.main(["--smoke", "--workdir", str(tmp_path / "w"), "--json", str(out),
                           "--max-host-anon-extra-gib", "0"]) == 3
    r = json.loads(out.read_text())
    assert r["bounds"]["violations"] and all(v > 0 for v in r["bounds"]["layer_weight_bytes"].values())
    assert bench_ptq.main(["--smoke", "--workdir", str(tmp_path / "w2"), "--json", str(out),
                           "--max-host-anon-extra-gib", "1000", "--max-device-gib", "1000"]) == 0
