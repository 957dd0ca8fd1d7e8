#!/usr/bin/env python
"""The hyper-connection ends under autograd on a real accelerator, at a block-rounding step's size.

    python benchmarks/check_hc_autograd.py --device cuda --json $OUT/hc_autograd.json

Block-wise rounding differentiates through hc_post (after attention) and hc_pre + hc_post (around
the experts) of V4-Flash's stream, [8, 2048, 4, 4096] bf16. This times forward + backward of
that chain (median of 10 after 3 warm-ups, device events) and its memory peak above the inputs on torch's path and on the fused
Functions (models/deepseek_v4/fused_hc.py), and measures both against the same chain in fp64:
the relative Frobenius error of the output and of each gradient. The fused path must be no less
accurate than torch's (``--check`` exits 1 otherwise).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common as C  # noqa: E402
from amct_ext.runtime import device as D  # noqa: E402
import models.deepseek_v4.modeling as modeling  # noqa: E402


def chain(y_attn, res, post_a, comb_a, y_ffn_fn, fn, scale, base, hc=4, iters=20, eps=1e-6):
    """hc_post after attention, then hc_pre before the experts and hc_post after them, where the
    experts are stood in for by ``y_ffn_fn`` (a fixed elementwise map, so the chain stays the hc
    ends' own cost)."""
    x = modeling.hc_post(y_attn, res, post_a, comb_a)
    y, post, comb = modeling.hc_pre(x, fn, scale, base, hc, iters, eps, 1e-6)
    return modeling.hc_post(y_ffn_fn(y), x, post, comb)


def chain_fp64(y_attn, res, post_a, comb_a, y_ffn_fn, fn, scale, base, hc=4, iters=20, eps=1e-6):
    """The same chain written out in fp64 from the formulas (the reference; torch's path itself
    computes in fp32)."""
    def post_end(y, r, post, comb):
        return post.unsqueeze(-1) * y.unsqueeze(-2) + torch.einsum("bskj,bskd->bsjd", comb, r)

    x = post_end(y_attn, res, post_a, comb_a)
    flat = x.flatten(-2)
    mix = (flat @ fn.t()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + 1e-6)
    pre, post, comb = modeling.hc_weights_torch(mix, scale, base, hc, iters, eps)
    return post_end(y_ffn_fn((pre.unsqueeze(-1) * x).sum(2)), x, post, comb)


def run(dev, fused: bool, inputs, cot, dtype, reps, f=chain):
    torch_way = modeling._use_fused_hc
    if not fused:
        modeling._use_fused_hc = lambda x, *frozen: False
    try:
        def once():
            leaves = [t.detach().to(dtype).requires_grad_(True) for t in inputs[:2]]  # y after attention, the stream
            out = f(leaves[0], leaves[1], *inputs[2:4], torch.tanh, *inputs[4:])
            gy, gres = torch.autograd.grad(out, leaves[:2], cot.to(dtype))
            return out, gy, gres
        got, ms, extra = C.timed_once_with_peak(once, dev, reps)
        return got, (ms, extra)
    finally:
        modeling._use_fused_hc = torch_way


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, nargs=2, default=(8, 2048), metavar=("B", "S"))
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    dev = D.resolve_device(a.device)
    hc, (b, s), dim = 4, a.tokens, a.dim
    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(b, s, dim, generator=g), torch.randn(b, s, hc, dim, generator=g),
              torch.rand(b, s, hc, generator=g) * 2, torch.softmax(torch.randn(b, s, hc, hc, generator=g), -1),
              torch.randn((2 + hc) * hc, hc * dim, generator=g) * 0.02, torch.rand(3, generator=g) + 0.5,
              torch.randn((2 + hc) * hc, generator=g) * 0.5]
    cot = torch.randn(b, s, hc, dim, generator=g)
    inputs = [t.to(dev) for t in inputs]
    cot = cot.to(dev)
    # the fp64 reference: the torch path on fp64 copies of the same (bf16-rounded) inputs
    bf = [t.to(torch.bfloat16).double() if i in (0, 1) else t.double() for i, t in enumerate(inputs)]
    ref, _ = run(dev, False, bf, cot.to(torch.bfloat16).double(), torch.float64, 0, chain_fp64)
    report = {"shape": [b, s, hc, dim], "device": str(dev)}
    for name, fused in (("torch", False), ("fused", True)):
        got, (ms, extra_gib) = run(dev, fused, inputs, cot, torch.bfloat16, a.reps)
        err = C.rel_fro_each(("out", "grad_y", "grad_res"), got, ref)
        report[name] = {"ms": ms, "peak_above_inputs_gib": extra_gib, "rel_fro_vs_fp64": err}
        del got
        D.empty_cache(dev)
    report["speedup"] = report["torch"]["ms"] / report["fused"]["ms"]
    ok = all(report["fused"]["rel_fro_vs_fp64"][k] <= report["torch"]["rel_fro_vs_fp64"][k] * 1.05
             for k in report["fused"]["rel_fro_vs_fp64"])
    report["fused_no_less_accurate"] = ok
    return C.finish_check(report, a.json, ok, a.check)


if __name__ == "__main__":
    sys.exit(main())
