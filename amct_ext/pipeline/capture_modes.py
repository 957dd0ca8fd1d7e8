"""How a layer's units are captured and solved: stored calls, or statistics.

The PTQ loop (``workflow.run_blockwise_ptq``) hands each quantized layer to one capture mode,
chosen by what the recipe's unit algorithms declare (``Recipe.needs()``):

- :class:`StoredCalls`: every unit's calls recorded during the layer's float forward (in host
  memory up to the budget, the rest spilled to OUTPUT/.scratch), then replayed by the recipe;
- :class:`Statistics`: per-leaf Hessians accumulated during that forward instead (no call is
  stored; ``algorithms/hessians.py``), in as many passes as the device budget needs, each pass's
  units solved and its Hessians freed before the next pass.

Both have one small interface, in the loop's order: ``capture(ph)`` (the float forward: the
layer's float output into ``work.next_hidden``, static ranges observed), ``account(ph, memory)``
(what the capture held), ``solve(ph, settings)`` (the unit recipe into ``work.done``), ``close()``
(free what the capture holds, also on an error) and ``account_calls(ph, memory)`` (the call data
alive at once over the layer, ``capture.CALL_METER``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..base import BaseModel
from ..runtime import device as devmod
from .capture import CALL_METER, CaptureStore, SpilledCalls, call_nbytes, capture_unit_io
from .ptq_units import UnitResult
from .static_ranges import finish_static, observe_static
from .stream import Stream, tensor_bytes


def call_bytes(calls) -> int:
    """Bytes of a unit's captured calls; a spilled sequence counts its bytes on disk."""
    if isinstance(calls, SpilledCalls):
        return sum(call_nbytes(c) for c in calls.head) + calls.spilled_nbytes
    return sum(call_nbytes(c) for c in calls)


@dataclass
class SolveSettings:
    """What the unit recipe runs with (the spec's, resolved once per run). ``write_as_solved``:
    units are written as soon as they are solved (False when a block stage tunes them after)."""

    recipe: Any
    seed: int
    dtype: torch.dtype
    holdout: float
    guard: bool
    propagate: str
    write_as_solved: bool


@dataclass
class LayerWork:
    """One quantized layer of the loop, shared by its capture mode and the block stage.

    ``todo``: the names of the units this run solves (the others an earlier run finished);
    ``done``: their results so far; ``saved``: those written. ``save(unit, result)`` writes a
    unit's parameters; ``on_saved(result)`` follows each write (progress)."""

    idx: int
    block: nn.Module
    units: list
    todo: set
    calib: Stream
    device: torch.device
    save: Callable[[Any, UnitResult], None]
    on_saved: Callable[[UnitResult], None] | None = None
    next_hidden: list | None = None
    done: dict = field(default_factory=dict)
    saved: dict = field(default_factory=dict)

    @property
    def todo_units(self) -> list:
        return [u for u in self.units if u.name in self.todo]

    def write(self, unit, ph) -> None:
        r = self.done[unit.name]
        with ph.phase("write", layer=self.idx):
            self.save(unit, r)
        self.saved[unit.name] = r
        if self.on_saved is not None:
            self.on_saved(r)

    def write_rest(self, ph) -> None:
        """Write every solved unit not written yet (after the block stage, when there is one)."""
        for unit in [u for u in self.todo_units if u.name not in self.saved]:
            self.write(unit, ph)


class CaptureMode(ABC):
    """The interface (see the module docstring) and what both modes share: the capture store
    (its accounting is reported by both) and the call meter of the layer."""

    name = ""

    def __init__(self, adapter: BaseModel, runtime: Any, work: LayerWork, scratch: Path | None):
        self.adapter, self.runtime, self.work = adapter, runtime, work
        self.store = CaptureStore(runtime.capture_memory_bytes, scratch, chunk_bytes=runtime.capture_buffer_bytes)
        CALL_METER.reset_peak()
        self.calls_before = CALL_METER.live      # call data alive before this layer (none in a run)
        self.sinks: dict[str, Any] = {}
        self.calls: dict[str, Any] = {}

    def capture(self, ph) -> int:
        """The layer's float forward (quantizers off: the float layer, bit for bit) capturing
        what the mode needs; returns how many static quantizers saw no data."""
        w = self.work
        with ph.phase("capture", layer=w.idx):
            self.adapter.set_quant_enabled(w.block, False)   # float math, bit for bit
            if not w.todo:   # the whole layer was done by an earlier run: only its float output is needed
                w.next_hidden = self.adapter.do_block_forward(w.block, w.calib.hidden, w.calib.state)
                return 0
            self._capture()
            return observe_static(self.adapter, w.block, w.calib, w.idx)

    @abstractmethod
    def _capture(self) -> None:
        """Run the float layer once, feeding what the recipe needs to this mode's sinks."""

    def account(self, ph, memory) -> None:
        memory.capture_memory_peak_bytes = max(memory.capture_memory_peak_bytes,
                                               self.store.peak_in_memory if self.store.memory_bytes is not None
                                               else sum(s.nbytes for s in self.sinks.values()))
        memory.capture_spilled_bytes += self.store.spilled_bytes
        ph.note(capture_bytes=sum(call_bytes(c) for c in self.calls.values() if isinstance(c, Sequence)),
                spilled_bytes=self.store.spilled_bytes, in_memory_peak_bytes=self.store.peak_in_memory)

    def solve(self, ph, settings: SolveSettings) -> None:
        """The unit recipe on the layer's todo units, with the whole layer's quantization on."""
        self.adapter.set_quant_enabled(self.work.block, True)
        if settings.propagate == "quant":
            finish_static(self.work.block, self.work.idx)   # counted once, by the observe pass
        if self.work.todo_units:
            self._solve(ph, settings)

    @abstractmethod
    def _solve(self, ph, settings: SolveSettings) -> None:
        """The unit recipe on the layer's todo units, from this mode's captures."""

    def close(self) -> None:
        for s in self.sinks.values():
            s.discard()
        self.store.cleanup()

    def account_calls(self, ph, memory) -> None:
        layer_calls_peak = CALL_METER.peak - self.calls_before
        memory.call_memory_peak_bytes = max(memory.call_memory_peak_bytes, layer_calls_peak)
        ph.note(call_memory_peak_bytes=layer_calls_peak)


