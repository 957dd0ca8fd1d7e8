"""Weight and activation quantizers: nn.Modules around the plain functions of formats.py.

- :class:`WeightQuantizer` fake-quantizes a weight, optionally with a learnable clipping
  factor per scale block (the PTQ solver's parameter), and exports deployable tensors.
- :class:`ActivationQuantizer` has three modes: ``off`` (returns its input object unchanged),
  ``observe`` (passes data through, records the running range) and ``quant``.

A spec of ``None`` (or an identity spec: format 'none', int bits >= 16) makes either quantizer
the identity.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from . import formats
from ..errors import AmctError, QuantConfigError
from .schemes import TensorSpec

#: Smallest clip factor used in the forward pass: keeps scales positive whatever the optimizer
#: does to the raw parameter.
CLIP_MIN = 1e-2
MODES = ("off", "observe", "quant")


class NotCalibratedError(AmctError, RuntimeError):
    """A static activation quantizer was asked to quantize before observing any data."""


def _active(spec: TensorSpec | None) -> TensorSpec | None:
    if spec is not None and not isinstance(spec, TensorSpec):
        raise QuantConfigError(f"expected a TensorSpec or None, got {type(spec).__name__}")
    return None if spec is None or spec.is_identity else spec


class WeightQuantizer(nn.Module):
    """Fake-quantizes weights per ``spec``.

    The learnable clip (``self.clip``, float32, one value per scale block, i.e. shaped like
    :func:`formats.scale_shape`, initialised to 1.0) exists only after :meth:`init_clip` /
    :meth:`enable_learning`; until then ``forward`` uses the full range. The forward pass uses
    ``clamp(clip, CLIP_MIN, 1)`` with a straight-through gradient, so an optimizer step that
    leaves (0, 1] is undone by the clamp but can still come back (a plain clamp would freeze
    the gradient once the parameter left the range). MX formats have power-of-two scales that
    a clip cannot move smoothly, so they are never learnable (:attr:`learnable` is False).

    The optional rounding offset (``self.round_offset``, float32, the weight's shape, int formats
    only; AutoRound) shifts every code: ``q = clamp(round(w / scale + V) + zp, ...)`` with V
    clamped to [-0.5, 0.5] in the forward pass (straight-through, like the clip). V = 0 is RTN
    exactly.
    """

    def __init__(self, spec: TensorSpec | None):
        super().__init__()
        self.spec = _active(spec)
        self.clip: nn.Parameter | None = None
        self.round_offset: nn.Parameter | None = None
        # Fixed grid (public scale shape): set by algorithms that choose the scales themselves
        # (GPTQ); then forward / export use them instead of computing scales from the weight,
        # so a replaced weight reproduces exactly the grid values the algorithm wrote.
        self.register_buffer("fixed_scale", None, persistent=False)
        self.register_buffer("fixed_zero_point", None, persistent=False)

    # --------------------------------------------------------------------------- properties
    @property
    def is_identity(self) -> bool:
        return self.spec is None

    @property
    def learnable(self) -> bool:
        # a fixed grid leaves nothing for a clip to move (clear_fixed_qparams first)
        return self.spec is not None and self.spec.format in ("int", "fp8") and self.fixed_scale is None

    @property
    def has_fixed_qparams(self) -> bool:
        return self.fixed_scale is not None

    def set_fixed_qparams(self, weight: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None) -> None:
        """Use the given public-shape scale (+ zero point) for ``weight`` from now on; the clip
        (already folded into these scales by whoever computed them) is dropped."""
        if self.spec is None:
            raise QuantConfigError("fixed scales given for a weight quantizer that does not quantize")
        shape = tuple(self.scale_shape(weight))
        if tuple(scale.shape) != shape:
            raise QuantConfigError(f"scale shape {tuple(scale.shape)} does not match the scale shape {shape}")
        scale = scale.detach().to(weight.device, torch.float32)
        if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
            raise QuantConfigError("fixed scales must be finite and > 0")
        needs_zp = self.spec.format == "int" and not self.spec.symmetric
        if needs_zp != (zero_point is not None):
            raise QuantConfigError(f"fixed scales of a {'n asymmetric' if needs_zp else ' symmetric / float'} "
                                   f"spec {'need' if needs_zp else 'take no'} zero_point")
        if zero_point is not None:
            if tuple(zero_point.shape) != shape:
                raise QuantConfigError(f"zero_point shape {tuple(zero_point.shape)} does not match {shape}")
            zero_point = zero_point.detach().to(weight.device, torch.float32)
            qmax = 2 ** self.spec.bits - 1
            if not bool(((zero_point >= 0) & (zero_point <= qmax) & (zero_point == zero_point.round())).all()):
                raise QuantConfigError(f"zero_point values must be integers in [0, {qmax}]")
        self.fixed_scale, self.fixed_zero_point = scale, zero_point
        self.clip = None
        self.round_offset = None

    def clear_fixed_qparams(self) -> None:
        self.fixed_scale = None
        self.fixed_zero_point = None

    def scale_shape(self, weight: torch.Tensor) -> torch.Size:
        return formats.scale_shape(weight.shape, self.spec)

    def check_shape(self, weight: torch.Tensor) -> None:
        """Raise the clear shape error (e.g. group size vs input dim) now, not mid-forward."""
        if self.spec is not None:
            formats.scale_shape(weight.shape, self.spec)

    # -------------------------------------------------------------------------- learning
    def init_clip(self, weight: torch.Tensor, value: float = 1.0) -> nn.Parameter | None:
        """Create the clip parameter (no-op returning None when not learnable)."""
        if not self.learnable:
            return None
        shape = self.scale_shape(weight)
        if self.clip is None or self.clip.shape != shape:
            self.clip = nn.Parameter(torch.full(shape, float(value), dtype=torch.float32,
                                                device=weight.device), requires_grad=False)
        return self.clip

    def enable_learning(self, weight: torch.Tensor) -> list[nn.Parameter]:
        """Make the clip trainable; returns the parameters to hand to an optimizer."""
        clip = self.init_clip(weight)
        if clip is None:
            return []
        clip.requires_grad_(True)
        return [clip]

    def disable_learning(self) -> None:
        for p in (self.clip, self.round_offset):
            if p is not None:
                p.requires_grad_(False)

    @property
    def roundable(self) -> bool:
        """Whether a learned rounding offset applies: integer grids whose scales come from the
        weight (a fixed grid, e.g. GPTQ's, already holds the rounded values)."""
        return self.spec is not None and self.spec.format == "int" and self.fixed_scale is None

    def init_round_offset(self, weight: torch.Tensor) -> nn.Parameter | None:
        """Create the rounding offset at 0 (= RTN); None when the format has no integer grid."""
        if not self.roundable:
            return None
        if self.round_offset is None or tuple(self.round_offset.shape) != tuple(weight.shape):
            self.round_offset = nn.Parameter(torch.zeros(weight.shape, dtype=torch.float32, device=weight.device),
                                             requires_grad=False)
        return self.round_offset

    def effective_round_offset(self) -> torch.Tensor | None:
        """The offset as used in the forward pass: clamped to [-0.5, 0.5], straight-through grad."""
        v = self.round_offset
        if v is None:
            return None
        clamped = v.clamp(-0.5, 0.5)
        return v + (clamped - v).detach() if v.requires_grad else clamped

    def effective_clip(self) -> torch.Tensor | None:
        """Clip as used in the forward pass: clamped to [CLIP_MIN, 1], straight-through grad."""
        c = self.clip
        if c is None:
            return None
        clamped = c.clamp(CLIP_MIN, 1.0)
        return c + (clamped - c).detach() if c.requires_grad else clamped

    def ptq_params(self) -> dict[str, torch.Tensor]:
        """Learned state (detached copies, clip already clamped); {} when there is none."""
        out = {}
        c = self.effective_clip()
        if c is not None:
            out["clip"] = c.detach().clone()
        v = self.effective_round_offset()
        if v is not None:
            out["round_offset"] = v.detach().clone()
        if self.fixed_scale is not None:
            out["scale"] = self.fixed_scale.detach().clone()
            if self.fixed_zero_point is not None:
                out["zero_point"] = self.fixed_zero_point.detach().clone()
        return out

    def load_ptq_params(self, params: Mapping[str, torch.Tensor], weight: torch.Tensor | None = None) -> None:
        """Load what :meth:`ptq_params` returned. ``weight`` is needed to create the clip
        parameter when it does not exist yet."""
        unknown = sorted(set(params) - {"clip", "scale", "zero_point", "round_offset"})
        if unknown:
            raise QuantConfigError(f"unknown weight-quantizer parameter(s) {', '.join(unknown)}; "
                                   "expected: clip, scale, zero_point, round_offset")
        if "scale" in params or "zero_point" in params:
            if "clip" in params or "round_offset" in params:
                raise QuantConfigError("weight-quantizer parameters: fixed scales exclude clip and round_offset")
            if weight is None:
                raise QuantConfigError("load_ptq_params: pass the weight to check the fixed scales' shape")
            if "scale" not in params:
                raise QuantConfigError("weight-quantizer parameters: zero_point without scale")
            self.set_fixed_qparams(weight, params["scale"], params.get("zero_point"))
            return
        if "round_offset" in params:
            self._load_round_offset(params["round_offset"], weight)
        if "clip" not in params:
            return
        value = params["clip"]
        if not self.learnable:
            raise QuantConfigError(f"clip given for a weight quantizer that has none (spec {self.spec})")
        if self.clip is None:
            if weight is None:
                raise QuantConfigError("load_ptq_params: pass the weight to create the clip parameter")
            self.init_clip(weight)
        if tuple(value.shape) != tuple(self.clip.shape):
            raise QuantConfigError(f"clip shape {tuple(value.shape)} does not match the scale shape {tuple(self.clip.shape)}")
        if not bool(torch.isfinite(value).all()) or not bool(((value > 0) & (value <= 1)).all()):
            raise QuantConfigError("clip values must be finite and lie in (0, 1]")
        with torch.no_grad():
            self.clip.copy_(value.to(self.clip.device, torch.float32))

    def _load_round_offset(self, value: torch.Tensor, weight: torch.Tensor | None) -> None:
        if not self.roundable:
            raise QuantConfigError(f"round_offset given for a weight quantizer without an integer grid (spec {self.spec})")
        if weight is None and self.round_offset is None:
            raise QuantConfigError("load_ptq_params: pass the weight to create the round_offset parameter")
        shape = tuple(weight.shape) if weight is not None else tuple(self.round_offset.shape)
        if tuple(value.shape) != shape:
            raise QuantConfigError(f"round_offset shape {tuple(value.shape)} does not match the weight {shape}")
        if not bool(torch.isfinite(value).all()) or not bool((value.abs() <= 0.5).all()):
            raise QuantConfigError("round_offset values must be finite and lie in [-0.5, 0.5]")
        if weight is not None:
            self.init_round_offset(weight)
        with torch.no_grad():
            self.round_offset.copy_(value.to(self.round_offset.device, torch.float32))

    # ------------------------------------------------------------------------------ use
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        if self.spec is None:
            return w
        if self.fixed_scale is not None:
            return formats.fake_quant_with_qparams(w, self.spec, self.fixed_scale, self.fixed_zero_point)
        return formats.fake_quant(w, self.spec, self.effective_clip(), self.effective_round_offset())

    @torch.no_grad()
    def export(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Deployable tensors of ``w``: see :func:`formats.quantize` (keys ``qweight``,
        ``scale`` / ``scale_e8m0``, ``zero_point``). Identity spec -> ``{"weight": w}``."""
        if self.spec is None:
            return {"weight": w.detach()}
        if self.fixed_scale is not None:
            d = formats.quantize_with_qparams(w, self.spec, self.fixed_scale, self.fixed_zero_point)
        else:
            d = formats.quantize(w, self.spec, self.effective_clip(), self.effective_round_offset())
        d["qweight"] = d.pop("q")
        return d

    def extra_repr(self) -> str:
        return f"spec={self.spec}"


class ActivationQuantizer(nn.Module):
    """Fake-quantizes activations; ``mode`` is 'off' | 'observe' | 'quant' (starts 'off').

    - off: returns the input object itself (a wrapped model stays bit-identical to float).
    - observe: returns the input object itself and records the running range
      (``running_min`` / ``running_max``, running extremes over all observed batches, float32):
      per tensor (shape ``[]``), or, for static specs of granularity 'channel', per channel of
      the last dim (shape ``[K]``).
    - quant: dynamic specs (per-token, MX, dynamic per-tensor / per-group / per-block) compute
      scales from the current tensor; static specs ('tensor' or 'channel' = per last-dim
      channel) use the observed range and raise :class:`NotCalibratedError` without one.

    For activations 'channel' means *per input channel* (statistics over the last dim), so a
    dynamic 'channel' spec is refused: use 'token' for one scale per row.
    """

    def __init__(self, spec: TensorSpec | None, mode: str = "off"):
        super().__init__()
        self.spec = _active(spec)
        if self.spec is not None:
            s = self.spec
            if s.dynamic and s.granularity == "channel":
                raise QuantConfigError("activation spec: dynamic granularity 'channel' is ambiguous; use 'token' (one scale per row)")
            if not s.dynamic and s.granularity not in ("tensor", "channel"):
                raise QuantConfigError(f"activation spec: static (dynamic=false) scales support granularity 'tensor' or 'channel', not {s.granularity!r}")
        # Non-persistent buffers: they follow .to(device) but stay out of the model state_dict
        # (checkpoint keys are the released model's keys); ptq_params() carries them instead.
        self.register_buffer("running_min", None, persistent=False)
        self.register_buffer("running_max", None, persistent=False)
        self._mode = "off"
        self.mode = mode

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in MODES:
            raise QuantConfigError(f"ActivationQuantizer.mode={value!r} is unknown; valid: {', '.join(MODES)}")
        self._mode = value

    @property
    def is_identity(self) -> bool:
        return self.spec is None

    @property
    def is_static(self) -> bool:
        return self.spec is not None and not self.spec.dynamic

    @property
    def observed(self) -> bool:
        return self.running_min is not None

    def reset_stats(self) -> None:
        self.running_min = None
        self.running_max = None

    @torch.no_grad()
    def _observe(self, x: torch.Tensor) -> None:
        formats._check_input(x, "observed activation")
        xf = x.detach().float()
        if self.spec.granularity == "channel" and not self.spec.dynamic:
            flat = xf.reshape(-1, xf.shape[-1])
            lo, hi = flat.amin(0), flat.amax(0)
        else:
            lo, hi = xf.amin(), xf.amax()
        if self.running_min is None:
            self.running_min, self.running_max = lo, hi
            return
        if self.running_min.shape != lo.shape:
            raise QuantConfigError(f"observed activation of shape {tuple(x.shape)} has {lo.numel()} channels; earlier batches had {self.running_min.numel()}")
        dev = self.running_min.device
        self.running_min = torch.minimum(self.running_min, lo.to(dev))
        self.running_max = torch.maximum(self.running_max, hi.to(dev))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._mode == "off" or self.spec is None:
            return x
        if self._mode == "observe":
            self._observe(x)
            return x
        if self.spec.dynamic:
            return formats.fake_quant(x, self.spec)
        if not self.observed:
            raise NotCalibratedError(f"static activation quantizer ({self.spec.format} {self.spec.granularity}) has no observed range; run it in 'observe' mode on calibration data first")
        return formats.fake_quant_from_range(x, self.spec, self.running_min, self.running_max)

    # ------------------------------------------------------------------- PTQ parameters
    def ptq_params(self) -> dict[str, torch.Tensor]:
        if not self.observed:
            return {}
        return {"running_min": self.running_min.detach().clone(),
                "running_max": self.running_max.detach().clone()}

    def load_ptq_params(self, params: Mapping[str, torch.Tensor]) -> None:
        keys = set(params)
        if keys - {"running_min", "running_max"} or len(keys) == 1:
            raise QuantConfigError(f"activation-quantizer parameters must be running_min and running_max together, got {', '.join(sorted(keys))}")
        if not keys:
            return
        lo, hi = params["running_min"], params["running_max"]
        if lo.shape != hi.shape or not bool(torch.isfinite(lo).all() & torch.isfinite(hi).all()):
            raise QuantConfigError("running_min / running_max must be finite and of the same shape")
        dev = self.running_min.device if self.running_min is not None else lo.device
        self.running_min = lo.detach().float().to(dev).clone()
        self.running_max = hi.detach().float().to(dev).clone()

    @torch.no_grad()
    def export(self) -> dict[str, torch.Tensor]:
        """Static scale (+ zero point) from the observed range; {} for dynamic / identity
        specs or before observation (dynamic scales are computed at run time)."""
        if not self.is_static or not self.observed:
            return {}
        scale, zp = formats.qparams_from_range(self.spec, self.running_min, self.running_max)
        out = {"scale": scale}
        if zp is not None:
            out["zero_point"] = zp.to(torch.int32)
        return out

    def extra_repr(self) -> str:
        return f"spec={self.spec}, mode={self._mode!r}"
