#!/usr/bin/env python
"""Kernel-level profile of one V4-Flash-shaped layer forward (ours, optionally w8a8), to see what
bounds it. Prints torch.profiler's table sorted by device time.

    python benchmarks/profile_layer.py --device cuda --layer 4 --batch 1 --seq-len 4096 [--w8a8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common as C  # noqa: E402
from amct_ext.runtime import device as D  # noqa: E402
from models.deepseek_v4 import DeepseekV4Config  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="auto")
    ap.add_argument("--config", default=None)
    ap.add_argument("--layer", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--w8a8", action="store_true")
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--shapes", action="store_true", help="group the table by input shapes")
    ap.add_argument("--host-profile", action="store_true",
                    help="also profile the host side (cProfile of 5 forwards): where launch-bound time goes")
    args = ap.parse_args(argv)
    dev = D.resolve_device(args.device)
    config = DeepseekV4Config.from_dict(C.flash_config_dict(args.config)[0])
    block = C.build_block(config, args.layer, dev)
    if args.w8a8:
        from amct_ext.quant.schemes import load_scheme
        from models.deepseek_v4.quant_module import quantize_block

        quantize_block(block, load_scheme("w8a8"), ["attn-linear", "moe"])
    x = torch.randn(args.batch, args.seq_len, config.hc_mult, config.dim, device=dev, dtype=torch.bfloat16)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len), device=dev)
    from amct_ext.runtime.device_checks import deferred_checks

    def forward():
        # as do_block_forward calls a layer: the quantizers' NaN/Inf flags are read back once, at
        # the end (so with --w8a8 "host time to return" includes that one sync)
        with deferred_checks():
            return block(x, 0, ids)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.inference_mode():
        for _ in range(2):
            forward()
        D.synchronize(dev)
        # host time: until the forward returns (kernels queued, not finished), then until done
        host, wall = [], []
        for _ in range(5):
            D.synchronize(dev)
            t0 = time.perf_counter()
            forward()
            t1 = time.perf_counter()
            D.synchronize(dev)
            host.append((t1 - t0) * 1e3)
            wall.append((time.perf_counter() - t0) * 1e3)
        print(f"host {statistics.median(host):.2f} ms to return, {statistics.median(wall):.2f} ms to finish "
              "(median of 5; a host time near the finish time means launch-bound)")
        if args.host_profile:
            import cProfile
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            for _ in range(5):
                forward()
            pr.disable()
            D.synchronize(dev)
            for key in ("tottime", "cumulative"):
                pstats.Stats(pr).sort_stats(key).print_stats(45)
        with torch.profiler.profile(activities=activities, record_shapes=args.shapes) as prof:
            forward()
            D.synchronize(dev)
    key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages(group_by_input_shape=args.shapes).table(
        sort_by=key, row_limit=args.rows, max_name_column_width=60, max_shapes_column_width=80))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
