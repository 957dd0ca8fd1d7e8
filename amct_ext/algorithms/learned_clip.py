"""Learned clipping on every captured call: the original blockwise solver, as an algorithm.

Adam optimises the unit's ``ptq_parameters()`` (one clip factor per weight-scale block, in
(0, 1]) to minimise

    MSE = sum over calls of ||unit_q(*args, **kwargs) - float_output||^2 / total elements

i.e. the mean squared error over every captured element (calls with more tokens weigh more).
``learned_clip`` trains and selects on the same calls (no held-out check); ``clip``
(clipping.py) uses :func:`solve_unit` on its training slice and validates on the rest.

Guarantees of :func:`solve_unit`
- ``loss_before`` is the RTN loss (every clip at 1.0, the quantizer's full range).
- The returned state is the best seen: RTN, or the parameters after some epoch. So
  ``loss_after <= loss_before`` on the calibration data, always.
- Deterministic: calls are visited in capture order, the RNG is seeded per unit (no optimiser
  randomness today; the seed guards future use). Bit-reproducible on the same machine at the
  same torch thread count (a different count changes float reduction order).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch
from torch import nn

from ..base import DEFAULT_EPOCHS, DEFAULT_LR
from ..pipeline.capture import UnitCall
from ..pipeline.replay import call_sq_err, unit_mse, unit_seed
from .base import Algorithm, SolveContext, UnitData
from .recipe import RecipeError, register


def solve_unit(module: nn.Module, calls: Sequence[UnitCall], *, epochs: int, lr: float,
               device: torch.device, seed: int, name: str) -> tuple[float | None, float | None, int, int]:
    """Optimise ``module.ptq_parameters()`` in place; returns (loss_before, loss_after,
    best_epoch, n_learnable). ``module`` must already be on ``device``, quantizers on.
    The RNG is seeded from ``seed`` and the unit's ``name`` (``replay.unit_seed``).

    The module's own float weights are frozen for the duration (only clips learn)."""
    torch.manual_seed(unit_seed(seed, name))
    was_training = module.training
    module.eval()  # QuantLinear skips its weight cache while a clip is trainable anyway
    frozen = [p for p in module.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    params = list(module.ptq_parameters())   # creates clips at 1.0 (= RTN) and enables grad
    n_learnable = sum(p.numel() for p in params)
    try:
        if not calls:
            return None, None, 0, n_learnable
        loss_before = unit_mse(module, calls, device)
        best_loss, best_epoch = loss_before, 0
        if not params or epochs == 0:
            return loss_before, loss_before, 0, n_learnable
        best_state = [p.detach().clone() for p in params]
        opt = torch.optim.Adam(params, lr=lr)
        for epoch in range(1, epochs + 1):
            for call in calls:
                opt.zero_grad(set_to_none=True)
                se, n = call_sq_err(module, call, device)
                (se / n).backward()
                opt.step()
            loss = unit_mse(module, calls, device)
            if loss < best_loss:  # strict: ties keep the earlier (simpler) state
                best_loss, best_epoch = loss, epoch
                best_state = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, b in zip(params, best_state):
                p.copy_(b)
        return loss_before, best_loss, best_epoch, n_learnable
    finally:
        freeze = getattr(module, "freeze_ptq_parameters", None)
        if freeze is not None:
            freeze()
        else:
            for p in params:
                p.requires_grad_(False)
        for p in frozen:
            p.requires_grad_(True)
        module.train(was_training)


@register
@dataclass
class LearnedClip(Algorithm):
    """``learned_clip[:epochs=N][:lr=X]``: Adam on the clip factors over every captured call,
    the best epoch kept (the pre-recipe ``--legacy-solver``)."""

    name: ClassVar[str] = "learned_clip"
    epochs: int = DEFAULT_EPOCHS
    lr: float = DEFAULT_LR

    def check(self) -> None:
        if self.epochs < 0:
            raise RecipeError(f"learned_clip.epochs must be >= 0, got {self.epochs}")
        if not self.lr > 0:
            raise RecipeError(f"learned_clip.lr must be > 0, got {self.lr}")

    def apply(self, unit, data: UnitData, ctx: SolveContext) -> dict[str, Any]:
        before, after, best_epoch, n_params = solve_unit(unit.module, data.calls, epochs=self.epochs, lr=self.lr,
                                                         device=ctx.device, seed=ctx.seed,
                                                         name=unit.name)
        return {"loss_before": before, "loss_after": after, "best_epoch": best_epoch, "n_params": n_params}
