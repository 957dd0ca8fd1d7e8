"""Integer weight fake quantization with a learned rounding offset and clip, forward and
backward, as two Triton kernels (CUDA).

Block-wise rounding (``algorithms/block_rounding.py``) recomputes every quantized weight of a
layer in every step, and differentiates through it to the per-weight rounding offset ``V`` and
the per-group clip factor ``c``. In torch that is ~12 fp32 passes forward and as many backward
over the weights (a V4-Flash layer: 6.4 G weights, ~0.5 s a step on an H200). These kernels read
each group of weights once and write it once.

The weights are seen as rows of one quantization group each: ``w [N, G]`` (G = the group size,
or the whole row for per-channel scales), ``v [N, G]`` fp32, ``c [N]`` fp32. Per row (group),
exactly as ``formats._fq_int`` computes it:

    symmetric:  amax = max|w| * c;            s = amax / qmax (1 where 0);            zp = none
    asymmetric: lo = min(min(w) * c, 0);      hi = max(max(w) * c, 0);
                s = (hi - lo) / (2^k - 1) (1 where 0);  zp = clamp(round(-lo / s), qmin, qmax)
    q = clamp(round(w / s + v) + zp, qmin, qmax);   out = (q - zp) * s      (round: half to even)

with ``c`` and ``v`` clamped to [clip_lo, 1] and [-0.5, 0.5] (straight-through, as the
quantizer's ``effective_clip`` / ``effective_round_offset``). The forward is bit-identical to
the torch definition (the same fp32 operations, IEEE division ``div_rn``, round half to even).

The backward gives what autograd gives through that torch definition, with the
straight-through estimator for ``round``:

    dv = g * s * [qmin <= round(w / s + v) + zp <= qmax]          (bit for bit: one product)
    dc = the chain through s and zp (per group, summed over the group's elements)

or, instead of ``dv``, the SignSGD step applied in place (``step_lr``): the offset's gradient is
complete inside this kernel (each weight's fake quantization enters a step's loss once), so the
step needs neither a gradient tensor nor the separate sign / scale / subtract / clamp passes over
the offsets (a V4-Flash layer: ~25 GB of float32 offsets, ~4 such passes a step). ``v`` may be
float16 (``BlockRound.offset_dtype``): it is read into float32 and the step rounds back.

``dc`` sums in another order than autograd, so it agrees to rounding (tests: relative 1e-5).
``tests/test_fused_rounding.py`` compares both kernels with autograd under Triton's
interpreter.
"""
from __future__ import annotations

import torch

from .device import device_guard
from .triton_support import triton, tl  # noqa: F401  (None without Triton)

#: one row (group) is one block of registers; longer rows use the torch path
MAX_GROUP = 16384

