"""Dynamic per-token symmetric integer fake quantization as one Triton kernel (CUDA).

``formats.fake_quant`` with an int, symmetric, per-token spec (w8a8's activations) computes

    amax = max |x_row|;  scale = amax / qmax  (1 where amax is 0);
    x_hat = clamp(round_half_even(x / scale), -qmax, qmax) * scale    -> x's dtype

as ~10 torch passes over an fp32 copy of the activation. This kernel reads each row once and
writes it once. It is bit-identical to the torch definition: the same fp32 operations, with an
IEEE round-to-nearest division (``div_rn``; Triton's default fp32 division is approximate) and
round half to even (as ``torch.round``). Non-finite inputs are counted on the
device and refused by the caller, as ``formats._check_input`` refuses them.

``tests/test_fused_attention.py`` compares it with ``formats.fake_quant`` under Triton's
interpreter; ``benchmarks/check_fast_paths.py`` on the GPU.
"""
from __future__ import annotations

import torch

from .device import device_guard
from .triton_support import triton, tl  # noqa: F401  (None without Triton)

MAX_ROW = 16384  # one row is one block of registers; longer rows use the torch path

if triton is not None:

    @triton.jit
    def _round_half_even(y):
        """torch.round, bit for bit, for |y| < 2^22 (larger |y| are clamped to the grid right after,
        to the same bound whatever this gives): y + 0.5 is exact, so floor gives
        round-half-up; exact ties that landed on an odd integer step back. (libdevice's rint
        would do, but Triton's interpreter lacks it, and the CI tests run there.)"""
        r = tl.floor(y + 0.5)
        odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
        r = tl.where(((r - y) == 0.5) & odd, r - 1.0, r)
        # a zero keeps y's sign, as torch.round(-0.3) is -0.0 (casebook A15)
        return tl.where(r == 0.0, y * 0.0, r)

    @triton.jit
    def _fq_int_token_kernel(x_ptr, out_ptr, bad_ptr, D: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < D
        x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        n_bad = tl.sum(tl.where(ax < float("inf"), 0, 1).to(tl.int32))   # NaN and +-Inf
        if n_bad > 0:
            tl.atomic_add(bad_ptr, n_bad)
        amax = tl.max(ax, 0)
        scale = tl.math.div_rn(amax, QMAX)
        scale = tl.where(scale > 0, scale, 1.0)
        q = _round_half_even(tl.math.div_rn(x, scale))
        q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
        tl.store(out_ptr + row * D + offs, (q * scale).to(out_ptr.dtype.element_ty), mask=mask)


def fused_int_token_supported(x: torch.Tensor) -> bool:
    return triton is not None and 0 < x.shape[-1] <= MAX_ROW and x.numel() > 0


def fake_quant_int_token(x: torch.Tensor, bits: int, out_dtype: torch.dtype | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_hat in x's dtype -- or ``out_dtype`` --, number of non-finite inputs as a 1-element device
    tensor)."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty_like(rows, dtype=out_dtype or rows.dtype)
    bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    block = triton.next_power_of_2(dim)
    with device_guard(x.device):
        _fq_int_token_kernel[(rows.shape[0],)](rows, out, bad, D=dim, QMAX=2 ** (bits - 1) - 1, BLOCK=block,
                                               num_warps=4 if block <= 2048 else 8)
    return out.view(x.shape), bad
