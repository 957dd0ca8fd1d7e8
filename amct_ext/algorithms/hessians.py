"""Hessian statistics of a layer's quantized leaves, accumulated while the layer runs.

GPTQ needs, per quantized leaf, only ``H = sum_x x^T x`` over the leaf's calibration inputs
(fp32, on the device) and the number of rows. When no algorithm of a recipe replays the
captured unit calls (``Recipe.needs().calls`` is False: ``rtn``, ``hclip``, ``gptq``), the
workflow stores no calls at all: a :class:`HessianCollector` is attached to the layer during its
ONE float forward and every leaf's Hessian is folded in as the rows go by. Nothing of the
calibration activations is kept. This is llm-compressor's sequential pipeline as well: all
Hessians of a layer come from the float (not yet quantized) layer in one pass (the sequential
GPTQ then re-runs the layer for its later stages, collecting only those leaves).

Where the rows are seen
- a QuantLinear called as a module: a forward pre-hook (its input, before any input
  quantization; the float forward has quantization off anyway);
- ``wo_a`` (WoAQuant: a grouped einsum, no module call): its ``input_observers`` list, one
  Hessian per output group, [G, d, d];
- routed experts on the MoE's grouped-GEMM path (the expert modules are never called there):
  the MoE's ``row_observer`` gets the rows sorted by expert with the rows per expert; each
  expert's Hessian is one ``addmm`` on its segment (a loop of E matmuls on the device after ONE
  read of the counts per forward; the loop path's per-expert calls reach the pre-hooks instead
  and give the same sums, in the same order). The experts' Hessians are stacked [E, C, C] per
  projection input, allocated on first use.

Stages: the collector also records, per unit, the order in which the leaves' input tensors are
first used during the block's first call (``LeafStat.stage``: 0 for the tensor read first, e.g. x
for an attention's wq_a / wkv, then qr for wq_b, ...). Every tensor a leaf reads depends only on
tensors of earlier stages, so a sequential GPTQ can re-collect stage k with stages < k
quantized (``HessianCollector(units, only=...)`` collects just those leaves).

Leaves that read the same tensor share one statistic (``w1`` / ``w3`` of an expert; ``wq_a`` /
``wkv`` of an attention): found by identity of the input tensor on the first call, so w1 / w3's
[E, 4096, 4096] fp32 stack (17 GB for 256 V4-Flash experts) exists once.

Exact losses from a Hessian: for a linear ``y = x W^T`` with float inputs X,
``||X (W_q - W)^T||^2 = tr((W_q - W) H (W_q - W)^T)`` -- exact, no calls needed
(:func:`weight_error`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..base import GatedProjections

__all__ = ["LeafStat", "HessianCollector", "quant_leaves", "weight_error", "fake_quant_weight",
           "estimated_hessian_bytes", "plan_hessian_passes"]


@dataclass
class LeafStat:
    """``H``: [B, C, C] fp32 sum of x^T x (B = 1, or the output groups of wo_a); ``n``: rows
    per matrix. ``H`` may be a view into a stacked tensor (routed experts)."""

    H: torch.Tensor | None = None
    n: int = 0
    leaves: list[str] = field(default_factory=list)   # leaf names (in the unit) that read this input
    stage: int = 0          # order of first use of this input within the unit (module doc)

    def add(self, x: torch.Tensor, groups: int = 0) -> None:
        C = x.shape[-1]
        x = x.detach().float()
        if groups:
            xg = x.reshape(-1, groups, C).transpose(0, 1)                    # [G, N, d]
            if self.H is None:
                self.H = torch.zeros(groups, C, C, dtype=torch.float32, device=x.device)
            self.H.baddbmm_(xg.transpose(1, 2), xg)
            self.n += xg.shape[1]
        else:
            x2 = x.reshape(-1, C)
            if self.H is None:
                self.H = torch.zeros(1, C, C, dtype=torch.float32, device=x.device)
            self.H[0].addmm_(x2.t(), x2)
            self.n += x2.shape[0]


def quant_leaves(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every leaf of a unit with a quantizing weight spec and an input (QuantLinear / WoAQuant)."""
    out = []
    for name, m in module.named_modules():
        wq = getattr(m, "weight_quantizer", None)
        if wq is None or wq.is_identity or not isinstance(getattr(m, "weight", None), torch.Tensor):
            continue
        if not hasattr(m, "input_quantizer"):
            continue
        out.append((name, m))
    return out


def _groups(leaf: nn.Module) -> int:
    return int(getattr(leaf, "n_groups", 0) or 0)


def observe_leaf(leaf: nn.Module, fn: Callable[[torch.Tensor], None]) -> Callable[[], None]:
    """Call ``fn(x)`` with every input of ``leaf``; returns the remover."""
    if _groups(leaf):
        obs = leaf.__dict__.setdefault("input_observers", [])
        obs.append(fn)
        return lambda: obs.remove(fn)
    h = leaf.register_forward_pre_hook(lambda _m, args: fn(args[0]))
    return h.remove


