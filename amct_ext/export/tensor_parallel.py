"""Tensor-parallel serving of an exported layout: which TP sizes a serving engine can shard it over.

An engine that runs a model at tensor-parallel size N splits some weights across N ranks: a
column-parallel linear splits its output rows, a row-parallel one its input columns (and a fused
MoE splits the experts' intermediate dimension: w1 / w3 rows, w2 columns). Each rank loads its
slice of the weight *and of its scales*, so a quantized weight can be sharded only where every
slice holds whole quantization blocks: an input-dim split of a group-128 weight needs
``in / N % 128 == 0`` (vLLM: ``verify_group_size_divides_partition``), an FP8 128x128-block
weight needs 128-multiples on both split dims, an MX weight 32 along its input dim. A dimension
that does not divide by N at all cannot be split. Whole-tensor checks (the group divides the
full input dim) say nothing about this: the tensor is fine, the shard is not.

The rules of one engine -- which leaves it splits along which dim, plus model-wide conditions
such as "the attention heads divide by N" -- come from the engine profile
(:class:`amct_ext.export.engine.EngineProfile` ``tp_rules`` / ``tp_checks``); a model supplies
the leaves' shapes and written specs (:class:`LeafLayout`). This module only does the arithmetic.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from ..quant.schemes import TensorSpec

#: the sizes an export's metadata is checked against (the TP sizes a single node serves)
TP_CANDIDATES = (1, 2, 4, 8, 16)
OUT, IN = "out", "in"
#: elements of one MX scale block along the input dim (OCP MX: 32)
MX_BLOCK = 32


@dataclass(frozen=True)
class ShardRule:
    """The engine splits the leaves matching ``pattern`` (layer-relative, full match) along
    ``dim``: OUT (column parallel: rows) or IN (row parallel: columns)."""

    pattern: str
    dim: str
    source: str

    def matches(self, leaf: str) -> bool:
        return re.fullmatch(self.pattern, leaf) is not None


@dataclass(frozen=True)
class LeafLayout:
    """One exported weight: its layer-relative name, the name printed in a refusal, its stored
    [out, in] shape and the spec it is written in (None: a float weight)."""

    leaf: str
    where: str
    shape: tuple[int, int]
    spec: TensorSpec | None


def granule(spec: TensorSpec | None) -> tuple[tuple[int, int], str]:
    """((rows, columns), name): the block of the written weight a shard must hold whole."""
    if spec is None:
        return (1, 1), "float weight"
    if spec.format == "int" and spec.granularity == "group":
        return (1, int(spec.group_size)), f"group {spec.group_size}"
    if spec.format == "fp8" and spec.granularity == "block":
        bn, bk = (int(x) for x in spec.block_size)
        return (bn, bk), f"block {bn}x{bk}"
    if spec.format in ("mxfp4", "mxfp8"):
        return (1, MX_BLOCK), f"{spec.format} block {MX_BLOCK}"
    return (1, 1), "per-channel scale"


def shard_failure(layout: LeafLayout, rule: ShardRule, tp: int) -> str | None:
    """Why ``layout`` cannot be split ``tp`` ways along ``rule.dim`` (None: it can)."""
    axis = 0 if rule.dim == OUT else 1
    name = "output" if rule.dim == OUT else "input"
    size = int(layout.shape[axis])
    if size % tp:
        return (f"{layout.where}: its {name} dim {size} does not split over --tensor-parallel {tp} "
                f"({rule.source})")
    blocks, what = granule(layout.spec)
    per_rank = size // tp
    if per_rank % blocks[axis]:
        return (f"{layout.where}: {name} dim {size} / --tensor-parallel {tp} = {per_rank} per rank, "
                f"not a multiple of its {what} ({rule.source})")
    return None


def first_failure(layouts: Iterable[LeafLayout], rules: Sequence[ShardRule], tp: int,
                  checks: Sequence[Callable[[int], str | None]] = ()) -> str | None:
    """The first reason the layout cannot be served at TP = ``tp``: model-wide ``checks``
    (each ``tp -> reason | None``) first, then every leaf against the first rule it matches."""
    if tp < 1:
        return f"--tensor-parallel {tp}: must be a positive integer"
    for check in checks:
        why = check(tp)
        if why:
            return why
    for layout in layouts:
        rule = next((r for r in rules if r.matches(layout.leaf)), None)
        if rule is not None:
            why = shard_failure(layout, rule, tp)
            if why:
                return why
    return None


def servable_sizes(layouts: Sequence[LeafLayout], rules: Sequence[ShardRule],
                   checks: Sequence[Callable[[int], str | None]] = (),
                   candidates: Sequence[int] = TP_CANDIDATES) -> list[int]:
    """The ``candidates`` at which the layout can be served."""
    return [tp for tp in candidates if first_failure(layouts, rules, tp, checks) is None]
