"""Integer codes decoded to weights as one Triton kernel (CUDA): ``StackCodes.decode``.

Block-wise rounding in turns (``blockround:turns``) runs every expert outside the turn at its
current fake-quant value, decoded from integer codes a chunk at a time: in every forward and
again in the backward's recomputation, so a V4-Pro step decodes its 25 G expert weights two to
four times. In torch the decode is ~7 passes over int16 and fp32 copies (nibbles split, the grid's
offset added, cast, zero point, scale, cast back), ~37 bytes of traffic a weight; this kernel
reads each code byte and scale once and writes each weight once (~2.6 bytes a weight at 4 bits).

Codes are stored as ``u = q - qmin`` (0 .. 2^bits - 1), two to a byte (low nibble first) where
they fit a nibble, else one a byte. Per block of ``G`` consecutive weights of a row (the group,
or the whole row for per-channel scales), exactly as ``formats.dequantize_int`` computes it:

    out = (float(u) + qmin - zp) * scale       (zp: 0 where symmetric)   -> the output dtype

``float(u) + qmin`` is the integer ``q`` exactly, and ``q - zp`` is exact in fp32 for these
small integers, so the one rounding is the product's (IEEE, as torch's), then the cast's: the
result equals the torch path bit for bit (``tests/test_fused_codes.py`` under Triton's
interpreter; ``benchmarks/check_block_rounding_kernels.py`` on the GPU).
"""
from __future__ import annotations

import torch

from .device import device_guard
from .triton_support import triton, tl  # noqa: F401  (None without Triton)

#: weights a program writes
BLOCK = 4096

if triton is not None:

    @triton.jit
    def _decode_kernel(codes_ptr, scale_ptr, zp_ptr, out_ptr, n, G: tl.constexpr, QMIN: tl.constexpr,
                       PACKED: tl.constexpr, HAS_ZP: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if PACKED:   # weight i is the low (even i) or high (odd i) nibble of byte i // 2
            byte = tl.load(codes_ptr + offs // 2, mask=mask, other=0).to(tl.int32)
            u = tl.where((offs % 2) == 0, byte & 15, byte >> 4)
        else:
            u = tl.load(codes_ptr + offs, mask=mask, other=0).to(tl.int32)
        blk = offs // G
        q = u.to(tl.float32) + QMIN
        if HAS_ZP:
            q = q - tl.load(zp_ptr + blk, mask=mask, other=0).to(tl.float32)
        y = q * tl.load(scale_ptr + blk, mask=mask, other=1.0)
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def fused_decode_supported(codes: torch.Tensor) -> bool:
    return triton is not None and codes.is_cuda and codes.numel() > 0


def decode(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, shape: tuple[int, ...],
           block: int, qmin: int, packed: bool, dtype: torch.dtype) -> torch.Tensor:
    """Weights of ``shape`` (last dim a multiple of ``block``) from their contiguous ``codes``
    (uint8; two a byte where ``packed``), fp32 ``scale`` and uint8 ``zero_point`` (or None), one
    of each per ``block`` consecutive weights; see the module doc."""
    out = torch.empty(shape, dtype=dtype, device=codes.device)
    n = out.numel()
    with device_guard(codes.device):
        _decode_kernel[(triton.cdiv(n, BLOCK),)](
            codes, scale, zero_point if zero_point is not None else scale, out, n, G=block, QMIN=qmin,
            PACKED=packed, HAS_ZP=zero_point is not None, BLOCK=BLOCK, num_warps=8)
    return out
