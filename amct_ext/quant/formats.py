"""Fake-quant (quantize-dequantize) number formats as plain functions.

Every function takes a floating tensor and returns a tensor of the same shape and dtype whose
values lie on the format's grid. The arithmetic runs in float32 whatever the input dtype, then
the result is cast back (so a bf16 input gives the bf16 rounding of the fp32 fake-quant value).

Blocks (what shares one scale) are set by the granularity; see ``TensorSpec``. The *public
scale shape* of a tensor ``x`` of shape ``[*lead, K]`` is one entry per block, no singleton
dims:

=============  ====================================  ========================================
granularity    blocks                                scale shape
=============  ====================================  ========================================
tensor         the whole tensor                      ``[]``
channel/token  one row (all dims but the last)       ``[*lead]``
group (g)      g consecutive elements of the last    ``[*lead, K // g]``  (K % g == 0 required)
block (r, c)   r x c tiles over the last two dims    ``[*lead2, ceil(R / r), ceil(C / c)]``
               (edges zero-padded)
mx             32 consecutive elements of last dim   ``[*lead, K // 32]``  (K % 32 == 0 required)
=============  ====================================  ========================================

``clip`` (optional, values in (0, 1], broadcastable to the public scale shape) multiplies the
range of each block before the scale is computed: ``amax * clip`` (or ``min * clip``,
``max * clip``). Rounding uses a straight-through estimator when a gradient is needed, so a PTQ
solver can learn ``clip``. ``torch.round`` rounds half to even.

Every function refuses NaN / Inf inputs with :class:`NonFiniteInputError`: at once, or, inside
a ``device_checks`` scope (a layer's forward, a graph capture), when that scope reads its checks.
"""
from __future__ import annotations

import math
import torch
import torch.nn.functional as F

from ..runtime import device, device_checks, fused_quant
from ..errors import AmctError, QuantConfigError
from .schemes import MX_BLOCK_SIZE, TensorSpec

FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0
#: Exponent of the largest power of two of the element format: floor(log2(max normal)).
MX_EMAX = {"mxfp8": 8, "mxfp4": 2}
MX_ELEM_MAX = {"mxfp8": FP8_E4M3_MAX, "mxfp4": E2M1_MAX}
#: e8m0 encodes 2^(code - 127) for codes 0..254 (255 is NaN).
E8M0_BIAS = 127
#: e2m1 magnitudes indexed by the low 3 bits of the code (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


class QuantInputError(AmctError, ValueError):
    """A tensor given to a quantization function cannot be quantized (dtype, shape, values)."""


class NonFiniteInputError(QuantInputError):
    """A tensor given to a quantization function contains NaN or Inf."""


# ------------------------------------------------------------------------------ small helpers
def _check_input(x: torch.Tensor, what: str = "input") -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        kind = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise QuantInputError(f"{what} must be a floating tensor to be quantized, got {kind}")
    # One reduction, read back at once or once per layer call / graph replay (device_checks).
    if x.numel():
        _refuse_non_finite(~torch.isfinite(x).all(), what, x)


def _refuse_non_finite(flag: torch.Tensor, what: str, x: torch.Tensor) -> None:
    """``flag``: a 1-element device tensor, non-zero when ``x`` had NaN / Inf."""
    device_checks.refuse_if(flag, [NonFiniteInputError(
        f"{what} of shape {tuple(x.shape)} contains NaN or Inf; refusing to quantize it")])


def _round(x: torch.Tensor) -> torch.Tensor:
    """Round half to even; straight-through gradient (identity) when autograd needs one."""
    if x.requires_grad:
        return x + (torch.round(x) - x).detach()
    return torch.round(x)


def _ste(y: torch.Tensor, y_q: torch.Tensor) -> torch.Tensor:
    """Forward value ``y_q``, gradient of identity w.r.t. ``y``."""
    if y.requires_grad:
        return y + (y_q - y).detach()
    return y_q


def _div_const(t: torch.Tensor, c: float) -> torch.Tensor:
    """``t / c`` as an IEEE division on every backend. (torch on CUDA turns a division by a Python
    number into a multiplication by its reciprocal, which differs from CPU in the last bit of
    some scales; a 0-dim tensor on t's device keeps it a true division -- casebook N2.)"""
    return t / torch.full((), c, dtype=t.dtype, device=t.device)


def _nonzero_scale(scale: torch.Tensor) -> torch.Tensor:
    # An all-zero block has scale 0; any positive scale maps it to exact zeros, 1 is simplest.
    return torch.where(scale > 0, scale, torch.ones_like(scale))


