"""Units whose weights the target format already holds exactly: keep them, codes and all.

A released checkpoint may already store weights on a grid the target scheme can express: the
routed experts of DeepSeek-V4's release are FP4 e2m1 with a power-of-two scale per 32, which is
exactly OCP MXFP4. Quantizing them to ``mxfp4`` by RTN gives back the released values bit for
bit; any algorithm that moves a weight or a scale there (GPTQ, a clip search, rounding offsets)
can only leave the grid the model was trained on. So, before a recipe runs, each unit whose
every quantized leaf is a fixed point of its weight quantizer (``fake_quant(w) == w`` exactly,
at the RTN state the run starts from) is set aside: no algorithm touches it, its result says
``kept_source_codes``, and the run summary counts it.

The test is on values, not on names: it holds for any source and scheme where the grids nest
(and for no bf16 weight in practice), so the framework needs no model knowledge for it.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..pipeline.ptq_units import PtqUnit, UnitResult

#: the key a kept unit's ``UnitResult.stats`` carries (read by the summary)
KEPT_SOURCE_CODES = "kept_source_codes"


@torch.no_grad()
def weights_on_target_grid(module: torch.nn.Module) -> bool:
    """True when ``module`` has quantized leaves and every one's weight equals its own RTN
    fake-quantization bit for bit (so RTN keeps the stored codes)."""
    from .hessians import fake_quant_weight, quant_leaves

    leaves = quant_leaves(module)
    if not leaves:
        return False
    for _, leaf in leaves:
        w = leaf.weight.detach()   # the quantizer's current state (RTN at a run's start)
        if not torch.equal(fake_quant_weight(leaf).to(w.dtype), w):
            return False
    return True


def split_kept(units: Sequence[PtqUnit]) -> tuple[list[PtqUnit], list[PtqUnit]]:
    """(units already on the target grid, units to solve), each in the given order."""
    kept, solve = [], []
    for u in units:
        (kept if weights_on_target_grid(u.module) else solve).append(u)
    return kept, solve


def kept_result(unit: PtqUnit) -> UnitResult:
    """The result of a unit set aside: RTN state, no loss measured (its weight error is zero)."""
    return UnitResult(name=unit.name, kind=unit.kind, layer=unit.layer_idx, loss_before=None, loss_after=None,
                      seconds=0.0, n_calls=0, n_params=0, best_epoch=0,
                      stats={KEPT_SOURCE_CODES: True, "reverted_to_rtn": False})


def is_kept(result: UnitResult | dict) -> bool:
    stats = result.get("stats") if isinstance(result, dict) else result.stats
    return bool(isinstance(stats, dict) and stats.get(KEPT_SOURCE_CODES))


__all__ = ["KEPT_SOURCE_CODES", "weights_on_target_grid", "split_kept", "kept_result", "is_kept"]
