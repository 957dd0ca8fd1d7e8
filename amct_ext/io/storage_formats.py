"""Codecs of the released DeepSeek-V4 checkpoint storage (spec §3).

These are *storage* formats (how the released weights are laid out on disk), not the fake-quant
formats the PTQ works in (those live in ``formats.py``):

- FP8 block: weight ``float8_e4m3fn [out, in]`` + scale ``[ceil(out/128), ceil(in/128)]`` in
  ``float8_e8m0fnu`` (ue8m0: powers of two) or float32; ``w = fp8 * scale`` per 128x128 block.
- FP4 (MXFP4 experts): weight ``int8 [out, in/2]`` (or ``float4_e2m1fn_x2``), two e2m1 codes
  per byte with the LOW nibble holding the EVEN input column; scale ``[out, in/32]`` e8m0.
- e8m0: one byte, value ``2^(byte - 127)``; byte 255 is NaN.

e8m0 values are converted through their exponent bits (uint8) rather than relying on torch's
float8_e8m0fnu casts: the bit path is exact (including 2^-127, a float32 subnormal), behaves the
same on every backend, and lets us reject NaN bytes with a message naming the tensor.

Decoders raise ``CheckpointError`` (bad stored data is a checkpoint problem); encoders raise
``ValueError`` on bad arguments.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F

from ..errors import CheckpointError

FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
FP8_BLOCK = 128
FP4_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN_BYTE = 255
# e2m1 magnitude of codes 0..7; bit 3 of a code is the sign.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_PACKED_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
SCALE_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _what(name: str | None) -> str:
    return f"tensor {name!r}" if name else "tensor"


# ----------------------------------------------------------------------------- e8m0
def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """The raw exponent bytes (uint8) of an e8m0 scale stored as float8_e8m0fnu or uint8."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return scale
    raise CheckpointError(f"expected an e8m0 scale (float8_e8m0fnu or uint8), got {scale.dtype}")


def e8m0_to_float32(scale: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Exact float32 values ``2^(byte-127)``; a NaN byte (255) raises CheckpointError."""
    b = e8m0_bytes(scale)
    n_nan = int((b == E8M0_NAN_BYTE).sum())
    if n_nan:
        raise CheckpointError(f"{_what(name)}: e8m0 scale holds NaN (byte 0xFF) in {n_nan} place(s)")
    b32 = b.to(torch.int32)
    # float32 bits of 2^(b-127): biased exponent b in bits 23..30 (b >= 1); b == 0 is 2^-127,
    # the subnormal with only mantissa bit 22 set.
    bits = torch.where(b32 == 0, torch.full_like(b32, 1 << 22), b32 << 23)
    return bits.view(torch.float32)


def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact floor(log2(x)) (int32) for positive finite float32 x (frexp: x = m*2^e, m in [.5,1))."""
    _, e = torch.frexp(x)
    return e.to(torch.int32) - 1


def _ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(x)) (int32) for positive finite float32 x."""
    m, e = torch.frexp(x)
    return torch.where(m == 0.5, e - 1, e).to(torch.int32)


def exponent_to_e8m0(exp: torch.Tensor) -> torch.Tensor:
    """Integer exponents -> float8_e8m0fnu (clamped to the finite range 2^-127 .. 2^127)."""
    b = (exp.to(torch.int32).clamp(-E8M0_BIAS, 254 - E8M0_BIAS) + E8M0_BIAS).to(torch.uint8)
    return b.view(torch.float8_e8m0fnu)


def float_to_e8m0(x: torch.Tensor, rounding: str = "up") -> torch.Tensor:
    """Positive float32 -> e8m0, rounding the exponent 'up' (never smaller, so a scale computed
    as amax/max_code cannot overflow the codes) or 'down'."""
    x = x.float()
    if rounding == "up":
        return exponent_to_e8m0(_ceil_log2(x))
    if rounding == "down":
        return exponent_to_e8m0(_floor_log2(x))
    raise ValueError(f"float_to_e8m0: rounding must be 'up' or 'down', got {rounding!r}")


def scale_to_float32(scale: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """A stored scale (e8m0, or a float dtype) as float32; NaN scales are rejected."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return e8m0_to_float32(scale, name)
    if scale.dtype in SCALE_FLOAT_DTYPES:
        s = scale.float()
        if bool(torch.isnan(s).any()):
            raise CheckpointError(f"{_what(name)}: scale holds NaN")
        return s
    raise CheckpointError(f"{_what(name)}: unsupported scale dtype {scale.dtype}")


