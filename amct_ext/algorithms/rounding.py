"""Learnable rounding (AutoRound, Cheng et al.): signed-gradient descent on rounding offsets.

Every integer weight quantizer of the unit gets a per-weight offset V in [-0.5, 0.5]
(``WeightQuantizer.round_offset``: codes ``round(w / scale + V)``; V = 0 is RTN) and, with
``learn_clip``, its per-block clip factor (the range scale, shared by min and max). Both are
trained against the unit's output MSE to the float output on the captured calls:

    for step t < iters:  call = calls[t mod n]             (capture order, deterministic)
                         loss = ||unit_q(call) - float_out||^2 / numel
                         p   -= lr_t * sign(dloss/dp)       lr_t = lr * (1 - t / iters)
                         V in [-0.5, 0.5], clip in [min(clip_min, clip_0), 1]

with the straight-through estimator for ``round``. SignSGD moves every offset by the same
step whatever its gradient's magnitude, which suits a parameter whose useful range is one
rounding step. The full-data MSE is measured at the start (the state before: RTN, or what an
earlier algorithm left) and every ``eval_every`` steps; the best state is kept, so the result
never has a higher loss than the state it started from.

Only integer grids have a rounding offset (fp8 / MX weights are skipped). Saved per leaf as
``{leaf}.weight_quantizer.round_offset`` (float32, the weight's shape) and ``.clip``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import ConfigError
from ..quant.quant_linear import QuantLinear
from ..quant.quantizers import CLIP_MIN
from ..pipeline.solver import _sq_err, unit_mse, unit_seed
from .base import Algorithm, SolveContext, UnitData
from .recipe import register


def _weight_leaves(module: nn.Module):
    """(leaf, weight) of every quantizer with an integer grid (QuantLinear, WoAQuant)."""
    out = []
    for m in module.modules():
        wq = getattr(m, "weight_quantizer", None)
        if wq is not None and getattr(m, "enabled", True) and wq.roundable:
            out.append((m, m.weight, wq))
    return out


def _invalidate(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, QuantLinear):
            m.invalidate_cache()


@torch.no_grad()
def signsgd_step(params: list[torch.Tensor], lr: float) -> None:
    """p -= lr * sign(grad) for every parameter with a gradient."""
    for p in params:
        if p.grad is not None:
            p.sub_(lr * torch.sign(p.grad))


@register
@dataclass
class AutoRound(Algorithm):
    """AutoRound: SignSGD on rounding offsets (+ clip factors), best state kept.

    ``lr``: 0 means 1 / iters (the paper's default). ``eval_every``: 0 means iters // 4."""

    name: ClassVar[str] = "autoround"
    iters: int = 200
    lr: float = 0.0
    learn_clip: bool = True
    clip_min: float = 0.5
    eval_every: int = 0

    def check(self) -> None:
        if self.iters < 0:
            raise ConfigError(f"iters={self.iters}: must be >= 0")
        if self.lr < 0:
            raise ConfigError(f"lr={self.lr}: must be >= 0 (0 = 1 / iters)")
        if not CLIP_MIN <= self.clip_min <= 1.0:
            raise ConfigError(f"clip_min={self.clip_min}: must lie in [{CLIP_MIN}, 1]")
        if self.eval_every < 0:
            raise ConfigError(f"eval_every={self.eval_every}: must be >= 0")

    def apply(self, unit, data: UnitData, ctx: SolveContext) -> dict[str, Any]:
        module = unit.module
        leaves = _weight_leaves(module)
        if not leaves:
            return {"skipped": "no integer weight quantizer with scales from the weight (fp8 / MX, or GPTQ's fixed grid)"}
        if not len(data):
            return {"skipped": "no calls"}
        torch.manual_seed(unit_seed(ctx.seed, unit.name))
        calls = data.calls
        device = ctx.device
        was_training = module.training
        module.eval()
        frozen = [p for p in module.parameters() if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        offsets, clips, clip_lo = [], [], []
        for _, w, wq in leaves:
            v = wq.init_round_offset(w)
            v.requires_grad_(True)
            offsets.append(v)
            if self.learn_clip:
                c = wq.init_clip(w)
                if c is not None:
                    # the range scale starts where an earlier algorithm left it (maybe below clip_min)
                    clip_lo.append(min(self.clip_min, float(c.min())))
                    c.requires_grad_(True)
                    clips.append(c)
        params = offsets + clips
        _invalidate(module)
        try:
            loss_before = unit_mse(module, calls, device)
            best_loss, best_step = loss_before, 0
            best = [p.detach().clone() for p in params]
            lr0 = self.lr or (1.0 / max(self.iters, 1))
            every = self.eval_every or max(self.iters // 4, 1)
            for t in range(self.iters):
                call = calls[t % len(calls)]
                for p in params:
                    p.grad = None
                se, n = _sq_err(module, call, device)
                (se / n).backward()
                signsgd_step(params, lr0 * (1.0 - t / self.iters))
                with torch.no_grad():
                    for v in offsets:
                        v.clamp_(-0.5, 0.5)
                    for c, lo in zip(clips, clip_lo):
                        c.clamp_(lo, 1.0)
                if (t + 1) % every == 0 or t + 1 == self.iters:
                    with torch.no_grad():
                        loss = unit_mse(module, calls, device)
                    if loss < best_loss:  # strict: ties keep the earlier state
                        best_loss, best_step = loss, t + 1
                        best = [p.detach().clone() for p in params]
            with torch.no_grad():
                for p, b in zip(params, best):
                    p.copy_(b)
            changed = sum(int((v != 0).sum()) for v in offsets)
            for _, _, wq in leaves:   # an all-zero offset is RTN: nothing to save
                if wq.round_offset is not None and not bool(wq.round_offset.any()):
                    wq.round_offset = None
            return {"loss_before": loss_before, "loss_after": best_loss, "best_step": best_step,
                    "n_offsets": sum(v.numel() for v in offsets), "n_nonzero_offsets": changed}
        finally:
            for p in params:
                p.requires_grad_(False)
                p.grad = None
            for p in frozen:
                p.requires_grad_(True)
            _invalidate(module)
            module.train(was_training)
