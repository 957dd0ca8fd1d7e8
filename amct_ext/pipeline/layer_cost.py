"""The cost of one decoder layer, as the torchrun layer split reads it.

A module of its own so that ``base.py`` (whose adapters state the cost of their layers) need not
import ``distributed.py``, which imports the workflow, which imports ``base.py``: the one import
circle amct_ext had (tests/test_import_graph.py keeps it out).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerCost:
    """Seconds (under ``CostRates``) of one layer: its float pass (load + forward over the
    calibration tokens) and its solving (capture forward + units)."""

    float_s: float
    solve_s: float

    @property
    def ptq_s(self) -> float:
        """A quantized layer: loaded and run once (capture), then its units solved."""
        return self.float_s + self.solve_s


__all__ = ["LayerCost"]
