"""The algorithm interface: what every PTQ algorithm (GPTQ, clipping, smoothing, rounding) sees.

A recipe (``recipe.py``) is an ordered list of :class:`Algorithm` objects. The workflow runs
them in order on each PTQ unit of a layer (an attention, a routed expert, the shared expert);
each edits ``unit.module`` in place (weights, clip factors, fixed scales, norm weights) and
returns a small dict of statistics for the report.

Data an algorithm gets
- :class:`UnitData`: the unit's captured calls (``capture.UnitCall``: args, kwargs and the
  FLOAT output, the target every algorithm reproduces). An algorithm that changes what the
  unit receives (smoothing folds ``1/s`` into the preceding norm, so the unit's input becomes
  ``x / s``) replaces the inputs with :meth:`UnitData.map_inputs`; the float targets stay.
  Later algorithms of the recipe then see the new inputs.
- :class:`SolveContext`: the compute device, the run seed, the compute dtype and the held-out
  split of the calls (the calibration windows split deterministically into a training and a
  held-out part; see :meth:`SolveContext.split`).

Layer-level entry point
Some algorithms solve many units of one kind at once (GPTQ: all routed experts of a layer in
one batched solve of stacked Hessians). Such an algorithm lists the kinds in
``group_kinds`` and implements :meth:`Algorithm.apply_group`; the workflow then calls
``apply_group(units, datas, ctx)`` once with every unit of that kind of the layer (in the
layer's order) instead of ``apply`` per unit. The default ``apply_group`` is the loop.

Block-level algorithms
An algorithm with ``solves_block = True`` (block-wise SignRound, ``block_rounding.py``) does not
see units: it runs once per decoder layer, after the unit algorithms of the recipe, on every
quantized leaf of the layer at once, against the layer's output (:class:`BlockData`: the layer's
calibration inputs, its float targets and a differentiable forward). It must be the last entry
of its recipe (``Recipe`` checks the order) and leaves the same per-unit state as the others
(the workflow saves the units after it).

Contract for the result an algorithm leaves behind: after ``apply``, the unit's
``export_ptq_params()`` holds everything needed to rebuild the quantized unit from the float
checkpoint with ``load_ptq_params``:
- a leaf (QuantLinear / WoAQuant) whose float weight was changed: write it in place (same
  Parameter, same dtype) and set ``leaf.weight_replaced = True``; the leaf then exports
  ``{leaf}.weight`` and loading writes it back (``quant_linear.load_replaced_weight``);
- clip factors: ``{leaf}.weight_quantizer.clip`` (``WeightQuantizer.clip``);
- a grid chosen by the algorithm: ``WeightQuantizer.set_fixed_qparams(weight, scale, zp)`` ->
  ``{leaf}.weight_quantizer.scale`` / ``.zero_point``; forward and export then use exactly
  these scales (GPTQ);
- static activation ranges: ``{leaf}.input_quantizer.running_min`` / ``running_max``.
The workflow's guard (``runner.run_recipe_on_units``) snapshots the unit before the recipe
(parameters, buffers, weight-quantizer state, observed ranges) and restores it when the recipe
made the unit worse than RTN on its calibration calls; state held OUTSIDE the unit (a norm
folded by smoothing) is the algorithm's to record in the unit.
"""
from __future__ import annotations

import abc
import dataclasses
import logging
import math
import os
import traceback
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Sequence

import torch

from ..errors import DeviceMemoryError
from ..pipeline.capture import LazyCalls, UnitCall
from ..runtime import device as devmod
from ..pipeline.ptq_units import PtqUnit

@dataclass(frozen=True)
class Needs:
    """What an algorithm needs the workflow to capture for it (``Algorithm.needs()``); the
    workflow serves the union over the recipe (``Recipe.needs()``) and nothing else.

    ``calls``: every call of the unit stored (args, kwargs, FLOAT output; in host memory up to
    the capture budget, spilled beyond it) and handed over as ``UnitData.calls``, for
    algorithms that replay the unit. Without it no call is stored: the layer's float forward
    accumulates per-leaf statistics instead (``UnitData.hessians``: ``sum x^T x`` of every
    quantized leaf's input, ``hessians.HessianCollector``), in as many capture passes as the
    device budget needs (``hessians.plan_hessian_passes``).
    ``statistics``: on that statistics path, whether the algorithm reads the Hessians. False
    (RTN) means they only serve the loss report, so the workflow skips the extra passes a
    layer too large for one pass would cost (V4-Pro).
    Grouping is declared by ``Algorithm.group_kinds`` (the unit kinds solved jointly)."""

    calls: bool = True
    statistics: bool = True

    def __or__(self, other: "Needs") -> "Needs":
        return Needs(calls=self.calls or other.calls, statistics=self.statistics or other.statistics)


