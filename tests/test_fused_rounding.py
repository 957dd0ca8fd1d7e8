"""The Triton kernels of learned-rounding fake quantization (``runtime/fused_rounding.py``, used by
block-wise rounding's grouped experts on CUDA) compute what the torch definition computes.

CI has no GPU: the kernels run under Triton's interpreter on CPU tensors (conftest.run_interpreted),
through the same autograd Function (``leaf_stack._FusedRounding``) the CUDA path calls:
- the forward equals ``formats.fake_quant(w, spec, clamp(clip), clamp(offset))`` bit for bit;
- the offset gradient equals autograd's through that definition bit for bit;
- the clip gradient agrees to 1e-5 relative (it sums the group in another order);
- the SignSGD step taken inside the backward (fused, and the torch path's ``_SteppedRounding``)
  gives the offset the reference gradient's step would, float32 and float16 offsets;
over asymmetric and symmetric groups, per-channel rows, fp32 and bf16 weights, with round-half
ties, all-zero groups, one-signed groups (the zero point clamps), offsets and clips outside
their ranges (clamped straight-through) and a row count that is no multiple of a launch's rows.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import run_interpreted

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {
    # name: (bits, symmetric, granularity, group, shape, dtype)
    "asym-g16-fp32": (3, False, "group", 16, (3, 10, 64), torch.float32),
    "asym-g128-bf16": (4, False, "group", 128, (2, 7, 256), torch.bfloat16),   # 28 rows: 3.5 launches
    "sym-g32-fp32": (4, True, "group", 32, (2, 7, 96), torch.float32),
    "asym-channel-fp32": (4, False, "channel", None, (2, 5, 48), torch.float32),
    "sym-channel-bf16": (8, True, "channel", None, (3, 4, 40), torch.bfloat16),
    "asym-g64-w2-fp32": (2, False, "group", 64, (2, 9, 128), torch.float32),
}


def _case(name: str, seed: int):
    from amct_ext.quant.schemes import TensorSpec

    bits, sym, gran, group, shape, dtype = CASES[name]
    spec = TensorSpec("int", bits, sym, gran, group)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    g_cols = group or shape[-1]
    flat = w.view(-1, g_cols)
    flat[0].zero_()                                  # an all-zero group: scale 1
    flat[1] = flat[1].abs() + 0.01                   # one-signed: lo = 0 (clamp), zero point at 0
    flat[2] = -flat[2].abs() - 0.01                  # hi = 0: zero point at qmax
    w = w.to(dtype)
    n_groups = w.numel() // g_cols
    clip_shape = shape[:-1] + ((shape[-1] // group,) if gran == "group" else ())
    clip = (0.6 + 0.45 * torch.rand(clip_shape, generator=g))         # some above 1: clamped
    clip.view(-1)[3] = 0.05                                              # below CLIP_MIN: clamped
    v = torch.rand(shape, generator=g) * 1.2 - 0.6                       # some outside [-0.5, 0.5]
    # exact ties: w / s + v on a half integer for a few elements (s of group 4 computed as formats does)
    upstream = torch.randn(shape, generator=g)
    assert n_groups > 4
    return spec, w, clip, v, upstream


def _reference(spec, w, clip, v, upstream):
    from amct_ext.quant import formats
    from amct_ext.quant.leaf_stack import _ste_clamp
    from amct_ext.quant.quantizers import CLIP_MIN

    c = clip.clone().requires_grad_(True)
    off = v.clone().requires_grad_(True)
    out = formats.fake_quant(w, spec, _ste_clamp(c, CLIP_MIN, 1.0), _ste_clamp(off, -0.5, 0.5))
    (out.float() * upstream).sum().backward()
    return out.detach(), off.grad, c.grad


def _fused(spec, w, clip, v, upstream):
    from amct_ext.quant import formats
    from amct_ext.quant.leaf_stack import _FusedRounding

    group = spec.group_size if spec.granularity == "group" else w.shape[-1]
    lo, hi = formats._int_range(spec.bits, spec.symmetric)
    c = clip.clone().requires_grad_(True)
    off = v.clone().requires_grad_(True)
    out = _FusedRounding.apply(w, c, off, group, lo, hi, spec.symmetric, None)
    (out.float() * upstream).sum().backward()
    return out.detach(), off.grad, c.grad


def _stepped(spec, w, clip, v, upstream, lr, offset_dtype, fused: bool):
    """The offset after one SignSGD step taken inside the backward, and the clip's gradient."""
    from amct_ext.quant import formats
    from amct_ext.quant.leaf_stack import SignStep, _FusedRounding, _SteppedRounding

    group = spec.group_size if spec.granularity == "group" else w.shape[-1]
    lo, hi = formats._int_range(spec.bits, spec.symmetric)
    c = clip.clone().requires_grad_(True)
    off = v.to(offset_dtype, copy=True).requires_grad_(True)
    step = SignStep(lr)
    if fused:
        out = _FusedRounding.apply(w, c, off, group, lo, hi, spec.symmetric, step)
    else:
        out = _SteppedRounding.apply(w, c, off, spec, step)
    (out.float() * upstream).sum().backward()
    assert off.grad is None
    return off.detach(), c.grad


