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

The routed experts of a layer are clipped together (``group_kinds``), ``expert_chunk`` at a
time, by the same steps on stacked weights [E, out, in]: one batched forward
(``grouped_forward``) per call slot serves every expert's losses and channel statistics, the
grid search runs on the stacked weights, Adam steps every expert on its own call (an expert
past its last call of the epoch is not stepped, its moments untouched: a masked Adam with
per-expert step counts, torch.optim.Adam's formula), and every choice (grid kept, best epoch,
the held-out winner) is made per expert. A test holds it to the one-by-one result in float64.
Where the batched forward cannot reproduce an expert (``grouped_forward_blocker``, a
per-tensor weight grid, a rounding offset left by AutoRound) the experts go one by one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..quant import formats
from ..quant.quant_linear import QuantLinear
from ..quant.quantizers import CLIP_MIN, ActivationQuantizer
from ..pipeline.replay import replay_calls as _replay, unit_mse
from .base import Algorithm, SolveContext, UnitData
from .gptq import leaf_targets as _targets
from .learned_clip import solve_unit
from .recipe import RecipeError, register
from .stacked import StackedCalls, common_group_blocker, expert_call_blocker, expert_projections, solve_ready_in_chunks, ste_clamp
from .runner import restore_unit, snapshot_unit

