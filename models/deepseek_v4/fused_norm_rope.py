"""RMSNorm and in-place rope as Triton kernels (CUDA, inference only).

In torch both are chains of elementwise passes over fp32 copies: RMSNorm is cast, square, mean,
rsqrt, two products and a cast back (~6 passes); rope on the 64 rope channels of the 64 query
heads is slicing, two products, a difference, a sum, a stack and a copy back (~10 launches, each
over [B, S, H, 32] strided pairs). On the H200 they were ~1.5 ms of a 12.8 ms V4-Flash layer
(RESULTS.md §4.3). Each kernel here reads its input once and writes its output once.

Numerics: the same fp32 operations as ``modeling.RMSNorm`` / ``modeling.apply_rope``, rounded to
the 16-bit output once; the mean's reduction order and fused multiply-adds may change the fp32
result in its last bit before that rounding. Checked against the torch expressions under Triton's
interpreter (tests/test_fused_attention.py) and against float64 at full shape on the GPU
(benchmarks/check_fast_paths.py).
"""
from __future__ import annotations

import torch

from amct_ext.runtime.device import device_guard
from amct_ext.runtime.triton_support import triton, tl  # noqa: F401  (None without Triton)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, R, C, eps, stride_x, stride_o, HAS_W: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        offs = tl.arange(0, BLOCK)
        mask = (rows < R)[:, None] & (offs < C)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        y = x * tl.math.rsqrt(tl.sum(x * x, axis=1) / C + eps)[:, None]
        if HAS_W:
            y = tl.load(w_ptr + offs, mask=offs < C, other=0.0).to(tl.float32)[None, :] * y
        tl.store(out_ptr + rows[:, None] * stride_o + offs[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, N, S, H, stride_b, stride_s, stride_h, stride_cos, first,
                     SIGN: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr):
        # rows are (batch, position, head) triples; each row's 2 * HALF rope channels are read and
        # written as one contiguous run, split into the (even, odd) pairs in registers
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = r < N
        h = r % H
        bs = r // H
        s = bs % S
        b = bs // S
        base = b * stride_b + s * stride_s + h * stride_h + first
        ch = tl.arange(0, 2 * HALF)
        ptrs = x_ptr + base[:, None] + ch[None, :]
        x = tl.load(ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
        a, o = tl.split(tl.reshape(x, (BLOCK_R, HALF, 2)))
        i = tl.arange(0, HALF)
        c = tl.load(cos_ptr + s[:, None] * stride_cos + i[None, :], mask=row_ok[:, None], other=0.0)
        sn = tl.load(sin_ptr + s[:, None] * stride_cos + i[None, :], mask=row_ok[:, None], other=0.0) * SIGN
        even = a * c - o * sn
        odd = a * sn + o * c
        y = tl.reshape(tl.join(even, odd), (BLOCK_R, 2 * HALF))
        tl.store(ptrs, y.to(x_ptr.dtype.element_ty), mask=row_ok[:, None])

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``(weight * (xf * rsqrt(mean(xf^2) + eps))).to(x.dtype)`` with xf = x.float(), over the last
    dim (``weight`` None: no weight)."""
    if triton is None:
        raise RuntimeError("rms_norm needs Triton")
    c = x.shape[-1]
    rows = x.reshape(-1, c)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(c)
    block_r = max(1, 4096 // block)                                   # short rows: several per program
    w = weight.contiguous() if weight is not None else out
    n = rows.shape[0]
    with device_guard(x.device):
        _rms_norm_kernel[(triton.cdiv(n, block_r),)](rows, w, out, n, c, float(eps), rows.stride(0), out.stride(0),
                                                     HAS_W=weight is not None, BLOCK_R=block_r, BLOCK=block,
                                                     num_warps=8 if block_r * block >= 4096 else 4)
    return out.view(x.shape)


def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``apply_rope(x, cos, sin, inverse, inplace=True)``: x [B, S, C] or [B, S, H, C] (last dim
    contiguous), cos / sin [S, R/2] fp32 (rows may be strided); rotates x's last R channels in
    place and returns x."""
    if triton is None:
        raise RuntimeError("rope_inplace needs Triton")
    if x.dim() not in (3, 4) or x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"rope_inplace: x {tuple(x.shape)} strides {x.stride()}, cos strides {cos.stride()} "
                         "(need [B, S, (H,) C] with a contiguous last dim)")
    half = cos.shape[-1]
    if half & (half - 1):
        raise ValueError(f"rope_inplace: {2 * half} rope channels; the kernel needs a power of two")
    xv = x if x.dim() == 4 else x.unsqueeze(2)
    bsz, seqlen, heads, chans = xv.shape
    rows = bsz * seqlen * heads
    block_r = max(1, 4096 // (2 * half))
    with device_guard(x.device):
        _rope_kernel[(triton.cdiv(rows, block_r),)](
            xv, cos, sin, rows, seqlen, heads, xv.stride(0), xv.stride(1), xv.stride(2), cos.stride(0),
            chans - 2 * half, SIGN=-1.0 if inverse else 1.0, HALF=half, BLOCK_R=block_r, num_warps=4)
    return x