class StoredCalls(CaptureMode):
    """Every todo unit's calls stored during the float forward, replayed by the recipe; one
    recipe run per device holding units (a sharded layer: a group's experts must share one)."""

    name = "calls"

    def __init__(self, adapter: BaseModel, runtime: Any, work: LayerWork, scratch: Path | None):
        adapter.prepare_capture(work.block)        # every unit called as a module: hooks see it
        super().__init__(adapter, runtime, work, scratch)
        for u in work.todo_units:
            made = runtime.make_sink(u) if runtime.make_sink is not None else None
            self.sinks[u.name] = made if made is not None else self.store.sink(u.file_stem)

    def _capture(self) -> None:
        w = self.work
        self.calls, w.next_hidden = capture_unit_io(
            w.todo_units, lambda: self.adapter.do_block_forward(w.block, w.calib.hidden, w.calib.state),
            sinks=self.sinks)

    def _solve(self, ph, settings: SolveSettings) -> None:
        from ..algorithms.runner import run_recipe_on_units

        w = self.work
        by_dev: dict[torch.device, list] = {}
        for u in w.todo_units:
            by_dev.setdefault(self.adapter.unit_device(w.block, u) if self.runtime.sharded else w.device,
                              []).append(u)
        for udev, group in by_dev.items():
            with ph.phase("solve:recipe", layer=w.idx, device=str(udev)):
                rs = run_recipe_on_units(group, self.calls, settings.recipe, device=udev, seed=settings.seed,
                                         dtype=settings.dtype, holdout=settings.holdout, guard=settings.guard,
                                         hessians=None)
            w.done.update({u.name: r for u, r in zip(group, rs)})
        self.calls = {}      # the unit captures are not read again: freed before the block stage


class Statistics(CaptureMode):
    """Per-leaf Hessians accumulated during the float forward (no stored call; the layer keeps
    its fast paths, the MoE's grouped GEMMs report their rows), pass by pass within the device
    budget (``hessians.plan_hessian_passes``): each pass solved, written and freed before the
    next pass collects its own, so an interrupted layer resumes at its next pass."""

    name = "statistics"

    def __init__(self, adapter: BaseModel, runtime: Any, work: LayerWork, scratch: Path | None,
                 needs_statistics: bool):
        super().__init__(adapter, runtime, work, scratch)
        self.needs_statistics = needs_statistics
        self.passes: list[list] = []
        self.hessians: dict | None = None
        self.collector = None

    def _capture(self) -> None:
        from ..algorithms.hessians import plan_hessian_passes

        w = self.work
        # more than one pass only when the layer's Hessians exceed the budget
        todo_units = w.todo_units
        self.passes = plan_hessian_passes(todo_units, self.runtime.hessian_budget(w.device))
        if len(self.passes) > 1 and not self.needs_statistics:
            # RTN: the Hessians would only measure its loss; not worth extra passes
            self.passes = [todo_units]
            self.hessians = {u.name: {} for u in todo_units}
            w.next_hidden = self.adapter.do_block_forward(w.block, w.calib.hidden, w.calib.state)
        else:
            self.collector, self.hessians, w.next_hidden = _collect_hessians(self.adapter, w.block, w.calib,
                                                                             self.passes[0])

    def account(self, ph, memory) -> None:
        if self.collector is not None:
            ph.note(hessian_bytes=tensor_bytes({id(ls.H): ls.H for st in self.hessians.values()
                                                for ls in st.values() if ls.H is not None}.values()),
                    host_count_reads=self.collector.host_reads, hessian_passes=len(self.passes))
        super().account(ph, memory)

    def _solve(self, ph, settings: SolveSettings) -> None:
        from ..algorithms.runner import run_recipe_on_units

        w = self.work
        for k, pass_units in enumerate(self.passes):
            if k > 0:
                with ph.phase("capture", layer=w.idx):
                    self.adapter.set_quant_enabled(w.block, False)
                    # the output is pass 0's again: not kept (a host copy of the layer's)
                    self.collector, self.hessians, _ = _collect_hessians(self.adapter, w.block, w.calib,
                                                                         pass_units, keep_output=False)
                    self.adapter.set_quant_enabled(w.block, True)
            with ph.phase("solve:recipe", layer=w.idx, device=str(w.device)):
                rerun = LayerRerun(self.adapter, w.block, w.calib)
                rs = run_recipe_on_units(pass_units, {}, settings.recipe, device=w.device, seed=settings.seed,
                                         dtype=settings.dtype, holdout=settings.holdout, guard=settings.guard,
                                         hessians=self.hessians, recollect=rerun)
            if rerun.forwards:   # a note goes to the phase just finished: solve:recipe
                ph.note(recollect_forwards=rerun.forwards, recollect_seconds=round(rerun.seconds, 3),
                        recollect_runs=rerun.runs)
            w.done.update({u.name: r for u, r in zip(pass_units, rs)})
            # written pass by pass: an interrupted layer resumes at its next pass (with a
            # block stage: after it)
            for unit in (pass_units if settings.write_as_solved else ()):
                w.write(unit, ph)
            self._free()
            devmod.empty_cache(w.device)

    def _free(self) -> None:
        self.hessians = None                   # frees the layer's Hessians (GBs on the device)
        if self.collector is not None:
            self.collector.free()
            self.collector = None

    def close(self) -> None:
        super().close()
        self._free()