if triton is not None:
    from .fused_quant import _round_half_even

    @triton.jit
    def _group_qparams(w, mask, c, QMIN: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr):
        """(scale s, zero point zp, s before the zero guard, lo, xmin, xmax) per row of ``w``."""
        if SYM:
            amax = tl.max(tl.where(mask, tl.abs(w), 0.0), axis=1)
            s0 = tl.math.div_rn(amax * c, QMAX * 1.0)
            s = tl.where(s0 > 0, s0, 1.0)
            zp = s * 0.0
            lo = s * 0.0
            xmin = amax
            xmax = amax
        else:
            xmin = tl.min(tl.where(mask, w, float("inf")), axis=1)
            xmax = tl.max(tl.where(mask, w, float("-inf")), axis=1)
            lo = tl.minimum(xmin * c, 0.0)
            hi = tl.maximum(xmax * c, 0.0)
            s0 = tl.math.div_rn(hi - lo, (QMAX - QMIN) * 1.0)
            s = tl.where(s0 > 0, s0, 1.0)
            zp = tl.minimum(tl.maximum(_round_half_even(tl.math.div_rn(-lo, s)), QMIN * 1.0), QMAX * 1.0)
        return s, zp, s0, lo, xmin, xmax

    @triton.jit
    def _load_tile(w_ptr, v_ptr, c_ptr, n_rows, G: tl.constexpr, BLOCK_G: tl.constexpr, ROWS: tl.constexpr,
                   HAS_V: tl.constexpr, HAS_C: tl.constexpr, CLIP_LO: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_G)
        rmask = rows < n_rows
        mask = rmask[:, None] & (cols[None, :] < G)
        offs = rows[:, None] * G + cols[None, :]
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_V:
            v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            v = w * 0.0
        if HAS_C:
            c = tl.load(c_ptr + rows, mask=rmask, other=1.0)
            c = tl.minimum(tl.maximum(c, CLIP_LO), 1.0)
        else:
            c = tl.full((ROWS,), 1.0, tl.float32)
        return rows, rmask, mask, offs, w, v, c

    @triton.jit
    def _fq_round_fwd_kernel(w_ptr, v_ptr, c_ptr, out_ptr, n_rows, G: tl.constexpr, BLOCK_G: tl.constexpr,
                             ROWS: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr, SYM: tl.constexpr,
                             HAS_V: tl.constexpr, HAS_C: tl.constexpr, CLIP_LO: tl.constexpr):
        rows, rmask, mask, offs, w, v, c = _load_tile(w_ptr, v_ptr, c_ptr, n_rows, G, BLOCK_G, ROWS, HAS_V, HAS_C,
                                                      CLIP_LO)
        s, zp, s0, lo, xmin, xmax = _group_qparams(w, mask, c, QMIN, QMAX, SYM)
        y = tl.math.div_rn(w, s[:, None])
        if HAS_V:
            y = y + tl.minimum(tl.maximum(v, -0.5), 0.5)
        q = _round_half_even(y)
        if not SYM:
            q = q + zp[:, None]
        q = tl.minimum(tl.maximum(q, QMIN * 1.0), QMAX * 1.0)
        if not SYM:
            q = q - zp[:, None]
        tl.store(out_ptr + offs, (q * s[:, None]).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _fq_round_bwd_kernel(g_ptr, w_ptr, v_ptr, c_ptr, dv_ptr, dc_ptr, n_rows, lr, G: tl.constexpr,
                             BLOCK_G: tl.constexpr, ROWS: tl.constexpr, QMIN: tl.constexpr, QMAX: tl.constexpr,
                             SYM: tl.constexpr, HAS_V: tl.constexpr, HAS_C: tl.constexpr, CLIP_LO: tl.constexpr,
                             WANT_V: tl.constexpr, WANT_C: tl.constexpr, STEP: tl.constexpr):
        rows, rmask, mask, offs, w, v, c = _load_tile(w_ptr, v_ptr, c_ptr, n_rows, G, BLOCK_G, ROWS, HAS_V, HAS_C,
                                                      CLIP_LO)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s, zp, s0, lo, xmin, xmax = _group_qparams(w, mask, c, QMIN, QMAX, SYM)
        ws = tl.math.div_rn(w, s[:, None])
        y = ws
        if HAS_V:
            y = y + tl.minimum(tl.maximum(v, -0.5), 0.5)
        qa = _round_half_even(y)
        if not SYM:
            qa = qa + zp[:, None]
        inside = (qa >= QMIN * 1.0) & (qa <= QMAX * 1.0) & mask
        q = tl.minimum(tl.maximum(qa, QMIN * 1.0), QMAX * 1.0)
        gs = g * s[:, None]                          # d out / d q
        dy = tl.where(inside, gs, 0.0)               # through the clamp and the straight-through round
        if WANT_V:
            if STEP:
                # the SignSGD step on the offset itself, its gradient complete here (each weight's
                # fake quantization enters the step's loss once): v - lr sign(dv), into [-0.5, 0.5]
                sgn = tl.where(dy > 0, 1.0, tl.where(dy < 0, -1.0, 0.0))
                vn = tl.minimum(tl.maximum(v - lr * sgn, -0.5), 0.5)
                tl.store(v_ptr + offs, vn.to(v_ptr.dtype.element_ty), mask=mask)
            else:
                tl.store(dv_ptr + offs, dy, mask=mask)
        if WANT_C:
            # s: directly (out = (q - zp) * s) and through y = w / s
            if SYM:
                ds = tl.sum(g * q, axis=1)
            else:
                ds = tl.sum(g * (q - zp[:, None]), axis=1)
            ds += tl.sum(-dy * ws, axis=1) / s
            if SYM:
                ds0 = tl.where(s0 > 0, ds, 0.0)
                dc = (ds0 / QMAX) * xmax                       # xmax holds amax (symmetric)
            else:
                # zp: out = (q - zp) s with q = clamp(r + zp): d out / d zp = s ([inside] - 1)
                dzp = tl.sum(dy, axis=1) - tl.sum(gs, axis=1)
                zr = _round_half_even(tl.math.div_rn(-lo, s))
                dz0 = tl.where((zr >= QMIN * 1.0) & (zr <= QMAX * 1.0), dzp, 0.0)
                # z0 = -lo / s
                dlo = -(dz0 / s)
                ds += dz0 * ((-lo / s) / s) * -1.0
                ds0 = tl.where(s0 > 0, ds, 0.0)
                dd = ds0 / (QMAX - QMIN)
                dlo += -dd
                dxmin = tl.where(xmin * c <= 0.0, dlo, 0.0)
                dxmax = tl.where(xmax * c >= 0.0, dd, 0.0)
                dc = dxmin * xmin + dxmax * xmax
            tl.store(dc_ptr + rows, dc, mask=rmask)


def fused_rounding_supported(w: torch.Tensor, group: int) -> bool:
    return triton is not None and w.is_cuda and 0 < group <= MAX_GROUP and w.numel() > 0


#: elements (rows x BLOCK_G) a program takes where the group is shorter. 1024 (8 rows of a
#: 128-group at 4 warps): the backward holds ~10 fp32 tiles live, and at 4096 elements a program
#: (the earlier shape) they spilled registers; measured on an H100, a V4-Flash chunk of 42 experts'
#: w13, float16 offsets: forward 1.51 -> 1.45 ms, forward + backward with the step 5.08 -> 3.62 ms,
#: results equal bit for bit (benchmarks/check_block_rounding_kernels.py --sweep,
#: results/block-rounding.md)
ELEMENTS_PER_PROGRAM = 1024


def _launch_shape(group: int) -> tuple[int, int, int]:
    """(BLOCK_G, ROWS, num_warps): ``ELEMENTS_PER_PROGRAM`` a program (one row where a row is longer)."""
    block = triton.next_power_of_2(group)
    rows = max(1, min(64, ELEMENTS_PER_PROGRAM // block))
    return block, rows, 4 if block * rows <= 4096 else 8


def fq_round_forward(w: torch.Tensor, v: torch.Tensor | None, c: torch.Tensor | None, group: int,
                     qmin: int, qmax: int, symmetric: bool, clip_lo: float,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fake-quant ``w`` (contiguous, numel a multiple of ``group``) in its dtype (or ``out_dtype``);
    see the module doc."""
    n_rows = w.numel() // group
    out = torch.empty_like(w, dtype=out_dtype or w.dtype)
    block, rows, warps = _launch_shape(group)
    with device_guard(w.device):
        _fq_round_fwd_kernel[(triton.cdiv(n_rows, rows),)](
            w, v if v is not None else w, c if c is not None else w, out, n_rows, G=group, BLOCK_G=block,
            ROWS=rows, QMIN=qmin, QMAX=qmax, SYM=symmetric, HAS_V=v is not None, HAS_C=c is not None,
            CLIP_LO=clip_lo, num_warps=warps)
    return out


def fq_round_backward(g: torch.Tensor, w: torch.Tensor, v: torch.Tensor | None, c: torch.Tensor | None,
                      group: int, qmin: int, qmax: int, symmetric: bool, clip_lo: float, want_v: bool,
                      want_c: bool, step_lr: float | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(d loss / d v [like w, fp32] or None, d loss / d c [n_rows, fp32] or None) from ``g`` = d loss / d out.

    ``step_lr``: instead of returning d loss / d v, apply the SignSGD step to ``v`` in place,
    ``v = clamp(v - step_lr * sign(d loss / d v), -0.5, 0.5)`` (in v's dtype; d v is then None)."""
    n_rows = w.numel() // group
    step = step_lr is not None and want_v
    dv = torch.empty(w.shape, dtype=torch.float32, device=w.device) if (want_v and not step) else None
    dc = torch.empty(n_rows, dtype=torch.float32, device=w.device) if want_c else None
    block, rows, warps = _launch_shape(group)
    with device_guard(w.device):
        _fq_round_bwd_kernel[(triton.cdiv(n_rows, rows),)](
            g, w, v if v is not None else w, c if c is not None else w, dv if dv is not None else g,
            dc if dc is not None else g, n_rows, float(step_lr or 0.0), G=group, BLOCK_G=block, ROWS=rows,
            QMIN=qmin, QMAX=qmax, SYM=symmetric, HAS_V=v is not None, HAS_C=c is not None, CLIP_LO=clip_lo,
            WANT_V=want_v, WANT_C=want_c, STEP=step, num_warps=warps)
    return dv, dc
