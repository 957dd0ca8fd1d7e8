"""The hyper-connection mixes and weights as Triton kernels (CUDA), with their backward.

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
from amct_ext.runtime.exact_gemm import linear_fp32
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


# ------------------------------------------------------------------ the mixes under autograd
# Block-wise rounding differentiates through both hc ends of each sub-layer. On torch's path that
# is a chain of broadcasts over fp32 copies of the [B, S, hc, D] stream (0.5 GiB in bf16 at
# 8 x 2048 tokens of V4-Flash) in the forward and again in the backward. The two Functions below
# run the forward through the kernels above and give each its backward: per-token dot products
# (hc_dots), the mixes again with transposed weights, and one pass for hc_pre's input gradient.

if triton is not None:

    @triton.jit
    def _hc_dots_kernel(a_ptr, b_ptr, out_ptr, D, K: tl.constexpr, J: tl.constexpr, BLOCK_D: tl.constexpr):
        """out[t, k, j] = sum_d a[t, k, d] * b[t, j, d] in fp32 (one program a token)."""
        t = tl.program_id(0).to(tl.int64)
        ks = tl.arange(0, K)
        js = tl.arange(0, J)
        acc = tl.zeros([K, J], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs = d0 + tl.arange(0, BLOCK_D)
            mask = (offs < D)[None, :]
            a = tl.load(a_ptr + (t * K + ks[:, None]) * D + offs[None, :], mask=mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + (t * J + js[:, None]) * D + offs[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += tl.sum(a[:, None, :] * b[None, :, :], axis=2)
        tl.store(out_ptr + (t * K + ks[:, None]) * J + js[None, :], acc)

    @triton.jit
    def _hc_pre_grad_kernel(x_ptr, gy_ptr, pre_ptr, g_lin_ptr, c_ptr, out_ptr, D,
                            K: tl.constexpr, BLOCK_D: tl.constexpr):
        """out[t, k] = pre[t, k] * gy[t] + g_lin[t, k] + c[t] * x[t, k], fp32 math, out's dtype."""
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = offs < D
        gy = tl.load(gy_ptr + t * D + offs, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(c_ptr + t)
        for k in tl.static_range(K):
            at = (t * K + k) * D + offs
            x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
            acc = tl.load(pre_ptr + t * K + k) * gy + tl.load(g_lin_ptr + at, mask=mask, other=0.0) + c * x
            tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)


def hc_dots(a: torch.Tensor, b: torch.Tensor, block_d: int = 256) -> torch.Tensor:
    """a [..., K, D], b [..., J, D] -> [..., K, J] fp32: every row of a against every row of b,
    per token. K and J are powers of two (hc = 4, or 1)."""
    if triton is None:
        raise RuntimeError("hc_dots needs Triton")
    *lead, n_k, dim = a.shape
    n_j = b.shape[-2]
    a, b = a.contiguous(), b.contiguous()
    tokens = a[..., 0, 0].numel()
    out = torch.empty(*lead, n_k, n_j, dtype=torch.float32, device=a.device)
    with device_guard(a.device):
        _hc_dots_kernel[(tokens,)](a, b, out, dim, K=n_k, J=n_j, BLOCK_D=block_d, num_warps=4)
    return out


def _hc_pre_input_grad(x: torch.Tensor, g_y: torch.Tensor, pre: torch.Tensor, g_lin: torch.Tensor,
                       c: torch.Tensor, block_d: int = 1024) -> torch.Tensor:
    """hc_pre's gradient for x [..., K, D]: the combine's pre * g_y, plus the mix's g_lin (fp32,
    x's shape) and its norm's c * x; one pass, rounded once to x's dtype."""
    *lead, n_k, dim = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    tokens = x[..., 0, 0].numel()
    with device_guard(x.device):
        _hc_pre_grad_kernel[(tokens, triton.cdiv(dim, block_d))](
            x.contiguous(), g_y.contiguous(), pre.float().contiguous(), g_lin.contiguous(), c.float().contiguous(),
            out, dim, K=n_k, BLOCK_D=block_d, num_warps=4)
    return out