# ----------------------------------------------------------------------------- helpers
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _expand_cols(s: torch.Tensor, block: int, cols: int) -> torch.Tensor:
    """Repeat each scale column ``block`` times and crop to ``cols`` (ragged last block)."""
    return s.repeat_interleave(block, dim=-1)[..., :cols]


def _check_finite(w: torch.Tensor, who: str) -> None:
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{who}: input holds NaN/inf; cannot choose a scale")


# ----------------------------------------------------------------------------- FP8 block
def decode_fp8_block(weight: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK,
                     dtype: torch.dtype = torch.bfloat16, device: str | torch.device | None = None,
                     name: str | None = None) -> torch.Tensor:
    """``float8_e4m3fn [out, in]`` x block scale ``[ceil(out/b), ceil(in/b)]`` -> ``dtype``.

    With ``device`` the raw (1-byte) tensors are moved first and the dequantization runs there,
    which moves 4x fewer bytes than dequantizing on the host. Out/in need not be multiples of
    ``block``: the last block row/column is ragged and its scale is cropped.
    """
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise CheckpointError(f"{_what(name)}: FP8 block weight must be 2-D float8_e4m3fn, "
                              f"got {weight.dtype} {tuple(weight.shape)}")
    out, cols = weight.shape
    want = (_cdiv(out, block), _cdiv(cols, block))
    if tuple(scale.shape) != want:
        raise CheckpointError(f"{_what(name)}: FP8 weight {tuple(weight.shape)} needs a block-{block} "
                              f"scale of shape {want}, got {tuple(scale.shape)}")
    if device is not None:
        weight, scale = weight.to(device), scale.to(device)
    s = scale_to_float32(scale, name)
    w = weight.to(torch.float32)
    if out % block == 0 and cols % block == 0:
        # Common case: broadcast through a blocked view, no full-size scale map.
        w.view(want[0], block, want[1], block).mul_(s[:, None, :, None])
    else:
        s_rows = s.repeat_interleave(block, dim=0)[:out]
        w.mul_(_expand_cols(s_rows, block, cols))
    return w.to(dtype)


def encode_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK,
                     scale_fmt: str = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """2-D float tensor -> (``float8_e4m3fn [out, in]``, scale ``[ceil(out/b), ceil(in/b)]``).

    Per block: scale = amax / 448. ``scale_fmt='ue8m0'`` rounds the scale UP to a power of two
    (stored float8_e8m0fnu) so ``|w| / scale <= 448`` still holds; 'fp32' keeps it exact (float32).
    All-zero blocks get scale 1.
    """
    if scale_fmt not in ("ue8m0", "fp32"):
        raise ValueError(f"encode_fp8_block: scale_fmt must be 'ue8m0' or 'fp32', got {scale_fmt!r}")
    if w.dim() != 2:
        raise ValueError(f"encode_fp8_block: expected a 2-D tensor, got shape {tuple(w.shape)}")
    _check_finite(w, "encode_fp8_block")
    out, cols = w.shape
    rb, cb = _cdiv(out, block), _cdiv(cols, block)
    wp = F.pad(w.float(), (0, cb * block - cols, 0, rb * block - out))  # zero padding: no effect on amax
    blocks = wp.view(rb, block, cb, block)
    amax = blocks.abs().amax(dim=(1, 3))
    # Clamp so a tiny (subnormal) amax still gives a nonzero scale; zero blocks -> scale 1.
    scale = torch.where(amax > 0, amax.clamp(min=torch.finfo(torch.float32).tiny) / FP8_E4M3_MAX,
                        torch.ones_like(amax))
    if scale_fmt == "ue8m0":
        stored = float_to_e8m0(scale, rounding="up")
        scale = e8m0_to_float32(stored)
    else:
        stored = scale
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.view(rb * block, cb * block)[:out, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), stored.contiguous()