# torch.optim.Adam's defaults, which solve_unit's learned clipping uses
_ADAM_BETAS, _ADAM_EPS = (0.9, 0.999), 1e-8


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
    group_kinds: ClassVar[tuple[str, ...]] = ("expert",)

    grid: int = 20
    grid_min: float = 0.5
    epochs: int = 2
    lr: float = 5e-3
    activation: bool = True
    act_grid: str = "1.0,0.9,0.8,0.7,0.6,0.5,0.4,0.3"
    # routed experts per batched solve (1 = one by one): their calls, weights, clips and Adam
    # moments sit on the device together (32 Flash experts: ~3 GB of calls, ~2 GB of weights)
    expert_chunk: int = 32

    def check(self) -> None:
        if self.grid < 0 or self.grid == 1:
            raise RecipeError(f"clip.grid must be 0 (off) or >= 2, got {self.grid}")
        if not (0 < self.grid_min < 1):
            raise RecipeError(f"clip.grid_min must lie in (0, 1), got {self.grid_min}")
        if self.epochs < 0 or not (self.lr > 0):
            raise RecipeError(f"clip.epochs must be >= 0 and clip.lr > 0, got {self.epochs}, {self.lr}")
        if self.expert_chunk < 1:
            raise RecipeError(f"clip.expert_chunk must be >= 1 (1 = one expert at a time), got {self.expert_chunk}")
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

    # ------------------------------------------------------------------ routed experts, batched
    def _group_blocker(self, units, datas) -> str | None:
        """Why the experts cannot be clipped batched (None: they can)."""
        why = common_group_blocker(self.expert_chunk, units)
        if why:
            return why
        for name, lins in expert_projections(units).items():
            ref = lins[0]
            for lin in lins:
                wq = lin.weight_quantizer
                if not getattr(lin, "enabled", True) or wq.spec is None or wq.spec.format not in ("int", "fp8"):
                    return f"{name} is not an enabled int / fp8 weight grid in every expert"
                if wq.spec != ref.weight_quantizer.spec:
                    return f"{name}'s weight specs differ between experts"
                if lin.weight.shape != ref.weight.shape or lin.weight.dtype != ref.weight.dtype:
                    return f"{name}'s weight shapes or dtypes differ between experts"
                if wq.round_offset is not None:
                    return f"{name} carries a rounding offset (AutoRound ran before clip)"
            if ref.weight_quantizer.spec.granularity == "tensor":
                return "a per-tensor weight scale is not per expert once stacked"
        if self.activation and any(isinstance(m, ActivationQuantizer) and m.is_static
                                   for u in units for m in u.module.modules()):
            return "static activation quantizers are clipped one unit at a time"
        return expert_call_blocker(datas)

    def apply_group(self, units, datas, ctx: SolveContext) -> list[dict[str, Any]]:
        why = self._group_blocker(units, datas)
        ready = [i for i, d in enumerate(datas) if ctx.split(d.calls)[0]]
        if why is not None or len(ready) < 2:
            return [self.apply(u, d, ctx) for u, d in zip(units, datas)]
        # the rest one by one (the per-expert "no calibration calls"), the ready experts in stacked chunks
        return solve_ready_in_chunks(units, datas, ready, self.expert_chunk, lambda u, d: self.apply(u, d, ctx),
                                     lambda us, ds: self._clip_chunk(us, ds, ctx))

    def _clip_chunk(self, units, datas, ctx: SolveContext) -> list[dict[str, Any]]:
        """Steps 1-4 of the module doc on ``len(units)`` experts at once, every choice per expert."""
        dev = ctx.device
        members = [u.module for u in units]
        cls = type(members[0])
        lins = expert_projections(units)
        names, E = tuple(lins), len(members)
        specs = {n: lins[n][0].weight_quantizer.spec for n in names}
        splits = [ctx.split(d.calls) for d in datas]
        n_train = [len(t) for t, _ in splits]
        train = StackedCalls([UnitData(t) for t, _ in splits], dev)
        judge = StackedCalls([UnitData(h or t) for t, h in splits], dev)

        def slot_error(rows, k: int, wq, taps=None):
            x, y, w, mask, n_rows = rows.slot(torch.full((E,), k, dtype=torch.long, device=dev))
            out = cls.grouped_forward(members, x, w, wq, taps)
            diff = (out.float() - y.float()) * mask
            return diff.square().sum(dim=(1, 2)), n_rows * out.shape[-1]

        @torch.no_grad()
        def mse(rows, wq) -> torch.Tensor:       # [E] float64, unit_mse per expert
            total = torch.zeros(E, dtype=torch.float64, device=dev)
            count = torch.zeros(E, dtype=torch.float64, device=dev)
            for k in range(rows.max_calls):
                se, n = slot_error(rows, k, wq)
                total += se.double()
                count += n.double()
            return total / count.clamp(min=1)

        def fq(clips: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
            """The stacked weights fake-quantized under ``clips`` (the learned clips: an int grid
            reuses its block ranges, ``formats.PreparedIntWeight``; the same numbers)."""
            return {n: (prepared[n].fake_quant(ste_clamp(clips[n], CLIP_MIN, 1.0)) if n in prepared else
                        formats.fake_quant(W[n], specs[n], ste_clamp(clips[n], CLIP_MIN, 1.0))) for n in names}

        with torch.no_grad():
            W = {n: torch.stack([l.weight.detach().to(dev) for l in lins[n]]) for n in names}   # [E, out, in]
            prepared = {n: formats.PreparedIntWeight(W[n], specs[n]) for n in names
                        if specs[n].format == "int" and self.epochs}
            # the incoming state, each leaf through its own quantizer (fixed grid, clip), as apply
            inc_wq = {n: torch.stack([l.weight_quantizer(l.weight.detach()).to(dev) for l in lins[n]]) for n in names}
            incoming = {n: [(l.weight_quantizer.clip, l.weight_quantizer.fixed_scale,
                             l.weight_quantizer.fixed_zero_point) for l in lins[n]] for n in names}
            inc_loss = mse(judge, inc_wq)
            del inc_wq
            for n in names:                      # candidates start from the weight's own scales
                for l in lins[n]:
                    l.weight_quantizer.clear_fixed_qparams()
                    l.invalidate_cache()
            # the state after that: a clip an earlier algorithm left stays (1: none, the same numbers)
            base_c = {n: (torch.stack([(l.weight_quantizer.effective_clip().detach() if l.weight_quantizer.clip
                                        is not None else torch.ones(l.weight_quantizer.scale_shape(l.weight)))
                                       .to(dev, torch.float32) for l in lins[n]])
                          if any(l.weight_quantizer.clip is not None for l in lins[n]) else None)
                      for n in names}
            base_wq = {n: formats.fake_quant(W[n], specs[n], base_c[n]) for n in names}
            base_train = mse(train, base_wq)
            ones = {n: torch.ones((E, *formats.scale_shape(W[n].shape[1:], specs[n])), device=dev) for n in names}
            start_c = {n: (base_c[n] if base_c[n] is not None else ones[n]) for n in names}
            start_train = base_train
            grid_kept = torch.zeros(E, dtype=torch.bool, device=dev)
            grid_c, grid_train, grid_judge = None, None, None
            if self.grid:
                energy = _input_energy(cls, members, train, base_wq, names, E, dev)
                grid_c = {n: grid_clip(W[n], specs[n], energy[n], self.grid, self.grid_min) for n in names}
                grid_train = mse(train, {n: formats.fake_quant(W[n], specs[n], grid_c[n]) for n in names})
                grid_kept = grid_train <= base_train          # else the proxy misled: start from RTN
                grid_judge = mse(judge, {n: formats.fake_quant(W[n], specs[n], grid_c[n]) for n in names})
                keep = grid_kept.reshape(E, *[1] * (grid_c[names[0]].dim() - 1))
                start_c = {n: torch.where(keep, grid_c[n], start_c[n]) for n in names}
                start_train = torch.where(grid_kept, grid_train, base_train)
            del base_wq

        learned = None
        if self.epochs:
            learned = self._adam(start_c, start_train, n_train, train, slot_error, mse, fq, E, dev)
            learned["judge"] = mse(judge, fq(learned["clip"]))

        # per expert: the best candidate on its judge slice, ties to the earlier one
        cand = [("incoming", inc_loss)]
        if self.grid:
            cand.append(("grid", torch.where(grid_kept, grid_judge, torch.full_like(grid_judge, float("inf")))))
        if learned is not None:
            cand.append(("learned", learned["judge"]))
        host = {name: loss.tolist() for name, loss in cand}
        host_base, kept = base_train.tolist(), grid_kept.tolist()
        host_grid = grid_train.tolist() if grid_train is not None else None
        host_epoch = learned["epoch"].tolist() if learned is not None else None
        host_lt = learned["train"].tolist() if learned is not None else None
        results = []
        with torch.no_grad():
            for e, (u, m) in enumerate(zip(units, members)):
                avail = [(name, host[name][e]) for name, _ in cand if not (name == "grid" and not kept[e])]
                choice, loss = avail[0]
                for name, l in avail[1:]:
                    if l < loss:
                        choice, loss = name, l
                for n in names:
                    _set_choice(lins[n][e], choice, incoming[n][e],
                                None if choice == "incoming" else (grid_c if choice == "grid" else learned["clip"])[n][e])
                t, h = splits[e]
                stats: dict[str, Any] = {"holdout_calls": len(h), "train_calls": len(t)}
                if self.grid:
                    stats["grid_train_loss"], stats["rtn_train_loss"] = host_grid[e], host_base[e]
                    stats["grid_kept"] = bool(kept[e])
                if learned is not None:
                    stats["learned_epoch"], stats["learned_train_loss"] = int(host_epoch[e]), host_lt[e]
                stats["choice"], stats["judge_loss"] = choice, loss
                stats["candidates"] = dict(avail)
                if self.activation:
                    stats["activation"] = self._activation(m, t, h or t, dev)
                stats["batched_experts"] = E
                results.append(stats)
        return results

    def _adam(self, start_c, start_train, n_train, train, slot_error, mse, fq, E, dev) -> dict[str, Any]:
        """solve_unit's learned clipping on every expert of the chunk: per epoch each expert
        steps once per training call of its own (Adam, torch.optim.Adam's update; an expert
        whose calls are used up waits, moments and step count untouched), then its training
        MSE; the best epoch is kept per expert (strict: ties keep the start)."""
        b1, b2 = _ADAM_BETAS
        P = {n: c.detach().clone().requires_grad_(True) for n, c in start_c.items()}
        m1 = {n: torch.zeros_like(p) for n, p in P.items()}
        m2 = {n: torch.zeros_like(p) for n, p in P.items()}
        best_c = {n: p.detach().clone() for n, p in P.items()}
        best_loss = start_train.clone()
        best_epoch = torch.zeros(E, dtype=torch.long, device=dev)
        steps = [0] * E
        shape = lambda p: (E, *[1] * (p.dim() - 1))   # noqa: E731
        for epoch in range(1, self.epochs + 1):
            for k in range(train.max_calls):
                active = [k < n for n in n_train]
                for e in range(E):
                    steps[e] += active[e]
                # per expert scalars on the host, as torch.optim.Adam computes them
                s = [max(st, 1) for st in steps]
                step_size = torch.tensor([self.lr / (1 - b1 ** st) for st in s], dtype=torch.float32, device=dev)
                bc2 = torch.tensor([(1 - b2 ** st) ** 0.5 for st in s], dtype=torch.float32, device=dev)
                on = torch.tensor(active, device=dev)
                for p in P.values():
                    p.grad = None
                se, n = slot_error(train, k, fq(P))
                (se / n.clamp(min=1)).sum().backward()   # each expert's gradient is its own MSE's
                with torch.no_grad():
                    for name, p in P.items():
                        g, a = p.grad, on.reshape(shape(p))
                        m1[name] = torch.where(a, m1[name].lerp(g, 1 - b1), m1[name])
                        m2[name] = torch.where(a, m2[name] * b2 + (1 - b2) * (g * g), m2[name])
                        denom = m2[name].sqrt() / bc2.reshape(shape(p)) + _ADAM_EPS
                        p.sub_(torch.where(a, step_size.reshape(shape(p)) * (m1[name] / denom), 0.0))
            with torch.no_grad():
                loss = mse(train, fq(P))
                better = loss < best_loss
                best_loss = torch.where(better, loss, best_loss)
                best_epoch = torch.where(better, torch.full_like(best_epoch, epoch), best_epoch)
                for name, p in P.items():
                    best_c[name] = torch.where(better.reshape(shape(p)), p.detach(), best_c[name])
        return {"clip": best_c, "train": best_loss, "epoch": best_epoch}


def _input_energy(cls, members, train, base_wq, names, E: int, dev) -> dict[str, torch.Tensor]:
    """E[x^2] per input channel of every projection of the stacked experts, over the training
    rows, in the base state: {name: [E, 1, in]} (the grid search's importance)."""
    acc = {n: None for n in names}
    count = torch.zeros(E, dtype=torch.float32, device=dev)
    for k in range(train.max_calls):
        taps: dict[str, torch.Tensor] = {}
        x, _, w, _, n_rows = train.slot(torch.full((E,), k, dtype=torch.long, device=dev))
        cls.grouped_forward(members, x, w, base_wq, taps)
        for n in names:
            s = taps[n].float().square().sum(1)          # padding rows are zeros
            acc[n] = s if acc[n] is None else acc[n] + s
        count += n_rows
    return {n: (acc[n] / count[:, None])[:, None, :] for n in names}


def _set_choice(lin, choice: str, incoming: tuple, value: torch.Tensor | None) -> None:
    """One expert's projection set to its chosen candidate: the incoming state (clip, fixed
    grid) as it was, or the chosen clip ``value``."""
    wq = lin.weight_quantizer
    if choice == "incoming":
        clip, fs, fz = incoming
        wq.clip, wq.fixed_scale, wq.fixed_zero_point = clip, fs, fz
    else:
        wq.clip = nn.Parameter(value.detach().to(lin.weight.device, torch.float32).clone(), requires_grad=False)
    lin.invalidate_cache()
