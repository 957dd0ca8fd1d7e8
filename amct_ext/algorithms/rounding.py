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

Only integer grids have a rounding offset (fp8 / MX weights are skipped).

What is kept (``fold_grid``, default on): the offset only chooses codes, so a leaf whose offset
moved is folded into the state GPTQ leaves -- the weight replaced by its fake-quant value, the
grid (scale, zero point) fixed -- wherever that reproduces the same fake-quant weight bit for
bit (``fold_to_fixed_grid``). Its files are then the codes (``{leaf}.weight_codes``: one byte, or
<= 4-bit codes packed in int32) and the scales, instead of a float32 offset per weight (a
V4-Flash layer's 256 experts: ~26 GB of offsets, held on the device until the layer is written).
Unfolded (``fold_grid=false``, or a leaf the check refuses) the state is saved as
``{leaf}.weight_quantizer.round_offset`` (float32, the weight's shape) and ``.clip``.

The routed experts of a layer are solved together (``group_kinds``), ``expert_chunk`` at a time:
their weights, offsets and clips stacked [E, out, in], every step one bmm-batched forward of
every expert on its own call (``t mod n_e``; rows padded with zeros, which add no error), the
loss the sum of the experts' own MSEs (so each expert's gradient is its own), the best state
tracked per expert. The same algorithm as one expert at a time -- a test holds the two to the
same offsets -- without 256 x ``iters`` small launch-bound steps (RESULTS §0.7). Where the
batched forward could not reproduce an expert (a per-tensor weight grid, a static or
per-tensor input quantizer, the model's ``grouped_forward_blocker``) the experts go one by one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import ConfigError
from ..quant import formats
from ..quant.quant_linear import QuantLinear
from ..quant.quantizers import CLIP_MIN
from ..pipeline.replay import call_sq_err as _sq_err, unit_mse, unit_seed
from .base import Algorithm, SolveContext, UnitData
from .recipe import register
from .stacked import StackedCalls as _StackedCalls, common_group_blocker, expert_call_blocker, expert_projections, solve_ready_in_chunks, ste_clamp as _ste_clamp


def _weight_leaves(module: nn.Module):
    """(leaf, weight) of every quantizer with an integer grid (QuantLinear, WoAQuant)."""
    out = []
    for m in module.modules():
        wq = getattr(m, "weight_quantizer", None)
        if wq is not None and getattr(m, "enabled", True) and wq.roundable:
            out.append((m, m.weight, wq))
    return out


@torch.no_grad()
def fold_to_fixed_grid(leaf: nn.Module) -> bool:
    """Replace ``leaf``'s weight by its fake-quant value under the learned offset and clip, and
    fix the grid those gave (``WeightQuantizer.set_fixed_qparams``; the offset and clip are
    dropped). Only where the folded leaf computes the same fake-quant weight bit for bit (a
    dequantized value must round back to its own code in the weight's dtype); returns whether
    it folded."""
    wq = leaf.weight_quantizer
    if wq.round_offset is None or not wq.roundable:
        return False
    w = leaf.weight
    d = formats.fixed_grid(w, wq.spec, wq.effective_clip(), wq.effective_round_offset())
    if d is None:
        return False
    zp = d.get("zero_point")
    w.copy_(formats.dequantize(d, wq.spec).to(w.dtype))
    wq.set_fixed_qparams(w, d["scale"], None if zp is None else zp.float())
    leaf.weight_replaced = True
    if isinstance(leaf, QuantLinear):
        leaf.invalidate_cache()
    return True


def _fold_leaves(leaves) -> int:
    """fold_to_fixed_grid on every leaf; returns how many folded."""
    return sum(fold_to_fixed_grid(leaf) for leaf in leaves)


def _invalidate(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, QuantLinear):
            m.invalidate_cache()


def learnable_state(leaves, learn_clip: bool, clip_min: float):
    """(offsets, clips, clip floors) of ``leaves`` (``_weight_leaves``), made trainable: each
    leaf's rounding offset (kept where an earlier run left one, else 0 = RTN) and, with
    ``learn_clip``, its clip factor. A clip starts where an earlier algorithm left it (hclip), and
    its floor is ``min(clip_min, that start)``: a step never pulls it back above where it began."""
    offsets, clips, clip_lo = [], [], []
    for _, w, wq in leaves:
        v = wq.init_round_offset(w)
        v.requires_grad_(True)
        offsets.append(v)
        if learn_clip:
            c = wq.init_clip(w)
            if c is not None:
                clip_lo.append(min(clip_min, float(c.min())))
                c.requires_grad_(True)
                clips.append(c)
    return offsets, clips, clip_lo


@torch.no_grad()
def clamp_learnables(offsets, clips, clip_lo) -> None:
    """After a step: offsets back into [-0.5, 0.5], clips into [floor, 1]."""
    for v in offsets:
        v.clamp_(-0.5, 0.5)
    for c, lo in zip(clips, clip_lo):
        c.clamp_(lo, 1.0)


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
    group_kinds: ClassVar[tuple[str, ...]] = ("expert",)
    iters: int = 200
    lr: float = 0.0
    learn_clip: bool = True
    clip_min: float = 0.5
    eval_every: int = 0
    # routed experts per batched solve: 16 Flash experts hold ~1.6 GB of fp32 offsets, the
    # same again in gradients and in the best state, plus the fake-quant intermediates
    expert_chunk: int = 16
    fold_grid: bool = True

    def check(self) -> None:
        if self.iters < 0:
            raise ConfigError(f"iters={self.iters}: must be >= 0")
        if self.lr < 0:
            raise ConfigError(f"lr={self.lr}: must be >= 0 (0 = 1 / iters)")
        if not CLIP_MIN <= self.clip_min <= 1.0:
            raise ConfigError(f"clip_min={self.clip_min}: must lie in [{CLIP_MIN}, 1]")
        if self.eval_every < 0:
            raise ConfigError(f"eval_every={self.eval_every}: must be >= 0")
        if self.expert_chunk < 1:
            raise ConfigError(f"expert_chunk={self.expert_chunk}: must be >= 1 (1 = one expert at a time)")

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
        offsets, clips, clip_lo = learnable_state(leaves, self.learn_clip, self.clip_min)
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
                clamp_learnables(offsets, clips, clip_lo)
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
            folded = _fold_leaves([leaf for leaf, _, _ in leaves]) if self.fold_grid else 0
            return {"loss_before": loss_before, "loss_after": best_loss, "best_step": best_step,
                    "n_offsets": sum(v.numel() for v in offsets), "n_nonzero_offsets": changed,
                    "folded_leaves": folded}
        finally:
            for p in params:
                p.requires_grad_(False)
                p.grad = None
            for p in frozen:
                p.requires_grad_(True)
            _invalidate(module)
            module.train(was_training)

    # ------------------------------------------------------------------ routed experts, batched
    def _group_blocker(self, units, datas) -> str | None:
        """Why the experts cannot be solved batched (None: they can)."""
        why = common_group_blocker(self.expert_chunk, units)
        if why:
            return why
        for name, lins in expert_projections(units).items():
            spec = lins[0].weight_quantizer.spec
            for lin in lins:
                wq = lin.weight_quantizer
                if not (getattr(lin, "enabled", True) and wq.roundable):
                    return f"{name} is not an enabled integer weight grid in every expert"
                if wq.spec != spec:
                    return f"{name}'s weight specs differ between experts"
                if wq.learnable != lins[0].weight_quantizer.learnable:
                    return f"{name}'s clip is learnable in some experts only"
                if lin.weight.shape != lins[0].weight.shape:
                    return f"{name}'s weight shapes differ between experts"
            if spec.granularity == "tensor":
                return "a per-tensor weight scale is not per expert once stacked"
        return expert_call_blocker(datas)

    def apply_group(self, units, datas, ctx: SolveContext) -> list[dict[str, Any]]:
        why = self._group_blocker(units, datas)
        ready = [i for i, (u, d) in enumerate(zip(units, datas)) if len(d) and _weight_leaves(u.module)]
        if why is not None or len(ready) < 2:
            return [self.apply(u, d, ctx) for u, d in zip(units, datas)]
        # the rest one by one (the per-expert skip message), the ready experts in stacked chunks
        return solve_ready_in_chunks(units, datas, ready, self.expert_chunk, lambda u, d: self.apply(u, d, ctx),
                                     lambda us, ds: self._solve_chunk(us, ds, ctx))

    def _solve_chunk(self, units, datas, ctx: SolveContext) -> list[dict[str, Any]]:
        """AutoRound on ``len(units)`` experts at once (see the module doc)."""
        dev = ctx.device
        members = [u.module for u in units]
        cls = type(members[0])
        lins = expert_projections(units)
        names, E = tuple(lins), len(members)
        specs = {n: lins[n][0].weight_quantizer.spec for n in names}
        # the members' own parameters first (as apply makes them): they receive the result
        own_v = {n: [l.weight_quantizer.init_round_offset(l.weight) for l in lins[n]] for n in names}
        own_c = {n: [l.weight_quantizer.init_clip(l.weight) for l in lins[n]] if self.learn_clip else [None] * E
                 for n in names}
        with torch.no_grad():
            W = {n: torch.stack([l.weight.detach().to(dev) for l in lins[n]]) for n in names}   # [E, out, in]
            V = {n: torch.stack([v.detach().to(dev) for v in own_v[n]]).clone() for n in names}
            C = {n: torch.stack([c.detach().to(dev) for c in own_c[n]]).clone() for n in names
                 if own_c[n][0] is not None}
            # not learned: a clip an earlier algorithm left still shapes the grid, as in apply
            # (a member without one: factors of 1, the same numbers)
            fixed_c = {}
            for n in names:
                if n not in C and any(l.weight_quantizer.clip is not None for l in lins[n]):
                    fixed_c[n] = torch.stack([
                        (l.weight_quantizer.effective_clip() if l.weight_quantizer.clip is not None else
                         torch.ones(l.weight_quantizer.scale_shape(l.weight))).detach().to(dev, torch.float32)
                        for l in lins[n]])
            # per expert and projection, as apply: the range scale may stay below clip_min
            # where an earlier algorithm put it
            lo = {n: torch.clamp(c.reshape(E, -1).amin(1), max=self.clip_min).reshape(E, *[1] * (c.dim() - 1))
                  for n, c in C.items()}
        params = list(V.values()) + list(C.values())
        for p in params:
            p.requires_grad_(True)
        rows = _StackedCalls(datas, dev)

        def weights_q() -> dict[str, torch.Tensor]:
            wq = {}
            for n in names:
                clip = _ste_clamp(C[n], CLIP_MIN, 1.0) if n in C else fixed_c.get(n)
                wq[n] = formats.fake_quant(W[n], specs[n], clip, _ste_clamp(V[n], -0.5, 0.5))
            return wq

        def slot_error(k: torch.Tensor, wq) -> tuple[torch.Tensor, torch.Tensor]:
            """Per expert (squared error fp32, elements) of its call ``k[e]`` (lengths 0 past its last)."""
            x, y, w, mask, n_rows = rows.slot(k)
            out = cls.grouped_forward(members, x, w, wq)
            diff = (out.float() - y.float()) * mask
            return diff.square().sum(dim=(1, 2)), n_rows * out.shape[-1]

        @torch.no_grad()
        def full_mse() -> torch.Tensor:
            wq = weights_q()
            total = torch.zeros(E, dtype=torch.float64, device=dev)
            count = torch.zeros(E, dtype=torch.float64, device=dev)
            for k in range(rows.max_calls):
                se, n = slot_error(torch.full((E,), k, dtype=torch.long, device=dev), wq)
                total += se.double()
                count += n.double()
            return total / count.clamp(min=1)

        try:
            loss_before = full_mse()
            best_loss = loss_before.clone()
            best_step = torch.zeros(E, dtype=torch.long, device=dev)
            best = [p.detach().clone() for p in params]
            lr0 = self.lr or (1.0 / max(self.iters, 1))
            every = self.eval_every or max(self.iters // 4, 1)
            for t in range(self.iters):
                for p in params:
                    p.grad = None
                k = torch.remainder(torch.full((E,), t, dtype=torch.long, device=dev), rows.n_calls)
                se, n = slot_error(k, weights_q())
                (se / n.clamp(min=1)).sum().backward()   # each expert's gradient is its own MSE's
                signsgd_step(params, lr0 * (1.0 - t / self.iters))
                with torch.no_grad():
                    for v in V.values():
                        v.clamp_(-0.5, 0.5)
                    for n_, c in C.items():
                        torch.maximum(c.clamp_(max=1.0), lo[n_], out=c)
                if (t + 1) % every == 0 or t + 1 == self.iters:
                    loss = full_mse()
                    better = loss < best_loss                  # strict: ties keep the earlier state
                    best_loss = torch.where(better, loss, best_loss)
                    best_step = torch.where(better, torch.full_like(best_step, t + 1), best_step)
                    with torch.no_grad():
                        for b, p in zip(best, params):
                            b.copy_(torch.where(better.reshape(E, *[1] * (p.dim() - 1)), p.detach(), b))
            before, after, steps = loss_before.tolist(), best_loss.tolist(), best_step.tolist()
            results = []
            with torch.no_grad():
                bests = dict(zip([("v", n) for n in V] + [("c", n) for n in C], best))
                for e in range(E):
                    changed, n_off = 0, 0
                    for n in names:
                        v = own_v[n][e]
                        v.copy_(bests[("v", n)][e].to(v.device))
                        if n in C:
                            own_c[n][e].copy_(bests[("c", n)][e].to(own_c[n][e].device))
                        n_off += v.numel()
                        nz = int((v != 0).sum())
                        changed += nz
                        if nz == 0:       # an all-zero offset is RTN: nothing to save
                            lins[n][e].weight_quantizer.round_offset = None
                    # folded expert by expert: the chunk's offsets are freed before the next chunk
                    folded = _fold_leaves([lins[n][e] for n in names]) if self.fold_grid else 0
                    results.append({"loss_before": before[e], "loss_after": after[e], "best_step": steps[e],
                                    "n_offsets": n_off, "n_nonzero_offsets": changed, "batched_experts": E,
                                    "folded_leaves": folded})
            return results
        finally:
            for p in params:
                p.grad = None
            for m in members:
                _invalidate(m)