# ----------------------------------------------------------------------------- FP4 (MXFP4)
def fp4_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (0..15, any integer dtype) -> float32 values; bit 3 is the sign."""
    lut = torch.tensor(FP4_VALUES + tuple(-v for v in FP4_VALUES), dtype=torch.float32,
                       device=codes.device)
    return lut[codes.long()]


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """``[out, in/2]`` bytes -> ``[out, in]`` uint8 codes; LOW nibble = even column."""
    b = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    lo, hi = b & 0x0F, b >> 4
    return torch.stack((lo, hi), dim=-1).reshape(b.shape[0], 2 * b.shape[1])


def decode_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device | None = None, block: int = FP4_BLOCK,
               name: str | None = None) -> torch.Tensor:
    """MXFP4 ``[out, in/2]`` packed bytes x e8m0 scale ``[out, ceil(in/block)]`` -> ``[out, in]``.

    Accepts int8, uint8 or float4_e2m1fn_x2 storage. With ``device`` the packed bytes and scales
    move first and the decode runs there.
    """
    if packed.dtype not in FP4_PACKED_DTYPES or packed.dim() != 2:
        raise CheckpointError(f"{_what(name)}: FP4 weight must be 2-D int8/uint8/float4_e2m1fn_x2, "
                              f"got {packed.dtype} {tuple(packed.shape)}")
    out, cols = packed.shape[0], 2 * packed.shape[1]
    want = (out, _cdiv(cols, block))
    if tuple(scale.shape) != want:
        raise CheckpointError(f"{_what(name)}: FP4 weight packed {tuple(packed.shape)} (logical "
                              f"[{out}, {cols}]) needs an e8m0 scale of shape {want}, "
                              f"got {tuple(scale.shape)}")
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise CheckpointError(f"{_what(name)}: FP4 scale must be float8_e8m0fnu, got {scale.dtype}")
    if device is not None:
        packed, scale = packed.to(device), scale.to(device)
    w = fp4_codes_to_float(unpack_fp4_codes(packed))
    s = e8m0_to_float32(scale, name)
    if cols % block == 0:
        w.view(out, want[1], block).mul_(s[:, :, None])
    else:
        w.mul_(_expand_cols(s, block, cols))
    return w.to(dtype)


# Rounding thresholds between consecutive e2m1 magnitudes, and whether an exact tie goes up.
# Ties go to the code with an even mantissa bit (= even code), i.e. round-half-to-even.
_FP4_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                   (2.5, False), (3.5, True), (5.0, False))


def float_to_fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """Already-scaled float values -> e2m1 codes (uint8 0..15), round-to-nearest-even,
    saturating at +-6. Zero keeps code 0 (no negative zero)."""
    a = x.abs()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t, tie_up in _FP4_THRESHOLDS:
        mag += (a >= t if tie_up else a > t).to(torch.uint8)
    sign = ((x < 0) & (mag > 0)).to(torch.uint8) << 3
    return mag | sign


def encode_fp4(w: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D float tensor with an even column count -> (packed int8 ``[out, in/2]``,
    e8m0 scale ``[out, ceil(in/block)]``).

    Scale per OCP MX: ``2^(floor(log2(amax)) - 2)`` (2 = emax of e2m1), so the block maximum
    lands in [4, 8) and values above 6 saturate. All-zero blocks get the smallest scale 2^-127.
    """
    if w.dim() != 2 or w.shape[1] % 2:
        raise ValueError(f"encode_fp4: expected a 2-D tensor with an even column count, "
                         f"got shape {tuple(w.shape)}")
    _check_finite(w, "encode_fp4")
    out, cols = w.shape
    nb = _cdiv(cols, block)
    wp = F.pad(w.float(), (0, nb * block - cols)).view(out, nb, block)
    amax = wp.abs().amax(dim=-1)
    exp = torch.where(amax > 0, _floor_log2(amax.clamp(min=torch.finfo(torch.float32).tiny)) - 2,
                      torch.full_like(amax, -E8M0_BIAS, dtype=torch.int32))
    scale = exponent_to_e8m0(exp)
    s = e8m0_to_float32(scale)
    codes = float_to_fp4_codes(wp / s[:, :, None]).view(out, nb * block)[:, :cols]
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous().view(torch.int8), scale.contiguous()


def fp4_logical_shape(packed_shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    """Logical ``[out, in]`` of an FP4 weight stored as ``[out, in/2]``."""
    return (int(packed_shape[0]), 2 * int(packed_shape[1]))


def fp8_scale_shape(shape: tuple[int, int], block: int = FP8_BLOCK) -> tuple[int, int]:
    return (_cdiv(shape[0], block), _cdiv(shape[1], block))


__all__ = [
    "FP8_E4M3_MAX", "FP4_E2M1_MAX", "FP4_VALUES", "FP8_BLOCK", "FP4_BLOCK",
    "e8m0_bytes", "e8m0_to_float32", "float_to_e8m0", "exponent_to_e8m0", "scale_to_float32",
    "decode_fp8_block", "encode_fp8_block", "decode_fp4", "encode_fp4",
    "unpack_fp4_codes", "fp4_codes_to_float", "float_to_fp4_codes",
    "fp4_logical_shape", "fp8_scale_shape",
]
