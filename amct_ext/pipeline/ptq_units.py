"""PTQ units: the pieces of a decoder layer that are calibrated one at a time.

A unit is a sub-module whose float output the solver reproduces with its quantized twin
(an attention, a routed expert, the shared expert). Units are named by checkpoint coordinates
(``layers.3.ffn.experts.17``) so saved parameters map back to the model unambiguously.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Iterator

from torch import nn


@dataclass
class PtqUnit:
    kind: str                 # 'attn' | 'expert' | 'shared_expert'
    name: str                 # checkpoint coordinate, e.g. 'layers.3.ffn.experts.17'
    layer_idx: int
    module: nn.Module
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def file_stem(self) -> str:
        """``layer_{i}_{unit}``: the name of the unit's parameter file (without suffix)."""
        local = self.name[len(f"layers.{self.layer_idx}."):] if self.name.startswith("layers.") else self.name
        return f"layer_{self.layer_idx}_{local.replace('.', '_')}"


@dataclass
class UnitResult:
    """What the report says about one solved unit."""

    name: str
    kind: str
    layer: int
    loss_before: float | None       # RTN MSE on the captured calibration calls (None: no calls)
    loss_after: float | None        # MSE of the kept parameters (<= loss_before with the guard)
    seconds: float
    n_calls: int
    n_params: int                   # learnable scalars (0: nothing learned, or not counted)
    best_epoch: int                 # 0 = RTN kept, k = after epoch k (epoch-based algorithms)
    resumed: bool = False           # loaded from an earlier run's files, not solved now
    stats: dict[str, Any] | None = None   # per-algorithm statistics (algorithms/runner.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parallel_groups(units: Iterable[PtqUnit]) -> list[list[PtqUnit]]:
    """A layer's units (in forward order) cut into runs of PARALLEL units: no unit of a run
    reads another's output. Consecutive units with the same ``metadata["reads"]`` (the name of
    the tensor they read, set by the model adapter: an MoE's routed and shared experts all read
    the FFN input) form one run; without it, consecutive units of one kind do (the routed
    experts of a layer). Used where units must be solved downstream first (sequential GPTQ on
    capture statistics: re-collecting a unit's inputs needs every unit upstream still float)."""
    groups: list[list[PtqUnit]] = []
    last = None
    for u in units:
        key = ("reads", u.metadata["reads"]) if u.metadata.get("reads") is not None else ("kind", u.kind)
        if groups and key == last:
            groups[-1].append(u)
        else:
            groups.append([u])
        last = key
    return groups


def make_ptq_unit(kind: str, name: str, layer_idx: int, module: nn.Module, **metadata: Any) -> PtqUnit:
    return PtqUnit(kind=kind, name=name, layer_idx=layer_idx, module=module, metadata=dict(metadata))


def iter_indexed_units(kind: str, prefix: str, layer_idx: int, modules: Iterable[nn.Module],
                       index_key: str) -> Iterator[PtqUnit]:
    """One unit per module of an indexed container (``ffn.experts.{e}``), metadata ``{index_key: e}``."""
    for idx, module in enumerate(modules):
        yield make_ptq_unit(kind, f"{prefix}.{idx}", layer_idx, module, **{index_key: idx})
