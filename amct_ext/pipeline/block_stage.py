"""The block stage: the recipe's block-level algorithm on a whole layer, after its unit algorithms.

A recipe whose last entry is a block-level algorithm (``blockround``) tunes every unit of a
layer together against the layer's output. Its targets are the float layer's output on the run's
inputs, or (``target=float_model``) the float MODEL's output, for which a float stream is carried
beside the quantized one. :class:`BlockStage` owns that algorithm and that stream; a recipe
without a block-level algorithm gets a stage that does nothing, so the PTQ loop calls the same
methods either way.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import torch
from torch import nn

from ..base import BaseModel
from ..errors import ConfigError
from ..quant.schemes import CACHE_TARGET
from ..runtime import device as devmod
from .ptq_units import UnitResult
from .stream import Stream


class BlockStage:
    """``algo``: the block-level algorithm (None: no block stage). The loop calls, per layer:
    ``capture_targets`` after the unit capture (the targets, while the layer is still float),
    ``run`` after the unit recipe, ``advance`` once the layer is done; ``enter_mtp`` and
    ``after_predecessor`` keep the float stream in step with the run's stream."""

    def __init__(self, algo: Any, propagate: str, seed: int):
        self.algo = algo
        self.seed = seed
        # its targets may be the float MODEL's outputs: a float stream carried beside the quantized one
        self.float_stream = algo is not None and algo.float_model_targets(propagate)
        self.fcalib: Stream | None = None
        self.float_next = None
        self.targets = None

    def check(self, recipe: Any, sharded: bool, handed_over: bool) -> None:
        """Refuse what the stage cannot do (one line naming the recipe and the way out)."""
        algo = self.algo
        if algo is not None and sharded:
            raise ConfigError(f"recipe {recipe}: the block-level {algo.name!r} needs the whole layer on "
                              "one device; it cannot run on a sharded layer (drop --shard, or the algorithm)")
        if self.float_stream and handed_over:
            raise ConfigError(f"recipe {recipe} with propagate=quant: {algo.name!r} (target=float_model) "
                              "needs the float model's stream, which a torchrun rank's hand-off does not carry; "
                              f"use {algo.name}:target=float_layer, or propagate=float")

    def check_device_memory(self, adapter: BaseModel, recipe: Any, scheme: Any, targets: Sequence[str],
                            layers: Sequence[int]) -> None:
        """Refuse, before any layer runs, a block stage that cannot fit the device: the weights it
        tunes (integer weight formats of ``targets``, counted by the adapter from the config) and
        their learnable state alone exceed the device's memory (a V4-Pro layer's experts: 25 G
        weights, 94 GiB with float16 offsets). A lower bound: a layer under it may still run out."""
        algo = self.algo
        total = None if algo is None else devmod.total_memory_bytes(adapter.device)
        if total is None:
            return
        tuned = [t for t in targets if t != CACHE_TARGET and (w := scheme.target(t).weight) is not None
                 and w.format == "int"]
        per = algo.block_bytes_per_weight(adapter.run.dtype.itemsize)
        for i in layers:
            counts = [adapter.target_weight_count(i, t) for t in tuned]
            n = sum(c for c in counts if c)
            if n * per > total:
                raise ConfigError(
                    f"recipe {recipe}: layer {i}'s block stage ({algo.name!r}) holds at least {n * per / 2 ** 30:.1f} GiB "
                    f"on {adapter.device} ({n / 1e9:.1f} G weights of {', '.join(tuned)} at {per} bytes each, "
                    f"weight and learnable state) and the device has {total / 2 ** 30:.1f} GiB; use a recipe without a "
                    "block stage for this model (e.g. --algo hclip,gptq:sequential=false --propagate float)"
                    f"{algo.memory_advice()}")

    def start(self, calib: Stream) -> None:
        self.fcalib = calib if self.float_stream else None   # the float model's stream (same as calib until layer 1)

    def enter_mtp(self, adapter: BaseModel, layer_idx: int, calib: Stream) -> None:
        """Before the run's stream ``calib`` turns into the MTP layer's inputs."""
        if self.fcalib is not None:
            self.fcalib = (calib if self.fcalib is calib
                           else Stream(*adapter.mtp_block_inputs(layer_idx, self.fcalib.hidden, self.fcalib.state)))

    def after_predecessor(self, calib: Stream) -> None:
        self.fcalib = calib if self.fcalib is not None else None   # float predecessors: one stream

    def capture_targets(self, adapter: BaseModel, work, ph) -> None:
        """The float model's output of this layer (the float stream's next inputs): computed
        here, while the layer is still float (GPTQ writes its fake-quant weights into the float
        ones); layer 0, whose two streams are one, has it from the capture."""
        self.float_next = None
        if self.fcalib is not None:
            if self.fcalib is work.calib:
                self.float_next = work.next_hidden
            else:
                with ph.phase("capture", layer=work.idx):
                    self.float_next = adapter.do_block_forward(work.block, self.fcalib.hidden, self.fcalib.state)
        self.targets = None
        if self.algo is not None and work.todo:
            self.targets = self.float_next if self.float_stream else work.next_hidden

    def run(self, adapter: BaseModel, work, ph) -> None:
        if self.algo is not None and work.todo_units:
            with ph.phase("solve:block", layer=work.idx, device=str(work.device)):
                from ..algorithms.source_grid import is_kept

                # units that kept the release's codes (already on the target grid) are not tuned
                units = [u for u in work.units if not is_kept(work.done[u.name])]
                run_block_stage(adapter, work.block, self.algo, units, work.calib, self.targets, work.done,
                                seed=self.seed, layer_idx=work.idx)
        self.targets = None

    def advance(self) -> None:
        if self.fcalib is not None:
            self.fcalib = Stream(self.float_next, self.fcalib.state)


def run_block_stage(adapter: BaseModel, block: nn.Module, algo, units: Sequence, calib: Stream,
                    targets: Sequence[torch.Tensor], results: dict[str, UnitResult], *, seed: int,
                    layer_idx: int) -> None:
    """The recipe's block-level algorithm on one layer (after its unit algorithms): every unit's
    leaves tuned together against the layer's output ``targets`` on the run's inputs ``calib``.
    Its statistics go into each unit's result; the unit's own loss after the unit algorithms no
    longer describes the unit, so ``loss_after`` becomes None (the layer's MSE is in the stats)."""
    from ..algorithms.base import BlockData
    from .replay import unit_seed

    dev = adapter.block_device(block)
    # every unit called as its own module (no fused path holding detached weights)
    adapter.prepare_capture(block)
    adapter.set_quant_enabled(block, True)
    t0 = time.perf_counter()
    data = BlockData(units=list(units), inputs=calib.hidden, states=calib.state or [{}] * len(calib.hidden),
                     targets=targets, forward=lambda x, st: adapter.block_forward_sample(block, x, st),
                     device=dev, seed=unit_seed(seed, f"layers.{layer_idx}"), layer_idx=layer_idx,
                     concat=adapter.concat_samples, block=block)
    stats = algo.apply_block(data)
    devmod.synchronize(dev)
    dt = time.perf_counter() - t0
    for u in units:
        r = results[u.name]
        r.stats = dict(r.stats or {})
        r.stats[algo.name] = {**stats.get(u.name, {}), "layer_seconds": round(dt, 3)}
        if "skipped" not in stats.get(u.name, {}):
            r.loss_after = None
        r.seconds += dt / max(len(units), 1)


__all__ = ["BlockStage", "run_block_stage"]
