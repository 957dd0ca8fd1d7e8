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
fake-quant weights recomputed each step. A model whose MoE offers ``attach_leaf_stacks`` (V4's)
has its routed experts tuned through stacked state (``quant/leaf_stack.py``): the offsets and
clips of a chunk of experts are one tensor each (every leaf's own state a view into it), a
chunk's fake-quant weights come from one op (on CUDA one Triton kernel forward, one backward:
``runtime/fused_rounding.py``) and its projections from grouped GEMMs, and the offsets take their
SignSGD step inside that backward (no gradient tensor, no separate passes over them). The same
numbers as every expert run as its own module (tests/test_grouped_block_rounding.py, float64).
``offset_dtype=float16`` halves the largest state (a V4-Flash layer: 12.6 instead of 24.6 GiB).
Each step's samples are copied to the device during the step before, on a side stream
(``prefetch``). A V4-Flash layer: 0.40 s a step on one H200, 51.4 GiB device peak (RESULTS,
block-rounding speed).

Where a layer's experts and their offsets do not fit the device at once (V4-Pro: 94.7 GiB), they
are tuned in ``turns`` (a model's ``begin_leaf_turns``; V4's in ``expert_turns.py``): turn j's
experts on the device with their state for its share of the steps, every other expert at its
current fake-quant value decoded from integer codes, the other units stepping throughout; the
end is compared with the start once, and the experts end folded into fixed grids. Each expert
then gets ``iters / turns`` steps: a quality price (results §1b), paid only where memory binds.
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import torch
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError, DeviceMemoryError
from ..runtime import device as devmod
from ..pipeline.replay import output_tensor
from ..quant.leaf_stack import SignStep, signsgd_
from ..quant.quantizers import CLIP_MIN
from .base import Algorithm, BlockData, Needs, SolveContext, UnitData, device_memory_error
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


#: BlockRound fields that move intermediates between memory and recomputation, never a number
MEMORY_ONLY_SETTINGS = ("recompute", "recompute_units", "hold_gb", "chunk_gb", "prefetch")

#: "STEP:PATH": a torch.profiler table of that step (0-based) written to PATH (benchmarks/)
PROFILE_ENV = "AMCT_PROFILE_BLOCKROUND"


def _profile_request() -> tuple[int, str | None]:
    value = os.environ.get(PROFILE_ENV, "")
    if not value:
        return -1, None
    step, _, path = value.partition(":")
    if not step.isdigit() or not path:
        raise ConfigError(f"{PROFILE_ENV}={value!r}: expected STEP:PATH, e.g. 5:/tmp/step5.txt")
    return int(step), path


@contextlib.contextmanager
def _maybe_profiled(on: bool, dev, path: str | None):
    """One step under torch.profiler, its kernel table written to ``path`` (device time first),
    then the same ops split by input shape (which tensors the time goes to)."""
    if not on:
        yield
        return
    from torch.profiler import profile

    devmod.synchronize(dev)
    with profile(activities=devmod.profiler_activities(dev), record_shapes=True) as prof:
        yield
        devmod.synchronize(dev)
    sort = "self_device_time_total" if dev.type != "cpu" else "self_cpu_time_total"
    by_op = prof.key_averages().table(sort_by=sort, row_limit=60, max_name_column_width=90)
    by_shape = prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=80,
                                                                  max_name_column_width=60, max_shapes_column_width=90)
    Path(path).write_text(by_op + "\n\nby input shape\n" + by_shape)


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
    #: with ``recompute``: also checkpoint the layer's other units (attention, shared expert).
    #: Off by default: their intermediates are small beside the experts' (a V4-Flash layer: +2.5
    #: GiB device peak) and recomputing them cost 17 % of a step (H100, results/block-rounding.md)
    recompute_units: bool = False
    #: with ``recompute``: device memory (GiB) for routed-expert chunks run WITHOUT checkpointing,
    #: the first chunks whose fake-quant weights fit it (0: every chunk recomputed). Trades the
    #: device peak for the step time; the numbers are the same
    hold_gb: float = 0.0
    #: False: no intermediate evaluation and no copy of a later state, the end state kept unless
    #: it is worse than the start (a real-size layer's memory: one copy of its offsets less)
    keep_best: bool = True
    #: the routed experts through their model's stacked state (``attach_leaf_stacks``): fake-quant
    #: weights by one op a chunk, grouped GEMMs; False: every expert as its own module
    grouped: bool = True
    #: the stacked offsets' size a chunk (GiB): what a backward holds at once
    chunk_gb: float = 2.0
    #: the dtype of the routed experts' stacked offsets (float16: half the memory of a
    #: real-size layer's largest state; the per-leaf offsets of the other units stay float32)
    offset_dtype: Literal["float32", "float16"] = "float32"
    #: each step's samples copied to the device during the step before, on a side stream (one
    #: batch more on the device: 1 GiB on V4-Flash at batch 8; the same numbers)
    prefetch: bool = True
    #: the routed experts tuned in turns (a model's ``begin_leaf_turns``): 0 = as many as the
    #: device needs (1 where every expert's float weights and offsets fit WHOLE_SHARE of it: a
    #: V4-Flash layer; else each turn's within TURN_SHARE: a V4-Pro layer, 5 turns on an H200;
    #: where the device cannot hold them all even once, 64 / 80 GB, also the ``LEAN`` setting:
    #: 11 turns in 60 GiB, results §1b), N = N turns (the recipe's settings as written). A turn
    #: has its experts' float weights and offsets on the device and ``iters / turns`` steps (its
    #: own decaying schedule); the experts outside it run at their current fake-quant values,
    #: decoded from integer codes. The other units step through all ``iters`` steps. The layer
    #: ends folded into fixed grids, or as it began where its MSE did not improve
    turns: int = 0
    #: in turns: the samples of one forward (0: the whole ``batch``). Smaller splits a step's batch
    #: into parts whose gradients add up before the step (the offsets then take their step after
    #: the last part instead of inside the backward): a part's intermediates instead of the
    #: batch's, for the turn's gradients held between the parts
    micro_batch: int = 0

    #: the device share every expert's float weights and offsets may take for one turn (auto)
    WHOLE_SHARE: ClassVar[float] = 0.42
    #: the share one turn's experts take where they do not (the codes of all experts, the
    #: layer's other weights and the step's intermediates share the rest)
    TURN_SHARE: ClassVar[float] = 0.15
    #: what ``turns=0`` sets where the device cannot hold every expert's float weights and
    #: offsets even once (a V4-Pro layer on 64 / 80 GB): the steps' batch in parts, the other
    #: units recomputed, smaller expert chunks. The setting whose whole layer was measured in
    #: 60 GiB (results/block-rounding.md §1b); only the memory of the steps changes
    LEAN: ClassVar[dict[str, Any]] = {"micro_batch": 2, "recompute_units": True, "chunk_gb": 1.0}

    def settings(self) -> dict[str, Any]:
        # these change where intermediates live, not one number (test_block_rounding,
        # test_grouped_block_rounding): a run may resume with them switched, and they are not
        # part of the folder's fingerprint. ``turns=0`` (as many as the device needs) and
        # ``micro_batch=0`` (the whole batch) are left out as well, so a record of the default
        # reads as before the options; the count of turns a layer took is in its statistics
        return {k: v for k, v in super().settings().items()
                if k not in MEMORY_ONLY_SETTINGS and not (k in ("turns", "micro_batch") and v == 0)}

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
        if not self.chunk_gb > 0:
            raise ConfigError(f"chunk_gb={self.chunk_gb}: must be > 0")
        if not self.hold_gb >= 0:
            raise ConfigError(f"hold_gb={self.hold_gb}: must be >= 0 (0: every expert chunk recomputed)")
        if self.offset_dtype not in ("float32", "float16"):
            raise ConfigError(f"offset_dtype={self.offset_dtype!r}: must be 'float32' or 'float16'")
        if self.turns < 0:
            raise ConfigError(f"turns={self.turns}: must be >= 0 (0: as many as the device needs)")
        if self.turns > 1 and not self.fold_grid:
            raise ConfigError(f"turns={self.turns} needs fold_grid=true: between turns an expert's result is "
                              "held as its codes on a fixed grid, not as offsets")
        if self.micro_batch < 0:
            raise ConfigError(f"micro_batch={self.micro_batch}: must be >= 0 (0: the whole batch in one forward)")
        if self.micro_batch and self.turns == 1:
            raise ConfigError(f"micro_batch={self.micro_batch} splits the steps of the experts' turns; with turns=1 "
                              "use a smaller batch instead")
        if self.turns > 1 and self.keep_best:
            raise ConfigError(f"turns={self.turns} needs keep_best=false: in turns only the end is compared "
                              "with the start (the layer's whole state is never on the device to copy)")

    def needs(self) -> Needs:
        # the unit capture serves the unit algorithms before it; this one reads the layer's
        # inputs and outputs, which the workflow has anyway
        return Needs(calls=False, statistics=False)

    def float_model_targets(self, propagate: str) -> bool:
        return self.target == "float_model" and propagate == "quant"

    def block_bytes_per_weight(self, weight_bytes: int) -> float:
        # every tuned weight and its rounding offset live on the device together for the whole
        # stage (the clips, one a group, are left out: a lower bound), unless the experts can go
        # in turns (fold_grid, keep_best=false: turns=0 takes them where the device needs it).
        # Then the weights alone: every expert's float weights are back on the device at the
        # stage's end (a V4-Pro layer: 47.4 GiB; results §1b)
        if self.turns > 1 or (self.turns == 0 and self.can_turn):
            return weight_bytes
        return weight_bytes + (2 if self.offset_dtype == "float16" else 4)

    def memory_advice(self) -> str:
        if self.turns > 1 or (self.turns == 0 and self.can_turn):
            return ""   # the weights alone do not fit: no setting of this algorithm helps
        # the setting that lets the layer go in turns where the device needs it (results §1b)
        return f"; or let the experts go in turns where the device needs it: --algo {self.name}:keep_best=false"

    @property
    def can_turn(self) -> bool:
        """The experts can go in turns: their result is held as codes between turns (fold_grid)
        and only the end is compared with the start (keep_best=false)."""
        return self.fold_grid and not self.keep_best

    def _turn_need(self, hosts: list, data: BlockData) -> tuple[int, int | None]:
        """(bytes every expert's float weights and offsets take at once, the device's memory)."""
        need = sum(h.leaf_turn_bytes(getattr(torch, self.offset_dtype)) for h in hosts)
        return need, devmod.total_memory_bytes(data.device)

    def _turn_hosts(self, data: BlockData) -> list:
        """The layer's modules that can tune their leaves in turns (``begin_leaf_turns``)."""
        if not self.grouped or data.block is None:
            return []
        return [m for m in data.block.modules() if getattr(m, "begin_leaf_turns", None) is not None
                and m.leaf_turn_bytes(getattr(torch, self.offset_dtype)) > 0]

    def turns_for(self, data: BlockData) -> int:
        """How many turns this layer's experts take (``turns``; 0: what the device needs)."""
        hosts = self._turn_hosts(data)
        if not hosts:
            return 1
        if self.turns:
            return self.turns
        need, total = self._turn_need(hosts, data)
        if total is None or need <= self.WHOLE_SHARE * total:
            return 1
        if not self.can_turn:
            raise ConfigError(
                f"blockround, layer {data.layer_idx}: the experts' weights and offsets ({need / 2 ** 30:.1f} GiB) do "
                f"not fit {self.WHOLE_SHARE:.0%} of {data.device} at once, and tuning them in turns needs "
                "fold_grid=true and keep_best=false")
        return -(-need // int(self.TURN_SHARE * total))

    def settings_for(self, data: BlockData, n_turns: int) -> "BlockRound":
        """The settings the layer's turns run with: these, or with ``turns=0`` where the device
        cannot hold every expert's float weights and offsets even once, ``LEAN`` for what it
        leaves at its defaults (an explicit ``micro_batch``, or a smaller ``chunk_gb``, stays)."""
        if self.turns or n_turns <= 1:
            return self
        need, total = self._turn_need(self._turn_hosts(data), data)
        if total is None or need <= total:
            return self
        lean = replace(self, micro_batch=self.micro_batch or self.LEAN["micro_batch"],
                       recompute_units=self.LEAN["recompute_units"] or self.recompute_units,
                       chunk_gb=min(self.chunk_gb, self.LEAN["chunk_gb"]))
        log.info("blockround layer %s: the experts' weights and offsets (%.1f GiB) are more than %s holds "
                 "(%.1f GiB): %d turns, micro_batch=%d, recompute_units=%s, chunk_gb=%g", data.layer_idx,
                 need / 2 ** 30, data.device, total / 2 ** 30, n_turns, lean.micro_batch,
                 str(lean.recompute_units).lower(), lean.chunk_gb)
        return lean

    #: the fewest steps a turn measured to improve a V4-Pro layer (9: 0.0435 -> 0.0213; at 3 its
    #: MSE doubled and the layer kept its start state; results §1b)
    FEWEST_TURN_STEPS: ClassVar[int] = 9

    def _warn_few_turn_steps(self, layer_idx: int, n_turns: int) -> None:
        if self.iters // n_turns < self.FEWEST_TURN_STEPS:
            log.warning("blockround layer %s: %d steps over %d turns leave each expert %d; with fewer than %d a "
                        "V4-Pro layer ended worse than it began (kept as it began: rounding to nearest): raise "
                        "blockround:iters", layer_idx, self.iters, n_turns, self.iters // n_turns,
                        self.FEWEST_TURN_STEPS)

    def apply(self, unit, data: UnitData, ctx: SolveContext) -> dict[str, Any]:
        raise ConfigError("blockround tunes a whole layer: it runs through the workflow's block stage, "
                          "not on a single unit")

    def _attach_stacks(self, data: BlockData, sign_step: SignStep) -> tuple[list, list]:
        """(modules that stacked their leaves' state, the stacks), with ``grouped``: every module
        of the layer offering ``attach_leaf_stacks`` (the model's grouped path) stacks its leaves;
        their offsets take ``sign_step`` inside the backward."""
        if not self.grouped or data.block is None:
            return [], []
        hosts, stacks = [], []
        for m in data.block.modules():
            attach = getattr(m, "attach_leaf_stacks", None)
            if attach is None:
                continue
            got = attach(learn_clip=self.learn_clip, clip_min=self.clip_min,
                         chunk_bytes=int(self.chunk_gb * 2 ** 30), recompute=self.recompute,
                         offset_dtype=getattr(torch, self.offset_dtype), step=sign_step,
                         hold_bytes=int(self.hold_gb * 2 ** 30))
            if got:
                hosts.append(m)
                stacks += got
        return hosts, stacks

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
        n_turns = self.turns_for(data)
        if n_turns > 1:
            self._warn_few_turn_steps(data.layer_idx, n_turns)
            return self.settings_for(data, n_turns)._apply_in_turns(data, per_unit, leaves, n_turns)
        modules = [u.module for u in data.units]
        tuning = _Tuning(modules)
        sign_step = SignStep()
        hosts, stacks = self._attach_stacks(data, sign_step)
        in_stack = {id(m.leaf) for st in stacks for m in st.members}
        offsets, clips, clip_lo = learnable_state([lf for lf in leaves if id(lf[0]) not in in_stack],
                                                  self.learn_clip, self.clip_min)
        # offsets first (an all-zero start offset is restored by zeroing, below)
        all_offsets = offsets + [v for st in stacks for v in st.offsets]
        params = all_offsets + clips + [c for st in stacks for c in st.clips]
        for p in params:
            p.requires_grad_(True)
        gen = torch.Generator().manual_seed(data.seed)

        layer_loss = _LayerLoss(data, params, modules, self.batch, ahead=self.prefetch)
        group_error, full_mse = layer_loss.group_error, layer_loss.full_mse

        # the SignSGD step of each parameter as soon as its gradient is complete (one backward a
        # step: autograd accumulates a parameter's contributions first); its gradient is then
        # freed, so a layer's gradients never all exist at once
        lr_now = [0.0]

        def step(p: torch.Tensor) -> None:
            with torch.no_grad():
                p.sub_(lr_now[0] * torch.sign(p.grad))
            p.grad = None

        hooks = []

        t_start = time.perf_counter()
        try:
            loss_before = full_mse()
            state_bytes = sum(p.numel() * p.element_size() for p in params)
            log.info("blockround layer %s: %d leaves (%d stacked), %d samples, start MSE %.6g (%.1f s); "
                     "learnable state %.2f GiB, device peak so far %.1f GiB", data.layer_idx, len(leaves),
                     len(in_stack), n, loss_before, time.perf_counter() - t_start, state_bytes / 2 ** 30,
                     devmod.peak_memory_bytes(dev) / 2 ** 30)
            best_loss, best_step = loss_before, 0
            # the state to return to; an all-zero start offset (RTN) is kept as None (restored by
            # zeroing): a fresh V4-Flash layer's offsets would be a 26 GB copy of zeros
            best = [None if (k < len(all_offsets) and not bool(p.any())) else p.detach().clone()
                    for k, p in enumerate(params)]
            lr0 = self.lr or (1.0 / max(self.iters, 1))
            # keep_best=False: the end state against the start only (no copy of a later state)
            every = (self.eval_every or max(self.iters // 10, 1)) if self.keep_best else max(self.iters, 1)
            order = _sample_order(n, gen)
            # the stacked offsets step inside their backward (sign_step); the rest as their
            # gradient completes
            stepped_inside = {id(v) for st in stacks for v in st.offsets}
            hooks = [p.register_post_accumulate_grad_hook(step) for p in params if id(p) not in stepped_inside]
            profile_step, profile_out = _profile_request()
            t_steps = time.perf_counter()
            # the steps' batches in draw order (a seeded permutation per epoch), each batch's
            # copies to the device issued during the step before (``prefetch``)
            draws = ([next(order) for _ in range(min(self.batch, n))] for _ in range(self.iters))
            for t, (ks, fetched) in enumerate(layer_loss.batches(draws)):
                lr_now[0] = sign_step.lr = lr0 * (1.0 - t / self.iters)
                with _maybe_profiled(t == profile_step, dev, profile_out), \
                        (_recomputed(modules) if (self.recompute and self.recompute_units)
                         else contextlib.nullcontext()):
                    se, count = group_error(ks, fetched)
                    # one backward for the batch: the mean over its elements. Samples that ran one
                    # by one (no concatenation) made a fake-quant node each: a step inside each
                    # node's backward would take one step a sample on its part of the gradient
                    # (casebook i34-19); the stacked offsets then step once, after the backward
                    split = layer_loss.ran_apart
                    sign_step.lr = None if split else lr_now[0]
                    (se / count).backward()
                    del se
                    if split:
                        _step_offsets([v for st in stacks for v in st.offsets], lr_now[0])
                    clamp_learnables(offsets, clips, clip_lo)
                    for st in stacks:
                        st.clamp_()
                if (t + 1) % max(self.iters // 10, 1) == 0 or t == 0:
                    devmod.synchronize(dev)
                    log.info("blockround layer %s: %d steps, %.3f s a step, device peak so far %.1f GiB",
                             data.layer_idx, t + 1, (time.perf_counter() - t_steps) / (t + 1),
                             devmod.peak_memory_bytes(dev) / 2 ** 30)
                if (t + 1) % every == 0 or t + 1 == self.iters:
                    loss = full_mse()
                    log.info("blockround layer %s: step %d / %d, MSE %.6g (%.1f s)", data.layer_idx, t + 1,
                             self.iters, loss, time.perf_counter() - t_start)
                    if loss < best_loss:   # strict: ties keep the earlier state
                        best_loss, best_step = loss, t + 1
                        _keep(params, best)
            _restore(params, best)
            out = self._unit_results(data, per_unit, len(leaves), loss_before, best_loss, best_step)
            log.info("blockround layer %s: done in %.1f s (steps %.1f s), device peak so far %.1f GiB", data.layer_idx,
                     time.perf_counter() - t_start, time.perf_counter() - t_steps, devmod.peak_memory_bytes(dev) / 2 ** 30)
            return out
        except torch.OutOfMemoryError as err:
            raise self._out_of_memory(data, _nbytes(params), err) from None
        finally:
            _release(hooks, params)
            for h in hosts:
                h.detach_leaf_stacks()
            tuning.restore()

    def _apply_in_turns(self, data: BlockData, per_unit: dict[str, list], leaves: list,
                        n_turns: int) -> dict[str, dict[str, Any]]:
        """apply_block with the routed experts in turns (``turns``): turn j tunes its experts'
        offsets and clips for its share of the steps, every other expert at its current codes;
        the other units' state steps through every turn. One comparison: the end against the
        start (all experts at their codes both times)."""
        dev = data.device
        modules = [u.module for u in data.units]
        hosts = self._turn_hosts(data)
        turned = {id(leaf) for h in hosts for leaf in h.turn_leaves()}
        # no reference to a turned leaf's weight may outlive the start of the turns: the device
        # copy of the experts (47 GiB on V4-Pro) is freed only with its last reference. The leaf
        # lists without those weights (edited in place: the caller holds them too); _Tuning
        # keeps the frozen parameters by name
        _drop_weights(leaves, turned)
        for lfs in per_unit.values():
            _drop_weights(lfs, turned)
        tuning = _Tuning(modules)
        offsets, clips, clip_lo = learnable_state([lf for lf in leaves if id(lf[0]) not in turned],
                                                  self.learn_clip, self.clip_min)
        own = offsets + clips   # the other units' state: every step
        own_bytes = _nbytes(own)
        sign_step = SignStep()
        layer_loss = _LayerLoss(data, own, modules, self.batch, ahead=self.prefetch)
        lr = {"own": 0.0, "turn": 0.0}
        lr_of: dict[int, str] = {}
        defer = [False]   # a step's batch in parts: the gradients add up, the steps come after

        def step(p: torch.Tensor) -> None:
            if defer[0]:
                return
            with torch.no_grad():
                p.sub_(lr[lr_of.get(id(p), "own")] * torch.sign(p.grad))
            p.grad = None

        hooks, keep = [], False
        t_start = time.perf_counter()
        try:
            counts = [h.begin_leaf_turns(n_turns) for h in hosts]
            log.info("blockround layer %s: the experts' codes made, their float weights on the host, %.1f GiB (%.1f s); "
                     "device %.1f GiB allocated", data.layer_idx, sum(h.parked_bytes() for h in hosts) / 2 ** 30,
                     time.perf_counter() - t_start, devmod.memory_allocated(dev) / 2 ** 30)
            loss_before = layer_loss.full_mse()
            log.info("blockround layer %s: %d leaves, %d samples, the experts in %d turns; start MSE %.6g (%.1f s), "
                     "device peak so far %.1f GiB", data.layer_idx, len(leaves), len(data.inputs), max(counts),
                     loss_before, time.perf_counter() - t_start, devmod.peak_memory_bytes(dev) / 2 ** 30)
            start = [None if (k < len(offsets) and not bool(p.any())) else p.detach().clone()
                     for k, p in enumerate(own)]
            for p in own:
                p.requires_grad_(True)
            hooks = [p.register_post_accumulate_grad_hook(step) for p in own]
            lr0 = self.lr or (1.0 / max(self.iters, 1))
            order = _sample_order(len(data.inputs), torch.Generator().manual_seed(data.seed))
            n = max(counts)
            t_steps = time.perf_counter()   # the turns' changes of weights included
            t = 0
            for j in range(n):
                steps = self.iters * (j + 1) // n - self.iters * j // n
                stacks = self._open_turn(hosts, j, counts, sign_step)
                turn_clips = [c for st in stacks for c in st.clips]
                # no loop variable in this frame may hold a turn's state past its turn: the
                # last one would keep its stack (1.4 GiB of a V4-Pro layer) through the layer's
                # end (casebook i34-21); comprehensions have their own scope
                lr_of.update({id(c): "turn" for c in turn_clips})
                hooks += [c.register_post_accumulate_grad_hook(step) for c in turn_clips]
                layer_loss.params = own + [v for st in stacks for v in st.params()]
                turn_lr0 = self.lr or (1.0 / max(steps, 1))
                draws = ([next(order) for _ in range(min(self.batch, len(data.inputs)))] for _ in range(steps))
                for u, (ks, fetched) in enumerate(layer_loss.batches(draws)):
                    lr["own"] = lr0 * (1.0 - t / self.iters)
                    lr["turn"] = turn_lr0 * (1.0 - u / steps)
                    # in parts, every step waits for the last part's gradient (hooks deferred)
                    defer[0] = 0 < self.micro_batch < len(ks)
                    sign_step.lr = lr["turn"]
                    self._batch_backward(layer_loss, ks, fetched, modules, sign_step)
                    if sign_step.lr is None:   # the offsets' step after the backward(s), on the sum
                        _step_summed(own, lr["own"])
                        _step_summed(turn_clips, lr["turn"])
                        _step_offsets([v for st in stacks for v in st.offsets], lr["turn"])
                    clamp_learnables(offsets, clips, clip_lo)
                    _clamp_stacks(stacks)
                    t += 1
                    if t == 1 or t % max(self.iters // 10, 1) == 0:
                        devmod.synchronize(dev)
                        log.info("blockround layer %s: %d steps, %.3f s a step, device peak so far %.1f GiB",
                                 data.layer_idx, t, (time.perf_counter() - t_steps) / t,
                                 devmod.peak_memory_bytes(dev) / 2 ** 30)
                fetched = None   # the turn's last batch off the device
                devmod.synchronize(dev)
                log.info("blockround layer %s: turn %d / %d (%d steps) done, %d steps in %.1f s, device peak so far "
                         "%.1f GiB (%.1f allocated)", data.layer_idx, j + 1, n, steps, t, time.perf_counter() - t_start,
                         devmod.peak_memory_bytes(dev) / 2 ** 30, devmod.memory_allocated(dev) / 2 ** 30)
                _close_turn(hosts, layer_loss, len(own))
                del stacks, turn_clips
            loss_after = layer_loss.full_mse()
            keep = loss_after < loss_before   # strict, as keep_best: a tie keeps the start
            log.info("blockround layer %s: end MSE %.6g against %.6g at the start: %s (%.1f s)", data.layer_idx,
                     loss_after, loss_before, "kept" if keep else "the start state kept",
                     time.perf_counter() - t_start)
            if not keep:
                _restore(own, start)
            _release(hooks, own)
            # nothing here may keep the other units' state once they are settled: the experts'
            # float weights come back to the device after them (casebook i34-21)
            hooks, start, layer_loss.params = [], None, []
            for held in (own, offsets, clips, clip_lo):
                held.clear()
            out = self._settle_turns(data, hosts, per_unit, turned, len(leaves), loss_before,
                                     min(loss_after, loss_before), self.iters if keep else 0, keep)
            for stats in out.values():
                stats["turns"] = n
            return out
        except torch.OutOfMemoryError as err:
            raise self._out_of_memory(data, own_bytes, err) from None
        finally:
            _release(hooks, own)
            for h in hosts:   # after an error: every weight back on the device as it began
                h.detach_leaf_stacks()
                h.abort_leaf_turns()
            tuning.restore()

    def _settle_turns(self, data: BlockData, hosts: list, per_unit: dict[str, list], turned: set[int], n_leaves: int,
                      loss_before: float, best_loss: float, best_step: int, keep: bool) -> dict[str, dict[str, Any]]:
        """The end of the turns: the other units settled first, so that their offsets leave the
        device before every expert's float weights come back to it (a V4-Pro layer: 47 GiB into a
        60-GiB budget, casebook i34-20); then the experts (folded with ``keep``). The units'
        results in their order."""
        out = self._unit_results(data, {u: lfs for u, lfs in per_unit.items()
                                        if not any(id(lf[0]) in turned for lf in lfs)},
                                 n_leaves, loss_before, best_loss, best_step)
        log.info("blockround layer %s: the other units settled; device %.1f GiB allocated before the experts "
                 "come back", data.layer_idx, devmod.memory_allocated(data.device) / 2 ** 30)
        settled: dict[int, tuple[int, bool]] = {}
        for h in hosts:
            settled.update(h.end_leaf_turns(keep))
        out.update(self._unit_results(data, {u: lfs for u, lfs in per_unit.items() if u not in out},
                                      n_leaves, loss_before, best_loss, best_step, settled))
        return {u.name: out[u.name] for u in data.units if u.name in out}

    def _open_turn(self, hosts: list, j: int, counts: list[int], sign_step: SignStep) -> list:
        """Turn j begun on every host that has it; its experts' stacked state made learnable."""
        for h, c in zip(hosts, counts):
            if j < c:
                h.begin_leaf_turn(j)
        stacks = [st for h in hosts for st in h.attach_leaf_stacks(
            learn_clip=self.learn_clip, clip_min=self.clip_min, chunk_bytes=int(self.chunk_gb * 2 ** 30),
            recompute=self.recompute, offset_dtype=getattr(torch, self.offset_dtype), step=sign_step,
            hold_bytes=int(self.hold_gb * 2 ** 30))]
        for p in (p for st in stacks for p in st.params()):
            p.requires_grad_(True)
        return stacks

    def _batch_backward(self, layer_loss: "_LayerLoss", ks: list[int], fetched, modules: list,
                        sign_step: SignStep) -> None:
        """The backward of one step's batch, in ``micro_batch`` parts whose gradients add up, or
        whole. ``sign_step.lr`` None afterwards: the stacked offsets did not step inside the
        backward (parts, or samples that ran one forward each: casebook i34-19) and take their
        step after it, on the batch's gradient."""
        with (_recomputed(modules) if (self.recompute and self.recompute_units) else contextlib.nullcontext()):
            if 0 < self.micro_batch < len(ks):
                sign_step.lr = None
                count = sum(layer_loss.data.targets[k].numel() for k in ks)
                for se, _ in layer_loss.errors_in_parts(ks, fetched, self.micro_batch):
                    (se / count).backward()
                    del se
                return
            se, count = layer_loss.group_error(ks, fetched)
            if layer_loss.ran_apart:
                sign_step.lr = None
            (se / count).backward()

    def _unit_results(self, data: BlockData, per_unit: dict[str, list], n_leaves: int, loss_before: float,
                      best_loss: float, best_step: int,
                      settled: dict[int, tuple[int, bool]] | None = None) -> dict[str, dict[str, Any]]:
        """Each unit's statistics, its offsets settled (an all-zero one dropped: the start state,
        nothing to save) and, with ``fold_grid``, folded into codes on a fixed grid. ``settled``:
        {id(leaf): (offsets its expert moved, folded)} of leaves the turns already settled."""
        settled = settled or {}
        out = {}
        for u in data.units:
            if u.name not in per_unit:   # settled in another call
                continue
            if any(id(leaf) in settled for leaf, _, _ in per_unit[u.name]):
                out[u.name] = self._settled_results(per_unit[u.name], settled, loss_before, best_loss, best_step,
                                                    n_leaves)
                continue
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
                           "folded_leaves": folded, "layer_leaves": n_leaves}
        return out

    @staticmethod
    def _settled_results(lfs: list, settled: dict[int, tuple[int, bool]], loss_before: float, best_loss: float,
                         best_step: int, n_leaves: int) -> dict[str, Any]:
        """A unit whose leaves the turns settled (an expert): its offsets were counted when its
        turn ended (once an expert, on its first leaf), and it is folded or left as it began."""
        return {"layer_loss_before": loss_before, "layer_loss_after": best_loss, "best_step": best_step,
                "n_offsets": sum(leaf.weight.numel() for leaf, _, _ in lfs),
                "n_nonzero_offsets": settled[id(lfs[0][0])][0] if lfs else 0,
                "folded_leaves": sum(int(settled[id(leaf)][1]) for leaf, _, _ in lfs), "layer_leaves": n_leaves}

    def _out_of_memory(self, data: BlockData, state: int, err: BaseException) -> DeviceMemoryError:
        return device_memory_error(
            "blockround", data.layer_idx, data.device, err,
            f"; the layer's learnable state alone is "
            f"{state / 2 ** 30:.1f} GiB{'' if self.offset_dtype == 'float16' else ' (offset_dtype=float16 halves it)'}"
            "; lower blockround:batch, or use a recipe without a block stage for this model")


class _Tuning:
    """The layer's modules while they are tuned: their own parameters frozen (the learnable state
    is what steps) and eval mode; :meth:`restore` puts both back and drops the quantizers' caches.
    The frozen parameters are kept by (module, name), not as tensors: a held tensor would keep a
    storage alive that the turns must free (casebook i34-17)."""

    def __init__(self, modules: list):
        self.modules = modules
        self.frozen = [(m, name) for m in modules for name, p in m.named_parameters() if p.requires_grad]
        for m, name in self.frozen:
            m.get_parameter(name).requires_grad_(False)
        self.was_training = [m.training for m in modules]
        for m in modules:
            m.eval()

    def restore(self) -> None:
        for m, name in self.frozen:
            m.get_parameter(name).requires_grad_(True)
        for m, tr in zip(self.modules, self.was_training):
            _invalidate(m)
            m.train(tr)


@torch.no_grad()
def _step_summed(params: list[torch.Tensor], lr: float) -> None:
    """The SignSGD step of every parameter on its gradient summed over a batch's parts; the
    gradients dropped (what the steps' hooks do, once for the whole batch)."""
    for p in params:
        if p.grad is not None:
            p.sub_(lr * torch.sign(p.grad))
            p.grad = None


@torch.no_grad()
def _step_offsets(offsets: list[torch.Tensor], lr: float) -> None:
    """The stacked offsets' step after the backward, on their summed gradient: the step the fused
    backward takes inside it (clamped to [-0.5, 0.5]); the gradients dropped."""
    for v in offsets:
        if v.grad is not None:
            signsgd_(v, v.grad, lr)
            v.grad = None


def _release(hooks: list, params: list[torch.Tensor]) -> None:
    """The steps' hooks removed; the parameters out of autograd, their gradients dropped."""
    for h in hooks:
        h.remove()
    for p in params:
        p.requires_grad_(False)
        p.grad = None


def _close_turn(hosts: list, layer_loss: "_LayerLoss", n_own: int) -> None:
    """The turn's state out of autograd and off the hosts (into the codes); the loss back to
    the other units' state (its first ``n_own`` parameters)."""
    _release([], layer_loss.params[n_own:])
    for h in hosts:
        h.detach_leaf_stacks()
        if h.turn_current() is not None:
            h.end_leaf_turn()
    layer_loss.params = layer_loss.params[:n_own]


def _clamp_stacks(stacks: list) -> None:
    for st in stacks:
        st.clamp_()


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _drop_weights(lfs: list, turned: set[int]) -> None:
    """The (leaf, weight, quantizer) entries of ``turned`` leaves as (leaf, None, quantizer), in place."""
    for k, (leaf, w, wq) in enumerate(lfs):
        if id(leaf) in turned:
            lfs[k] = (leaf, None, wq)


def _sample_order(n: int, gen: torch.Generator):
    """Sample indices for the steps: one random permutation of the samples after another."""
    while True:
        yield from torch.randperm(n, generator=gen).tolist()


def _keep(params: list[torch.Tensor], best: list[torch.Tensor | None]) -> None:
    """The current state as the best: into the same buffers (one copy of the state, not two)."""
    with torch.no_grad():
        for k, p in enumerate(params):
            if best[k] is None:
                best[k] = p.detach().clone()
            else:
                best[k].copy_(p)


def _restore(params: list[torch.Tensor], best: list[torch.Tensor | None]) -> None:
    """The kept state back into the parameters (None: the all-zero start offset)."""
    with torch.no_grad():
        for p, b in zip(params, best):
            if b is None:
                p.zero_()
            else:
                p.copy_(b)


class _LayerLoss:
    """The layer's output error on the calibration samples: ``group_error(ks)`` (with autograd,
    a step's batch) and ``full_mse()`` (every sample, the parameters frozen for the pass).

    ``ahead``: each batch's host -> device copies are issued one batch early, on a side stream
    (``CopiesAhead``), so they overlap the batch before; the same tensors, the same numbers."""

    def __init__(self, data: BlockData, params: list[torch.Tensor], modules: list, batch: int, ahead: bool = True):
        self.data, self.params, self.modules, self.batch, self.ahead = data, params, modules, batch, ahead
        self.ran_apart = False

    def fetch(self, ks: list[int]) -> devmod.CopiesAhead:
        """Samples ``ks``' inputs then targets, their copies to the device issued now."""
        data = self.data
        return devmod.CopiesAhead([data.inputs[k] for k in ks] + [data.targets[k] for k in ks], data.device)

    def batches(self, draws):
        """(ks, fetched) for each ``ks`` of ``draws``, the next batch's copies issued before this
        one is handed out (with ``ahead``)."""
        draws = iter(draws)
        cur = next(draws, None)
        pending = self.fetch(cur) if (cur is not None and self.ahead) else None
        while cur is not None:
            nxt = next(draws, None)
            following = self.fetch(nxt) if (nxt is not None and self.ahead) else None
            yield cur, (pending if pending is not None else self.fetch(cur))
            cur, pending = nxt, following

    def group_error(self, ks: list[int], fetched: devmod.CopiesAhead | None = None) -> tuple[torch.Tensor, int]:
        """(sum of squared errors in fp32, elements) of samples ``ks``: one forward of them
        all where the model concatenates samples (``data.concat``), else one forward each."""
        # each sample to the device first (pinned host -> device), joined there: a host-side
        # join of 8 V4-Flash windows is a 0.5 GB pageable copy a step (casebook i34-2)
        moved = (fetched if fetched is not None else self.fetch(ks)).get()
        return self._error(ks, moved[:len(ks)], moved[len(ks):])

    def errors_in_parts(self, ks: list[int], fetched: devmod.CopiesAhead | None, size: int):
        """``group_error`` of samples ``ks`` a part of ``size`` samples at a time (the caller runs
        each part's backward before the next part's forward, so one part's intermediates live)."""
        moved = (fetched if fetched is not None else self.fetch(ks)).get()
        xs, ts = moved[:len(ks)], moved[len(ks):]
        for i in range(0, len(ks), size):
            yield self._error(ks[i:i + size], xs[i:i + size], ts[i:i + size])

    def _error(self, ks: list[int], xs: list[torch.Tensor], ts: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
        data = self.data
        states = [data.states[k] for k in ks]
        joined = data.concat(xs, states) if (data.concat is not None and len(ks) > 1) else None
        #: the last call ran several samples one forward each (no concatenation)
        self.ran_apart = joined is None and len(ks) > 1
        if joined is None:
            errs = [self.group_error_of(x, st, t) for x, st, t in zip(xs, states, ts)]
            return sum(e for e, _ in errs), sum(c for _, c in errs)
        return self.group_error_of(*joined, torch.cat(ts))

    def group_error_of(self, x, state, target) -> tuple[torch.Tensor, int]:
        out = output_tensor(self.data.forward(x, state))
        diff = out.float() - target.to(self.data.device).float()
        return diff.square().sum(), diff.numel()

    @torch.no_grad()
    def full_mse(self) -> float:
        # the parameters frozen for the pass: each leaf's fake-quant weight is computed once
        # and cached for every sample (the cache key holds no offset: invalidated around it)
        n = len(self.data.inputs)
        for p in self.params:
            p.requires_grad_(False)
        for m in self.modules:
            _invalidate(m)
        try:
            total, count = 0.0, 0
            draws = (list(range(k0, min(k0 + self.batch, n))) for k0 in range(0, n, self.batch))
            for ks, fetched in self.batches(draws):
                se, c = self.group_error(ks, fetched)
                total += float(se.double().item())
                count += c
        finally:
            for m in self.modules:
                _invalidate(m)
            for p in self.params:
                p.requires_grad_(True)
        return total / max(count, 1)
