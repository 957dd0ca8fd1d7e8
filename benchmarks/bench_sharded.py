#!/usr/bin/env python
"""One V4-Flash-shaped layer (random weights, released FP8/FP4 format on disk) built with the
sharded path across every GPU, against the same layer built on one GPU.

Prints the placement per module group (stem / attention / indexer / experts per device), checks
the sharded forward equals the single-device forward (bf16 tolerance), and times build and
forward with the per-device peak memory.

    python benchmarks/bench_sharded.py --device cuda --json $OUT/sharded.json
    python benchmarks/bench_sharded.py --smoke        # tiny config on CPU (devices cpu, cpu, cpu)
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common as C  # noqa: E402
from bench_load import write_layer  # noqa: E402

from amct_ext.runtime import device as D  # noqa: E402
from amct_ext.base import RunConfig  # noqa: E402
from amct_ext.io.checkpoint import CheckpointReader  # noqa: E402
from models.deepseek_v4 import DeepseekV4Config  # noqa: E402
from models.deepseek_v4.adapter import DeepseekV4Adapter  # noqa: E402
from models.deepseek_v4.loading import load_block  # noqa: E402


def placement(block) -> dict[str, dict[str, int]]:
    """bytes per device for each module group."""
    out: dict[str, dict[str, int]] = collections.defaultdict(lambda: collections.defaultdict(int))
    for name, p in block.named_parameters():
        if name.startswith("attn.indexer."):
            group = "indexer"
        elif name.startswith("attn."):
            group = "attention"
        elif name.startswith("ffn.experts."):
            group = "routed experts"
        else:
            group = "stem (norms, hc, gate, shared expert)"
        out[group][str(p.device)] += p.numel() * p.element_size()
    return {g: dict(v) for g, v in out.items()}


def timed(fn, dev, devices, repeats):
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        for d in devices:
            D.synchronize(d)
        t = time.perf_counter()
        out = fn()
        for d in devices:
            D.synchronize(d)
        times.append((time.perf_counter() - t) * 1e3)
    return out, statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--layer", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    if args.smoke:
        from models.deepseek_v4.tiny import tiny_config

        config, dev, devices, seq = tiny_config(), torch.device("cpu"), ["cpu", "cpu", "cpu"], 160
        args.layer = 3
    else:
        raw, _ = C.flash_config_dict()
        config = DeepseekV4Config.from_dict(raw)
        dev = D.resolve_device(args.device)
        devices = [str(d) for d in D.device_list(dev.type)]
        seq = args.seq_len
    result: dict = {"devices": devices, "layer": args.layer, "seq_len": seq}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        result["write"] = write_layer(config, args.layer, dev, folder, seed=0, check_against_cpu=False)
        gen = torch.Generator(device="cpu").manual_seed(1)
        x = torch.randn(1, seq, config.hc_mult, config.dim, generator=gen).to(dev, torch.bfloat16)
        ids = torch.randint(0, config.vocab_size, (1, seq), generator=gen).to(dev)

        # single device
        for d in devices:
            D.reset_peak_memory(d)
        with CheckpointReader(folder) as reader:
            t = time.perf_counter()
            single, _ = load_block(reader, config, args.layer, torch.bfloat16, dev)
            D.synchronize(dev)
            build_single = (time.perf_counter() - t) * 1e3
        with torch.inference_mode():
            ref, fwd_single = timed(lambda: single(x, 0, ids), dev, [dev], args.repeats)
        result["single"] = {"device": str(dev), "build_ms": build_single, "forward_ms": fwd_single,
                            "peak_bytes": D.peak_memory_bytes(dev)}
        ref = ref.float().cpu()
        del single
        D.empty_cache(dev)

        # sharded over every device
        for d in devices:
            D.reset_peak_memory(d)
        adapter = DeepseekV4Adapter(RunConfig(model_path=folder, device=str(dev), dtype=torch.bfloat16,
                                              shard_devices=devices, progress=False))
        t = time.perf_counter()
        block = adapter.block(args.layer, sharded=True)
        for d in devices:
            D.synchronize(d)
        build_sharded = (time.perf_counter() - t) * 1e3
        result["placement_bytes"] = placement(block)
        with torch.inference_mode():
            out, fwd_sharded = timed(lambda: block(x, 0, ids), dev, devices, args.repeats)
        result["sharded"] = {"build_ms": build_sharded, "forward_ms": fwd_sharded,
                             "peak_bytes": {d: D.peak_memory_bytes(d) for d in dict.fromkeys(devices)}}
        out = out.float().cpu()
        diff = out - ref
        tok = diff.flatten(2).norm(dim=-1) / ref.flatten(2).norm(dim=-1).clamp_min(1e-12)
        result["agreement"] = {"rel_fro": (diff.norm() / ref.norm()).item(), "max_abs": diff.abs().max().item(),
                               "tok_rel_median": tok.median().item(), "bit_identical": bool(torch.equal(out, ref))}
        adapter.release_block(block)

    print(json.dumps(result, indent=2))
    ok = result["agreement"]["tok_rel_median"] <= 2e-2
    print("agreement:", "ok" if ok else "FAILED")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