@dataclass
class SolveContext:
    """What an algorithm needs besides the unit and its data.

    ``holdout``: the fraction of a unit's calls kept out of training (0 = none). The split is
    by position: the LAST ``ceil(holdout * n)`` calls (at least one when ``n >= 2`` and
    ``holdout > 0``; none when ``n < 2``) are held out. Calls follow the calibration windows in
    order, so for an attention unit with batch size 1 the held-out calls are whole windows.
    """

    device: torch.device = torch.device("cpu")
    seed: int = 0
    dtype: torch.dtype | None = None
    holdout: float = 0.25
    layer_idx: int | None = None
    #: statistics path only (``UnitData.hessians``): ``recollect(units, {unit name: leaf names})``
    #: runs the layer's calibration forward once more with quantization on in ``units`` only
    #: (every other unit float) and returns fresh statistics of those leaves, {unit name: {leaf:
    #: LeafStat}}: the inputs a leaf sees once the leaves before it are quantized. None where
    #: the layer cannot be re-run (stored calls, a unit solved on its own in a test).
    recollect: Callable[[Sequence[PtqUnit], dict[str, set[str]]], dict[str, dict]] | None = None
    #: no later algorithm of the recipe reads the capture statistics: an algorithm may free
    #: them as it goes (``LeafStat.H = None``), the device memory of a layer's Hessians
    consume_statistics: bool = False

    def split(self, calls: Sequence[UnitCall]) -> tuple[list[UnitCall], list[UnitCall]]:
        """(training calls, held-out calls). Lazy calls (``capture.LazyCalls``: spilled, rescaled)
        split into two lazy slices: nothing is read here (a list would load every call of the unit)."""
        if not isinstance(calls, LazyCalls):
            calls = list(calls)
        n = len(calls)
        if self.holdout <= 0 or n < 2:
            return calls, []
        k = min(n - 1, max(1, math.ceil(self.holdout * n)))
        return calls[:n - k], calls[n - k:]


class UnitData:
    """The captured calls of one unit; algorithms may replace the calls' inputs (never the
    float targets)."""

    def __init__(self, calls: Sequence[UnitCall] | None = None, hessians: dict | None = None):
        #: statistics collected during the capture instead of calls (algorithms/hessians.py):
        #: leaf name -> LeafStat; None when calls were stored
        self.hessians = hessians
        # lazy calls (capture.LazyCalls: spilled to disk, rescaled) stay lazy: list() would
        # load every call of every unit of the layer back into host memory at once
        self._calls: Sequence[UnitCall] = calls if isinstance(calls, LazyCalls) else list(calls or [])

    @property
    def calls(self) -> Sequence[UnitCall]:
        return self._calls

    def __len__(self) -> int:
        return len(self._calls)

    def __iter__(self) -> Iterator[UnitCall]:
        return iter(self._calls)

    def map_inputs(self, fn: Callable[[tuple, dict], tuple[tuple, dict]]) -> None:
        """Replace every call's ``(args, kwargs)`` by ``fn(args, kwargs)``; outputs unchanged."""
        self._calls = [UnitCall(*fn(c.args, c.kwargs), c.output) for c in self._calls]

    def set_calls(self, calls: Sequence[UnitCall]) -> None:
        self._calls = calls if isinstance(calls, LazyCalls) else list(calls)


@dataclass
class BlockData:
    """What a block-level algorithm gets for one decoder layer.

    ``inputs[k]`` / ``states[k]``: the layer's k-th calibration sample as the run feeds it (the
    quantized predecessors' output with ``propagate='quant'``); ``targets[k]``: the float output
    it is to reproduce (``BlockRound.target`` says which float output the workflow computed);
    ``forward(x, state)``: the layer with quantization on, differentiable with respect to the
    quantizers' learnable state; ``units``: the layer's PTQ units (their leaves are the ones to
    tune); ``concat``: how several samples form one forward (or None). Inputs and targets may live
    on the host; the algorithm moves them to ``device``."""

    units: Sequence[PtqUnit]
    inputs: Sequence[torch.Tensor]
    states: Sequence[dict[str, Any]]
    targets: Sequence[torch.Tensor]
    forward: Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]
    device: torch.device = torch.device("cpu")
    #: several samples as one forward's (x, state) (``BaseModel.concat_samples``), None: one by one
    concat: Callable[[Sequence[torch.Tensor], Sequence[dict[str, Any]]], tuple | None] | None = None
    seed: int = 0
    layer_idx: int | None = None
    #: the layer itself: modules in it that stack many leaves' learnable state
    #: (``attach_leaf_stacks``, e.g. an MoE's routed experts) are tuned through their stacks
    block: Any = None