def capture_mode(adapter: BaseModel, runtime: Any, work: LayerWork, needs: Any, scratch: Path | None
                 ) -> CaptureMode:
    """The mode the unit recipe's ``needs`` ask for: a recipe that replays no calls (rtn, hclip,
    gptq) gets statistics unless the layer is sharded or ``runtime.statistics`` is off."""
    if not needs.calls and not runtime.sharded and runtime.statistics:
        return Statistics(adapter, runtime, work, scratch, needs_statistics=needs.statistics)
    return StoredCalls(adapter, runtime, work, scratch)


def _collect_hessians(adapter: BaseModel, block: nn.Module, calib: Stream, units: Sequence,
                      keep_output: bool = True, only: dict[str, set[str]] | None = None,
                      stop_after_units: bool = False):
    """One forward of ``block`` over ``calib`` with a HessianCollector on ``units`` (``only``:
    those leaves): (collector, {unit name: its statistics}, the layer's output, or [] without
    ``keep_output``). ``stop_after_units``: each sample's forward ends once every unit's module
    has returned (nothing after them feeds their leaves). The collector lets go of its stacks:
    the statistics own them."""
    from ..algorithms.hessians import HessianCollector

    collector = HessianCollector(units, only=only)
    collector.attach(block)
    stop_after = [u.module for u in units] if stop_after_units else ()
    try:
        out = adapter.do_block_forward(block, calib.hidden, calib.state, keep_outputs=keep_output,
                                       stop_after=stop_after)
    finally:
        collector.detach()
    collector.release()
    return collector, {u.name: collector.stats(u.name) for u in units}, out


class LayerRerun:
    """``SolveContext.recollect`` of the statistics path: the layer's calibration forward once
    more, with quantization on in the given units only (every other unit and the rest of the
    layer float, as in the capture), collecting the given leaves' statistics. Each sample's
    forward ends once the given units' modules have returned: a re-run for the attention's
    later stages does not run the MoE after it (the routed experts on the MoE's grouped path
    are never called as modules, so their re-run goes to the layer's end). Counts its forwards
    and their time for the report (``runs``: [unit kinds, leaves collected, seconds] each)."""

    def __init__(self, adapter: BaseModel, block: nn.Module, calib: Stream):
        self.adapter, self.block, self.calib = adapter, block, calib
        self.forwards = 0
        self.seconds = 0.0
        self.runs: list[list] = []

    def __call__(self, units: Sequence, leaves: dict[str, set[str]]) -> dict[str, dict]:
        t0 = time.perf_counter()
        self.adapter.set_quant_enabled(self.block, False)
        try:
            for u in units:
                self.adapter.set_quant_enabled(u.module, True)
            _, stats, _ = _collect_hessians(self.adapter, self.block, self.calib, units, keep_output=False,
                                            only=leaves, stop_after_units=True)
        finally:
            # the recipe runs with the whole layer's quantization on (run_blockwise_ptq): back to it
            self.adapter.set_quant_enabled(self.block, True)
        devmod.synchronize(self.adapter.block_device(self.block))   # the time is the forward's
        dt = time.perf_counter() - t0
        self.forwards += 1
        self.seconds += dt
        self.runs.append(["+".join(sorted({u.kind for u in units})), sum(len(v) for v in leaves.values()),
                          round(dt, 3)])
        return stats


__all__ = ["CaptureMode", "StoredCalls", "Statistics", "capture_mode", "LayerWork", "SolveSettings",
           "LayerRerun", "call_bytes"]
