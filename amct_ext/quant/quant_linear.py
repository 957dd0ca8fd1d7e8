"""Quantized building blocks: QuantLinear, QuantizedMatmul, QuantGatedMLP.

All of them are exact no-ops when their specs are None / quantizers are off: the outputs are
bit-identical (``torch.equal``) to the float modules / ops they replace. Parameters are never
copied or cast: QuantLinear holds the very Parameter objects of the nn.Linear it wraps.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from . import formats
from ..errors import QuantConfigError
from .packing import pack_int32, unpack_int32
from .quantizers import ActivationQuantizer, WeightQuantizer
from .schemes import TensorSpec


def load_replaced_weight(weight: torch.Tensor, value: torch.Tensor, who: str) -> None:
    """Write an algorithm's replaced float weight (PTQ key ``{leaf}.weight``) into ``weight`` in
    place (same Parameter, so packed / shared storage follows). Same shape and dtype, finite."""
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(weight.shape) or value.dtype != weight.dtype:
        got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
        raise QuantConfigError(f"{who}: replaced weight {got} does not match the weight "
                               f"{(tuple(weight.shape), weight.dtype)}")
    if not bool(torch.isfinite(value).all()):
        raise QuantConfigError(f"{who}: replaced weight contains NaN or Inf")
    with torch.no_grad():
        weight.copy_(value.to(weight.device))


# A replaced weight that lies on its quantizer's fixed grid (GPTQ writes dequantized grid values)
# is saved as its codes, ``weight_codes``, not as the float weight (a V4-Flash layer's GPTQ
# parameters were 12.3 GB as bf16 and filled a 64 GB disk after a few layers): one byte per
# weight (int8 / uint8 / fp8), or, for integer grids of <= 4 bits, ``bits`` bits per weight packed
# into int32 words along each row (``packing.pack_int32``, compressed-tensors' stream). The codes
# are kept only where decoding them gives the weight back bit for bit, so loading is exact;
# anything else (smoothing folds scales into weights) is saved as ``weight``.
_CODE_FORMATS = ("int", "fp8")
_PACKED_MAX_BITS = 4


def _packs(spec) -> bool:
    return spec.format == "int" and spec.bits <= _PACKED_MAX_BITS


def _pack_codes(q: torch.Tensor, spec) -> torch.Tensor:
    """Integer codes [R, C] -> int32 words [R, ceil(C * bits / 32)] (asymmetric codes shifted to
    the signed range the packer takes)."""
    signed = q.to(torch.int16) - (0 if spec.symmetric else 1 << (spec.bits - 1))
    return pack_int32(signed, spec.bits)


def _unpack_codes(words: torch.Tensor, spec, cols: int) -> torch.Tensor:
    codes = unpack_int32(words, spec.bits, cols).to(torch.int16)
    return codes.to(torch.int8) if spec.symmetric else (codes + (1 << (spec.bits - 1))).to(torch.uint8)


def _decode_codes(codes: torch.Tensor, quantizer: WeightQuantizer, dtype: torch.dtype) -> torch.Tensor:
    """The weight a leaf's saved codes stand for, on its fixed grid, in the weight's dtype."""
    d = {"q": codes, "scale": quantizer.fixed_scale}
    if quantizer.fixed_zero_point is not None:
        d["zero_point"] = quantizer.fixed_zero_point
    return formats.dequantize(d, quantizer.spec, torch.float32).to(dtype)


@torch.no_grad()
def replaced_weight_params(weight: torch.Tensor, quantizer: WeightQuantizer) -> dict[str, torch.Tensor]:
    """The PTQ key of an algorithm's replaced weight: ``weight_codes`` (on-grid, exact) or ``weight``."""
    spec = quantizer.spec
    if quantizer.has_fixed_qparams and spec is not None and spec.format in _CODE_FORMATS:
        codes = formats.quantize_with_qparams(weight.detach(), spec, quantizer.fixed_scale,
                                              quantizer.fixed_zero_point)["q"]
        if torch.equal(_decode_codes(codes, quantizer, weight.dtype), weight.detach()):
            return {"weight_codes": _pack_codes(codes, spec) if _packs(spec) else codes}
    return {"weight": weight.detach().clone()}


