#!/usr/bin/env python
"""Block-wise rounding's device pieces on a real accelerator, at a V4-Flash chunk's size.

    python benchmarks/check_block_rounding_kernels.py --device cuda --json $OUT/br_kernels.json

1. ``rounded_fake_quant`` (the Triton forward / backward on CUDA) against the torch definition
   on the same device, bf16 weights [E, 4096, 4096] (w13 of E experts), asymmetric int4 g128:
   forward bit for bit (the GPU's bf16 cast rounds to nearest even, which Triton's interpreter
   does not: tests/test_fused_rounding.py compares the fp32 values there), offset gradient bit for
   bit, clip gradient's largest relative error;
2. ``grouped_linear`` (torch._grouped_mm and its backward) against one matmul per expert;
3. ``StackCodes.decode`` (the Triton decode of integer codes, blockround's turns) against the
   torch definition on a V4-Pro w13 chunk: bf16 bit for bit;
4. the time of each (median of 10 after 3 warm-ups, device events) beside its floor: bytes moved
   over the measured copy bandwidth, FLOPs over the measured bf16 matmul rate.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from amct_ext.quant import formats  # noqa: E402
from amct_ext.quant.leaf_stack import _ste_clamp, rounded_fake_quant  # noqa: E402
from amct_ext.quant.quantizers import CLIP_MIN  # noqa: E402
from amct_ext.quant.schemes import TensorSpec  # noqa: E402
from amct_ext.runtime import device as D  # noqa: E402
from amct_ext.runtime.grouped_linear import grouped_linear  # noqa: E402


def timed(fn, dev, reps=10, warm=3) -> float:
    return statistics.median(D.elapsed_ms(fn, dev, repeats=reps, warmup=warm))


def launch_sweep(w, spec, c, v16, up, dev) -> list[dict]:
    """The fused forward and backward-with-step (float16 offsets) at each launch shape: the
    times, and whether the results equal the shipped shape's (forward output, stepped offsets,
    clip gradient) bit for bit."""
    from amct_ext.runtime import fused_rounding as fr
    from amct_ext.quant.leaf_stack import SignStep

    shipped = fr._launch_shape

    def results():
        off = v16.detach().clone().requires_grad_(True)
        cc = c.detach().clone().requires_grad_(True)
        o = rounded_fake_quant(w, spec, cc, off, SignStep(0.0037))
        o.backward(up)
        return o.detach(), off.detach(), cc.grad

    ref = results()
    rows_out = []
    step = SignStep(1e-9)
    try:
        for per_program in (1024, 2048, 4096, 8192):
            for warps in (2, 4, 8):
                def shape(group, _e=per_program, _w=warps):
                    block = fr.triton.next_power_of_2(group)
                    return block, max(1, min(64, _e // block)), _w
                fr._launch_shape = shape

                def fwd():
                    with torch.no_grad():
                        rounded_fake_quant(w, spec, c, v16)

                def fwd_bwd():
                    rounded_fake_quant(w, spec, c, v16, step).backward(up)
                    c.grad = None
                got = results()
                row = {"elements": per_program, "warps": warps, "fwd_ms": timed(fwd, dev),
                       "fwd_bwd_step16_ms": timed(fwd_bwd, dev),
                       "equal": all(bool(torch.equal(x, y)) for x, y in zip(got, ref))}
                print("sweep", row)
                rows_out.append(row)
    finally:
        fr._launch_shape = shipped
    return rows_out


def check_codes_decode(dev, res: dict, experts: int = 4, rows: int = 6144, cols: int = 7168) -> None:
    """``StackCodes.decode`` (the Triton kernel on CUDA) against ``decode_reference`` (the torch
    definition, ``formats.dequantize_int``) on a V4-Pro w13 chunk ([4, 6144, 7168], asymmetric
    int4 g128, bf16 out): mismatches (0: bit for bit), the time of each, the floor (bytes read and
    written over the copy bandwidth)."""
    from amct_ext.quant.stack_codes import StackCodes

    spec = TensorSpec("int", 4, False, "group", 128)
    sc = StackCodes((experts, rows, cols), spec, dev)
    g = torch.Generator(device=dev).manual_seed(2)
    for e in range(experts):
        q = torch.randint(sc.qmin, sc.qmax + 1, (rows, cols), device=dev, generator=g)
        scale = torch.rand(rows, cols // 128, device=dev, generator=g) * 1e-2 + 1e-4
        zp = torch.randint(0, 16, (rows, cols // 128), device=dev, generator=g).to(torch.uint8)
        sc.put(e, (0, rows), q, scale, zp)
    got, want = sc.decode(0, experts, torch.bfloat16), sc.decode_reference(0, experts, torch.bfloat16)
    res["decode_mismatch"] = int((got != want).sum())
    del got, want
    n = experts * rows * cols
    res["decode_ms"] = timed(lambda: sc.decode(0, experts, torch.bfloat16), dev)
    res["decode_torch_ms"] = timed(lambda: sc.decode_reference(0, experts, torch.bfloat16), dev)
    res["decode_floor_ms"] = (n / 2 + n / 128 * 5 + n * 2) / res["copy_GBps"] / 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=6144, help="routed rows of the chunk")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true",
                    help="also time the fused kernels at other launch shapes (elements a program x warps)")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    g = torch.Generator(device=dev).manual_seed(0)
    res: dict = {"device": str(dev), "shape": [a.experts, a.rows, a.cols]}

    # bandwidth and matmul rate (the floors)
    big = torch.empty(2 ** 30, dtype=torch.uint8, device=dev)
    ms = timed(lambda: big.clone(), dev)
    res["copy_GBps"] = 2 * big.numel() / ms / 1e6
    m = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16, generator=g)
    ms = timed(lambda: m @ m, dev)
    res["bf16_TFLOPs"] = 2 * 8192 ** 3 / ms / 1e9
    del big, m

    spec = TensorSpec("int", 4, False, "group", 128)
    w = (torch.randn(a.experts, a.rows, a.cols, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    v = (torch.rand(w.shape, device=dev, generator=g) - 0.5).requires_grad_(True)
    c = (0.7 + 0.3 * torch.rand(a.experts, a.rows, a.cols // 128, device=dev, generator=g)).requires_grad_(True)
    up = torch.randn(w.shape, device=dev, generator=g).to(torch.bfloat16)

    out = rounded_fake_quant(w, spec, c, v)
    out.backward(up)
    dv, dc = v.grad.clone(), c.grad.clone()
    v.grad = c.grad = None
    ref = formats.fake_quant(w, spec, _ste_clamp(c, CLIP_MIN, 1.0), _ste_clamp(v, -0.5, 0.5))
    ref.backward(up)
    res["fq_out_mismatch"] = int((out != ref).sum())
    res["fq_dv_mismatch"] = int((dv != v.grad).sum())
    res["fq_dc_rel"] = float((dc - c.grad).abs().max() / c.grad.abs().max())
    # the SignSGD step inside the backward (float16 offsets): fused kernel vs the torch path
    from amct_ext.quant.leaf_stack import SignStep, _SteppedRounding
    for dt in (torch.float32, torch.float16):
        got = {}
        for kind in ("fused", "torch"):
            off = v.detach().to(dt, copy=True).requires_grad_(True)
            cc = c.detach().clone().requires_grad_(True)
            step = SignStep(0.0037)
            if kind == "fused":
                o = rounded_fake_quant(w, spec, cc, off, step)
            else:
                o = _SteppedRounding.apply(w, cc, off, spec, step)
            o.backward(up)
            got[kind] = (off.detach(), cc.grad)
        res[f"step_{str(dt)[6:]}_mismatch"] = int((got["fused"][0] != got["torch"][0]).sum())
    v.grad = c.grad = None
    n = w.numel()

    def fwd():
        with torch.no_grad():
            rounded_fake_quant(w, spec, c, v)

    def fwd_bwd():
        rounded_fake_quant(w, spec, c, v).backward(up)
        v.grad = c.grad = None

    v16 = v.detach().half().requires_grad_(True)
    step = SignStep(1e-9)

    def fwd_bwd_step16():
        rounded_fake_quant(w, spec, c, v16, step).backward(up)
        c.grad = None

    def torch_fwd_bwd():
        formats.fake_quant(w, spec, _ste_clamp(c, CLIP_MIN, 1.0), _ste_clamp(v, -0.5, 0.5)).backward(up)
        v.grad = c.grad = None

    res["fq_fwd_ms"] = timed(fwd, dev)
    res["fq_fwd_floor_ms"] = n * (2 + 4 + 2) / res["copy_GBps"] / 1e6
    res["fq_fwd_bwd_ms"] = timed(fwd_bwd, dev)
    res["fq_fwd_bwd_floor_ms"] = n * (2 + 4 + 2 + 2 + 2 + 4 + 4) / res["copy_GBps"] / 1e6
    res["fq_fwd_bwd_step16_ms"] = timed(fwd_bwd_step16, dev)
    res["fq_fwd_bwd_step16_floor_ms"] = n * (2 + 2 + 2 + 2 + 2 + 2 + 2) / res["copy_GBps"] / 1e6
    res["fq_torch_fwd_bwd_ms"] = timed(torch_fwd_bwd, dev, reps=3, warm=1)
    if a.sweep:
        res["sweep"] = launch_sweep(w, spec, c, v16, up, dev)
    del ref, out, up

    check_codes_decode(dev, res)

    # grouped GEMM: w13-like [E, 2I, D] as [E, rows, cols], tokens spread unevenly
    counts = torch.randint(0, 2 * a.tokens // a.experts, (a.experts,), generator=torch.Generator().manual_seed(1))
    counts[0] = 0
    counts = counts.tolist()
    t = sum(counts)
    x = torch.randn(t, a.cols, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_(True)
    wq = (torch.randn(a.experts, a.rows, a.cols, device=dev, generator=g) * 0.02).to(torch.bfloat16).requires_grad_(True)
    gy = torch.randn(t, a.rows, device=dev, dtype=torch.bfloat16, generator=g)
    y = grouped_linear(x, wq, counts)
    y.backward(gy)
    gx, gw = x.grad.clone(), wq.grad.clone()
    x.grad = wq.grad = None
    outs, start = [], 0
    for e, k in enumerate(counts):
        outs.append(x[start:start + k] @ wq[e].T)
        start += k
    y_ref = torch.cat(outs)
    y_ref.backward(gy)
    scale = lambda r: float(r.abs().max()) or 1.0  # noqa: E731
    res["gmm_y_rel"] = float((y - y_ref).abs().max()) / scale(y_ref)
    res["gmm_dx_rel"] = float((gx - x.grad).abs().max()) / scale(x.grad)
    res["gmm_dw_rel"] = float((gw - wq.grad).abs().max()) / scale(wq.grad)
    res["gmm_tokens"] = t
    x.grad = wq.grad = None

    def gmm_fwd_bwd():
        grouped_linear(x, wq, counts).backward(gy)
        x.grad = wq.grad = None

    res["gmm_fwd_bwd_ms"] = timed(gmm_fwd_bwd, dev)
    res["gmm_fwd_bwd_floor_ms"] = 3 * 2 * t * a.rows * a.cols / res["bf16_TFLOPs"] / 1e9
    for k, val in res.items():
        print(f"{k}: {val}")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    ok = res["fq_out_mismatch"] == 0 and res["fq_dv_mismatch"] == 0 and res["fq_dc_rel"] < 1e-4 \
        and res["step_float32_mismatch"] == 0 and res["step_float16_mismatch"] == 0 \
        and res["decode_mismatch"] == 0 and res["gmm_y_rel"] < 1e-2 and res["gmm_dx_rel"] < 1e-2 and res["gmm_dw_rel"] < 1e-2
    print("ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
