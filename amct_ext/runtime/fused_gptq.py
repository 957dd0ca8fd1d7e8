"""GPTQ's column sweep of one lazy block as one Triton kernel (CUDA), for integer grids.

``algorithms.gptq._sweep_block`` quantizes the block's columns one after the other: per column

    q = (clamp(round_half_even(w / s) [+ z], qmin, qmax) [- z]) * s;   e = (w - q) / d
    W[:, i+1:] -= e * U[i, i+1:]                         (mul, then sub: two roundings)

as ~10 launches over the whole [B, R, n] block, replayed from a CUDA graph. The sweep is then
bound by those launches' memory traffic, 7x its FLOP floor (RESULTS §0.9). Rows are independent
(U is shared by every row of a matrix), so this kernel gives each program a tile of rows of one
matrix, holds the tile [rows, n] in registers for the whole block and writes only the grid values
and the scaled errors. It is bit-identical to ``_sweep_block`` for finite inputs: the same fp32
operations in the same order, an IEEE division (``div_rn``; Triton's default fp32 division is approximate), round
half to even, and no fused multiply-add (``enable_fp_fusion=False``: a contracted ``w - e * u``
rounds once, torch rounds twice; casebook A10). A column is read out of the register tile by an
integer sum of its bit pattern, so even a -0.0 comes out as it went in.

The grid is static: ``S`` (and ``Z``) per element, as ``gptq_solve`` passes it for per-channel
and static-group specs; for dynamic groups that span the whole block the caller computes the
group's qparams from the block's columns first (they are taken before any column of the block is
swept, as in ``_sweep_block``). ``tests/test_fused_gptq.py`` compares it with ``_sweep_block``
under Triton's interpreter; ``benchmarks/bench_gptq_sweep.py`` on the GPU.
"""
from __future__ import annotations

import torch

from .device import device_guard
from .triton_support import triton, tl  # noqa: F401  (None without Triton)

if triton is not None:
    from .fused_quant import _round_half_even   # torch.round, -0.0 included

MAX_BLOCK = 256        # columns of one lazy block held in registers (GPTQ's default block: 128)

if triton is not None:

    @triton.jit
    def _clamp(x, lo, hi):
        # torch.clamp_ for finite x. (A NaN would come out clamped, where torch keeps it: weights
        # are refused non-finite on load and activations by the device checks, so none gets here.)
        return tl.minimum(tl.maximum(x, lo), hi)

    @triton.jit
    def _column(tile, sel):
        """Column ``sel`` [1, NP] (one True) of a [BR, NP] fp32 tile, bit for bit."""
        bits = tile.to(tl.int32, bitcast=True)
        return tl.sum(tl.where(sel, bits, 0), axis=1).to(tl.float32, bitcast=True)

    @triton.jit
    def _sweep_kernel(w_ptr, u_ptr, s_ptr, z_ptr, q_ptr, e_ptr, R, n,
                      swb, swr, swc, sub, sur, suc, ssb, ssr, ssc, szb, szr, szc,
                      QMIN: tl.constexpr, QMAX: tl.constexpr, HAS_Z: tl.constexpr,
                      BR: tl.constexpr, NP: tl.constexpr):
        pid_r = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        rows = pid_r * BR + tl.arange(0, BR)
        cols = tl.arange(0, NP)
        rmask = rows < R
        m2 = rmask[:, None] & (cols[None, :] < n)
        r64 = rows.to(tl.int64)
        W = tl.load(w_ptr + b * swb + r64[:, None] * swr + cols[None, :] * swc, mask=m2, other=0.0)
        s_rows = s_ptr + b * ssb + r64 * ssr        # the grid is read column by column (unchanged)
        z_rows = z_ptr + b * szb + r64 * szr
        out = b * R * n + r64 * n
        for i in range(n):
            w = _column(W, cols[None, :] == i)
            s = tl.load(s_rows + i * ssc, mask=rmask, other=1.0)
            col = _round_half_even(tl.math.div_rn(w, s))
            if HAS_Z:
                z = tl.load(z_rows + i * szc, mask=rmask, other=0.0)
                col = col + z
                col = _clamp(col, QMIN, QMAX)
                col = col - z
            else:
                col = _clamp(col, QMIN, QMAX)
            q = col * s
            d = tl.load(u_ptr + b * sub + i * suc + i * sur)
            e = tl.math.div_rn(w - q, d)
            tl.store(q_ptr + out + i, q, mask=rmask)
            tl.store(e_ptr + out + i, e, mask=rmask)
            # the columns after i; the others get -(+-0), which leaves no used value changed
            later = (cols > i) & (cols < n)
            u = tl.load(u_ptr + b * sub + i * sur + cols * suc, mask=later, other=0.0)
            W = W - e[:, None] * u[None, :]


MAX_MATRICES = 65535   # the launch grid's second axis


def fused_sweep_supported(W1: torch.Tensor, U: torch.Tensor) -> bool:
    """Whether the kernel can sweep this block: fp32 weights and factor, at most MAX_BLOCK
    columns, at most MAX_MATRICES matrices."""
    return (triton is not None and W1.dtype == torch.float32 and U.dtype == torch.float32
            and 0 < W1.shape[-1] <= MAX_BLOCK and W1.shape[0] <= MAX_MATRICES)


def fused_sweep_block(W1: torch.Tensor, U1: torch.Tensor, S1: torch.Tensor, Z1: torch.Tensor | None,
                      qmin: int, qmax: int, rows_per_program: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """``_sweep_block`` for an integer grid given per element: ``W1`` [B, R, n] (not modified),
    ``U1`` [B, n, n], ``S1`` / ``Z1`` [B, R, n] (any strides). Returns ``(Q1, E1)``, contiguous."""
    B, R, n = W1.shape
    Q1 = torch.empty(B, R, n, dtype=torch.float32, device=W1.device)
    E1 = torch.empty_like(Q1)
    np2 = triton.next_power_of_2(n)
    br = max(1, min(rows_per_program, triton.next_power_of_2(R)))
    z = Z1 if Z1 is not None else S1
    grid = (triton.cdiv(R, br), B)
    with device_guard(W1.device):
        _sweep_kernel[grid](W1, U1, S1, z, Q1, E1, R, n, *W1.stride(), *U1.stride(), *S1.stride(), *z.stride(),
                            QMIN=qmin, QMAX=qmax, HAS_Z=Z1 is not None, BR=br, NP=np2,
                            num_warps=4, enable_fp_fusion=False)
    return Q1, E1