def load_weight_codes(weight: torch.Tensor, quantizer: WeightQuantizer, codes: torch.Tensor, who: str) -> None:
    """Write the weight that saved ``weight_codes`` stand for (the quantizer's fixed scales must
    be loaded first) into ``weight`` in place."""
    if not quantizer.has_fixed_qparams or quantizer.spec is None or quantizer.spec.format not in _CODE_FORMATS:
        raise QuantConfigError(f"{who}: weight_codes given without fixed int / fp8 weight scales "
                               "(weight_quantizer.scale) to decode them")
    spec = quantizer.spec
    rows, cols = weight.shape
    if _packs(spec):
        want, dtype = (rows, math.ceil(cols * spec.bits / 32)), torch.int32
        what = f"{spec.bits}-bit codes packed in int32 words"
    else:
        want, dtype = (rows, cols), None
        what = "one byte per element"
    if not isinstance(codes, torch.Tensor) or tuple(codes.shape) != want or (
            codes.dtype != dtype if dtype is not None else codes.dtype.itemsize != 1):
        got = (tuple(codes.shape), codes.dtype) if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise QuantConfigError(f"{who}: weight_codes {got} do not match the weight shape {tuple(weight.shape)} "
                               f"({what}: shape {want} expected)")
    codes = codes.to(weight.device)
    if _packs(spec):
        codes = _unpack_codes(codes, spec, cols)
    load_replaced_weight(weight, _decode_codes(codes, quantizer, weight.dtype), who)


