"""Block-wise SignRound (AutoRound over a whole decoder layer, as Intel's auto-round runs it).

``autoround`` (rounding.py) tunes each unit (an attention, an expert) against that unit's own
output. ``blockround`` tunes every quantized leaf of a decoder layer TOGETHER against the
layer's output, so an error one unit leaves can be compensated by another, and the router, the
norms and the residual path between them are inside the loss:

    params: every integer leaf's rounding offset V (codes ``round(w / scale + V)``, V = 0 is
            what the unit algorithms left: RTN, or hclip's clip) and, with ``learn_clip``, its
            per-block clip factor (the range scale of min and max)
    for step t < iters:  S_t = the next ``batch`` calibration samples (a seeded permutation
                               per epoch, as auto-round draws its batches)
                         loss = sum_{k in S_t} ||layer_q(x_k) - y_k||^2 / numel
                         p   -= lr_t * sign(dloss/dp)       lr_t = lr * (1 - t / iters)
                         V in [-0.5, 0.5], clip in [min(clip_min, clip_0), 1]
    every ``eval_every`` steps: the MSE over every sample; the best state is kept (the start
    state included, so the layer never ends worse on its calibration data than it began;
    ``keep_best=false``: only the start and the end are compared, for memory)

``x_k``: the layer's inputs as the run feeds them (the quantized predecessors' outputs with
``--propagate quant``). ``y_k`` (``target``):
- ``float_model`` (default): the FLOAT MODEL's output of this layer, i.e. the float layer on the
  float model's own inputs. With ``propagate=quant`` the workflow carries that float stream beside
  the quantized one; the layer then learns to undo part of its predecessors' error. This is
  auto-round's ``enable_quanted_input`` (its student sees the quantized inputs, its target is
  the float block on the float inputs).
- ``float_layer``: the float layer on the same inputs ``x_k`` (the target every unit algorithm uses).
With ``propagate=float`` the two are the same.

What is kept: as ``autoround``, a leaf whose offset moved is folded into a fixed grid (the weight
replaced by its fake-quant value, scale and zero point fixed; ``rounding.fold_to_fixed_grid``)
wherever that reproduces the same fake-quant weight bit for bit, so export writes codes and
scales; otherwise the offset and clip are saved.

Cost: every step is a forward and a backward of the whole layer on ``batch`` samples, with the
fake-quant weights recomputed each step; the routed experts run one by one (the grouped MoE path
holds detached stacks). This is a `--recipe best` algorithm, minutes a layer at real size
(RESULTS §3.4).
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from ..pipeline.replay import output_tensor
from ..quant.quantizers import CLIP_MIN
from .base import Algorithm, BlockData, Needs, SolveContext, UnitData
from .recipe import register
from .rounding import _fold_leaves, _invalidate, _weight_leaves, clamp_learnables, learnable_state

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _recomputed(modules):
    """Each module's forward under activation checkpointing while gradients are on: its
    fake-quant weights and intermediates are recomputed in the backward instead of held (a
    V4-Flash layer's 256 experts would otherwise keep several fp32 copies of 6.4 G weights)."""
    patched = []
    for m in modules:
        if "forward" in m.__dict__:     # already an instance attribute: leave it alone
            continue
        f = m.forward

        def run(*args, _f=f, **kwargs):
            if torch.is_grad_enabled():
                return checkpoint(_f, *args, use_reentrant=False, **kwargs)
            return _f(*args, **kwargs)

        m.forward = run
        patched.append(m)
    try:
        yield
    finally:
        for m in patched:
            del m.forward


@register
@dataclass
class BlockRound(Algorithm):
    """SignSGD on rounding offsets (+ clip factors) of a whole layer against its output.

    ``lr``: 0 means 1 / iters (auto-round's rule). ``eval_every``: 0 means max(iters // 10, 1).
    ``batch``: calibration samples (stream entries: ``--batch-size`` windows each) per step.
    ``recompute``: activation checkpointing per unit (the memory of a real-size layer; same numbers)."""

    name: ClassVar[str] = "blockround"
    solves_block: ClassVar[bool] = True
    iters: int = 200
    lr: float = 0.0
    batch: int = 8
    learn_clip: bool = True
    clip_min: float = 0.5
    eval_every: int = 0
    target: Literal["float_model", "float_layer"] = "float_model"
    fold_grid: bool = True
    # on by default: without it a real-size layer's fake-quant intermediates do not fit (the
    # tiny model pays ~1/3 more time for it)
    recompute: bool = True
    #: False: no intermediate evaluation and no copy of a later state, the end state kept unless
    #: it is worse than the start (a real-size layer's memory: one copy of its offsets less)
    keep_best: bool = True

    def settings(self) -> dict[str, Any]:
        # recompute changes where intermediates live, not one number (test_block_rounding): a
        # run may resume with it switched, and it is not part of the folder's fingerprint
        return {k: v for k, v in super().settings().items() if k != "recompute"}

    def check(self) -> None:
        if self.iters < 0:
            raise ConfigError(f"iters={self.iters}: must be >= 0")
        if self.lr < 0:
            raise ConfigError(f"lr={self.lr}: must be >= 0 (0 = 1 / iters)")
        if self.batch < 1:
            raise ConfigError(f"batch={self.batch}: must be >= 1")
        if not CLIP_MIN <= self.clip_min <= 1.0:
            raise ConfigError(f"clip_min={self.clip_min}: must lie in [{CLIP_MIN}, 1]")
        if self.eval_every < 0:
            raise ConfigError(f"eval_every={self.eval_every}: must be >= 0")
        if self.target not in ("float_model", "float_layer"):
            raise ConfigError(f"target={self.target!r}: must be 'float_model' or 'float_layer'")

    def needs(self) -> Needs:
        # the unit capture serves the unit algorithms before it; this one reads the layer's
        # inputs and outputs, which the workflow has anyway
        return Needs(calls=False, statistics=False)

    def float_model_targets(self, propagate: str) -> bool:
        return self.target == "float_model" and propagate == "quant"

    def apply(self, unit, data: UnitData, ctx: SolveContext) -> dict[str, Any]:
        raise ConfigError("blockround tunes a whole layer: it runs through the workflow's block stage, "
                          "not on a single unit")

    def apply_block(self, data: BlockData) -> dict[str, dict[str, Any]]:
        dev = data.device
        n = len(data.inputs)
        if len(data.states) != n or len(data.targets) != n:
            raise ValueError(f"blockround: {n} inputs, {len(data.states)} states, {len(data.targets)} targets")
        per_unit = {u.name: _weight_leaves(u.module) for u in data.units}
        leaves = [lf for lfs in per_unit.values() for lf in lfs]
        if not leaves:
            return {u.name: {"skipped": "no integer weight quantizer with scales from the weight"} for u in data.units}
        if not n:
            return {u.name: {"skipped": "no calibration samples"} for u in data.units}
        modules = [u.module for u in data.units]
        frozen = [p for m in modules for p in m.parameters() if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        was_training = [m.training for m in modules]
        for m in modules:
            m.eval()
        offsets, clips, clip_lo = learnable_state(leaves, self.learn_clip, self.clip_min)
        params = offsets + clips
        gen = torch.Generator().manual_seed(data.seed)

        def group_error(ks: list[int]) -> tuple[torch.Tensor, int]:
            """(sum of squared errors in fp32, elements) of samples ``ks``: one forward of them
            all where the model concatenates samples (``data.concat``), else one forward each."""
            joined = data.concat([data.inputs[k] for k in ks], [data.states[k] for k in ks]) \
                if (data.concat is not None and len(ks) > 1) else None
            if joined is None:
                errs = [group_error_of(data.inputs[k], data.states[k], data.targets[k]) for k in ks]
                return sum(e for e, _ in errs), sum(c for _, c in errs)
            return group_error_of(*joined, torch.cat([data.targets[k].to(dev) for k in ks]))

        def group_error_of(x, state, target) -> tuple[torch.Tensor, int]:
            out = output_tensor(data.forward(x, state))
            diff = out.float() - target.to(dev).float()
            return diff.square().sum(), diff.numel()

        @torch.no_grad()
        def full_mse() -> float:
            # the parameters frozen for the pass: each leaf's fake-quant weight is computed once
            # and cached for every sample (the cache key holds no offset: invalidated around it)
            for p in params:
                p.requires_grad_(False)
            for m in modules:
                _invalidate(m)
            try:
                total, count = 0.0, 0
                for k0 in range(0, n, self.batch):
                    se, c = group_error(list(range(k0, min(k0 + self.batch, n))))
                    total += float(se.double().item())
                    count += c
            finally:
                for m in modules:
                    _invalidate(m)
                for p in params:
                    p.requires_grad_(True)
            return total / max(count, 1)

        # the SignSGD step of each parameter as soon as its gradient is complete (one backward a
        # step: autograd accumulates a parameter's contributions first); its gradient is then
        # freed, so a layer's gradients never all exist at once
        lr_now = [0.0]

        def step(p: torch.Tensor) -> None:
            with torch.no_grad():
                p.sub_(lr_now[0] * torch.sign(p.grad))
            p.grad = None

        hooks = []

        def batches():
            while True:
                yield from torch.randperm(n, generator=gen).tolist()

        t_start = time.perf_counter()
        try:
            loss_before = full_mse()
            log.info("blockround layer %s: %d leaves, %d samples, start MSE %.6g (%.1f s)", data.layer_idx,
                     len(leaves), n, loss_before, time.perf_counter() - t_start)
            best_loss, best_step = loss_before, 0
            # the state to return to; an all-zero start offset (RTN) is kept as None (restored by
            # zeroing): a fresh V4-Flash layer's offsets would be a 26 GB copy of zeros
            best = [None if (k < len(offsets) and not bool(p.any())) else p.detach().clone()
                    for k, p in enumerate(params)]
            lr0 = self.lr or (1.0 / max(self.iters, 1))
            # keep_best=False: the end state against the start only (no copy of a later state)
            every = (self.eval_every or max(self.iters // 10, 1)) if self.keep_best else max(self.iters, 1)
            order = batches()
            hooks = [p.register_post_accumulate_grad_hook(step) for p in params]
            for t in range(self.iters):
                lr_now[0] = lr0 * (1.0 - t / self.iters)
                ks = [next(order) for _ in range(min(self.batch, n))]
                with _recomputed(modules) if self.recompute else contextlib.nullcontext():
                    se, count = group_error(ks)
                    # one backward for the batch: the mean over its elements
                    (se / count).backward()
                    del se
                clamp_learnables(offsets, clips, clip_lo)
                if (t + 1) % every == 0 or t + 1 == self.iters:
                    loss = full_mse()
                    log.info("blockround layer %s: step %d / %d, MSE %.6g (%.1f s)", data.layer_idx, t + 1,
                             self.iters, loss, time.perf_counter() - t_start)
                    if loss < best_loss:   # strict: ties keep the earlier state
                        best_loss, best_step = loss, t + 1
                        with torch.no_grad():   # into the same buffers: one copy of the state, not two
                            for k, p in enumerate(params):
                                if best[k] is None:
                                    best[k] = p.detach().clone()
                                else:
                                    best[k].copy_(p)
            with torch.no_grad():
                for p, b in zip(params, best):
                    if b is None:
                        p.zero_()
                    else:
                        p.copy_(b)
            out = {}
            for u in data.units:
                lfs = per_unit[u.name]
                changed = sum(int((wq.round_offset != 0).sum()) for _, _, wq in lfs if wq.round_offset is not None)
                n_off = sum(w.numel() for _, w, _ in lfs)
                for _, _, wq in lfs:   # an all-zero offset is the start state: nothing to save
                    wq.round_offset.requires_grad_(False)
                    if not bool(wq.round_offset.any()):
                        wq.round_offset = None
                for _, _, wq in lfs:
                    if wq.clip is not None:
                        wq.clip.requires_grad_(False)
                folded = _fold_leaves([leaf for leaf, _, _ in lfs]) if (self.fold_grid and lfs) else 0
                out[u.name] = {"layer_loss_before": loss_before, "layer_loss_after": best_loss,
                               "best_step": best_step, "n_offsets": n_off, "n_nonzero_offsets": changed,
                               "folded_leaves": folded, "layer_leaves": len(leaves)}
            return out
        finally:
            for h in hooks:
                h.remove()
            for p in params:
                p.requires_grad_(False)
                p.grad = None
            for p in frozen:
                p.requires_grad_(True)
            for m, tr in zip(modules, was_training):
                _invalidate(m)
                m.train(tr)
