"""The learnable rounding state of many same-shaped weight leaves, stacked.

Block-wise rounding tunes every integer-grid leaf of a layer at once. A layer's routed experts
are hundreds of leaves of one shape whose weights a model already keeps stacked (``[E, R, C]``:
the grouped-GEMM path), so their state is stacked too: one offset tensor ``V [Ec, R, C]`` and one
clip tensor ``[Ec, R, C / g]`` per CHUNK of ``Ec`` experts. Each leaf's ``round_offset`` and
``clip`` become views into its chunk (so everything that reads a leaf -- a per-leaf forward, the
fold into a fixed grid, the saved parameters -- sees the same numbers), while a model's grouped
path computes a chunk's fake-quant weights with ONE differentiable op
(:func:`rounded_fake_quant`) and a grouped GEMM, instead of a Python loop over the leaves.

Chunks are separate tensors so that an optimizer stepping each parameter as soon as its
gradient is complete (``register_post_accumulate_grad_hook``) never holds more than one chunk's
gradient (a V4-Flash layer's offsets are 25.8 GB in float32).

The torch path of :func:`rounded_fake_quant` is ``formats.fake_quant`` itself on the stacked
tensor (the same operations, element for element, as each leaf's quantizer); on CUDA with Triton
the forward and the backward are one kernel each (``runtime/fused_rounding.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn

from ..runtime import device as devmod
from ..runtime import fused_rounding
from . import formats
from .quantizers import CLIP_MIN
from .schemes import TensorSpec


def stackable(spec: TensorSpec | None) -> bool:
    """An integer grid whose scales are per row or per group of a row: stacking rows changes no block."""
    return spec is not None and not spec.is_identity and spec.format == "int" and spec.granularity in ("group", "channel")


def _group_of(spec: TensorSpec, cols: int) -> int:
    return spec.group_size if spec.granularity == "group" else cols


def _ste_clamp(p: torch.Tensor, lo, hi) -> torch.Tensor:
    clamped = torch.clamp(p, lo, hi)
    return p + (clamped - p).detach() if p.requires_grad else clamped


@dataclass
class SignStep:
    """The SignSGD step an offset takes inside its own backward (``lr`` None: no step, the
    offset gets its gradient as usual). Set by the optimizer before each backward."""

    lr: float | None = None


def signsgd_(offset: torch.Tensor, dv: torch.Tensor, lr: float) -> None:
    """offset = clamp(offset - lr * sign(dv), -0.5, 0.5), the arithmetic in float32 whatever the
    offset's dtype (the fused kernel's, element for element)."""
    v = offset.float() - lr * torch.sign(dv.float())
    offset.copy_(v.clamp_(-0.5, 0.5))


class _FusedRounding(torch.autograd.Function):
    """The Triton forward / backward of :func:`rounded_fake_quant` (CUDA)."""

    @staticmethod
    def forward(ctx, w, clip, offset, group, qmin, qmax, symmetric, step):
        ctx.save_for_backward(w, clip, offset)
        ctx.args = (group, qmin, qmax, symmetric, step)
        return fused_rounding.fq_round_forward(w, offset, clip, group, qmin, qmax, symmetric, CLIP_MIN)

    @staticmethod
    def backward(ctx, g):
        w, clip, offset = ctx.saved_tensors
        group, qmin, qmax, symmetric, step = ctx.args
        want_c = clip is not None and ctx.needs_input_grad[1]
        want_v = offset is not None and ctx.needs_input_grad[2]
        lr = step.lr if step is not None else None
        dv, dc = fused_rounding.fq_round_backward(g.contiguous(), w, offset, clip, group, qmin, qmax, symmetric,
                                                  CLIP_MIN, want_v, want_c, step_lr=lr)
        return (None, None if dc is None else dc.view_as(clip), None if dv is None else dv.view_as(offset),
                None, None, None, None, None)


class _SteppedRounding(torch.autograd.Function):
    """The torch definition with the offset's SignSGD step taken in the backward (what the fused
    kernel does, for devices without it): d out / d offset and d out / d clip by autograd through
    ``formats.fake_quant`` on a float32 copy of the offset, then the step in place."""

    @staticmethod
    def forward(ctx, w, clip, offset, spec, step):
        ctx.save_for_backward(w, clip, offset)
        ctx.args = (spec, step)
        with torch.no_grad():
            c = None if clip is None else clip.clamp(CLIP_MIN, 1.0)
            return formats.fake_quant(w, spec, c, offset.float().clamp(-0.5, 0.5))

    @staticmethod
    def backward(ctx, g):
        w, clip, offset = ctx.saved_tensors
        spec, step = ctx.args
        want_c = clip is not None and ctx.needs_input_grad[1]
        with torch.enable_grad():
            v32 = offset.detach().float().requires_grad_(True)
            c = None if clip is None else clip.detach().requires_grad_(want_c)
            out = formats.fake_quant(w, spec, None if c is None else _ste_clamp(c, CLIP_MIN, 1.0),
                                     _ste_clamp(v32, -0.5, 0.5))
            grads = torch.autograd.grad(out, [v32, c] if want_c else [v32], g)
        dv = grads[0]
        if ctx.needs_input_grad[2]:
            if step.lr is None:
                return None, grads[1] if want_c else None, dv.to(offset.dtype), None, None
            with torch.no_grad():
                signsgd_(offset, dv, step.lr)
        return None, grads[1] if want_c else None, None, None, None


def rounded_fake_quant(w: torch.Tensor, spec: TensorSpec, clip: torch.Tensor | None,
                       offset: torch.Tensor | None, step: SignStep | None = None) -> torch.Tensor:
    """``formats.fake_quant(w, spec, clamp(clip), clamp(offset))`` for an integer group / channel
    spec, differentiable with respect to ``clip`` [..., R, C / g] and ``offset`` [..., R, C]
    (clamped to [CLIP_MIN, 1] and [-0.5, 0.5] straight-through, as the weight quantizer does).
    ``w`` is treated as a constant (frozen weights).

    ``step`` with an ``lr``: the backward does not return the offset's gradient but takes the
    SignSGD step on the offset in place (:class:`SignStep`); the clip's gradient is returned."""
    group = _group_of(spec, w.shape[-1])
    w = w.detach()
    fused = (devmod.fused_kernels_enabled(w.device) and fused_rounding.fused_rounding_supported(w, group)
             and w.is_contiguous() and (offset is None or offset.is_contiguous())
             and (clip is None or (clip.is_contiguous() and clip.dtype == torch.float32)))
    if fused:
        lo, hi = formats._int_range(spec.bits, spec.symmetric)
        return _FusedRounding.apply(w, clip, offset, group, lo, hi, spec.symmetric, step)
    if step is not None and offset is not None:
        return _SteppedRounding.apply(w, clip, offset, spec, step)
    c = None if clip is None else _ste_clamp(clip, CLIP_MIN, 1.0)
    v = None if offset is None else _ste_clamp(offset, -0.5, 0.5)
    return formats.fake_quant(w, spec, c, v)