class QuantLinear(nn.Module):
    """``F.linear(input_quantizer(x), weight_quantizer(weight), bias)``.

    In inference (module in eval mode, no trainable clip, and no gradient wanted for the
    weight) the fake-quant weight is cached. The cache key covers the weight object, its
    storage, its autograd version counter, device and dtype and the clip parameter, so
    ordinary updates invalidate it; call :meth:`invalidate_cache` after writing into
    ``weight.data`` directly (such writes bypass the version counter).
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None,
                 weight_spec: TensorSpec | None = None, act_spec: TensorSpec | None = None,
                 cache_weight: bool = True):
        super().__init__()
        if weight.dim() != 2:
            raise QuantConfigError(f"QuantLinear needs a 2-D weight [out, in], got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # the same Parameter object: no copy, dtype and device unchanged
        self.bias = bias
        self.weight_quantizer = WeightQuantizer(weight_spec)
        self.weight_quantizer.check_shape(weight)
        self.input_quantizer = ActivationQuantizer(act_spec)
        self.cache_weight = cache_weight
        # enabled=False runs the float linear (bit-identical) with the quantizers kept in place
        self.enabled = True
        self._cached_weight: torch.Tensor | None = None
        self._cache_key: tuple | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight_spec: TensorSpec | None = None,
                    act_spec: TensorSpec | None = None, cache_weight: bool = True) -> "QuantLinear":
        return cls(linear.weight, linear.bias, weight_spec, act_spec, cache_weight)

    # ------------------------------------------------------------------ weight cache
    # Bumped by every invalidation anywhere: lets a container that derived something from many
    # QuantLinears (the stacked fake-quant experts of an MoE) check its validity with one int.
    generation = 0

    def invalidate_cache(self) -> None:
        self._cached_weight = None
        self._cache_key = None
        QuantLinear.generation += 1

    def _can_cache(self) -> bool:
        if not self.cache_weight or self.training or self.weight_quantizer.is_identity:
            return False
        for p in (self.weight_quantizer.clip, self.weight_quantizer.round_offset):
            if p is not None and p.requires_grad:
                return False
        # A cached (detached) weight would cut the gradient path to the weight.
        return not (torch.is_grad_enabled() and self.weight.requires_grad)

    def _key(self) -> tuple:
        w, clip, off = self.weight, self.weight_quantizer.clip, self.weight_quantizer.round_offset
        ck = None if clip is None else (id(clip), clip.data_ptr(), clip._version)
        ok = None if off is None else (id(off), off.data_ptr(), off._version)
        fs = self.weight_quantizer.fixed_scale
        fk = None if fs is None else (id(fs), fs._version)
        return (id(w), w.data_ptr(), w._version, w.device, w.dtype, ck, ok, fk)

    #: the cache key (``_key``) at which the weight was checked to lie on its fixed grid
    _on_grid_key: tuple | None = None

    def mark_on_grid(self) -> None:
        """The caller checked, bit for bit, that the weight quantizes back to itself on the fixed
        grid its quantizer now holds (``formats.fixed_grid``): its fake-quant value is the weight.
        Holds while the key holds: any change of the weight (in place too), its device, the clip,
        the offset or the fixed scale lapses it."""
        self._on_grid_key = self._key()

    def weight_on_grid(self) -> bool:
        """The weight is its own fake-quant value (:meth:`mark_on_grid`, still current)."""
        return self._on_grid_key is not None and self.enabled and self._on_grid_key == self._key()

    def quantized_weight(self) -> torch.Tensor:
        """The fake-quant weight used by forward (same dtype as the weight)."""
        if not self._can_cache():
            return self.weight_quantizer(self.weight)
        key = self._key()
        if self._cached_weight is None or key != self._cache_key:
            with torch.no_grad():
                self._cached_weight = self.weight_quantizer(self.weight)
            self._cache_key = key
        return self._cached_weight

    def train(self, mode: bool = True):
        self.invalidate_cache()  # frees the copy while training / solving
        return super().train(mode)

    def _apply(self, fn, *args, **kwargs):
        self.invalidate_cache()  # .to() / .cuda() / .half(): recompute on the new tensors
        return super()._apply(fn, *args, **kwargs)

    # ----------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return F.linear(x, self.weight, self.bias)
        return F.linear(self.input_quantizer(x), self.quantized_weight(), self.bias)

    # ------------------------------------------------------------------ PTQ / export
    def export_ptq_params(self) -> dict[str, torch.Tensor]:
        """Learned / observed state, keyed ``weight_quantizer.<name>`` and
        ``input_quantizer.<name>``."""
        out = {f"weight_quantizer.{k}": v for k, v in self.weight_quantizer.ptq_params().items()}
        out.update({f"input_quantizer.{k}": v for k, v in self.input_quantizer.ptq_params().items()})
        if getattr(self, "weight_replaced", False):   # set by algorithms that rewrite the weight
            out.update(replaced_weight_params(self.weight, self.weight_quantizer))
        return out

    def load_ptq_params(self, params: Mapping[str, torch.Tensor]) -> None:
        w, a = {}, {}
        codes = None
        for k, v in params.items():
            if k == "weight":
                load_replaced_weight(self.weight, v, "QuantLinear")
                self.weight_replaced = True
                continue
            if k == "weight_codes":
                codes = v
                continue
            owner, _, name = k.partition(".")
            if owner == "weight_quantizer":
                w[name] = v
            elif owner == "input_quantizer":
                a[name] = v
            else:
                raise QuantConfigError(f"unknown QuantLinear PTQ parameter {k!r}; keys start with weight_quantizer. or input_quantizer.")
        self.weight_quantizer.load_ptq_params(w, self.weight)
        self.input_quantizer.load_ptq_params(a)
        if codes is not None:   # decoded on the fixed grid just loaded
            load_weight_codes(self.weight, self.weight_quantizer, codes, "QuantLinear")
            self.weight_replaced = True
        self.invalidate_cache()

    @torch.no_grad()
    def export(self) -> dict[str, torch.Tensor]:
        """Deployable tensors: ``qweight``, ``scale`` / ``scale_e8m0`` (+ ``zero_point``) from
        the weight quantizer (``weight`` when it is identity), ``bias`` if any, and
        ``input_scale`` (+ ``input_zero_point``) for static activation specs."""
        out = self.weight_quantizer.export(self.weight)
        if self.bias is not None:
            out["bias"] = self.bias.detach()
        out.update({f"input_{k}": v for k, v in self.input_quantizer.export().items()})
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class QuantizedMatmul(nn.Module):
    """``matmul(a_quantizer(a), b_quantizer(b))`` for the attention matmuls (q @ k^T, p @ v).

    Each operand is quantized *in the layout it is passed*: per-token specs reduce over the
    operand's last dim. For q @ k^T pass ``k`` as stored (``[..., T, d]``) with
    ``transpose_b=True`` so k is quantized per token over the head dim, or use :meth:`einsum`.
    With both quantizers off the result is bit-identical to ``torch.matmul``.
    """

    def __init__(self, a_spec: TensorSpec | None = None, b_spec: TensorSpec | None = None):
        super().__init__()
        self.a_quantizer = ActivationQuantizer(a_spec)
        self.b_quantizer = ActivationQuantizer(b_spec)
        self.enabled = True  # False: plain torch.matmul, quantizers untouched

    def set_mode(self, mode: str) -> None:
        self.a_quantizer.mode = mode
        self.b_quantizer.mode = mode

    def forward(self, a: torch.Tensor, b: torch.Tensor, transpose_b: bool = False) -> torch.Tensor:
        if not self.enabled:
            return torch.matmul(a, b.transpose(-1, -2) if transpose_b else b)
        b = self.b_quantizer(b)
        if transpose_b:
            b = b.transpose(-1, -2)
        return torch.matmul(self.a_quantizer(a), b)

    def einsum(self, equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.einsum(equation, self.a_quantizer(a), self.b_quantizer(b))



class QuantGatedMLP(nn.Module):
    """Gated MLP ``down(act(gate(x)) * up(x))`` with QuantLinear projections.

    Wraps a module with ``gate_proj`` / ``up_proj`` / ``down_proj`` nn.Linear children and an
    ``act_fn``. Projections keep the wrapped module's attribute names, so parameter names stay
    checkpoint coordinates. Subclasses for other layouts set :attr:`PROJECTIONS` (role ->
    attribute name, e.g. ``{"gate": "w1", "up": "w3", "down": "w2"}``) and may override
    ``forward``. ``weight_spec`` / ``act_spec`` are one spec for all projections or a dict
    role -> spec.
    """

    PROJECTIONS: dict[str, str] = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}

    def __init__(self, mlp: nn.Module, weight_spec=None, act_spec=None, cache_weight: bool = True):
        super().__init__()
        if not hasattr(mlp, "act_fn"):
            raise QuantConfigError(f"{type(mlp).__name__} has no act_fn; QuantGatedMLP needs one")
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = mlp.act_fn
        self._wrap_projections(mlp, weight_spec, act_spec, cache_weight)
        gate = self.projection("gate")
        self.hidden_size = getattr(mlp, "hidden_size", gate.in_features)
        self.intermediate_size = getattr(mlp, "intermediate_size", gate.out_features)

    @staticmethod
    def _spec_for(spec, role: str):
        if isinstance(spec, Mapping):
            return spec.get(role)
        return spec

    def _wrap_projections(self, mlp: nn.Module, weight_spec, act_spec, cache_weight: bool = True) -> None:
        """Replace each projection of ``mlp`` by a QuantLinear sharing its parameters."""
        for role, attr in self.PROJECTIONS.items():
            lin = getattr(mlp, attr, None)
            if not isinstance(lin, nn.Linear):
                raise QuantConfigError(f"{type(mlp).__name__}.{attr} ({role} projection) must be an nn.Linear, got {type(lin).__name__}")
            setattr(self, attr, QuantLinear.from_linear(
                lin, self._spec_for(weight_spec, role), self._spec_for(act_spec, role), cache_weight))

    def projection(self, role: str) -> QuantLinear:
        return getattr(self, self.PROJECTIONS[role])

    @property
    def clamp_limit(self) -> float:
        """The unit's own clamp of the up projection's output, ``|up| <= limit`` (and the gate's
        ``<= limit``); 0: none. A model whose MLP clamps overrides it."""
        return 0.0

    def channel_clamp(self) -> torch.Tensor | None:
        """A per-channel limit ([intermediate] fp32) that replaces :attr:`clamp_limit` after the up
        projection's rows were scaled (smoothing into the down projection), or None: the unit's
        own clamp applies. This class has no clamp: always None."""
        return None

    def set_channel_clamp(self, limit: torch.Tensor | None) -> None:
        """Set (or with None drop) the per-channel limit of :meth:`channel_clamp`; a unit without
        a clamp ignores it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (self.projection(r) for r in ("gate", "up", "down"))
        return down(self.act_fn(gate(x)) * up(x))
