"""Clipping that never loses: grid start, learned clip factors, held-out check.

Per unit:
1. Split the captured calls into a training and a held-out slice (``SolveContext.split``).
2. Grid start (``grid`` > 0): for every weight-scale block independently, the clip factor in
   ``linspace(grid_min, 1, grid)`` that minimises the activation-weighted weight error
   ``sum_j E[x_j^2] (w_j - q_j)^2`` over the block (the diagonal of the leaf's input Hessian,
   from one replay of the training calls; for ``wo_a`` per output group). The factor 1 (RTN)
   is a candidate and ties keep it, so the start is never worse than RTN on this proxy; it is
   kept only if it is also not worse than RTN on the unit's output MSE over the training
   slice (else the start is RTN).
3. Learned clipping from there: Adam on the clip factors against the unit's output MSE on the
   training slice (``learned_clip.solve_unit``; the best epoch is kept, so never worse than the
   start on that slice). ``epochs=0`` skips it.
4. Held-out check: the incoming state (RTN, or what earlier algorithms of the recipe left),
   the grid start and the learned clips are compared on the held-out slice; the best is
   kept, ties going to the incoming state, then to the grid start. With no held-out slice
   (fewer than 2 calls or ``holdout`` 0) the training slice decides.
5. Activation clipping (``activation``): every static activation quantizer of the unit (an
   observed range, ``dynamic: false`` specs) gets a range factor from ``act_grid`` (1 first)
   by coordinate search on the training-slice output MSE, then the same held-out check.

A leaf that carries fixed scales from an earlier algorithm (GPTQ) has them dropped for the
candidates (a clip acts on scales computed from the weight); the incoming candidate keeps them.

``grid=0, holdout 0`` (``--algo clip:grid=0`` with ``--holdout 0``) is the original learned
clipping (Adam from RTN, best epoch on the calibration calls).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..quant import formats
from ..quant.quant_linear import QuantLinear
from ..quant.quantizers import ActivationQuantizer
from ..pipeline.replay import replay_calls as _replay, unit_mse
from .base import Algorithm, SolveContext, UnitData
from .gptq import leaf_targets as _targets
from .learned_clip import solve_unit
from .recipe import RecipeError, register
from .runner import restore_unit, snapshot_unit


def _mse(module, calls, device) -> float | None:
    return unit_mse(module, calls, device) if calls else None


@torch.no_grad()
def _input_sq_means(module: nn.Module, calls, device) -> dict[str, torch.Tensor]:
    """E[x_j^2] per input channel of every quantized leaf (per group for wo_a: [G, d])."""
    targets = _targets(module)
    acc: dict[str, list] = {t.name: [None, 0] for t in targets}
    handles = []
    for t in targets:
        def hook(_m, args, t=t):
            x = args[0].detach().to(device=device, dtype=torch.float32)
            x = x.reshape(-1, t.groups, t.C) if t.groups else x.reshape(-1, 1, t.C)
            s = x.square().sum(0)
            a = acc[t.name]
            a[0] = s if a[0] is None else a[0] + s
            a[1] += x.shape[0]
        handles.append(t.hook_module.register_forward_pre_hook(hook))
    try:
        _replay(module, calls, device)
    finally:
        for h in handles:
            h.remove()
    return {name: s / n for name, (s, n) in acc.items() if s is not None}


@torch.no_grad()
def grid_clip(weight: torch.Tensor, spec, importance: torch.Tensor, grid: int, grid_min: float) -> torch.Tensor:
    """Per scale block, the clip factor of ``linspace(grid_min, 1, grid)`` with the smallest
    ``sum importance_j * (w - fake_quant(w, clip))^2`` (1.0 first: ties keep RTN).
    ``importance`` broadcasts against ``weight`` [R, C] ([C] or [R, C])."""
    w = weight.detach().float()
    shape = formats.scale_shape(w.shape, spec)
    lay = formats._layout(w.shape, spec, "weight")
    imp = torch.broadcast_to(importance.float(), w.shape)

    def block_err(c: float) -> torch.Tensor:
        q = formats.fake_quant(w, spec, torch.full(shape, c, device=w.device))
        e = lay.view((w - q).square() * imp)
        return lay.to_public(e.sum(dim=lay.reduce_dims, keepdim=True))

    best_c = torch.ones(shape, device=w.device)
    best_e = block_err(1.0)
    for c in torch.linspace(1.0, grid_min, grid).tolist()[1:]:
        e = block_err(c)
        better = e < best_e
        best_c = torch.where(better, torch.full_like(best_c, c), best_c)
        best_e = torch.where(better, e, best_e)
    return best_c


def _leaf_importance(t, sq: torch.Tensor) -> torch.Tensor:
    """E[x^2] laid out against the 2-D weight [R2, C] (wo_a: group g's rows get group g's)."""
    if t.groups:
        return sq[:, None, :].expand(t.groups, t.R, t.C).reshape(t.groups * t.R, t.C)
    return sq[0]


@register
@dataclass
class Clip(Algorithm):
    """Weight (and static activation) clipping that keeps RTN where it does not win."""

    name: ClassVar[str] = "clip"

    grid: int = 20
    grid_min: float = 0.5
    epochs: int = 2
    lr: float = 5e-3
    activation: bool = True
    act_grid: str = "1.0,0.9,0.8,0.7,0.6,0.5,0.4,0.3"

    def check(self) -> None:
        if self.grid < 0 or self.grid == 1:
            raise RecipeError(f"clip.grid must be 0 (off) or >= 2, got {self.grid}")
        if not (0 < self.grid_min < 1):
            raise RecipeError(f"clip.grid_min must lie in (0, 1), got {self.grid_min}")
        if self.epochs < 0 or not (self.lr > 0):
            raise RecipeError(f"clip.epochs must be >= 0 and clip.lr > 0, got {self.epochs}, {self.lr}")
        self.act_factors()

    def act_factors(self) -> list[float]:
        try:
            vals = [float(v) for v in str(self.act_grid).split(",") if v.strip()]
        except ValueError:
            raise RecipeError(f"clip.act_grid={self.act_grid!r} must be comma-separated numbers") from None
        if not vals or any(not (0 < v <= 1) for v in vals):
            raise RecipeError(f"clip.act_grid={self.act_grid!r}: factors must lie in (0, 1]")
        return vals

    def apply(self, unit, data: UnitData, ctx: SolveContext) -> dict[str, Any]:
        module, dev = unit.module, ctx.device
        train, held = ctx.split(data.calls)
        if not train:
            return {"choice": "incoming", "reason": "no calibration calls"}
        clippable = any(t.spec.format in ("int", "fp8") for t in _targets(module))
        static = self.activation and any(isinstance(m, ActivationQuantizer) and m.is_static
                                         for m in module.modules())
        if not clippable and not static:   # MX scales are powers of two: no clip to learn
            return {"choice": "incoming", "reason": "nothing to clip"}
        judge = held or train
        incoming = snapshot_unit(module)
        inc_loss = _mse(module, judge, dev)
        stats: dict[str, Any] = {"holdout_calls": len(held), "train_calls": len(train)}

        # weight clipping candidates start from the weight's own scales
        for t in _targets(module):
            if t.leaf.weight_quantizer.has_fixed_qparams:
                t.leaf.weight_quantizer.clear_fixed_qparams()
                if isinstance(t.leaf, QuantLinear):
                    t.leaf.invalidate_cache()
        base_train = _mse(module, train, dev)
        base = snapshot_unit(module)
        cands = [("incoming", incoming, inc_loss)]
        if self.grid:
            sq = _input_sq_means(module, train, dev)
            for t in _targets(module):
                wq = t.leaf.weight_quantizer
                if not wq.learnable or t.name not in sq:
                    continue
                c = grid_clip(t.leaf.weight, t.spec, _leaf_importance(t, sq[t.name]).to(t.leaf.weight.device),
                              self.grid, self.grid_min)
                wq.init_clip(t.leaf.weight)
                with torch.no_grad():
                    wq.clip.copy_(c)
                if isinstance(t.leaf, QuantLinear):
                    t.leaf.invalidate_cache()
            grid_train = _mse(module, train, dev)
            stats["grid_train_loss"], stats["rtn_train_loss"] = grid_train, base_train
            if grid_train > base_train:       # the proxy misled: start from RTN
                restore_unit(module, base)
                stats["grid_kept"] = False
            else:
                stats["grid_kept"] = True
                cands.append(("grid", snapshot_unit(module), _mse(module, judge, dev)))
        if self.epochs:
            _, after, best_epoch, n = solve_unit(module, train, epochs=self.epochs, lr=self.lr, device=dev,
                                                  seed=ctx.seed, name=unit.name)
            stats["learned_epoch"], stats["learned_train_loss"] = best_epoch, after
            cands.append(("learned", snapshot_unit(module), _mse(module, judge, dev)))
        name, snap, loss = min(cands, key=lambda c: c[2])   # min keeps the first of equals
        restore_unit(module, snap)
        stats["choice"], stats["judge_loss"] = name, loss
        stats["candidates"] = {n: l for n, _, l in cands}
        if self.activation:
            stats["activation"] = self._activation(module, train, judge, dev)
        return stats

    @torch.no_grad()
    def _activation(self, module: nn.Module, train, judge, dev) -> dict[str, Any]:
        qs = [(n, m) for n, m in module.named_modules()
              if isinstance(m, ActivationQuantizer) and m.is_static and m.observed and m.mode == "quant"]
        if not qs:
            return {"quantizers": 0}
        orig = {n: (m.running_min.clone(), m.running_max.clone()) for n, m in qs}
        j_before = _mse(module, judge, dev)
        factors = self.act_factors()
        chosen = {}
        for n, m in qs:
            lo, hi = orig[n]
            best_f, best_l = 1.0, None
            for f in [1.0] + [f for f in factors if f != 1.0]:
                m.running_min, m.running_max = lo * f, hi * f
                loss = _mse(module, train, dev)
                if best_l is None or loss < best_l:
                    best_f, best_l = f, loss
            m.running_min, m.running_max = lo * best_f, hi * best_f
            chosen[n] = best_f
        j_after = _mse(module, judge, dev)
        if j_after >= j_before:        # held-out check: keep the observed ranges
            for n, m in qs:
                m.running_min, m.running_max = orig[n]
            return {"quantizers": len(qs), "kept": False, "factors": chosen}
        return {"quantizers": len(qs), "kept": True, "factors": chosen}