def _fused_fp32_out(spec, w, clip, v):
    from amct_ext.quant import formats
    from amct_ext.quant.quantizers import CLIP_MIN
    from amct_ext.runtime import fused_rounding

    group = spec.group_size if spec.granularity == "group" else w.shape[-1]
    lo, hi = formats._int_range(spec.bits, spec.symmetric)
    return fused_rounding.fq_round_forward(w, v, clip, group, lo, hi, spec.symmetric, CLIP_MIN, out_dtype=torch.float32)


def _with_ties(spec, w, clip, v):
    """Offsets that put some w / s + v exactly on a half integer (round half to even decides)."""
    from amct_ext.quant import formats
    from amct_ext.quant.quantizers import CLIP_MIN

    d = formats.quantize(w, spec, clip.clamp(CLIP_MIN, 1.0))
    scale = formats.expand_qparam(d["scale"], w.shape, spec)
    y = w.float() / scale
    tie = torch.floor(y) + 0.5 - y                  # v making y + v = floor(y) + 0.5
    v = v.clone()
    v.view(-1)[5::7] = tie.view(-1)[5::7].clamp(-0.5, 0.5)
    return v


def interpreted_checks() -> dict:
    """(child process) per case: forward and offset-gradient mismatches (counts), the clip
    gradient's largest relative error."""
    torch.set_num_threads(1)
    res = {}
    for name in CASES:
        for seed in (0, 1):
            spec, w, clip, v, up = _case(name, seed)
            v = _with_ties(spec, w, clip, v)
            ref_out, ref_dv, ref_dc = _reference(spec, w, clip, v, up)
            out, dv, dc = _fused(spec, w, clip, v, up)
            scale = ref_dc.abs().max().item() or 1.0
            dtype_ok = out.dtype == w.dtype
            if w.dtype != torch.float32:
                # the interpreter casts fp32 -> bf16 by truncation (the GPU rounds to nearest even,
                # benchmarks/check_fast_paths.py): compare the kernel's fp32 values before the cast
                out = _fused_fp32_out(spec, w, clip, v)
                ref_out = _reference(spec, w.float(), clip, v, up)[0]
            # the step inside the backward: the reference's gradient, stepped as the hook would
            lr = 0.0037
            steps = {}
            for dt in (torch.float32, torch.float16):
                # the reference at the offset as stored (float16 rounds it)
                _, dv_dt, dc_dt = _reference(spec, w, clip, v.to(dt).float(), up)
                want = (v.to(dt).float() - lr * torch.sign(dv_dt)).clamp(-0.5, 0.5).to(dt)
                for fused in (True, False):
                    got, gc = _stepped(spec, w, clip, v, up, lr, dt, fused)
                    steps[f"{'fused' if fused else 'torch'}-{str(dt)[6:]}"] = (
                        int((got != want).sum()), float((gc - dc_dt).abs().max()) / scale)
            res[f"{name}-{seed}"] = {
                "steps": steps,
                "out_mismatch": int((out != ref_out).sum()),
                "dv_mismatch": int((dv != ref_dv).sum()),
                "dc_rel": ((dc - ref_dc).abs().max().item()) / scale,
                "dc_nonzero": int((ref_dc != 0).sum()),
                "dtype_ok": dtype_ok,
            }
    return res


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted("tests.test_fused_rounding")


@pytest.mark.parametrize("name", list(CASES))
def test_kernels_equal_the_torch_definition(interpreted, name):
    for seed in (0, 1):
        r = interpreted[f"{name}-{seed}"]
        assert r["dtype_ok"], r
        assert r["out_mismatch"] == 0, r
        assert r["dv_mismatch"] == 0, r
        assert r["dc_nonzero"] > 0, r            # the clip gradient is exercised
        assert r["dc_rel"] < 1e-5, r
        assert len(r["steps"]) == 4
        for kind, (mismatch, dc_rel) in r["steps"].items():
            assert mismatch == 0, (kind, r)
            assert dc_rel < 1e-5, (kind, r)


def test_launch_shape_is_the_measured_one():
    """The launch shape is a measured choice (casebook i34-9): 1024 elements a program at 4 warps,
    which keeps the backward's tiles in registers and gives the shipped numbers bit for bit on
    CUDA. A new shape needs a new ``check_block_rounding_kernels.py --sweep`` (times and equality)."""
    from amct_ext.runtime import fused_rounding as fr

    assert fr._launch_shape(128) == (128, 8, 4)      # V4's w4a16-g128 / w4a8 groups
    assert fr._launch_shape(64) == (64, 16, 4)
    assert fr._launch_shape(4096) == (4096, 1, 4)    # per-channel rows: one a program, as before
    assert fr._launch_shape(16384) == (16384, 1, 8)
