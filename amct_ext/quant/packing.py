"""Bit packing of sub-byte integer codes, in the two layouts the export formats use (the
compressed-tensors stream also stores GPTQ's low-bit codes in a run's ptq_params).

- compressed-tensors ``pack-quantized``: codes of ``b`` bits, made unsigned by adding
  ``2^(b-1)``, laid end to end along the last dim as one little-endian bit stream, cut into
  int32 words (32 codes -> exactly ``b`` words; a ragged tail is zero-padded). Element ``j`` of
  a row starts at bit ``j * b`` of that row's stream. The zero point is packed the same way
  along dim 0.
- Ascend ModelSlim W4A8 (``int4`` in int8): rows ``2j`` and ``2j + 1`` of the ``[out, in]``
  code matrix share one byte row: row ``2j`` in the low nibble, row ``2j + 1`` in the high
  nibble, both as signed 4-bit two's complement.

Both are written here from the format descriptions (no library code); the compressed-tensors
package is only used by the tests, as the independent check of this packing.
"""
from __future__ import annotations

import math

import torch

from ..errors import QuantConfigError


def _bit_weights(device: torch.device) -> torch.Tensor:
    return (torch.ones(32, dtype=torch.int64, device=device) << torch.arange(32, device=device))


def pack_int32(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes ``[rows, cols]`` in ``[-2^(b-1), 2^(b-1) - 1]`` -> int32 ``[rows, ceil(cols*b/32)]``."""
    if not 1 <= bits <= 8:
        raise QuantConfigError(f"pack_int32: bits={bits} outside 1..8")
    if codes.dim() != 2:
        raise QuantConfigError(f"pack_int32: expected a 2-D code matrix, got shape {tuple(codes.shape)}")
    rows, cols = codes.shape
    u = codes.to(torch.int64) + (1 << (bits - 1))
    if bool(((u < 0) | (u >= (1 << bits))).any()):
        raise QuantConfigError(f"pack_int32: codes out of the {bits}-bit range")
    padded = math.ceil(cols / 32) * 32
    if padded != cols:
        u = torch.nn.functional.pad(u, (0, padded - cols))
    if 32 % bits == 0:
        # no code straddles a word: word w holds codes [w*per, (w+1)*per) at bit (j % per) * bits
        per = 32 // bits
        shifts = torch.arange(per, device=u.device, dtype=torch.int64) * bits
        words = (u.reshape(rows, padded // per, per) << shifts).sum(-1)
    else:
        # one bit per position of the row's stream, then 32 stream bits -> one word
        shifts = torch.arange(bits, device=u.device)
        stream = ((u.unsqueeze(-1) >> shifts) & 1).reshape(rows, padded * bits // 32, 32)
        words = (stream * _bit_weights(u.device)).sum(-1)
    # two's complement wrap into int32 (bit 31 set -> negative)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
    return words[:, : math.ceil(cols * bits / 32)].contiguous()


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`pack_int32`: int32 ``[rows, words]`` -> signed int8 codes ``[rows, cols]``."""
    rows, n_words = packed.shape
    need = math.ceil(cols * bits / 32)
    if n_words != need:
        raise QuantConfigError(f"packed tensor has {n_words} int32 words per row; {cols} codes of "
                               f"{bits} bits need {need}")
    w = packed.to(torch.int64) & 0xFFFFFFFF
    padded_words = math.ceil(cols / 32) * bits
    if padded_words != n_words:
        w = torch.nn.functional.pad(w, (0, padded_words - n_words))
    if 32 % bits == 0:
        per = 32 // bits
        shifts = torch.arange(per, device=w.device, dtype=torch.int64) * bits
        u = ((w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(rows, -1)[:, :cols]
    else:
        stream = (w.unsqueeze(-1) >> torch.arange(32, device=w.device)) & 1          # [rows, words, 32]
        stream = stream.reshape(rows, -1, bits)                                        # one code per row of bits
        u = (stream << torch.arange(bits, device=w.device)).sum(-1)[:, :cols]
    return (u - (1 << (bits - 1))).to(torch.int8)


def pack_int32_dim0(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_int32` along dim 0 (the zero-point layout): ``[rows, cols]`` -> ``[ceil(rows*b/32), cols]``."""
    return pack_int32(codes.t().contiguous(), bits).t().contiguous()


def unpack_int32_dim0(packed: torch.Tensor, bits: int, rows: int) -> torch.Tensor:
    return unpack_int32(packed.t().contiguous(), bits, rows).t().contiguous()


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """Signed int4 codes ``[out, in]`` (``out`` even) -> int8 ``[out/2, in]``: row 2j low nibble,
    row 2j+1 high nibble."""
    out = codes.shape[0]
    if out % 2:
        raise QuantConfigError(f"int4 row packing needs an even row count, got {out}")
    if bool(((codes < -8) | (codes > 7)).any()):
        raise QuantConfigError("int4 row packing: codes outside [-8, 7]")
    c = codes.to(torch.int16) & 0xF
    byte = c[0::2] | (c[1::2] << 4)
    return byte.to(torch.uint8).view(torch.int8).contiguous()


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4_rows`: int8 ``[out/2, in]`` -> signed int8 codes ``[out, in]``."""
    b = packed.view(torch.uint8).to(torch.int16)
    lo, hi = b & 0xF, b >> 4
    lo = torch.where(lo >= 8, lo - 16, lo)
    hi = torch.where(hi >= 8, hi - 16, hi)
    return torch.stack((lo, hi), dim=1).reshape(2 * b.shape[0], b.shape[1]).to(torch.int8)
