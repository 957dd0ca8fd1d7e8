#!/usr/bin/env python
"""The two ways a rank gets the float inputs of its first layer (amct_ext/pipeline/distributed.py),
measured with the project's own functions:

- recompute: embed the calibration windows and run layers 0..k-1 float
  (``workflow.float_layer_output``, as a rank of ``--boundary recompute`` does);
- send: rank 0 sends that stream to rank 1 (``distributed.send_stream`` / ``recv_stream``),
  plus a synthetic stream of ``--mb`` MiB to measure the link's bandwidth.

    torchrun --nproc-per-node 2 benchmarks/bench_boundary.py --model-path CKPT [--device cpu]

Prints one JSON object (rank 0); the numbers go into benchmarks/RESULTS.md §12.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from amct_ext.runtime import device as devmod  # noqa: E402
from amct_ext.pipeline import distributed as dist  # noqa: E402
from amct_ext.base import PtqConfig, RunConfig  # noqa: E402
from amct_ext.pipeline.calibration import DEFAULT_CALIBRATION_PATH  # noqa: E402
from amct_ext.quant.schemes import load_scheme  # noqa: E402
from amct_ext.pipeline.workflow import Stream, embed_stream, float_layer_output, load_calib_windows  # noqa: E402
from models.deepseek_v4.adapter import DeepseekV4Adapter  # noqa: E402


def timed_sends(stream, repeats: int, env):
    """Rank 0 sends ``stream`` to rank 1 ``repeats`` times, between barriers; (seconds of each
    send, what rank 1 received last)."""
    times, got = [], None
    for _ in range(repeats):
        dist.barrier(env)
        t0 = time.perf_counter()
        if env.rank == 0:
            dist.send_stream(stream, 1, env)
        else:
            got = dist.recv_stream(0, env)
        dist.barrier(env)
        times.append(time.perf_counter() - t0)
    return times, got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calib-samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2, help="k: the boundary is the input of layer k")
    ap.add_argument("--mb", type=int, default=256, help="synthetic stream size for the bandwidth")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    env = dist.env_from()
    if env is None or env.world_size != 2:
        raise SystemExit("run under torchrun --nproc-per-node 2")
    env = dist.init(env, args.device)
    scheme, targets = load_scheme("w8a8"), ["attn-linear", "moe"]
    cfg = PtqConfig(n_samples=args.calib_samples, seq_len=args.seq_len, calib_path=DEFAULT_CALIBRATION_PATH)
    with DeepseekV4Adapter(RunConfig(args.model_path, device=str(env.device), dtype=torch.float32,
                                     progress=False)) as adapter:
        windows = load_calib_windows(adapter, cfg)
        dist.barrier(env)
        rec = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            s = embed_stream(adapter, windows, 1)
            for i in range(args.layers):
                block = adapter.block(i)
                s = float_layer_output(adapter, block, s, True, scheme, targets)
                adapter.release_block(block)
            devmod.synchronize(env.device)
            rec.append(time.perf_counter() - t0)
        nbytes = s.nbytes
        dist.barrier(env)
        sent, got = timed_sends(s, args.repeats, env)
        if env.rank == 1:
            assert all(torch.equal(a, b) for a, b in zip(s.hidden, got.hidden))   # the very bits
        big = Stream([torch.randn(args.mb * 2 ** 20 // 4)], [{}])
        bw = [big.nbytes / t for t in timed_sends(big, args.repeats, env)[0]]
    if env.rank == 0:
        print(json.dumps({
            "device": str(env.device), "backend": devmod.dist_backend(env.device.type),
            "calib": [args.calib_samples, args.seq_len], "boundary_layer": args.layers,
            "stream_bytes": nbytes, "recompute_s_median": sorted(rec)[len(rec) // 2],
            "send_recv_s_median": sorted(sent)[len(sent) // 2],
            "link_bytes_per_s_median": sorted(bw)[len(bw) // 2], "synthetic_mb": args.mb,
            "torch": torch.__version__, "threads_per_rank": torch.get_num_threads(),
        }, indent=1))
    dist.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
