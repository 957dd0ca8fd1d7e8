#!/usr/bin/env python
"""What the resume fingerprint's weights digest (amct_ext/io/weights_digest.py) costs at V4-Flash size.

Measures, on this CPU, one thread:
1. ``hashlib.sha256`` over large in-memory buffers (MB/s): the hash itself;
2. ``weights_digest.tensor_digest`` over a file in the page cache (MB/s): hash + reads in
   16 MiB chunks, the path the run takes (the layer's own load has just read those pages, or the
   digest's read-ahead brings them in for it);
and computes, from the V4-Flash release layout (every layer's stored tensors: FP8 linears with
their block scales, FP4 experts with e8m0 scales, bf16 / fp32 rest; ``models/deepseek_v4``), the
bytes each layer's digest reads and the seconds it takes at the measured rate, against a default
run's layer time on the H200 (``--layer-seconds``: 46.6 s w4a16-g128 default, 18.4 s w8a8 RTN,
benchmarks/RESULTS.md §0.13 and §0.8).

    PYTHONPATH=$PWD python benchmarks/weights_digest_cost.py [--mb 256] [--json FILE]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BITS = {"bfloat16": 16, "float32": 32, "float8_e4m3fn": 8, "float8_e8m0fnu": 8, "int8": 8, "int64": 64,
        "int32": 32, "float16": 16}


def _best(fn, repeats: int) -> tuple[float, float]:
    """(best wall s, best CPU s of this thread) of ``repeats`` calls: on a shared box the wall
    time includes waiting for a core, the thread's CPU time does not."""
    wall = cpu = math.inf
    for _ in range(repeats):
        t, c = time.perf_counter(), time.thread_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - t), min(cpu, time.thread_time() - c)
    return wall, cpu


def sha256_rate(mb: int, repeats: int = 3) -> tuple[float, float]:
    """MB/s (10^6 bytes) of hashlib.sha256 over a ``mb`` MB buffer: (by wall, by CPU time)."""
    buf = os.urandom(1 << 20) * mb
    wall, cpu = _best(lambda: hashlib.sha256(buf).hexdigest(), repeats)
    return len(buf) / wall / 1e6, len(buf) / cpu / 1e6


def file_digest_rate(mb: int, repeats: int = 3) -> tuple[float, float]:
    """MB/s of ``tensor_digest`` over a ``mb`` MB file already in the page cache: (wall, CPU)."""
    from amct_ext.io.weights_digest import tensor_digest

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "blob"
        p.write_bytes(os.urandom(1 << 20) * mb)
        p.read_bytes()                                   # in the page cache, as after the layer's load
        wall, cpu = _best(lambda: tensor_digest(p, "k", "BF16", [mb << 20], 0, mb << 20), repeats)
    return (mb << 20) / wall / 1e6, (mb << 20) / cpu / 1e6


def v4_flash_bytes() -> dict:
    """Stored bytes of V4-Flash's stem and of each of its layers (release layout)."""
    import torch

    from amct_ext.runtime.empty import empty_weights
    from models.deepseek_v4.configuration import DeepseekV4Config
    from models.deepseek_v4.modeling import DeepseekV4ForCausalLM
    from models.deepseek_v4.synthetic import base_config_dict, expected_release_layout, synthetic_config_dict

    n = int(base_config_dict("v4-flash")["num_hidden_layers"])
    config = DeepseekV4Config(**json.loads(json.dumps(synthetic_config_dict("v4-flash", n))))
    one = DeepseekV4Config(**json.loads(json.dumps(synthetic_config_dict("v4-flash", 1))))
    with empty_weights():
        stem = {k: t for k, t in DeepseekV4ForCausalLM(one, dtype=torch.bfloat16).state_dict().items()
                if not k.startswith("layers.")}
    stem_bytes = sum(t.numel() * BITS[str(t.dtype)[6:]] // 8 for t in stem.values())
    layers, by_kind = [], {}
    for i in range(n):
        kind = (config.compress_ratios[i], i < config.n_hash_layers)
        if kind not in by_kind:
            lay = expected_release_layout(config, i)
            by_kind[kind] = sum(math.prod(s) * BITS[str(dt)[6:]] // 8 for s, dt in lay.values())
        layers.append(by_kind[kind])
    return {"n_layers": n, "stem_bytes": stem_bytes, "layer_bytes": layers}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="buffer / file size of the rate measurements (MB)")
    ap.add_argument("--layer-seconds", default="46.6,18.4",
                    help="a default run's seconds per V4-Flash layer on the H200 (comma list)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rate, rate_cpu = sha256_rate(args.mb)
    frate_wall, frate_cpu = file_digest_rate(args.mb)
    # the cost model uses the CPU-time rate: what one core does when the thread has it (the
    # H200 host has 16 cores for one run); the wall rate on a shared box mostly measures waiting
    frate = frate_cpu
    sizes = v4_flash_bytes()
    total = sizes["stem_bytes"] + sum(sizes["layer_bytes"])
    layer_max = max(sizes["layer_bytes"])
    per_layer_s = layer_max / (frate * 1e6)
    first_s = (sizes["stem_bytes"] + sizes["layer_bytes"][0]) / (frate * 1e6)
    out = {"sha256_MBps": round(rate, 1), "sha256_MBps_by_cpu_time": round(rate_cpu, 1),
           "file_digest_MBps": round(frate_wall, 1), "file_digest_MBps_by_cpu_time": round(frate_cpu, 1),
           "loadavg_1min": round(os.getloadavg()[0], 2), "buffer_MB": args.mb,
           "v4_flash_total_GB": round(total / 1e9, 2), "v4_flash_layer_GB_max": round(layer_max / 1e9, 3),
           "v4_flash_stem_GB": round(sizes["stem_bytes"] / 1e9, 3), "n_layers": sizes["n_layers"],
           "digest_s_per_layer": round(per_layer_s, 2), "digest_s_total_serial": round(total / (frate * 1e6), 1),
           "digest_s_not_overlapped": round(first_s, 2), "runs": []}
    print(f"sha256 {rate:.0f} MB/s ({rate_cpu:.0f} by CPU time), tensor_digest (page cache) {frate_wall:.0f} MB/s "
          f"({frate_cpu:.0f} by CPU time), one thread, load average {os.getloadavg()[0]:.1f}")
    print(f"V4-Flash stored bytes: {total / 1e9:.1f} GB ({sizes['n_layers']} layers, max {layer_max / 1e9:.2f} GB "
          f"a layer, stem {sizes['stem_bytes'] / 1e9:.2f} GB): {per_layer_s:.2f} s a layer")
    for ls in (float(x) for x in args.layer_seconds.split(",")):
        run_s = ls * sizes["n_layers"]
        row = {"layer_seconds": ls, "run_seconds": round(run_s, 1),
               "serial_share_pct": round(100 * total / (frate * 1e6) / run_s, 2),
               "overlapped_share_pct": round(100 * first_s / run_s, 3),
               "thread_busy_share_pct": round(100 * per_layer_s / ls, 1)}
        out["runs"].append(row)
        print(f"layer {ls:5.1f} s (run {run_s / 60:.1f} min): serial {row['serial_share_pct']:.2f} % of the run, "
              f"overlapped {row['overlapped_share_pct']:.3f} % (stem + layer 0 before layer 0's check; the "
              f"thread busy {row['thread_busy_share_pct']:.1f} % of each later layer's time)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
