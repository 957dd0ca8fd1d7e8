#!/usr/bin/env python
"""What reading every shard's header adds to the job plan at V4-Flash size (issue 36).

Times the valid V4-Flash plan (``build_job``: w4a16-g128, compressed-tensors export with
--dequantize-rest, the job of benchmarks/RESULTS.md §14) in one process, alternating runs with
the header check (``plan_checks.check_checkpoint_headers``) on and off, after one warm-up, and
the header check alone: wall seconds and this process's CPU seconds (``time.process_time``; on the
shared 2-core box the wall time is mostly waiting for a core). The checkpoint is ``plan_time_to_error.write_index_only_checkpoint``'s
(real headers, sparse data); pass ``--ckpt`` to reuse one.

    PYTHONPATH=$PWD python benchmarks/plan_header_cost.py --out /tmp/plan-hdr [--repeats 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt", default=None, help="an existing V4-Flash folder of plan_time_to_error.py")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from plan_time_to_error import write_index_only_checkpoint

    from amct_ext.data import CALIB_DEFAULT, EVAL_DEFAULT
    from amct_ext.io.checkpoint import CheckpointReader
    from amct_ext.pipeline import plan_checks
    from amct_ext.pipeline.job import PtqOptions, ResolvedPaths, build_job
    from models.deepseek_v4.plan import DeepseekV4PlanSpec

    root = Path(args.out)
    good = Path(args.ckpt) if args.ckpt else write_index_only_checkpoint(root / "flash")

    def plan():
        return build_job(PtqOptions(output_dir=str(root / "o"), scheme="w4a16-g128", calib_samples=128,
                                    seq_len=2048, batch_size=1, eval_batch_size=1, dtype="bf16",
                                    export="compressed-tensors", dequantize_rest=True), DeepseekV4PlanSpec(),
                         ResolvedPaths(good, CALIB_DEFAULT, EVAL_DEFAULT))

    real = plan_checks.check_checkpoint_headers
    plan()                                            # warm-up: imports, skeleton caches
    on, off, alone = [], [], []

    def timed(fn):
        t, c = time.perf_counter(), time.process_time()
        r = fn()
        return r, (time.perf_counter() - t, time.process_time() - c)

    for _ in range(args.repeats):
        for enabled, into in ((True, on), (False, off)):
            plan_checks.check_checkpoint_headers = real if enabled else (lambda *a, **k: 0)
            into.append(timed(plan)[1])
        plan_checks.check_checkpoint_headers = real
        spec = DeepseekV4PlanSpec()
        cfg = spec.read_config(good)
        with CheckpointReader(good) as r:
            n, dt = timed(lambda: real(r, spec.expected_tensors(cfg), "bench"))
            alone.append(dt)
    with CheckpointReader(good) as r:
        shards, keys = len(set(r.weight_map.values())), len(r.weight_map)
    out = {"shards": shards, "keys": keys, "tensors_checked": n, "repeats": args.repeats,
           "wall_cpu_s_with_headers": [[round(w, 2), round(c, 2)] for w, c in on],
           "wall_cpu_s_without_headers": [[round(w, 2), round(c, 2)] for w, c in off],
           "wall_cpu_s_headers_alone": [[round(w, 2), round(c, 2)] for w, c in alone]}
    for name, xs in (("with", on), ("without", off), ("headers_alone", alone)):
        out[f"median_cpu_s_{name}"] = round(statistics.median(c for _, c in xs), 2)
        out[f"median_wall_s_{name}"] = round(statistics.median(w for w, _ in xs), 2)
    print(json.dumps(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