class _HcPre(torch.autograd.Function):
    """hc_pre through the kernels, differentiable in x (the hc parameters are frozen: the caller
    keeps them out, modeling._use_fused_hc)."""

    @staticmethod
    def forward(ctx, x, fn, scale, base, hc_mult, sinkhorn_iters, hc_eps, norm_eps, fn_split, weights_torch):
        flat = x.flatten(-2)                                              # [..., hc*D]
        # mean of squares inside one reduction, no fp32 copy of the stream
        mean_sq = torch.linalg.vector_norm(flat, dim=-1, keepdim=True, dtype=torch.float32).square() / flat.shape[-1]
        rstd = torch.rsqrt(mean_sq + norm_eps)
        lin = linear_fp32(flat, fn, fn_split)
        pre, post, comb = hc_weights(lin * rstd, scale, base, hc_mult, sinkhorn_iters, hc_eps)
        ctx.save_for_backward(x, fn, scale, base, lin, rstd, pre)
        ctx.consts = (hc_mult, sinkhorn_iters, hc_eps, weights_torch)
        return hc_mix(x, pre.unsqueeze(-1)).squeeze(-2), post, comb

    @staticmethod
    def backward(ctx, g_y, g_post, g_comb):
        x, fn, scale, base, lin, rstd, pre = ctx.saved_tensors
        hc_mult, sinkhorn_iters, hc_eps, weights_torch = ctx.consts
        g_pre = hc_dots(x, g_y.unsqueeze(-2)).squeeze(-1)                 # [..., hc]: sum_d g_y * x[k]
        # the weights are a few dozen floats a token: their backward is torch's, on a recomputation
        with torch.enable_grad():
            mix = (lin * rstd).detach().requires_grad_(True)
            outs = weights_torch(mix, scale, base, hc_mult, sinkhorn_iters, hc_eps)
            (g_mix,) = torch.autograd.grad(outs, (mix,), (g_pre, g_post, g_comb))
        # mix = lin * rstd with lin = flat @ fn^T and rstd = (mean(flat^2) + eps)^-1/2, so
        # d/dflat = rstd * (g_mix @ fn) - rstd^3 / N * (g_mix . lin) * flat
        c = -(g_mix * lin).sum(-1) * rstd.squeeze(-1).pow(3) / (x.shape[-2] * x.shape[-1])
        g_lin = torch.matmul(g_mix * rstd, fn.float()).view(x.shape)
        g_x = _hc_pre_input_grad(x, g_y, pre, g_lin, c)
        return g_x, None, None, None, None, None, None, None, None, None


class _HcPost(torch.autograd.Function):
    """hc_post through the kernel, differentiable in all four inputs."""

    @staticmethod
    def forward(ctx, y, res, post, comb):
        ctx.save_for_backward(y, res, post, comb)
        return hc_mix(res, comb, y, post)

    @staticmethod
    def backward(ctx, g):
        y, res, post, comb = ctx.saved_tensors
        need_y, need_res, need_post, need_comb = ctx.needs_input_grad
        g = g.contiguous()
        g_y = hc_mix(g, post.unsqueeze(-1)).squeeze(-2).to(y.dtype) if need_y else None
        g_res = hc_mix(g, comb.transpose(-1, -2)).to(res.dtype) if need_res else None
        g_post = hc_dots(g, y.unsqueeze(-2)).squeeze(-1) if need_post else None      # [..., hc]
        g_comb = hc_dots(res, g) if need_comb else None                               # [..., k, j]
        return g_y, g_res, g_post, g_comb


def hc_pre_fused(x, fn, scale, base, hc_mult, sinkhorn_iters, hc_eps, norm_eps, fn_split, weights_torch):
    """modeling.hc_pre on the kernels: (y, post, comb); autograd reaches x. ``weights_torch`` is
    modeling's torch definition of the weights, used for their backward."""
    return _HcPre.apply(x, fn, scale, base, hc_mult, sinkhorn_iters, hc_eps, norm_eps, fn_split, weights_torch)


def hc_post_fused(y, res, post, comb):
    """modeling.hc_post on the kernel; autograd reaches all four inputs."""
    return _HcPost.apply(y, res, post, comb)
