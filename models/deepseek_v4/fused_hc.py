"""The hyper-connection mixes and weights as Triton kernels (CUDA, inference only).

Both ends of a V4 sub-layer mix the hc copies of the residual stream with per-token weights:

    hc_pre  combine:  y[t]       = sum_k pre[t, k]     * x[t, k]                 (J = 1 output row)
    hc_post:          out[t, j]  = post[t, j] * y[t] + sum_k comb[t, k, j] * res[t, k]

with k, j < hc (4) and rows of D (4096) channels, in fp32, rounded once to the stream's dtype.
In torch these are broadcasts over an fp32 copy of the stream (or a batched 4 x 4 GEMM per token);
at S = 4096 they cost ~1 ms per call on an H200 for ~0.3 GB of memory traffic. The kernel reads
each bf16 row once and writes the result once.

Numerics: the same fp32 products and sums in the same order (the optional y term first, then
k = 0, 1, ...); the compiler may fuse a multiply and an add into one FMA, which changes the last
fp32 bit at most -- far below the bf16 rounding of the result. tests/test_fused_attention.py
checks the kernel against the torch expressions under Triton's interpreter.
"""
from __future__ import annotations

import torch

from amct_ext.runtime.device import device_guard
from amct_ext.runtime.triton_support import triton, tl  # noqa: F401  (None without Triton)


if triton is not None:

    @triton.jit
    def _hc_mix_kernel(rows_ptr, w_ptr, y_ptr, a_ptr, out_ptr, D,
                       K: tl.constexpr, J: tl.constexpr, HAS_Y: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = offs < D
        if HAS_Y:
            y = tl.load(y_ptr + t * D + offs, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(J):
            if HAS_Y:
                acc = tl.load(a_ptr + t * J + j) * y
            else:
                acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for k in tl.static_range(K):
                row = tl.load(rows_ptr + (t * K + k) * D + offs, mask=mask, other=0.0).to(tl.float32)
                acc += tl.load(w_ptr + (t * K + k) * J + j) * row
            tl.store(out_ptr + (t * J + j) * D + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


if triton is not None:

    @triton.jit
    def _sigmoid(x):
        return 1.0 / (1.0 + tl.exp(-x))

    @triton.jit
    def _hc_weights_kernel(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, hc_eps,
                           HC: tl.constexpr, ITERS: tl.constexpr, BLOCK_T: tl.constexpr):
        """mix [T, (2 + HC) * HC] -> pre [T, HC], post [T, HC], comb [T, HC, HC] (hc_pre's formulas)."""
        width: tl.constexpr = (2 + HC) * HC
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < T
        c = tl.arange(0, HC)
        row = mix_ptr + t[:, None] * width
        m2 = tmask[:, None]
        s0 = tl.load(scale_ptr)
        s1 = tl.load(scale_ptr + 1)
        s2 = tl.load(scale_ptr + 2)
        pre = tl.load(row + c[None, :], mask=m2, other=0.0) * s0 + tl.load(base_ptr + c)[None, :]
        tl.store(pre_ptr + t[:, None] * HC + c[None, :], _sigmoid(pre) + hc_eps, mask=m2)
        post = tl.load(row + HC + c[None, :], mask=m2, other=0.0) * s1 + tl.load(base_ptr + HC + c)[None, :]
        tl.store(post_ptr + t[:, None] * HC + c[None, :], 2.0 * _sigmoid(post), mask=m2)
        ij = c[:, None] * HC + c[None, :]                                        # [HC, HC], row-major
        m3 = tmask[:, None, None]
        comb = tl.load(mix_ptr + t[:, None, None] * width + 2 * HC + ij[None, :, :], mask=m3, other=0.0)
        comb = comb * s2 + tl.load(base_ptr + 2 * HC + ij)[None, :, :]
        comb = tl.exp(comb - tl.max(comb, 2)[:, :, None])                        # softmax over the last dim
        comb = comb / tl.sum(comb, 2)[:, :, None] + hc_eps
        comb = comb / (tl.sum(comb, 1)[:, None, :] + hc_eps)                     # column sums
        for _ in tl.static_range(ITERS - 1):
            comb = comb / (tl.sum(comb, 2)[:, :, None] + hc_eps)                 # row sums
            comb = comb / (tl.sum(comb, 1)[:, None, :] + hc_eps)
        tl.store(comb_ptr + t[:, None, None] * (HC * HC) + ij[None, :, :], comb, mask=m3)


def hc_weights(mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int, sinkhorn_iters: int,
               hc_eps: float, block_t: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_pre's per-token weights from the normalised mix [..., (2 + hc) * hc] fp32, in one kernel:
    (pre [..., hc], post [..., hc], comb [..., hc, hc]). The torch version is ~120 launches of tiny
    ops (20 Sinkhorn iterations), which left the GPU waiting on the host."""
    if triton is None:
        raise RuntimeError("hc_weights needs Triton")
    lead = mix.shape[:-1]
    flat = mix.reshape(-1, mix.shape[-1]).float().contiguous()
    n = flat.shape[0]
    pre = torch.empty(n, hc_mult, dtype=torch.float32, device=mix.device)
    post = torch.empty_like(pre)
    comb = torch.empty(n, hc_mult, hc_mult, dtype=torch.float32, device=mix.device)
    with device_guard(mix.device):
        _hc_weights_kernel[(triton.cdiv(n, block_t),)](
            flat, scale.float().contiguous(), base.float().contiguous(), pre, post, comb, n, float(hc_eps),
            HC=hc_mult, ITERS=sinkhorn_iters, BLOCK_T=block_t, num_warps=4)
    return pre.view(*lead, hc_mult), post.view(*lead, hc_mult), comb.view(*lead, hc_mult, hc_mult)


def hc_mix(rows: torch.Tensor, weights: torch.Tensor, y: torch.Tensor | None = None,
           y_weights: torch.Tensor | None = None, block_d: int = 1024) -> torch.Tensor:
    """rows [..., K, D], weights [..., K, J] fp32, optional y [..., D] with y_weights [..., J]
    -> out [..., J, D] in rows' dtype: out[j] = y_weights[j] * y + sum_k weights[k, j] * rows[k]."""
    if triton is None:
        raise RuntimeError("hc_mix needs Triton")
    *lead, n_k, dim = rows.shape
    n_j = weights.shape[-1]
    tokens = rows[..., 0, 0].numel()
    rows = rows.contiguous()
    weights = weights.float().contiguous()
    out = torch.empty(*lead, n_j, dim, dtype=rows.dtype, device=rows.device)
    has_y = y is not None
    y = y.contiguous() if has_y else rows
    y_weights = y_weights.float().contiguous() if has_y else weights
    grid = (tokens, triton.cdiv(dim, block_d))
    with device_guard(rows.device):
        _hc_mix_kernel[grid](rows, weights, y, y_weights, out, dim, K=n_k, J=n_j, HAS_Y=has_y, BLOCK_D=block_d,
                             num_warps=4)
    return out
