"""GPTQ's batched solve (``gptq_solve``) on one chunk of V4-Flash-sized experts: the lean sweep
as one Triton kernel (runtime/fused_gptq.py, the CUDA default for integer grids), the torch sweep
it replaces replayed from a CUDA graph and eager (AMCT_GRAPHS=0), and the frozen reference loop
(tests/gptq_reference.py). Checks that all four give the same grid values, scales and zero points
on the device (the kernel against the torch sweep bit for bit, the objective too), and times each
(median of ``--repeats`` after a warm-up).

Floor: the solve's FLOPs (two Cholesky factorizations and one Cholesky inverse of each [C, C]
Hessian, ~(1/3 + 1/3 + 2/3) C^3 multiply-adds, and the sweep's R C^2 / 2 multiply-adds) at the
measured fp32 matmul rate.

    python benchmarks/bench_gptq_sweep.py --device cuda --experts 16 --rows 4096 --cols 4096 \
        --json $OUT/gptq_sweep.json        # one chunk of V4-Flash w1 / w3 (stacked rows)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from common import D  # noqa: E402

import amct_ext.algorithms.gptq as gptq_mod  # noqa: E402
from amct_ext.algorithms.gptq import gptq_solve  # noqa: E402
from amct_ext.quant import formats  # noqa: E402
from amct_ext.quant.schemes import TensorSpec  # noqa: E402
from tests.gptq_reference import reference_solve  # noqa: E402

SPECS = {"int8-channel": TensorSpec("int", 8, True, "channel"),
         "int4-g128-asym": TensorSpec("int", 4, False, "group", 128),
         "int3-g128-asym": TensorSpec("int", 3, False, "group", 128)}


def problem(E, R, Cc, spec, dev, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    W = (torch.randn(E, R, Cc, generator=g) * 0.02).to(dev)
    X = torch.randn(E, 2 * Cc, Cc, generator=g).to(dev)
    X = X + 0.5 * X.roll(1, dims=-1)                       # correlated inputs
    H = 2 / X.shape[1] * X.transpose(1, 2) @ X
    S = Z = None
    if not (spec.granularity == "group"):
        s, z = formats.qparams(W.reshape(-1, Cc), spec)
        S = formats.expand_qparam(s, (E * R, Cc), spec).reshape(E, R, Cc)
    return W, H, S, Z


def fp32_matmul_rate(dev, n):
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    _, t = timed(lambda: a @ b, dev, 5)
    return {"n": n, "median_s": t["median_s"], "flop_per_s": 2 * n ** 3 / t["median_s"]}


def timed(fn, dev, repeats):
    fn()                                                    # warm-up (and graph capture)
    ts, out = [], None
    for _ in range(repeats):
        D.synchronize(dev)
        t0 = time.perf_counter()
        out = fn()
        D.synchronize(dev)
        ts.append(time.perf_counter() - t0)
    return out, {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--specs", default=",".join(SPECS))
    ap.add_argument("--no-reference", action="store_true", help="skip timing the reference loop")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = D.resolve_device(a.device)
    mm = fp32_matmul_rate(dev, 4096 if dev.type != "cpu" else 512)
    E, R, Cc = a.experts, a.rows, a.cols
    flops = E * 2 * ((1 / 3 + 1 / 3 + 2 / 3) * Cc ** 3 + R * Cc ** 2 / 2)
    res = {"env": C.environment(dev), "args": vars(a), "matmul": mm, "solve_flops": flops,
           "floor_s": flops / mm["flop_per_s"], "cases": {}}
    for name in a.specs.split(","):
        spec = SPECS[name]
        W, H, S, Z = problem(E, R, Cc, spec, dev)
        case = {}
        # the default on CUDA for integer grids: the block sweep as one Triton kernel (fused_gptq)
        kernel, launches = gptq_mod.fused_sweep_block, []
        gptq_mod.fused_sweep_block = lambda *args, **kw: launches.append(1) or kernel(*args, **kw)
        try:
            out_f, case["fused"] = timed(lambda: gptq_solve(W, H, spec, S=S, Z=Z, graphs={}), dev, a.repeats)
        finally:
            gptq_mod.fused_sweep_block = kernel
        case["fused_blocks_swept"] = len(launches)      # 0: the kernel was not taken (CPU, other grids)
        # the torch sweep it replaces: graphed, then eager
        enabled = gptq_mod.fused_kernels_enabled
        gptq_mod.fused_kernels_enabled = lambda device: False
        try:
            graphs: dict = {}
            out_g, case["graphed"] = timed(lambda: gptq_solve(W, H, spec, S=S, Z=Z, graphs=graphs), dev, a.repeats)
            case["graph_replays"] = sum(g.replays for g in graphs.values())
            case["graph_capture_error"] = next((g.capture_error for g in graphs.values() if g.capture_error), None)
            os.environ[D.GRAPHS_ENV] = "0"
            out_e, case["eager"] = timed(lambda: gptq_solve(W, H, spec, S=S, Z=Z), dev, a.repeats)
        finally:
            os.environ.pop(D.GRAPHS_ENV, None)
            gptq_mod.fused_kernels_enabled = enabled
        if a.no_reference:
            out_r, _ = reference_solve(W, H, spec, S=S, Z=Z), None
        else:
            out_r, case["reference"] = timed(lambda: reference_solve(W, H, spec, S=S, Z=Z), dev, 1)
        for k in range(3):
            if out_r[k] is not None:
                case[f"equal_{'QSZ'[k]}_graphed_vs_reference"] = bool(torch.equal(out_g[k], out_r[k]))
                case[f"equal_{'QSZ'[k]}_eager_vs_reference"] = bool(torch.equal(out_e[k], out_r[k]))
                case[f"equal_{'QSZ'[k]}_fused_vs_reference"] = bool(torch.equal(out_f[k], out_r[k]))
                # bit patterns (-0.0 included) of the kernel against the torch sweep it replaces
                case[f"equal_{'QSZ'[k]}_bits_fused_vs_graphed"] = bool(torch.equal(
                    out_f[k].contiguous().view(torch.int32), out_g[k].contiguous().view(torch.int32)))
        case["equal_loss_fused_vs_graphed"] = bool(torch.equal(out_f[3], out_g[3]))
        case["loss_rel_diff"] = float(((out_g[3] - out_r[3]).abs() / out_r[3].abs()).max())
        res["cases"][name] = case
        print(name, json.dumps(case), flush=True)
    print(f"floor {res['floor_s']:.3f} s ({flops:.3g} FLOP at {mm['flop_per_s'] / 1e12:.1f} TFLOP/s)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1, default=str))
    ok = all(v for c in res["cases"].values() for k, v in c.items() if k.startswith("equal_"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
