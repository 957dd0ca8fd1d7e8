#!/usr/bin/env python
"""V4's sparse attention under autograd on a real accelerator, at a block-rounding step's size.

    python benchmarks/check_banded_attention.py --device cuda --json $OUT/banded_attention.json --check

A block-rounding step differentiates through the attention of a V4-Flash ratio-4 layer: q [8,
2048, 64, 512] bf16, one shared KV head, a window of 128 and 512 compressed entries. This times
forward + backward (median of --reps after 3 warm-ups, device events) and the memory peak above
the inputs of autograd through the plain torch ops and of ``BandedAttention`` (its own backward,
models/deepseek_v4/banded_attention.py), and measures both against the plain path in float64 on
the same rounded inputs (at --accuracy-batch, for memory): the relative Frobenius error of the
output and of each gradient. ``--check`` exits 1 unless the forward is the plain path's to the
bit and every gradient of the Function is within 1.05 x the plain path's error (+ 1e-4).
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
from models.deepseek_v4 import DeepseekV4Config  # noqa: E402
from check_fast_paths import attention_inputs  # noqa: E402


def run(attn, inputs, cot, dtype, banded: bool, reps: int):
    """(output, gradients of q, kv, comp_kv), (median ms, GiB above the inputs)."""
    chosen = modeling.fast_paths_enabled
    modeling.fast_paths_enabled = lambda device: banded
    try:
        q, kv, comp_kv, comp_idx = inputs

        def once():
            leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, kv, comp_kv)]
            out = attn.sparse_attention(*leaves, comp_idx)
            grads = torch.autograd.grad(out, leaves, cot.to(dtype))
            return (out, *grads)

        got, ms, extra = C.timed_once_with_peak(once, q.device, reps)
        return got, (ms, extra)
    finally:
        modeling.fast_paths_enabled = chosen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--config", default=None, help="a V4 config.json (default: V4-Flash's, shipped)")
    ap.add_argument("--layer", type=int, default=2, help="a ratio-4 layer of the config")
    ap.add_argument("--tokens", type=int, nargs=2, default=(8, 2048), metavar=("B", "S"))
    ap.add_argument("--accuracy-batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="the operands' dtype (float32: a CPU's smoke run; its bf16 GEMMs are very slow)")
    ap.add_argument("--json")
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    dev = D.resolve_device(a.device)
    config = DeepseekV4Config.from_dict(C.flash_config_dict(a.config)[0])
    dtype = getattr(torch, a.dtype)
    attn = modeling.Attention(config, a.layer, dtype).to(dev)
    b, s = a.tokens
    q, kv, comp_kv, comp_idx, sink = attention_inputs(attn, b, s, config.index_topk, dev)
    with torch.no_grad():
        attn.attn_sink.copy_(sink)
    attn.attn_sink.requires_grad_(False)
    cot = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(dev)
    inputs = [t.to(dtype) for t in (q, kv, comp_kv)] + [comp_idx]
    report = {"shape_q": list(q.shape), "ratio": attn.ratio, "dtype": a.dtype, "device": str(dev)}
    outs = {}
    for name, banded in (("plain", False), ("banded", True)):
        got, (ms, extra) = run(attn, inputs, cot, dtype, banded, a.reps)
        report[name] = {"ms": ms, "peak_above_inputs_gib": extra}
        outs[name] = got[0]
        del got
        D.empty_cache(dev)
    report["forward_bit_for_bit"] = bool(torch.equal(outs["plain"], outs["banded"]))
    del outs
    report["speedup"] = report["plain"]["ms"] / report["banded"]["ms"]

    # accuracy on the first --accuracy-batch sequences, against the plain path in float64
    k = a.accuracy_batch
    small = [t[:k] for t in inputs[:3]] + [None if comp_idx is None else comp_idx[:k]]
    attn.double()
    ref_all, _ = run(attn, [t.double() for t in small[:3]] + [small[3]], cot[:k].double(), torch.float64, False, 0)
    attn.to(dtype)
    attn.attn_sink.data = attn.attn_sink.data.float()
    ok = report["forward_bit_for_bit"]
    for name, banded in (("plain", False), ("banded", True)):
        got, _ = run(attn, small, cot[:k], dtype, banded, 0)
        report[name]["rel_fro_vs_fp64"] = C.rel_fro_each(("out", "grad_q", "grad_kv", "grad_comp_kv"), got, ref_all)
    for n, e in report["banded"]["rel_fro_vs_fp64"].items():
        ok = ok and e <= 1.05 * report["plain"]["rel_fro_vs_fp64"][n] + 1e-4
    report["banded_no_less_accurate"] = ok
    return C.finish_check(report, a.json, ok, a.check)


if __name__ == "__main__":
    sys.exit(main())
