"""Round-to-nearest: the quantizers as the scheme defines them, nothing learned.

Its statistics are the unit's RTN loss (MSE to the float output over the captured calls) when
calls were captured; it is the baseline the other algorithms are measured (and guarded)
against."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..pipeline.replay import unit_mse
from .base import Algorithm, Needs, SolveContext, UnitData
from .recipe import register


@register
@dataclass
class RTN(Algorithm):
    name: ClassVar[str] = "rtn"

    def needs(self) -> Needs:
        # nothing to solve: no calls, and the Hessians would only measure the RTN loss
        return Needs(calls=False, statistics=False)

    def apply(self, unit, data: UnitData, ctx: SolveContext) -> dict[str, Any]:
        if not len(data):
            return {"loss": None}
        return {"loss": unit_mse(unit.module, data.calls, ctx.device)}
