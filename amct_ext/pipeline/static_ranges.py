"""Static activation quantizers (``dynamic: false``): their ranges observed on calibration data.

After ``quantize_block`` an 'observe' pass over the layer's calibration inputs (float inputs,
RTN weights) records the ranges, then the quantizers switch to 'quant'. One that saw no data (an
expert no calibration token was routed to) is left 'off' (float activations) and counted: see
the workflow's module docstring for why that is not an error.
"""
from __future__ import annotations

import logging
from typing import Sequence

from torch import nn

from ..base import BaseModel
from ..errors import ConfigError
from ..quant.quantizers import ActivationQuantizer
from ..quant.schemes import QuantScheme

log = logging.getLogger("amct_ext.pipeline.workflow")   # the records keep the name they always had


def static_quantizers(module: nn.Module) -> list[ActivationQuantizer]:
    return [m for m in module.modules() if isinstance(m, ActivationQuantizer) and m.is_static]


def scheme_has_static(scheme: QuantScheme, targets: Sequence[str]) -> bool:
    """Whether any activation / cache spec used by ``targets`` is static (needs calibration)."""
    for t in targets:
        spec = scheme.cache if t == "attn-cache" else scheme.target(t).input
        if spec is not None and not spec.dynamic:
            return True
    return False


def observe_static(adapter: BaseModel, block: nn.Module, calib, layer_idx: int) -> int:
    """Record the ranges of static activation quantizers over the layer's calibration inputs
    (``calib``: a ``stream.Stream``; RTN weights), then switch them to 'quant' (unobserved ones
    to 'off'). Returns the number left unobserved. No-op (0) for dynamic-only schemes."""
    static = static_quantizers(block)
    if not static:
        return 0
    if calib is None:
        raise ConfigError("the scheme has static activation specs (dynamic: false): they need calibration data")
    for q in static:
        q.reset_stats()
        q.mode = "observe"
    adapter.set_quant_enabled(block, True)
    adapter.do_block_forward(block, calib.hidden, calib.state)
    return finish_static(block, layer_idx)


def finish_static(block: nn.Module, layer_idx: int) -> int:
    """Static quantizers with a range -> 'quant', without one -> 'off'; returns how many are off."""
    unobserved = 0
    for q in static_quantizers(block):
        if q.observed:
            q.mode = "quant"
        else:
            q.mode = "off"
            unobserved += 1
    if unobserved:
        log.warning("layer %d: %d static activation quantizer(s) saw no calibration data "
                    "(e.g. experts no calibration token was routed to); they stay in float",
                    layer_idx, unobserved)
    return unobserved


__all__ = ["static_quantizers", "scheme_has_static", "observe_static", "finish_static"]