def estimated_hessian_bytes(unit: Any) -> int:
    """Bytes of the fp32 Hessians a :class:`HessianCollector` makes for ``unit``: one [B, C, C]
    per distinct leaf input. Leaves of one unit with the same input width and grouping are
    counted once, as the collector shares them when they read one tensor (w1 / w3 of an
    expert, wq_a / wkv of an attention); an estimate for planning passes, exact for experts."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for _, leaf in quant_leaves(unit.module):
        key = (int(leaf.weight.shape[-1]), _groups(leaf))
        if key not in seen:
            seen.add(key)
            total += max(key[1], 1) * key[0] * key[0] * 4
    return total


def plan_hessian_passes(units: Sequence[Any], budget_bytes: int | None) -> list[list[Any]]:
    """Split one layer's units (in forward order) into capture passes whose Hessians fit in
    ``budget_bytes`` (None: one pass). A V4-Pro layer's routed experts alone need 94 GB of
    fp32 Hessians (w1 / w3: [384, 7168, 7168], w2: [384, 3072, 3072]), more than fits beside
    the layer on one device; each pass runs the layer's float forward once more and collects
    only its units' statistics, which are solved and freed before the next pass.

    The passes are filled from the END of the forward order, so the units solved (and their
    weights replaced) in earlier passes are downstream of, or parallel to, every unit of a later
    pass: the experts of a MoE are parallel, attention comes before them and goes in the last
    pass. Every pass therefore still sees the float function upstream of its units, as one
    pass would. A unit larger than the budget gets a pass of its own."""
    units = list(units)
    if budget_bytes is None or not units:
        return [units] if units else []
    passes: list[list[Any]] = []
    current: list[Any] = []
    used = 0
    for u in reversed(units):
        b = estimated_hessian_bytes(u)
        if current and used + b > budget_bytes:
            passes.append(current)
            current, used = [], 0
        current.insert(0, u)
        used += b
    passes.append(current)
    return passes


class _UnitStats:
    """The statistics of one unit: leaf name -> LeafStat (shared by leaves reading one tensor).

    While ``recording`` (until the unit's module returns from its first call), the distinct input
    tensors are kept in order of first use, so each new statistic gets its stage; the references
    are dropped after that call (identity, not equality: two tensors with equal values are two
    stages). Routed experts on the MoE's grouped path are never called: the row observer gives
    their stages."""

    def __init__(self) -> None:
        self.by_leaf: dict[str, LeafStat] = {}
        self._last: tuple[torch.Tensor, LeafStat] | None = None   # the input seen last, for aliasing
        self.recording = True
        self._inputs: list[torch.Tensor] = []                    # distinct inputs, first-use order
        self.n_stages = 0

    def stage_of(self, x: torch.Tensor) -> int:
        for k, t in enumerate(self._inputs):
            if t is x:
                return k
        self.n_stages += 1          # a new tensor; first seen after the first call: a stage of its own
        if self.recording:
            self._inputs.append(x)
        return self.n_stages - 1

    def stop_recording(self) -> None:
        self.recording = False
        self._inputs = []
        self._last = None

    def feed(self, name: str, leaf: nn.Module, x: torch.Tensor) -> None:
        st = self.by_leaf.get(name)
        if st is None:
            if self._last is not None and self._last[0] is x and not _groups(leaf) and \
                    self._last[1].H is not None and self._last[1].H.shape[-1] == x.shape[-1]:
                st = self._last[1]           # same tensor as the previous leaf: share, count once
                st.leaves.append(name)
                self.by_leaf[name] = st
                return
            st = self.by_leaf[name] = LeafStat(leaves=[name], stage=self.stage_of(x))
        elif name != st.leaves[0]:
            return                           # an alias: its rows were counted by the first reader
        st.add(x, _groups(leaf))
        self._last = (x, st)


class HessianCollector:
    """Per-leaf Hessians of ``units`` (PtqUnits of one layer) while ``block`` runs.

    ``attach(block)`` / ``detach()`` (or use as a context manager); ``stats(unit_name)`` ->
    {leaf name: LeafStat}. Routed experts of a MoE exposing ``row_observer`` (its grouped path)
    are matched to the units by identity of the expert modules. ``only``: {unit name: leaf
    names} to collect (None: every quantized leaf); a re-collection of one stage's leaves
    allocates nothing for the others."""

    def __init__(self, units: Sequence[Any], only: dict[str, set[str]] | None = None):
        self.units = list(units)
        self.only = only
        self._stats = {u.name: _UnitStats() for u in self.units}
        self._removers: list[Callable[[], None]] = []
        self._stacks: dict[tuple[int, str], torch.Tensor] = {}
        self.host_reads = 0               # count reads of the rows per expert (one per forward)

    def stats(self, name: str) -> dict[str, LeafStat]:
        return self._stats[name].by_leaf

    def wants(self, unit_name: str, leaf: str) -> bool:
        return self.only is None or leaf in self.only.get(unit_name, ())

    def attach(self, block: nn.Module) -> "HessianCollector":
        for u in self.units:
            ust = self._stats[u.name]
            for name, leaf in quant_leaves(u.module):
                if self.wants(u.name, name):
                    self._removers.append(observe_leaf(leaf, lambda x, n=name, lf=leaf, s=ust: s.feed(n, lf, x)))
            # stages are recorded during the unit's first call only (one call's tensors kept)
            handle = u.module.register_forward_hook(lambda *_, s=ust: s.stop_recording() if s.recording else None)
            self._removers.append(handle.remove)
        by_module = {id(u.module): u for u in self.units}
        for moe in block.modules():
            experts = getattr(moe, "experts", None)
            if not isinstance(experts, nn.ModuleList) or not hasattr(moe, "route_grouped"):
                continue
            index = {e: by_module[id(m)] for e, m in enumerate(experts) if id(m) in by_module}
            if not index or not all(isinstance(u.module, GatedProjections) for u in index.values()):
                continue
            moe.row_observer = self._row_observer(moe, index)
            self._removers.append(lambda m=moe: m.__dict__.pop("row_observer", None))
        return self

    def release(self) -> None:
        """Drop the collector's own references to the stacked expert Hessians: the LeafStats
        alone hold them afterwards, so a consumer that sets ``LeafStat.H = None`` for every
        expert of a stack frees it (GPTQ consumes each stage's statistics as it solves)."""
        self._stacks.clear()

    def detach(self) -> None:
        for r in reversed(self._removers):
            r()
        self._removers = []

    def __enter__(self) -> "HessianCollector":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def _row_observer(self, moe: nn.Module, index: dict[int, Any]):
        cache: dict[str, Any] = {"counts": None, "list": None}
        # expert leaves by role (GatedProjections): gate and up read the sorted rows, down the
        # activation's output rows; the model's grouped path names the projection it feeds
        roles = type(next(iter(index.values())).module).PROJECTIONS
        readers = {roles["gate"]: (roles["gate"], roles["up"]), roles["down"]: (roles["down"],)}
        # per projection the experts that want it (``only``), and their slots in its stack
        wanted = {p: {e: u for e, u in index.items() if any(self.wants(u.name, lf) for lf in leaves)}
                  for p, leaves in readers.items()}
        slots = {p: {e: k for k, e in enumerate(sorted(w))} for p, w in wanted.items()}
        stage_of: dict[str, int] = {}     # projection -> order of first use (w1 before w2)

        def observe(rows: torch.Tensor, projection: str, counts: torch.Tensor) -> None:
            if cache["counts"] is not counts:   # one host read of the counts per forward
                cache["counts"], cache["list"] = counts, counts.tolist()
                self.host_reads += 1
            stage_of.setdefault(projection, len(stage_of))
            index_p, slot = wanted[projection], slots[projection]
            if not index_p:
                return
            n_per = cache["list"]
            C = rows.shape[-1]
            key = (id(moe), projection)
            stack = self._stacks.get(key)
            if stack is None:
                # one slot per expert collected here (a pass may hold only some of the experts)
                stack = self._stacks[key] = torch.zeros(len(index_p), C, C, dtype=torch.float32, device=rows.device)
                for e, u in index_p.items():
                    ust = self._stats[u.name]
                    st = LeafStat(H=stack[slot[e]:slot[e] + 1], n=0, leaves=list(readers[projection]),
                                  stage=stage_of[projection])
                    for leaf in readers[projection]:
                        ust.by_leaf[leaf] = st
            x = rows.detach().float()
            start = 0
            for e, n in enumerate(n_per):
                if n and e in index_p:
                    seg = x[start:start + n]
                    stack[slot[e]].addmm_(seg.t(), seg)
                    self._stats[index_p[e].name].by_leaf[readers[projection][0]].n += n
                start += n
        return observe

    def free(self) -> None:
        self._stacks.clear()
        for s in self._stats.values():
            s.by_leaf.clear()


# ----------------------------------------------------------------------------- exact losses
@torch.no_grad()
def fake_quant_weight(leaf: nn.Module) -> torch.Tensor:
    """The weight the leaf's forward uses with quantization on (fake-quant), 2-D."""
    return leaf.weight_quantizer(leaf.weight.detach())


@torch.no_grad()
def weight_error(dW: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """``sum_b tr(dW_b H_b dW_b^T)`` per matrix b: dW [B, R, C], H [B, C, C] -> [B] (fp32 math,
    fp64 result). With H = sum x^T x this is exactly ``||X dW^T||^2``."""
    dW = dW.float()
    return (torch.bmm(dW, H) * dW).sum(dim=(1, 2)).double()
