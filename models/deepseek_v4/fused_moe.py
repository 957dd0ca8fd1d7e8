"""V4's clamped SwiGLU and the routed-expert combine as Triton kernels (CUDA, inference only).

Between the two expert GEMMs, ``Expert.forward`` / ``MoE.route_grouped`` compute, per row,

    up = clamp(x @ w3, -L, L);  gate = clamp(x @ w1, max=L);  h = silu(gate) * up * route_weight

in fp32 from the bf16 GEMM output, then round h to bf16. In torch that is ~8 passes over fp32
copies of a [T, 2I] tensor (T = 6 x tokens rows: 24576 x 4096 at S = 4096), ~1.5 ms per layer on an
H200; the kernel reads the bf16 [T, 2I] once and writes the bf16 [T, I] once.

Numerics: the same fp32 operations in the same order; silu is x / (1 + exp(-x)) as in torch, with
Triton's exp (last-bit differences in fp32, before the bf16 rounding). Checked against the torch
expression under Triton's interpreter (tests/test_fused_attention.py) and at full shape on the GPU
(benchmarks/check_fast_paths.py).
"""
from __future__ import annotations

import torch

from amct_ext.device import device_guard

try:  # optional, as in fused_attention.py
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


if triton is not None:

    @triton.jit
    def _swiglu_kernel(h_ptr, w_ptr, out_ptr, I, limit, HAS_W: tl.constexpr, HAS_LIMIT: tl.constexpr,
                       BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        gate = tl.load(h_ptr + row * 2 * I + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_ptr + row * 2 * I + I + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_LIMIT:
            up = tl.minimum(tl.maximum(up, -limit), limit)
            gate = tl.minimum(gate, limit)
        y = gate / (1.0 + tl.exp(-gate)) * up
        if HAS_W:
            y = y * tl.load(w_ptr + row)
        tl.store(out_ptr + row * I + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


if triton is not None:

    @triton.jit
    def _combine_kernel(y_ptr, rows_ptr, out_ptr, D, K: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < D
        r = tl.load(rows_ptr + t * K).to(tl.int64)
        acc = tl.load(y_ptr + r * D + offs, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(1, K):
            r = tl.load(rows_ptr + t * K + j).to(tl.int64)
            acc += tl.load(y_ptr + r * D + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * D + offs, acc, mask=mask)


def combine_rows(y: torch.Tensor, rows: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """out[t] = sum_j y[rows[t, j]] in fp32, j in order: y [T, D] (the experts' outputs in sorted
    order), rows [N, k] -> [N, D] fp32. The same fp32 additions in the same order as gathering
    and adding in torch (no multiply, so nothing to contract): bit-identical."""
    if triton is None:
        raise RuntimeError("combine_rows needs Triton")
    y = y.contiguous()
    rows = rows.contiguous()
    n, k = rows.shape
    dim = y.shape[1]
    out = torch.empty(n, dim, dtype=torch.float32, device=y.device)
    with device_guard(y.device):
        _combine_kernel[(n, triton.cdiv(dim, block))](y, rows, out, dim, K=k, BLOCK=block, num_warps=4)
    return out


def clamped_swiglu(h: torch.Tensor, limit: float, weights: torch.Tensor | None = None,
                   block: int = 1024) -> torch.Tensor:
    """h [T, 2I] = [x @ w1 | x @ w3] (16-bit), weights [T] fp32 or None -> [T, I] in h's dtype."""
    if triton is None:
        raise RuntimeError("clamped_swiglu needs Triton")
    h = h.contiguous()
    rows, inter = h.shape[0], h.shape[1] // 2
    out = torch.empty(rows, inter, dtype=h.dtype, device=h.device)
    has_w = weights is not None
    w = weights.float().contiguous() if has_w else h
    grid = (rows, triton.cdiv(inter, block))
    with device_guard(h.device):
        _swiglu_kernel[grid](h, w, out, inter, float(limit), HAS_W=has_w, HAS_LIMIT=limit > 0, BLOCK=block, num_warps=4)
    return out