class _Layout:
    """How a tensor of a given shape is cut into blocks that share one scale.

    ``view(x)`` reshapes (and for 'block', zero-pads) x so that reducing ``reduce_dims`` with
    keepdim gives one value per block (the *view scale*); ``restore`` undoes it.
    ``to_view`` / ``to_public`` convert scales between view and public shape (module doc).
    """

    def __init__(self, shape: torch.Size, granularity: str, group_size: int | None = None,
                 block_size: tuple[int, int] | None = None, what: str = "tensor"):
        self.shape = torch.Size(shape)
        self.gran = granularity
        nd = len(self.shape)
        if granularity != "tensor" and nd == 0:
            raise QuantInputError(f"{what} is a scalar; granularity {granularity!r} needs at least one dim")
        if granularity == "tensor":
            self.public_shape = torch.Size([])
        elif granularity in ("channel", "token"):
            self.public_shape = self.shape[:-1]
        elif granularity == "group":
            k = self.shape[-1]
            if k % group_size:
                raise QuantInputError(
                    f"{what} of shape {tuple(self.shape)}: last dim {k} is not divisible by the "
                    f"group size {group_size}")
            self.group_size = group_size
            self.public_shape = self.shape[:-1] + (k // group_size,)
        elif granularity == "block":
            if nd < 2:
                raise QuantInputError(f"{what} of shape {tuple(self.shape)}: granularity 'block' needs at least 2 dims")
            self.br, self.bc = block_size
            r, c = self.shape[-2:]
            self.nr, self.nc = math.ceil(r / self.br), math.ceil(c / self.bc)
            self.public_shape = self.shape[:-2] + (self.nr, self.nc)
        else:  # pragma: no cover - TensorSpec validates granularity
            raise QuantConfigError(f"unknown granularity {granularity!r}")

    @property
    def reduce_dims(self) -> tuple[int, ...]:
        # Every view puts a block's elements on the last dim, except 'block' (rows at -3).
        return (-3, -1) if self.gran == "block" else (-1,)

    def view(self, x: torch.Tensor) -> torch.Tensor:
        if self.gran == "tensor":
            return x.reshape(1, -1)
        if self.gran in ("channel", "token"):
            return x
        if self.gran == "group":
            return x.reshape(*self.shape[:-1], self.shape[-1] // self.group_size, self.group_size)
        r, c = self.shape[-2:]
        pad_r, pad_c = self.nr * self.br - r, self.nc * self.bc - c
        if pad_r or pad_c:
            # Zero padding changes neither amax nor (zero-inclusive) min/max of a tile.
            x = F.pad(x, (0, pad_c, 0, pad_r))
        return x.reshape(*self.shape[:-2], self.nr, self.br, self.nc, self.bc)

    def restore(self, xv: torch.Tensor) -> torch.Tensor:
        if self.gran in ("channel", "token"):
            return xv
        if self.gran in ("tensor", "group"):
            return xv.reshape(self.shape)
        r, c = self.shape[-2:]
        full = xv.reshape(*self.shape[:-2], self.nr * self.br, self.nc * self.bc)
        if full.shape[-2:] != (r, c):
            full = full[..., :r, :c].contiguous()
        return full

    def to_view(self, s: torch.Tensor) -> torch.Tensor:
        if self.gran == "tensor":
            return s.reshape(1, 1)
        if self.gran == "block":
            return s.unsqueeze(-1).unsqueeze(-3)
        return s.unsqueeze(-1)

    def to_public(self, sv: torch.Tensor) -> torch.Tensor:
        if self.gran == "tensor":
            return sv.reshape(())
        if self.gran == "block":
            return sv.squeeze(-1).squeeze(-2)
        return sv.squeeze(-1)

    def clip_view(self, clip: torch.Tensor | None, what: str) -> torch.Tensor | None:
        """Broadcast ``clip`` to the public scale shape and return it in view shape."""
        if clip is None:
            return None
        if not isinstance(clip, torch.Tensor):
            clip = torch.tensor(float(clip))
        with torch.no_grad():
            ok = bool(((clip > 0) & (clip <= 1)).all())
        if not ok:
            raise QuantInputError(f"clip for {what} must lie in (0, 1]; got values outside")
        try:
            c = torch.broadcast_to(clip.float(), self.public_shape)
        except RuntimeError:
            raise QuantInputError(
                f"clip of shape {tuple(clip.shape)} does not broadcast to the scale shape "
                f"{tuple(self.public_shape)} of {what} {tuple(self.shape)} ({self.gran})") from None
        return self.to_view(c)


def _layout(shape: torch.Size, spec: TensorSpec, what: str) -> _Layout:
    return _Layout(shape, spec.granularity, spec.group_size, spec.block_size, what)


def scale_shape(shape: torch.Size | tuple[int, ...], spec: TensorSpec) -> torch.Size:
    """Public scale shape (one entry per block) of a tensor of ``shape`` under ``spec``."""
    return _layout(torch.Size(shape), spec, "tensor").public_shape


# -------------------------------------------------------------------------------- integer
def _int_range(bits: int, symmetric: bool) -> tuple[int, int]:
    """Integer grid: symmetric uses the *restricted* range [-(2^(k-1)-1), 2^(k-1)-1] (no
    -2^(k-1), so +x and -x quantize alike and the int8 grid is -127..127); asymmetric uses
    [0, 2^k - 1]."""
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        return -qmax, qmax
    return 0, 2 ** bits - 1


def int_qparams_from_range(xmin: torch.Tensor, xmax: torch.Tensor, bits: int,
                           symmetric: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point for asymmetric) for blocks whose range is [xmin, xmax].

    Symmetric:  ``amax = max(|xmin|, |xmax|)``, ``scale = amax / (2^(k-1) - 1)``, zp = None.
    Asymmetric: the range is widened to contain 0 (so 0 is exactly representable and the zero
    point lies in range): ``lo = min(xmin, 0)``, ``hi = max(xmax, 0)``,
    ``scale = (hi - lo) / (2^k - 1)``, ``zp = round(-lo / scale)`` (a float holding an integer).
    Blocks with a zero range get scale 1 (they quantize to exact zeros).
    """
    qmin, qmax = _int_range(bits, symmetric)
    if symmetric:
        amax = torch.maximum(xmin.abs(), xmax.abs())
        return _nonzero_scale(_div_const(amax, qmax)), None
    lo, hi = torch.clamp(xmin, max=0), torch.clamp(xmax, min=0)
    scale = _nonzero_scale(_div_const(hi - lo, qmax))
    zp = torch.clamp(_round(-lo / scale), qmin, qmax)
    return scale, zp


def _int_block_qparams(xv: torch.Tensor, lay: _Layout, bits: int, symmetric: bool,
                       clip_v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    dims = lay.reduce_dims
    if symmetric:
        amax = xv.abs().amax(dim=dims, keepdim=True)
        if clip_v is not None:
            amax = amax * clip_v
        return int_qparams_from_range(-amax, amax, bits, True)
    xmin = xv.amin(dim=dims, keepdim=True)
    xmax = xv.amax(dim=dims, keepdim=True)
    if clip_v is not None:
        xmin, xmax = xmin * clip_v, xmax * clip_v
    return int_qparams_from_range(xmin, xmax, bits, False)


def _int_codes(xv, scale, zp, qmin, qmax, offset_v=None):
    """Integer codes (as float): ``clamp(round(x / scale + V) + zp, qmin, qmax)``; ``V`` is the
    learned rounding offset (AutoRound, in [-0.5, 0.5], shaped like x's view) or None (RTN)."""
    y = xv / scale
    if offset_v is not None:
        y = y + offset_v
    q = _round(y)
    if zp is not None:
        q = q + zp
    return torch.clamp(q, qmin, qmax)


def _int_decode(q, scale, zp):
    """``(q - zp) * scale``; shared by fake_quant and dequantize so both agree bit for bit."""
    if zp is not None:
        q = q - zp
    return q * scale


def _offset_view(lay: _Layout, x: torch.Tensor, round_offset: torch.Tensor | None) -> torch.Tensor | None:
    """The rounding offset in the view layout of x (same shape as x, else a clear error)."""
    if round_offset is None:
        return None
    if tuple(round_offset.shape) != tuple(x.shape):
        raise QuantInputError(f"round_offset of shape {tuple(round_offset.shape)} does not match the "
                              f"tensor {tuple(x.shape)} it rounds")
    return lay.view(round_offset.float())


def _fq_int(x: torch.Tensor, spec: TensorSpec, clip, round_offset=None) -> torch.Tensor:
    lay = _layout(x.shape, spec, "input")
    xv = lay.view(x.float())
    scale, zp = _int_block_qparams(xv, lay, spec.bits, spec.symmetric, lay.clip_view(clip, "input"))
    qmin, qmax = _int_range(spec.bits, spec.symmetric)
    out = _int_decode(_int_codes(xv, scale, zp, qmin, qmax, _offset_view(lay, x, round_offset)), scale, zp)
    return lay.restore(out).to(x.dtype)


class PreparedIntWeight:
    """A fixed integer-grid weight for many fake quantizations that differ only in their clip
    (learned clipping steps): the float view and each block's range are computed once, and
    :meth:`fake_quant` gives ``fake_quant(x, spec, clip)`` bit for bit (the same functions on
    the same values; gradients to the clip alike), without re-reading the weight for its
    ranges, re-checking it for NaN / Inf, or reading the clip back to check its range."""

    def __init__(self, x: torch.Tensor, spec: TensorSpec):
        _need(spec, ("int",))
        _check_input(x)
        self.spec, self.dtype = spec, x.dtype
        self.lay = _layout(x.shape, spec, "input")
        with torch.no_grad():
            self.xv = self.lay.view(x.detach().float())
            dims = self.lay.reduce_dims
            if spec.symmetric:
                self.lo, self.hi = None, self.xv.abs().amax(dim=dims, keepdim=True)
            else:
                self.lo = self.xv.amin(dim=dims, keepdim=True)
                self.hi = self.xv.amax(dim=dims, keepdim=True)

    def fake_quant(self, clip: torch.Tensor | None) -> torch.Tensor:
        """``clip``: public scale shape, already in (0, 1] (e.g. a clamped learned clip) or None."""
        spec = self.spec
        c = None if clip is None else self.lay.to_view(torch.broadcast_to(clip.float(), self.lay.public_shape))
        if spec.symmetric:
            amax = self.hi if c is None else self.hi * c
            scale, zp = int_qparams_from_range(-amax, amax, spec.bits, True)
        else:
            lo, hi = (self.lo, self.hi) if c is None else (self.lo * c, self.hi * c)
            scale, zp = int_qparams_from_range(lo, hi, spec.bits, False)
        qmin, qmax = _int_range(spec.bits, spec.symmetric)
        return self.lay.restore(_int_decode(_int_codes(self.xv, scale, zp, qmin, qmax), scale, zp)).to(self.dtype)


def fake_quant_int(x: torch.Tensor, bits: int = 8, *, symmetric: bool = True,
                   granularity: str = "channel", group_size: int | None = None,
                   block_size: tuple[int, int] | None = None, clip=None) -> torch.Tensor:
    """Integer k-bit fake quantization (k = 2..8).

    Per block (granularity; see module doc), with ``clip`` applied to the range first:

    - symmetric:  ``qmax = 2^(k-1) - 1``, ``scale = amax / qmax``,
      ``q = clamp(round(x / scale), -qmax, qmax)``, ``x_hat = q * scale``
      (restricted range: -2^(k-1) is never used).
    - asymmetric: range widened to contain 0, ``scale = (max - min) / (2^k - 1)``,
      ``zp = round(-min / scale)``, ``q = clamp(round(x / scale) + zp, 0, 2^k - 1)``,
      ``x_hat = (q - zp) * scale``.

    A block of zeros gets scale 1 and stays zero.
    """
    spec = TensorSpec("int", bits, symmetric, granularity, group_size, block_size,
                      dynamic=True if granularity == "token" else None)
    _check_input(x)
    return x if spec.is_identity else _fq_int(x, spec, clip)


def quantize_int(x: torch.Tensor, spec: TensorSpec, clip=None, round_offset=None):
    """Deployable integer form: ``(q, scale, zero_point)``.

    ``q`` has x's shape; int8 for symmetric specs, uint8 for asymmetric ones (one value per
    element, not packed). ``scale`` is float32 in the public scale shape; ``zero_point`` is
    int32 in the same shape for asymmetric specs, else ``None``.
    ``dequantize_int(*quantize_int(x, spec), spec)`` equals ``fake_quant(x, spec)`` (in fp32).
    """
    _need(spec, ("int",))
    _check_input(x)
    lay = _layout(x.shape, spec, "input")
    xv = lay.view(x.float())
    scale, zp = _int_block_qparams(xv, lay, spec.bits, spec.symmetric, lay.clip_view(clip, "input"))
    qmin, qmax = _int_range(spec.bits, spec.symmetric)
    q = lay.restore(_int_codes(xv, scale, zp, qmin, qmax, _offset_view(lay, x, round_offset)))
    q = q.detach().to(torch.int8 if spec.symmetric else torch.uint8)
    zp_out = None if zp is None else lay.to_public(zp).detach().to(torch.int32)
    return q, lay.to_public(scale).detach(), zp_out


def dequantize_int(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                   spec: TensorSpec, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_int`: ``(q - zero_point) * scale`` per block."""
    _need(spec, ("int",))
    lay = _layout(q.shape, spec, "q")
    sv = lay.to_view(scale.float())
    zv = None if zero_point is None else lay.to_view(zero_point.float())
    return lay.restore(_int_decode(lay.view(q.float()), sv, zv)).to(dtype)


# ------------------------------------------------------------------------------- fp8 e4m3
def cast_e4m3(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest e4m3fn value (ties to even), saturating at +-448;
    returns a float8_e4m3fn tensor."""
    return torch.clamp(y, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def _pow2_ceil(scale: torch.Tensor) -> torch.Tensor:
    """Positive scales rounded UP to a power of two, exactly (frexp: s = m * 2^e, m in [0.5, 1)),
    so ``|x| / scale <= 448`` still holds: the ue8m0 scales of DeepSeek's FP8 blocks."""
    m, e = torch.frexp(scale)
    return torch.ldexp(torch.ones_like(scale), torch.where(m == 0.5, e - 1, e))


def _fp8_block_scale(xv, lay, clip_v, scale_format: str = "float"):
    amax = xv.abs().amax(dim=lay.reduce_dims, keepdim=True)
    if clip_v is not None:
        amax = amax * clip_v
    scale = _nonzero_scale(_div_const(amax, FP8_E4M3_MAX))
    return _pow2_ceil(scale) if scale_format == "ue8m0" else scale


def _fq_fp8(x, spec, clip):
    lay = _layout(x.shape, spec, "input")
    xv = lay.view(x.float())
    scale = _fp8_block_scale(xv, lay, lay.clip_view(clip, "input"), spec.scale_format)
    y = torch.clamp(xv / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    out = _ste(y, cast_e4m3(y).float()) * scale
    return lay.restore(out).to(x.dtype)


def fake_quant_fp8(x: torch.Tensor, *, granularity: str = "tensor", group_size: int | None = None,
                   block_size: tuple[int, int] | None = None, clip=None) -> torch.Tensor:
    """FP8 e4m3 (OCP e4m3fn: max 448, no Inf) fake quantization.

    Per block: ``scale = amax / 448`` (``amax * clip`` with clip), ``x_hat =
    e4m3(clamp(x / scale, -448, 448)) * scale`` where e4m3() rounds to nearest, ties to even.
    Granularity 'block' with ``block_size=(128, 128)`` is DeepSeek's released weight layout
    (edges not divisible by 128 are padded). A block of zeros gets scale 1 and stays zero.
    """
    spec = TensorSpec("fp8", 8, True, granularity, group_size, block_size,
                      dynamic=True if granularity == "token" else None)
    _check_input(x)
    return _fq_fp8(x, spec, clip)


def quantize_fp8(x: torch.Tensor, spec: TensorSpec, clip=None):
    """Deployable FP8 form: ``(elements, scale)``; elements are float8_e4m3fn with x's shape,
    scale is float32 in the public scale shape (``x ~ elements * scale``; DeepSeek checkpoints
    call this scale ``scale_inv``)."""
    _need(spec, ("fp8",))
    _check_input(x)
    lay = _layout(x.shape, spec, "input")
    xv = lay.view(x.float())
    scale = _fp8_block_scale(xv, lay, lay.clip_view(clip, "input"), spec.scale_format)
    e = cast_e4m3(xv / scale)
    # Restore via float32: padding / reshaping float8 tensors is not supported everywhere.
    elements = lay.restore(e.float()).to(torch.float8_e4m3fn)
    return elements.detach(), lay.to_public(scale).detach()


def dequantize_fp8(elements: torch.Tensor, scale: torch.Tensor, spec: TensorSpec,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``elements * scale`` per block."""
    _need(spec, ("fp8",))
    lay = _layout(elements.shape, spec, "elements")
    return lay.restore(lay.view(elements.float()) * lay.to_view(scale.float())).to(dtype)


# ---------------------------------------------------------------------- OCP microscaling (MX)
def round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to the nearest FP4 e2m1 value, ties to even mantissa, saturating at
    +-6. Representable magnitudes: 0, 0.5, 1, 1.5, 2, 3, 4, 6.

    Within [0, 2) the grid step is 0.5, in [2, 4) it is 1, in [4, 6] it is 2; in each range
    the grid index's parity equals the mantissa bit, so rounding ``|y| / step`` half-to-even
    is exactly round-to-nearest-even of e2m1.
    """
    a = torch.clamp(y.abs(), max=E2M1_MAX)
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return torch.copysign(torch.round(a / step) * step, y)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """e2m1 values (already on the grid) -> 4-bit codes in uint8: bit 3 sign, bits 2..0 the
    index into :data:`E2M1_VALUES` (which is the OCP exponent/mantissa bit pattern)."""
    table = torch.tensor(E2M1_VALUES, device=v.device)
    mag = v.abs()
    idx = torch.bucketize(mag, table)
    sign = ((v < 0) & (mag > 0)).to(torch.uint8)
    return idx.to(torch.uint8) | (sign << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (uint8, one per element) -> float32 values."""
    table = torch.tensor(E2M1_VALUES, device=codes.device)
    c = codes.to(torch.int64)
    mag = table[c & 7]
    return torch.where((c & 8) > 0, -mag, mag)


def _mx_elem(elem: str) -> str:
    if elem not in MX_EMAX:
        raise QuantConfigError(f"MX element format {elem!r} is unknown; valid: {', '.join(MX_EMAX)}")
    return elem


def _mx_shared_exp(xv: torch.Tensor, elem: str, clip_v) -> torch.Tensor:
    """``shared_exp = floor(log2(amax)) - emax_elem`` per 32-block, clamped to e8m0's
    [-127, 127]; 0 for all-zero blocks. frexp gives floor(log2) exactly (log2 may round)."""
    amax = xv.detach().abs().amax(dim=-1, keepdim=True)
    if clip_v is not None:
        amax = amax * clip_v.detach()  # power-of-two scales carry no gradient
    _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1)  =>  floor(log2(amax)) = e - 1
    shared = torch.clamp(e - 1 - MX_EMAX[elem], -E8M0_BIAS, E8M0_BIAS)
    return torch.where(amax > 0, shared, torch.zeros_like(shared))


def _mx_round(y: torch.Tensor, elem: str) -> torch.Tensor:
    """Element rounding with saturation, as float32 values."""
    if elem == "mxfp8":
        return cast_e4m3(y).float()
    return round_e2m1(y)


def _mx_layout(x: torch.Tensor, what: str) -> _Layout:
    return _Layout(x.shape, "group", MX_BLOCK_SIZE, None, what)


def _fq_mx(x, elem, clip):
    lay = _mx_layout(x, "input")
    xv = lay.view(x.float())
    shared = _mx_shared_exp(xv, elem, lay.clip_view(clip, "input"))
    scale = torch.exp2(shared.float())  # exact power of two (2^-127 is an fp32 subnormal)
    y = torch.clamp(xv / scale, -MX_ELEM_MAX[elem], MX_ELEM_MAX[elem])
    out = _ste(y, _mx_round(y, elem)) * scale
    return lay.restore(out).to(x.dtype)


def fake_quant_mx(x: torch.Tensor, elem: str, clip=None) -> torch.Tensor:
    """OCP Microscaling fake quantization, ``elem`` = 'mxfp8' (e4m3) or 'mxfp4' (e2m1).

    Blocks of 32 consecutive elements of the last dim (K % 32 == 0 required) share the scale
    ``2^shared_exp`` with ``shared_exp = floor(log2(amax)) - emax_elem`` (emax 8 for e4m3, 2 for
    e2m1; clamped to the e8m0 range [-127, 127]); elements are
    ``round_to_elem(clamp(x / scale, -max, max))`` (max 448 / 6, round to nearest even) and
    ``x_hat = element * scale``. All-zero blocks use scale 1. ``clip`` scales amax before the
    exponent is taken; it gets no gradient (the scale is a power of two).
    """
    _mx_elem(elem)
    _check_input(x)
    return _fq_mx(x, elem, clip)


def fake_quant_mxfp8(x: torch.Tensor, clip=None) -> torch.Tensor:
    """:func:`fake_quant_mx` with e4m3 elements."""
    return fake_quant_mx(x, "mxfp8", clip)


def fake_quant_mxfp4(x: torch.Tensor, clip=None) -> torch.Tensor:
    """:func:`fake_quant_mx` with e2m1 elements."""
    return fake_quant_mx(x, "mxfp4", clip)


def quantize_mx(x: torch.Tensor, elem: str, clip=None):
    """Deployable MX form: ``(elements, e8m0)``.

    ``elements`` has x's shape: float8_e4m3fn for 'mxfp8', uint8 e2m1 codes (one per element,
    not packed; see :func:`e2m1_encode`) for 'mxfp4'. ``e8m0`` is uint8 of shape
    ``[*lead, K // 32]`` holding ``shared_exp + 127``.
    """
    _mx_elem(elem)
    _check_input(x)
    lay = _mx_layout(x, "input")
    xv = lay.view(x.float())
    shared = _mx_shared_exp(xv, elem, lay.clip_view(clip, "input"))
    y = torch.clamp(xv / torch.exp2(shared.float()), -MX_ELEM_MAX[elem], MX_ELEM_MAX[elem])
    vals = lay.restore(_mx_round(y, elem))
    elements = vals.to(torch.float8_e4m3fn) if elem == "mxfp8" else e2m1_encode(vals)
    e8m0 = (lay.to_public(shared) + E8M0_BIAS).to(torch.uint8)
    return elements.detach(), e8m0


def dequantize_mx(elements: torch.Tensor, e8m0: torch.Tensor, elem: str,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_mx`: ``element * 2^(e8m0 - 127)`` per 32-block."""
    _mx_elem(elem)
    vals = elements.float() if elem == "mxfp8" else e2m1_decode(elements)
    lay = _mx_layout(vals, "elements")
    scale = torch.exp2(e8m0.float() - E8M0_BIAS)
    return lay.restore(lay.view(vals) * lay.to_view(scale)).to(dtype)


# ------------------------------------------------------------------------------ dispatchers
def _need(spec: TensorSpec, formats: tuple[str, ...]) -> None:
    if not isinstance(spec, TensorSpec) or spec.format not in formats:
        got = spec.format if isinstance(spec, TensorSpec) else type(spec).__name__
        raise QuantConfigError(f"expected a TensorSpec of format {'/'.join(formats)}, got {got}")


def _fused_int_token(x: torch.Tensor, spec: TensorSpec, clip) -> bool:
    """Dynamic symmetric per-token int without clip, on a device with the fused kernels, no autograd."""
    return (spec.format == "int" and spec.symmetric and spec.granularity == "token" and clip is None
            and isinstance(x, torch.Tensor) and x.is_floating_point() and device.fused_kernels_enabled(x.device)
            and not (torch.is_grad_enabled() and x.requires_grad) and fused_quant.fused_int_token_supported(x))


def fake_quant(x: torch.Tensor, spec: TensorSpec | None, clip=None, round_offset=None) -> torch.Tensor:
    """Fake-quantize ``x`` per ``spec`` (see the per-format functions for the math).

    ``spec`` None or identity (format 'none', int bits >= 16) returns ``x`` itself.
    The spec's ``dynamic`` flag is irrelevant here: scales always come from ``x``; static
    activation scales go through :func:`fake_quant_from_range`. ``round_offset`` (int formats
    only, shaped like x): learned rounding, codes ``round(x / scale + round_offset)``.
    """
    if spec is None or spec.is_identity:
        return x
    if round_offset is not None:
        _need(spec, ("int",))
        _check_input(x)
        return _fq_int(x, spec, clip, round_offset)
    if _fused_int_token(x, spec, clip):
        # the same numbers in one pass (amct_ext/runtime/fused_quant.py); non-finite inputs still refused
        out, n_bad = fused_quant.fake_quant_int_token(x, spec.bits)
        _refuse_non_finite(n_bad, "input", x)
        return out
    _check_input(x)
    if spec.format == "int":
        return _fq_int(x, spec, clip)
    if spec.format == "fp8":
        return _fq_fp8(x, spec, clip)
    return _fq_mx(x, spec.format, clip)


def quantize(x: torch.Tensor, spec: TensorSpec, clip=None, round_offset=None) -> dict[str, torch.Tensor]:
    """Deployable tensors of ``x`` as a dict: int -> ``q``, ``scale`` (+ ``zero_point``);
    fp8 -> ``q`` (float8_e4m3fn), ``scale``; MX -> ``q`` (elements / e2m1 codes),
    ``scale_e8m0``. ``dequantize(quantize(x, spec), spec)`` equals ``fake_quant(x, spec)``."""
    if spec is None or spec.is_identity:
        raise QuantConfigError("quantize() needs a quantizing spec; this one leaves tensors in float")
    if round_offset is not None:
        _need(spec, ("int",))
    if spec.format == "int":
        q, s, zp = quantize_int(x, spec, clip, round_offset)
        out = {"q": q, "scale": s}
        if zp is not None:
            out["zero_point"] = zp
        return out
    if spec.format == "fp8":
        q, s = quantize_fp8(x, spec, clip)
        return {"q": q, "scale": s}
    q, e = quantize_mx(x, spec.format, clip)
    return {"q": q, "scale_e8m0": e}


@torch.no_grad()
def fixed_grid(x: torch.Tensor, spec: TensorSpec, clip=None, round_offset=None) -> dict[str, torch.Tensor] | None:
    """:func:`quantize`'s codes and grid of ``x`` (an integer spec) where they stand for its
    fake-quant value exactly: the codes decode, in ``x``'s dtype, to ``fake_quant(x, spec, clip,
    round_offset)`` bit for bit, and that value quantizes back to itself on the grid (a weight
    replaced by it reproduces it with the scales fixed). None where the dtype's rounding breaks
    either."""
    target = fake_quant(x, spec, clip, round_offset)
    d = quantize(x.detach(), spec, clip, round_offset)
    folded = dequantize(d, spec).to(x.dtype)
    zp = d.get("zero_point")
    again = fake_quant_with_qparams(folded, spec, d["scale"], None if zp is None else zp.float())
    return d if torch.equal(folded, target) and torch.equal(again, target) else None


def dequantize(d: dict[str, torch.Tensor], spec: TensorSpec,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize`."""
    if spec.format == "int":
        return dequantize_int(d["q"], d["scale"], d.get("zero_point"), spec, dtype)
    if spec.format == "fp8":
        return dequantize_fp8(d["q"], d["scale"], spec, dtype)
    return dequantize_mx(d["q"], d["scale_e8m0"], spec.format, dtype)


# ------------------------------------------------------------- explicit (fixed) weight scales
# An algorithm that chooses the grid itself (GPTQ) stores its scales with the weight; these
# functions quantize with given scales. With the scales RTN would compute (``qparams``) they
# give exactly ``fake_quant`` / ``quantize`` (the same float ops, in the same order).
def qparams(x: torch.Tensor, spec: TensorSpec, clip=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The public-shape scale (float32; for MX the power of two ``2^shared_exp``) and zero point
    (float32 holding integers; asymmetric int only, else None) that ``fake_quant`` uses."""
    _check_input(x)
    lay = _layout(x.shape, spec, "input") if not spec.is_mx else _mx_layout(x, "input")
    xv = lay.view(x.float())
    cv = lay.clip_view(clip, "input")
    if spec.format == "int":
        scale, zp = _int_block_qparams(xv, lay, spec.bits, spec.symmetric, cv)
    elif spec.format == "fp8":
        scale, zp = _fp8_block_scale(xv, lay, cv, spec.scale_format), None
    else:
        scale, zp = torch.exp2(_mx_shared_exp(xv, spec.format, cv).float()), None
    return lay.to_public(scale).detach(), None if zp is None else lay.to_public(zp).detach()


def _qp_layout(shape, spec: TensorSpec, what: str) -> _Layout:
    if spec.is_mx:
        return _Layout(torch.Size(shape), "group", MX_BLOCK_SIZE, None, what)
    return _layout(torch.Size(shape), spec, what)


def _check_qparams(lay: _Layout, scale: torch.Tensor, zero_point, spec: TensorSpec, what: str) -> None:
    if tuple(scale.shape) != tuple(lay.public_shape):
        raise QuantInputError(f"{what}: scale of shape {tuple(scale.shape)} does not match the scale shape "
                              f"{tuple(lay.public_shape)} of a {tuple(lay.shape)} tensor ({spec.granularity})")
    needs_zp = spec.format == "int" and not spec.symmetric
    if needs_zp != (zero_point is not None):
        raise QuantInputError(f"{what}: {'a zero point is required' if needs_zp else 'no zero point expected'} "
                              f"for {spec.format} {'symmetric' if spec.symmetric else 'asymmetric'}")
    if zero_point is not None and tuple(zero_point.shape) != tuple(scale.shape):
        raise QuantInputError(f"{what}: zero point of shape {tuple(zero_point.shape)} != scale shape {tuple(scale.shape)}")


def expand_qparam(p: torch.Tensor, shape, spec: TensorSpec) -> torch.Tensor:
    """A public-shape scale / zero point broadcast to one value per element of ``shape``."""
    lay = _qp_layout(shape, spec, "tensor")
    xv_shape = lay.view(torch.empty(lay.shape, device="meta")).shape
    return lay.restore(lay.to_view(p).expand(xv_shape).contiguous())


def public_qparam(expanded: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """Inverse of :func:`expand_qparam` (the value at the first element of each block)."""
    lay = _qp_layout(expanded.shape, spec, "tensor")
    v = lay.view(expanded)
    for d in lay.reduce_dims:
        v = v.narrow(d, 0, 1)
    return lay.to_public(v).contiguous()


def _codes_with_qparams(xv, sv, zv, spec):
    if spec.format == "int":
        qmin, qmax = _int_range(spec.bits, spec.symmetric)
        return _int_codes(xv, sv, zv, qmin, qmax)
    limit = FP8_E4M3_MAX if spec.format == "fp8" else MX_ELEM_MAX[spec.format]
    y = torch.clamp(xv / sv, -limit, limit)
    return _ste(y, cast_e4m3(y).float() if spec.format in ("fp8", "mxfp8") else round_e2m1(y))


def _qparam_views(x: torch.Tensor, spec: TensorSpec, scale: torch.Tensor, zero_point: torch.Tensor | None,
                  what: str):
    """Checked block views of ``x`` and of its given scale / zero point (fp32, on x's device)."""
    _check_input(x)
    lay = _qp_layout(x.shape, spec, "input")
    _check_qparams(lay, scale, zero_point, spec, what)
    xv = lay.view(x.float())
    sv = lay.to_view(scale.float().to(x.device))
    zv = None if zero_point is None else lay.to_view(zero_point.float().to(x.device))
    return lay, xv, sv, zv


def fake_quant_with_qparams(x: torch.Tensor, spec: TensorSpec, scale: torch.Tensor,
                            zero_point: torch.Tensor | None = None) -> torch.Tensor:
    """Fake-quantize ``x`` on the grid of the given public-shape ``scale`` (+ ``zero_point``)."""
    lay, xv, sv, zv = _qparam_views(x, spec, scale, zero_point, "fake_quant_with_qparams")
    q = _codes_with_qparams(xv, sv, zv, spec)
    out = _int_decode(q, sv, zv) if spec.format == "int" else q * sv
    return lay.restore(out).to(x.dtype)


def quantize_with_qparams(x: torch.Tensor, spec: TensorSpec, scale: torch.Tensor,
                          zero_point: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Deployable tensors (the keys of :func:`quantize`) on the grid of the given scales;
    ``dequantize`` of the result equals :func:`fake_quant_with_qparams` (in fp32)."""
    lay, xv, sv, zv = _qparam_views(x, spec, scale, zero_point, "quantize_with_qparams")
    q = lay.restore(_codes_with_qparams(xv, sv, zv, spec)).detach()
    if spec.format == "int":
        out = {"q": q.to(torch.int8 if spec.symmetric else torch.uint8), "scale": scale.float().detach()}
        if zero_point is not None:
            out["zero_point"] = zero_point.detach().to(torch.int32)
        return out
    if spec.format == "fp8":
        return {"q": q.to(torch.float8_e4m3fn), "scale": scale.float().detach()}
    _, e = torch.frexp(scale.float())  # scale = 2^k exactly: frexp gives mantissa 0.5, exponent k+1
    e8m0 = (e - 1 + E8M0_BIAS).to(torch.uint8)
    return {"q": q.to(torch.float8_e4m3fn) if spec.format == "mxfp8" else e2m1_encode(q), "scale_e8m0": e8m0}


# ----------------------------------------------------------------- static (calibrated) scales
def qparams_from_range(spec: TensorSpec, xmin: torch.Tensor, xmax: torch.Tensor):
    """Static scale (+ zero point) from an observed range [xmin, xmax] (any shape that
    broadcasts against the tensors it will quantize, e.g. ``[]`` or ``[K]``).
    int: see :func:`int_qparams_from_range`; fp8: ``scale = max(|xmin|, |xmax|) / 448``."""
    xmin, xmax = xmin.float(), xmax.float()
    if spec.format == "int":
        return int_qparams_from_range(xmin, xmax, spec.bits, spec.symmetric)
    if spec.format == "fp8":
        scale = _nonzero_scale(_div_const(torch.maximum(xmin.abs(), xmax.abs()), FP8_E4M3_MAX))
        return (_pow2_ceil(scale) if spec.scale_format == "ue8m0" else scale), None
    raise QuantConfigError(f"format {spec.format!r} has no static scales (MX scales are always per block of the current tensor)")


def fake_quant_from_range(x: torch.Tensor, spec: TensorSpec, xmin: torch.Tensor,
                          xmax: torch.Tensor) -> torch.Tensor:
    """Fake-quantize with scales computed from an observed range (static activation quant);
    ``xmin`` / ``xmax`` broadcast against ``x`` (``[]`` per tensor, ``[K]`` per last-dim
    channel). Values outside the observed range saturate."""
    if spec is None or spec.is_identity:
        return x
    _check_input(x)
    scale, zp = qparams_from_range(spec, xmin.to(x.device), xmax.to(x.device))
    xf = x.float()
    if spec.format == "int":
        qmin, qmax = _int_range(spec.bits, spec.symmetric)
        out = _int_decode(_int_codes(xf, scale, zp, qmin, qmax), scale, zp)
    else:
        y = torch.clamp(xf / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)
        out = _ste(y, cast_e4m3(y).float()) * scale
    return out.to(x.dtype)


__all__ = [
    "FP8_E4M3_MAX", "E2M1_MAX", "E2M1_VALUES", "E8M0_BIAS", "MX_EMAX",
    "QuantInputError", "NonFiniteInputError",
    "scale_shape", "fake_quant", "quantize", "dequantize",
    "fake_quant_int", "quantize_int", "dequantize_int", "int_qparams_from_range",
    "fake_quant_fp8", "quantize_fp8", "dequantize_fp8", "cast_e4m3",
    "fake_quant_mx", "fake_quant_mxfp8", "fake_quant_mxfp4", "quantize_mx", "dequantize_mx",
    "round_e2m1", "e2m1_encode", "e2m1_decode",
    "qparams_from_range", "fake_quant_from_range",
    "qparams", "expand_qparam", "public_qparam", "fake_quant_with_qparams", "quantize_with_qparams",
]
