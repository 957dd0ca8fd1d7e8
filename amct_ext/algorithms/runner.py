"""Running a recipe on the PTQ units of one layer (called by workflow.run_blockwise_ptq).

Order: algorithm by algorithm (the recipe order), and for each algorithm either one
``apply_group`` call over every unit of a kind it lists in ``group_kinds`` (GPTQ: all routed
experts at once) or ``apply`` per unit. So ``clip,gptq`` clips every expert before GPTQ solves
them together.

Around the recipe, per unit: the RTN loss (MSE to the float output over the unit's captured
calls) before, the loss after and -- with ``guard`` -- a fall back to RTN when the recipe made
the unit worse on its calibration calls (the snapshot taken before the first algorithm is put
back: weights, norms, clip factors, fixed scales).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..errors import DeviceMemoryError
from ..pipeline.capture import UnitCall
from ..quant.quant_linear import QuantLinear
from ..quant.quantizers import ActivationQuantizer, WeightQuantizer
from ..pipeline.ptq_units import PtqUnit, UnitResult
from ..pipeline.replay import unit_mse, unit_seed
from .base import SolveContext, UnitData, device_memory_error
from .recipe import Recipe

_WQ_STATE = ("clip", "fixed_scale", "fixed_zero_point")

log = logging.getLogger(__name__)
PROGRESS_EVERY_S = 30.0   # a kind solved unit by unit reports its progress this often (INFO)


@dataclass
class _Snapshot:
    tensors: dict[str, torch.Tensor]
    quantizers: dict[str, dict[str, Any]]
    replaced: dict[str, bool]
    ranges: dict[str, tuple]
    extra: Callable[[], None] | None = None   # the unit's own restore (snapshot_extra_state)


def snapshot_unit(module: nn.Module) -> _Snapshot:
    """Everything an algorithm may change inside a unit: parameters / buffers (cloned), the
    weight quantizers' learned state and the leaves' ``weight_replaced`` flags."""
    tensors = {k: v.detach().clone() for k, v in module.state_dict(keep_vars=True).items() if v is not None}
    quant, replaced, ranges = {}, {}, {}
    for name, m in module.named_modules():
        if isinstance(m, ActivationQuantizer) and m.observed:   # non-persistent: not in state_dict
            ranges[name] = (m.running_min.clone(), m.running_max.clone())
        if isinstance(m, WeightQuantizer):
            quant[name] = {k: (None if getattr(m, k) is None else getattr(m, k).detach().clone()) for k in _WQ_STATE}
            quant[name].update({k: v.detach().clone() for k, v in m._parameters.items()
                                if k not in _WQ_STATE and v is not None})
            quant[name].update({k: v.detach().clone() for k, v in m._buffers.items()
                                if k not in _WQ_STATE and v is not None})
        if hasattr(m, "weight_quantizer"):
            replaced[name] = bool(getattr(m, "weight_replaced", False))
    extra = getattr(module, "snapshot_extra_state", None)
    return _Snapshot(tensors, quant, replaced, ranges, extra() if extra is not None else None)


@torch.no_grad()
def restore_unit(module: nn.Module, snap: _Snapshot) -> None:
    current = module.state_dict(keep_vars=True)
    for k, v in snap.tensors.items():
        if k in current and current[k] is not None:
            current[k].copy_(v)
    for name, m in module.named_modules():
        if isinstance(m, ActivationQuantizer) and name in snap.ranges:
            m.running_min, m.running_max = (t.clone() for t in snap.ranges[name])
        if isinstance(m, WeightQuantizer) and name in snap.quantizers:
            saved = snap.quantizers[name]
            m.clip = None if saved["clip"] is None else nn.Parameter(saved["clip"].clone(), requires_grad=False)
            m.fixed_scale = saved["fixed_scale"]
            m.fixed_zero_point = saved["fixed_zero_point"]
            for k in list(m._parameters):
                if k not in _WQ_STATE:
                    m._parameters[k] = (nn.Parameter(saved[k].clone(), requires_grad=False) if k in saved else None)
            for k in list(m._buffers):
                if k not in _WQ_STATE:
                    m._buffers[k] = saved[k].clone() if k in saved else None
        if name in snap.replaced:
            m.weight_replaced = snap.replaced[name]
        if isinstance(m, QuantLinear):
            m.invalidate_cache()
    if snap.extra is not None:   # smoothing: input_smooth, the block's attn_norm, up_limit
        snap.extra()


@torch.no_grad()
def hessian_leaf_errors(unit: PtqUnit, stats: dict) -> dict[str, tuple[torch.Tensor, int]]:
    """Per quantized leaf with a statistic: (``tr(dW H dW^T)`` on the device, output elements),
    dW = fake-quant weight - weight: the leaf's exact squared output error on its calibration
    rows (float inputs, weight quantization only)."""
    from .hessians import fake_quant_weight, quant_leaves, weight_error

    out = {}
    for name, leaf in quant_leaves(unit.module):
        ls = stats.get(name)
        if ls is None or ls.H is None or ls.n == 0:
            continue
        w = leaf.weight.detach()
        B = ls.H.shape[0]
        dW = (fake_quant_weight(leaf).float() - w.float()).reshape(B, -1, w.shape[-1]).to(ls.H.device)
        out[name] = (weight_error(dW, ls.H).sum(), ls.n * w.shape[0])
    return out


def _apply_algorithm(algo, units, datas, ctxs, stats, seconds, statistics: bool = False) -> None:
    """:func:`_apply_algorithm_units`; where the device runs out of memory, one DeviceMemoryError
    naming the algorithm, the layer, the device and what to lower, never torch's traceback
    (casebook i34-24: hclip on a V4-Pro layer in 60 GiB)."""
    try:
        _apply_algorithm_units(algo, units, datas, ctxs, stats, seconds, statistics)
    except torch.OutOfMemoryError as err:
        raise _out_of_device_memory(algo, units, ctxs, err) from None


def _out_of_device_memory(algo, units, ctxs, err: BaseException) -> DeviceMemoryError:
    ctx = ctxs[units[0].name] if units else SolveContext()
    advice = algo.memory_advice() or f"; use a recipe without {algo.name} for this model"
    return device_memory_error(algo.name, ctx.layer_idx, ctx.device, err, advice)


def _apply_algorithm_units(algo, units, datas, ctxs, stats, seconds, statistics: bool = False) -> None:
    """One algorithm of a recipe over a layer's units: the kinds it solves jointly
    (``algo.group_kinds``, e.g. all routed experts) through ``apply_group``, the others one by
    one; or every unit in one ``apply_group`` when the algorithm solves the layer jointly
    (``solves_layer_jointly``). Each unit's result goes to ``stats[name][algo.name]``, its time
    (a group's time shared equally) to ``seconds[name]``."""
    if algo.solves_layer_jointly(statistics):
        groups = [("layer", list(units))] if units else []
        singles = []
    else:
        kinds = sorted({u.kind for u in units if u.kind in algo.group_kinds})
        groups = [(kind, [u for u in units if u.kind == kind]) for kind in kinds]
        singles = [u for u in units if u.kind not in algo.group_kinds]
    for kind, members in groups:
        tg = time.perf_counter()
        # one context for the group: the seed of its first unit (the group is solved jointly)
        results = algo.apply_group(members, [datas[u.name] for u in members], ctxs[members[0].name])
        took = time.perf_counter() - tg
        share = took / max(len(members), 1)
        for u, r in zip(members, results):
            stats[u.name][algo.name] = r
            seconds[u.name] += share
        log.info("%s: %d %s unit(s) solved jointly in %.2f s", algo.name, len(members), kind, took)
    # unit by unit: a per-kind running total, logged as each kind completes and every
    # PROGRESS_EVERY_S meanwhile (a layer's 256 experts one by one can take minutes; an
    # interrupted run still tells where its time went)
    total = {k: sum(1 for u in singles if u.kind == k) for k in dict.fromkeys(u.kind for u in singles)}
    spent: dict[str, list] = {}           # kind -> [units done, seconds]
    last_report = time.perf_counter()
    for u in singles:
        tu = time.perf_counter()
        stats[u.name][algo.name] = algo.apply(u, datas[u.name], ctxs[u.name])
        took = time.perf_counter() - tu
        seconds[u.name] += took
        done = spent.setdefault(u.kind, [0, 0.0])
        done[0] += 1
        done[1] += took
        now = time.perf_counter()
        if done[0] == total[u.kind] or now - last_report >= PROGRESS_EVERY_S:
            log.info("%s: %d / %d %s unit(s) solved in %.2f s", algo.name, done[0], total[u.kind], u.kind, done[1])
            last_report = now


def _run_on_hessians(units, hessians, recipe, *, device, seed, dtype, holdout, on_algorithm, recollect=None):
    """Recipe run on capture statistics (no calls): losses are the exact per-leaf output errors
    of the weights, summed over the unit's leaves, per output element -- before: RTN on the float
    calibration rows; after: on the rows each leaf was solved on (the float rows, or for a
    sequential GPTQ's later stages the rows through its quantized earlier stages); the guard is the algorithms' own (GPTQ keeps a leaf's result only where it is not
    above RTN's on that exact loss), so no snapshot of the layer is taken. ``recollect``: the
    workflow's re-run of the layer (``SolveContext.recollect``)."""
    datas = {u.name: UnitData([], hessians=hessians.get(u.name, {})) for u in units}
    ctxs = {u.name: SolveContext(device=device, seed=unit_seed(seed, u.name), dtype=dtype, holdout=holdout,
                                 layer_idx=u.layer_idx, recollect=recollect) for u in units}
    before_leaf = {u.name: hessian_leaf_errors(u, datas[u.name].hessians) for u in units}
    seconds = {u.name: 0.0 for u in units}
    stats: dict[str, dict[str, Any]] = {u.name: {} for u in units}
    leaf_after: dict[str, dict[str, float]] = {u.name: {} for u in units}
    algos = list(recipe.algorithms)
    for k, algo in enumerate(algos):
        ta = time.perf_counter()
        # the last reader of the capture statistics may free them as it solves
        last_reader = not any(a.needs().statistics for a in algos[k + 1:])
        for c in ctxs.values():
            c.consume_statistics = last_reader
        _apply_algorithm(algo, units, datas, ctxs, stats, seconds, statistics=True)
        for u in units:
            r = stats[u.name].get(algo.name) or {}
            leaf_after[u.name].update(r.pop("leaf_loss", {}) if isinstance(r, dict) else {})
        if on_algorithm is not None:
            on_algorithm(algo.name, time.perf_counter() - ta)
    # one host read for all units' RTN losses
    names = [(u.name, leaf) for u in units for leaf in before_leaf[u.name]]
    values = torch.stack([before_leaf[n][leaf][0].to(device) for n, leaf in names]).tolist() if names else []
    rtn = {key: v for key, v in zip(names, values)}
    out = []
    for u in units:
        leaves = before_leaf[u.name]
        elems = sum(n for _, n in leaves.values())
        if not leaves:
            before = after = None
        else:
            before = sum(rtn[(u.name, leaf)] for leaf in leaves) / elems
            after = sum(leaf_after[u.name].get(leaf, rtn[(u.name, leaf)]) for leaf in leaves) / elems
        stats[u.name]["reverted_to_rtn"] = False
        stats[u.name]["loss"] = ("hessian: sum over leaves of ||X (W_q - W)^T||^2 / output elements; X: the "
                                 "float rows (loss_before), the rows each leaf was solved on (loss_after: "
                                 "a sequential GPTQ's later stages read their quantized earlier stages)")
        out.append(UnitResult(name=u.name, kind=u.kind, layer=u.layer_idx, loss_before=before, loss_after=after,
                              seconds=seconds[u.name], n_calls=0, n_params=0, best_epoch=0, stats=stats[u.name]))
    return out


def run_recipe_on_units(units: Sequence[PtqUnit], calls: dict[str, list[UnitCall]], recipe: Recipe, *,
                        device: torch.device, seed: int, dtype: torch.dtype | None = None,
                        holdout: float = 0.25, guard: bool = True,
                        on_algorithm: Callable[[str, float], None] | None = None,
                        hessians: dict[str, dict] | None = None,
                        recollect: Callable | None = None) -> list[UnitResult]:
    """Apply ``recipe`` to ``units`` (already on ``device``, quantizers on); returns one
    UnitResult per unit (loss_before = RTN, loss_after = the kept state).

    ``hessians``: per unit the capture's statistics (``hessians.HessianCollector``) instead of
    calls, for a recipe that needs no calls (``recipe.needs().calls`` False); see
    ``_run_on_hessians`` for what the losses and the guard are then. ``recollect``: with
    ``hessians``, the workflow's re-run of the layer for fresh statistics
    (``SolveContext.recollect``; sequential GPTQ).

    Units whose weights the target format already holds exactly (``source_grid``: a release's
    FP4 experts under mxfp4) are set aside first: no algorithm runs on them and their result
    says ``kept_source_codes``."""
    from .source_grid import kept_result, split_kept

    kept, solve = split_kept(units)
    if kept:
        log.info("%d of %d unit(s) already on the target grid: kept as stored (no algorithm)", len(kept), len(units))
        solved = {}
        if solve:
            rs = run_recipe_on_units(solve, calls, recipe, device=device, seed=seed, dtype=dtype, holdout=holdout,
                                     guard=guard, on_algorithm=on_algorithm, hessians=hessians, recollect=recollect)
            solved = {u.name: r for u, r in zip(solve, rs)}
        return [solved[u.name] if u.name in solved else kept_result(u) for u in units]
    if hessians is not None:
        if recipe.needs().calls:
            raise ValueError(f"recipe {recipe} replays calls: it cannot run on capture statistics")
        return _run_on_hessians(units, hessians, recipe, device=device, seed=seed, dtype=dtype, holdout=holdout,
                                on_algorithm=on_algorithm, recollect=recollect)
    datas = {u.name: UnitData(calls.get(u.name, [])) for u in units}
    ctxs = {u.name: SolveContext(device=device, seed=unit_seed(seed, u.name), dtype=dtype, holdout=holdout,
                                 layer_idx=u.layer_idx) for u in units}
    before = {u.name: (unit_mse(u.module, datas[u.name].calls, device) if len(datas[u.name]) else None)
              for u in units}
    snaps = {u.name: snapshot_unit(u.module) for u in units} if guard else {}
    seconds = {u.name: 0.0 for u in units}
    stats: dict[str, dict[str, Any]] = {u.name: {} for u in units}
    for algo in recipe.algorithms:
        ta = time.perf_counter()
        _apply_algorithm(algo, units, datas, ctxs, stats, seconds)
        if on_algorithm is not None:
            on_algorithm(algo.name, time.perf_counter() - ta)
    out = []
    for u in units:
        n = len(datas[u.name])
        after = unit_mse(u.module, datas[u.name].calls, device) if n else None
        reverted = False
        if guard and after is not None and before[u.name] is not None and after > before[u.name]:
            restore_unit(u.module, snaps[u.name])
            after, reverted = before[u.name], True
        stats[u.name]["reverted_to_rtn"] = reverted
        out.append(UnitResult(name=u.name, kind=u.kind, layer=u.layer_idx, loss_before=before[u.name],
                              loss_after=after, seconds=seconds[u.name], n_calls=n, n_params=0,
                              best_epoch=0, stats=stats[u.name]))
    return out