@dataclass
class Algorithm(abc.ABC):
    """Base of every algorithm: a small config dataclass (its fields are its settings).

    Subclasses set ``name`` (the registry key) and implement :meth:`apply`.
    """

    name: ClassVar[str] = ""
    #: unit kinds whose units the workflow hands to :meth:`apply_group` all at once
    group_kinds: ClassVar[tuple[str, ...]] = ()
    #: True: a block-level algorithm (:meth:`apply_block` once per layer, see the module doc)
    solves_block: ClassVar[bool] = False

    def settings(self) -> dict[str, Any]:
        """Everything that changes the result (recorded in ptq_params/meta.json)."""
        return {"name": self.name, **dataclasses.asdict(self)}

    def needs(self) -> Needs:
        """What the workflow must capture for this algorithm (see :class:`Needs`); the
        default replays calls. Declared here, served by the workflow: a new algorithm never
        edits ``pipeline/workflow.py`` to get its data."""
        return Needs()

    def check(self) -> None:
        """Validate the fields; raise ``recipe.RecipeError`` naming the field."""

    def solves_layer_jointly(self, statistics: bool) -> bool:
        """True: :meth:`apply_group` gets every unit of the layer at once (all kinds, in the
        layer's forward order) instead of one call per ``group_kinds`` kind; ``statistics``: the
        recipe runs on capture statistics. Default False."""
        return False

    @abc.abstractmethod
    def apply(self, unit: PtqUnit, data: UnitData, ctx: SolveContext) -> dict[str, Any]:
        """Edit ``unit.module`` in place from its calibration data; returns the unit's stats."""

    def apply_group(self, units: Sequence[PtqUnit], datas: Sequence[UnitData],
                    ctx: SolveContext) -> list[dict[str, Any]]:
        """All units of one kind of a layer at once; the default is the per-unit loop."""
        return [self.apply(u, d, ctx) for u, d in zip(units, datas)]

    def float_model_targets(self, propagate: str) -> bool:
        """A block-level algorithm: whether its targets are the FLOAT MODEL's output of the
        layer (the float stream, which the workflow then carries beside the quantized one) rather
        than the float layer's output on the inputs the run feeds it. Default False."""
        return False

    def block_bytes_per_weight(self, weight_bytes: int) -> int:
        """A block-level algorithm: the device bytes it holds at once for each integer weight it
        tunes, at least (the weight in ``weight_bytes`` plus its learnable state); the workflow
        refuses a layer whose total exceeds the device before any layer runs. Default: the weight."""
        return weight_bytes

    def memory_advice(self) -> str:
        """A block-level algorithm: what else to try where that refusal comes (appended to it;
        '' for nothing)."""
        return ""

    def apply_block(self, data: BlockData) -> dict[str, dict[str, Any]]:
        """A block-level algorithm on one layer: edits the units' leaves in place; returns
        {unit name: stats}. Only called where ``solves_block``."""
        raise TypeError(f"{self.name} is not a block-level algorithm (solves_block is False): the workflow "
                        "calls apply_block only on the recipe's last entry when it is one")


def device_memory_error(what: str, layer_idx: int | None, device: torch.device, err: BaseException,
                        advice: str) -> DeviceMemoryError:
    """The project's one error for ``what`` running out of memory on ``device`` (its size named,
    then ``advice``), in place of torch's traceback; the innermost frame of this project's code in
    ``err``'s traceback goes to the log, so the log keeps where it ran out."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if f"{os.sep}amct_ext{os.sep}" in f.filename or f"{os.sep}models{os.sep}" in f.filename]
    if frames:
        logging.getLogger(__name__).warning(
            "%s layer %s: out of device memory in %s:%d (%s), %.1f GiB allocated", what, layer_idx,
            os.path.basename(frames[-1].filename), frames[-1].lineno, frames[-1].name,
            devmod.memory_allocated(device) / 2 ** 30)
    total = devmod.total_memory_bytes(device)
    return DeviceMemoryError(f"{what}, layer {layer_idx}: out of device memory on {device}"
                             f"{'' if total is None else f' ({total / 2 ** 30:.1f} GiB)'}{advice}")