@dataclass
class StackMember:
    """One leaf's place in a stack: expert ``expert`` rows ``rows[0]:rows[1]``."""

    leaf: nn.Module
    expert: int
    rows: tuple[int, int]


@dataclass
class LeafStack:
    """Learnable rounding state of the leaves ``members`` whose weights are ``weight [E, R, C]``.

    Built by :meth:`bind`; every member's ``weight_quantizer.round_offset`` (and ``clip`` with
    ``learn_clip``) is then a view into ``offsets[k]`` (``clips[k]``) of its chunk k, experts
    ``bounds[k]``. ``clip_floor[k]`` (broadcast over a row's groups): each member's clip floor,
    min(clip_min, its start), as ``rounding.learnable_state`` gives a single leaf."""

    weight: torch.Tensor
    spec: TensorSpec
    members: list[StackMember]
    bounds: list[tuple[int, int]] = field(default_factory=list)
    offsets: list[torch.Tensor] = field(default_factory=list)
    clips: list[torch.Tensor] = field(default_factory=list)
    clip_floor: list[torch.Tensor] = field(default_factory=list)
    #: set: the offsets take their SignSGD step inside the backward (no gradient tensor)
    step: SignStep | None = None

    def bind(self, learn_clip: bool, clip_min: float, bounds: Sequence[tuple[int, int]],
             offset_dtype: torch.dtype = torch.float32, step: SignStep | None = None) -> None:
        """Create the chunked state (chunk k: experts ``bounds[k]``) from the members' current
        state and point the members at it. ``offset_dtype``: float32, or float16 where memory
        binds (an offset lies in [-0.5, 0.5]: float16 resolves 2^-12 there; steps smaller than
        half of that are lost, which the default schedule reaches in its last 3 % of steps).
        ``step``: the offsets step inside the backward (:class:`SignStep`)."""
        n_exp, rows, cols = self.weight.shape
        dev = self.weight.device
        group = _group_of(self.spec, cols)
        self.bounds = list(bounds)
        self.step = step
        by_expert: dict[int, list[StackMember]] = {}
        for m in self.members:
            by_expert.setdefault(m.expert, []).append(m)
        for e0, e1 in self.bounds:
            v = torch.zeros(e1 - e0, rows, cols, dtype=offset_dtype, device=dev)
            # the scales' public shape: [Ec, R] per channel, [Ec, R, C / g] per group
            tail = (cols // group,) if self.spec.granularity == "group" else ()
            c = torch.ones(e1 - e0, rows, *tail, dtype=torch.float32, device=dev) if learn_clip else None
            floor = torch.ones(e1 - e0, rows, *(1,) * len(tail), dtype=torch.float32, device=dev) if learn_clip else None
            for e in range(e0, e1):
                for m in by_expert.get(e, ()):
                    wq = m.leaf.weight_quantizer
                    r0, r1 = m.rows
                    if wq.round_offset is not None:
                        v[e - e0, r0:r1].copy_(wq.round_offset.detach())
                    wq.round_offset = nn.Parameter(v[e - e0, r0:r1], requires_grad=False)
                    if c is not None:
                        start = wq.init_clip(m.leaf.weight)
                        c[e - e0, r0:r1].copy_(start.detach())
                        floor[e - e0, r0:r1] = min(clip_min, float(start.min()))
                        wq.clip = nn.Parameter(c[e - e0, r0:r1], requires_grad=False)
            self.offsets.append(v)
            if c is not None:
                self.clips.append(c)
                self.clip_floor.append(floor)

    def params(self) -> list[torch.Tensor]:
        return self.offsets + self.clips

    @torch.no_grad()
    def clamp_(self) -> None:
        """After a step: offsets back into [-0.5, 0.5] (unless they stepped in the backward,
        which clamps them), clips into [floor, 1]."""
        for v in (self.offsets if self.step is None else ()):
            v.clamp_(-0.5, 0.5)
        for c, lo in zip(self.clips, self.clip_floor):
            torch.clamp(c, min=lo, max=torch.ones_like(lo), out=c)

    def fake_quant(self, k: int) -> torch.Tensor:
        """Chunk k's fake-quant weights [Ec, R, C] in the weight's dtype (differentiable)."""
        e0, e1 = self.bounds[k]
        return rounded_fake_quant(self.weight[e0:e1], self.spec, self.clips[k] if self.clips else None,
                                  self.offsets[k], self.step)


def chunk_bounds(n_experts: int, expert_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Consecutive expert ranges of at most ``chunk_bytes`` each (at least one expert a chunk;
    ``chunk_bytes`` <= 0: one chunk)."""
    per = max(1, chunk_bytes // max(expert_bytes, 1)) if chunk_bytes > 0 else n_experts
    return [(e, min(e + per, n_experts)) for e in range(0, n_experts, per)]


def held_chunks(bounds: Sequence[tuple[int, int]], expert_weight_bytes: int, hold_bytes: int) -> frozenset[int]:
    """The chunks (indices into ``bounds``, first ones first) whose fake-quant weights fit
    ``hold_bytes`` together: block-wise rounding runs them without activation checkpointing (their
    weights and intermediates kept for the backward) and recomputes the rest. Only the weights are
    counted: they are a chunk's largest intermediate (its activations scale with the routed rows,
    a few percent of them at a V4-Flash step)."""
    held, used = set(), 0
    for k, (e0, e1) in enumerate(bounds):
        need = (e1 - e0) * expert_weight_bytes
        if used + need > hold_bytes:
            break
        held.add(k)
        used += need
    return frozenset(held)


def stack_leaves(weight: torch.Tensor, members: Sequence[StackMember]) -> LeafStack | None:
    """A :class:`LeafStack` over ``members`` when every one quantizes with one stackable spec and
    owns a learnable integer grid (no fixed scales), else None (the caller keeps them per leaf)."""
    specs = {m.leaf.weight_quantizer.spec for m in members}
    if len(specs) != 1:
        return None
    spec = next(iter(specs))
    if not stackable(spec) or weight.dim() != 3:
        return None
    for m in members:
        wq = m.leaf.weight_quantizer
        if not (getattr(m.leaf, "enabled", True) and wq.roundable and wq.learnable):
            return None
    return LeafStack(weight=weight, spec=spec, members=list(members))
