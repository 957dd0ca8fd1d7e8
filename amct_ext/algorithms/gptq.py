"""GPTQ (Frantar et al., 2022): quantize a weight column by column, pushing each column's
rounding error onto the columns not yet quantized through the inverse Hessian of the layer's
reconstruction loss ``||X W^T - X Q^T||^2`` (H = 2 X^T X over the calibration inputs X).

Per quantized leaf of a unit (a QuantLinear, or the grouped ``wo_a``):
- Hessian: accumulated on the compute device from the leaf's inputs, one replayed call at a
  time (the inputs are never stacked). ``wo_a`` applies one [o_lora, d] block per output group
  g to ``o[..., g, :]``: one Hessian per group, [G, d, d].
- Damping: ``percdamp * mean(diag(H))`` added to the diagonal. Columns whose input is always
  zero ("dead", diag 0) get diag 1 and keep their RTN value (no information either way).
- Lazy blocks of ``block_size`` columns (rounded up to a multiple of the group size, so a
  group's scale is computed once all earlier columns' updates reached it).
- Grid: the scheme's weight spec through amct_ext.quant.formats, any format / granularity:
  integer groups (no act-order) take their scale when the loop reaches the group, from the
  error-compensated columns (as in the reference implementation); every other case (per
  channel, per tensor, 128x128 blocks, fp8, MX, and any grouped spec under act-order) uses the
  scales of the ORIGINAL weight ("static groups", on the original column order), so the result
  stays on the scheme's grid whatever the processing order. A clip factor already learned on
  the leaf (e.g. ``clip`` earlier in the recipe) is folded into those scales.
- act-order: columns processed by decreasing diag(H); the permutation is undone at the end.

Result: the leaf's weight is replaced IN PLACE by the dequantized grid values in the weight's
own dtype (fp32 compressor islands stay fp32), and its weight quantizer gets GPTQ's scales
(and zero points) as fixed qparams, so ``fake_quant`` of the new weight returns exactly that
weight and ``export()`` writes GPTQ's integers and scales. Saved as ``{leaf}.weight`` +
``{leaf}.weight_quantizer.scale`` (+ ``.zero_point``).

Within a unit GPTQ is sequential: leaves are grouped into stages by the tensor they read (for
an attention: {wq_a, wkv, compressor and indexer linears reading x} -> {wq_b, indexer.wq_b
reading qr} -> {wo_a} -> {wo_b}; for an expert {w1, w3} -> {w2}); each stage's Hessians are
those of the inputs the unit's float calls produce with every earlier stage already
GPTQ-quantized (and all of the unit's activation quantizers on), so w2 sees the inputs of the
quantized w1 / w3. Where they come from:
- capture statistics (no call stored, the default): stage 0 from the capture's Hessians, each
  later stage from one more forward of the layer with quantization on in the units being solved
  only (``SolveContext.recollect``), collecting just that stage's leaves. The layer's units are
  solved downstream first, in runs of parallel units (``ptq_units.parallel_groups``: the routed
  and shared experts, then the attention), so every unit upstream of a run is still float while
  the run is re-collected: one forward serves all experts' w2, and V4's attention adds one per
  stage after the first (two with the attn-linear targets, wo_a float; three with wo_a). Equal to the replayed calls bit for bit on the tiny layer
  (tests/test_gptq_sequential_statistics.py);
- stored calls (another algorithm of the recipe needs them, e.g. ``clip,gptq``): a replay of the
  unit's calls per stage.
Either way a stage is solved by one joint solver: leaves reading one tensor share a Hessian and
are solved as one matrix of stacked rows (w1 / w3), experts batched.
``sequential=false`` takes every Hessian from the FLOAT unit instead (llm-compressor's choice:
all Hessians of a layer from one pass of the unquantized layer), from the capture alone, or with
stored calls (``all_tokens``) from one replay with quantization off.
Each leaf keeps GPTQ's weights only where the exact loss ``tr(dW H dW^T)`` (on the stage's
Hessian) is not above RTN's.

The column sweep of a lazy block (``gptq_solve``): on CUDA, for an integer grid in fp32 (static,
or dynamic groups as wide as the lazy block), it is one Triton kernel (``runtime/fused_gptq.py``,
bit-identical); otherwise the torch sweep ``_sweep_block``, replayed from a CUDA graph where there
is one.

Routed experts: :meth:`GPTQ.apply_group` gets every expert of the layer; each stage's Hessians
are stacked [E, D, D] and solved in one batched pass, ``expert_chunk`` experts at a time (a
V4-Flash expert's w1 Hessian is 4096^2 fp32 = 64 MiB). An expert no calibration token reached
keeps RTN. ``all_tokens=true`` uses every token of the layer for every expert (llm-compressor's
MoE calibration): the tokens are the union of the experts' captured inputs -- each token appears
top-k times, a uniform weight that GPTQ is invariant to -- and w2's inputs are computed from
them without routing weights (a token has none for an expert that did not pick it).
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch
from torch import nn

from ..quant import formats
from ..runtime.device import GraphedCall, fused_kernels_enabled
from ..runtime.fused_gptq import fused_sweep_block, fused_sweep_supported
from ..pipeline.capture import UnitCall
from ..quant.quant_linear import QuantLinear
from ..pipeline.replay import replay_calls as _replay
from .base import Algorithm, Needs, SolveContext, UnitData
from .recipe import RecipeError, register
from ..errors import AmctError


# ----------------------------------------------------------------------------- the solver
def _cholesky_inverse_upper(H: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp I)^-1, batched [B, C, C]; raises damping where a
    matrix is not positive definite (tiny calibration sets make H singular)."""
    C = H.shape[-1]
    eye = torch.eye(C, dtype=H.dtype, device=H.device)
    diag = H.diagonal(dim1=-2, dim2=-1)
    damp = percdamp * diag.mean(-1)
    for attempt in range(6):
        Hd = H + (damp * (10 ** attempt))[:, None, None] * eye
        L, info = torch.linalg.cholesky_ex(Hd)
        if not bool((info != 0).any()):
            break
    else:
        raise FloatingPointError("GPTQ: the Hessian is not positive definite even with 1e5 x damping")
    Hinv = torch.cholesky_inverse(L)
    return torch.linalg.cholesky(Hinv, upper=True)


def _quant_column(w, s, z, spec):
    """One column [B, R] on the grid (s, z: [B, R]); the same float ops as formats.fake_quant."""
    q = formats._codes_with_qparams(w, s, z, spec)
    return formats._int_decode(q, s, z) if spec.format == "int" else q * s


def _group_qparams(wg: torch.Tensor, spec, clip_g: torch.Tensor | None):
    """Scale / zero point [B, R, 1] of one integer group from its current columns [B, R, g]."""
    if spec.symmetric:
        amax = wg.abs().amax(dim=-1, keepdim=True)
        if clip_g is not None:
            amax = amax * clip_g
        return formats.int_qparams_from_range(-amax, amax, spec.bits, True)
    xmin = wg.amin(dim=-1, keepdim=True)
    xmax = wg.amax(dim=-1, keepdim=True)
    if clip_g is not None:
        xmin, xmax = xmin * clip_g, xmax * clip_g
    return formats.int_qparams_from_range(xmin, xmax, spec.bits, False)


def _sweep_block(W1: torch.Tensor, U1: torch.Tensor, S1: torch.Tensor | None, Z1: torch.Tensor | None,
                 clip1: torch.Tensor | None, *, spec, gs: int | None):
    """GPTQ's column sweep of one lazy block: ``W1`` [B, R, n] (not modified), ``U1`` [B, n, n]
    (the block's part of the upper Cholesky factor of H^-1), the grid ``S1`` / ``Z1`` [B, R, n]
    (static) or None (``gs``: integer groups whose qparams are taken when the sweep reaches them,
    the block starting on a group boundary; ``clip1`` [B, R, groups of the block] or None).
    Returns ``(Q1, E1, S1, Z1)``: grid values, the scaled errors (contiguous, for the trailing
    update), and the qparams used.

    Each column costs only the launches that decide the result, written into preallocated
    buffers, and nothing reads the host: the sweep is launch bound (RESULTS §0.9) and is replayed
    from a CUDA graph (runtime.device.GraphedCall). Every element sees exactly the float ops of
    the straightforward loop (tests/test_gptq_solver_exact.py: a frozen copy of it)."""
    B, R, n = W1.shape
    W1 = W1.clone()
    dynamic = gs is not None
    if dynamic:
        S1 = torch.empty_like(W1)
        Z1 = None if spec.symmetric else torch.empty_like(W1)
    is_int = spec.format == "int"
    if is_int:
        qmin, qmax = formats._int_range(spec.bits, spec.symmetric)
    Q1 = torch.empty_like(W1)
    E1 = torch.empty_like(W1)
    tmp = torch.empty_like(W1)
    col = torch.empty(B, R, dtype=W1.dtype, device=W1.device)
    D1 = U1.diagonal(dim1=-2, dim2=-1)[:, None, :]               # [B, 1, n]
    for i in range(n):
        if dynamic and i % gs == 0:
            g = i // gs
            s, z = _group_qparams(W1[:, :, i:i + gs], spec, None if clip1 is None else clip1[:, :, g:g + 1])
            S1[:, :, i:i + gs] = s
            if Z1 is not None:
                Z1[:, :, i:i + gs] = z
        w = W1[:, :, i]
        s = S1[:, :, i]
        q = Q1[:, :, i]
        if is_int:                                   # formats._int_codes / _int_decode, op by op
            torch.div(w, s, out=col)
            torch.round(col, out=col)
            if Z1 is not None:
                z = Z1[:, :, i]
                col.add_(z)
                col.clamp_(qmin, qmax)
                col.sub_(z)
            else:
                col.clamp_(qmin, qmax)
            torch.mul(col, s, out=q)
        else:
            torch.mul(formats._codes_with_qparams(w, s, None, spec), s, out=q)
        e = E1[:, :, i]
        torch.sub(w, q, out=e)
        e.div_(D1[:, :, i])
        if i + 1 < n:
            t = tmp[:, :, :n - i - 1]
            torch.mul(e[:, :, None], U1[:, None, i, i + 1:], out=t)
            W1[:, :, i + 1:].sub_(t)
    return Q1, E1, S1, Z1


@torch.no_grad()
def gptq_solve(W: torch.Tensor, H: torch.Tensor, spec, *, S: torch.Tensor | None = None,
               Z: torch.Tensor | None = None, clip: torch.Tensor | None = None, block_size: int = 128,
               percdamp: float = 0.01, act_order: bool = False, graphs: dict | None = None):
    """Batched GPTQ. ``W`` [B, R, C] and ``H`` [B, C, C] float32 on one device.

    Grid: either static expanded qparams ``S`` (and ``Z`` for asymmetric int), one value per
    element [B, R, C], or (``S`` None: integer 'group' specs) scales computed per group during
    the loop, with ``clip`` [B, R, C // g] (or None). Returns ``(Q, S, Z, loss)``: the grid
    values [B, R, C] (float32), the expanded qparams actually used, and the per-matrix GPTQ
    objective ``sum((w - q)^2 / d^2) / 2`` [B]. ``graphs``: a dict the caller keeps across
    calls of one bucket, so the column sweep's CUDA graph is captured once (not once a call)."""
    B, R, C = W.shape
    W = W.clone()
    H = H.clone()
    dynamic = S is None
    gs = spec.group_size if dynamic else None
    if dynamic:
        if spec.format != "int" or spec.granularity != "group":
            raise ValueError("per-group scales during the loop are for integer 'group' specs")
        if act_order:
            raise ValueError("act-order needs static groups (pass S)")
        S = torch.empty_like(W)
        Z = None if spec.symmetric else torch.empty_like(W)
        block_size = math.ceil(block_size / gs) * gs
    diag = H.diagonal(dim1=-2, dim2=-1)
    dead = diag == 0
    diag.masked_fill_(dead, 1.0)
    perm = None
    if act_order:
        perm = torch.argsort(diag, dim=-1, descending=True, stable=True)       # [B, C]
        W = W.gather(2, perm[:, None, :].expand(B, R, C))
        S = S.gather(2, perm[:, None, :].expand(B, R, C))
        if Z is not None:
            Z = Z.gather(2, perm[:, None, :].expand(B, R, C))
        H = H.gather(1, perm[:, :, None].expand(B, C, C)).gather(2, perm[:, None, :].expand(B, C, C))
    U = _cholesky_inverse_upper(H, percdamp)
    del H, diag, dead          # the damped copy is no longer needed: free it before the sweep
    Q = torch.empty_like(W)
    loss = torch.zeros(B, dtype=torch.float64, device=W.device)
    key = (spec, dynamic, gs)
    if graphs is None:
        graphs = {}
    if key not in graphs:
        graphs[key] = GraphedCall(functools.partial(_sweep_block, spec=spec, gs=gs), W.device)
    sweep = graphs[key]
    # integer grids on CUDA: the block's sweep as one Triton kernel (runtime/fused_gptq.py), bit
    # for bit; dynamic groups only where one group is the whole block (its qparams come first)
    fused = spec.format == "int" and (not dynamic or block_size == gs) and fused_kernels_enabled(W.device) \
        and fused_sweep_supported(W[:, :, :block_size], U)
    if fused:
        qmin, qmax = formats._int_range(spec.bits, spec.symmetric)
    for i1 in range(0, C, block_size):
        i2 = min(i1 + block_size, C)
        clip1 = None if (clip is None or not dynamic) else clip[:, :, i1 // gs:math.ceil(i2 / gs)]
        if fused:
            W1 = W[:, :, i1:i2]
            if dynamic:
                s, z = _group_qparams(W1, spec, None if clip1 is None else clip1[:, :, 0:1])
                S1, Z1 = s.expand(W1.shape), None if z is None else z.expand(W1.shape)
            else:
                S1, Z1 = S[:, :, i1:i2], None if Z is None else Z[:, :, i1:i2]
            Q1, E1 = fused_sweep_block(W1, U[:, i1:i2, i1:i2], S1, Z1, qmin, qmax)
        else:
            Q1, E1, S1, Z1 = sweep(W[:, :, i1:i2], U[:, i1:i2, i1:i2], None if dynamic else S[:, :, i1:i2],
                                   None if (dynamic or Z is None) else Z[:, :, i1:i2], clip1)
        Q[:, :, i1:i2] = Q1
        if dynamic:
            S[:, :, i1:i2] = S1
            if Z is not None:
                Z[:, :, i1:i2] = Z1
        loss += E1.double().square().sum(dim=(1, 2)) / 2
        if i2 < C:
            W[:, :, i2:] -= torch.bmm(E1, U[:, i1:i2, i2:])
    if perm is not None:
        inv = torch.argsort(perm, dim=-1)
        idx = inv[:, None, :].expand(B, R, C)
        Q, S = Q.gather(2, idx), S.gather(2, idx)
        Z = None if Z is None else Z.gather(2, idx)
    return Q, S, Z, loss


def _check_recollected_rows(captured: dict, source: dict, want: dict[str, set[str]]) -> None:
    """A re-collection sees the same calibration rows as the capture (same samples, same
    routing: every unit upstream is still float). Fewer rows mean the re-run missed calls --
    e.g. a unit module called twice in a sample, whose re-run stops after the first (
    ``BaseModel.do_block_forward(stop_after=...)``): a clear error, not a thinner Hessian."""
    for name, leaves in want.items():
        for leaf in leaves:
            before, now = captured[name].get(leaf), source.get(name, {}).get(leaf)
            if before is not None and now is not None and now.n != before.n:
                raise AmctError(f"sequential gptq: the layer's re-run gave {name}.{leaf} {now.n} rows, the capture "
                                f"{before.n}; does a unit's module run more than once per sample?")


# ----------------------------------------------------------------------------- leaves
class _Target:
    """One quantized leaf of a unit as a GPTQ problem: B matrices [R, C] with B Hessians
    (B = 1 for a linear, the number of output groups for wo_a)."""

    def __init__(self, name: str, leaf: nn.Module):
        self.name, self.leaf = name, leaf
        w = leaf.weight
        self.groups = int(getattr(leaf, "n_groups", 0) or 0)   # WoAQuant: grouped einsum
        self.B = self.groups or 1
        R2, self.C = w.shape
        self.R = R2 // self.B
        self.H: torch.Tensor | None = None
        self.n = 0

    @property
    def spec(self):
        return self.leaf.weight_quantizer.spec

    @property
    def hook_module(self) -> nn.Module:
        # wo_a is no module call of its own: its input quantizer sees o [B, S, G, d] first
        return self.leaf.input_quantizer if self.groups else self.leaf

    def key(self) -> tuple:
        return (self.name, self.B, self.R, self.C, self.leaf.weight.dtype, self.spec)

    def add(self, x: torch.Tensor, device: torch.device) -> None:
        x = x.detach().to(device=device, dtype=torch.float32)
        if self.H is None:
            self.H = torch.zeros(self.B, self.C, self.C, dtype=torch.float32, device=device)
        if self.groups:
            xg = x.reshape(-1, self.groups, self.C).transpose(0, 1)          # [G, N, d]
            self.H.baddbmm_(xg.transpose(1, 2), xg)
            self.n += xg.shape[1]
        else:
            x2 = x.reshape(-1, self.C)
            self.H[0].addmm_(x2.t(), x2)
            self.n += x2.shape[0]

    def hessian(self) -> torch.Tensor:
        return self.H * (2.0 / max(self.n, 1))

    def weight3d(self, device) -> torch.Tensor:
        return self.leaf.weight.detach().to(device=device, dtype=torch.float32).reshape(self.B, self.R, self.C)

    def clip(self) -> torch.Tensor | None:
        c = self.leaf.weight_quantizer.effective_clip()
        return None if c is None else c.detach()

    @torch.no_grad()
    def write(self, Q: torch.Tensor, S: torch.Tensor, Z: torch.Tensor | None) -> None:
        w = self.leaf.weight
        q2 = Q.reshape(w.shape).to(device=w.device, dtype=w.dtype)
        spec = self.spec
        scale = formats.public_qparam(S.reshape(w.shape), spec)
        zp = None if Z is None else formats.public_qparam(Z.reshape(w.shape), spec)
        w.copy_(q2)
        self.leaf.weight_quantizer.set_fixed_qparams(w, scale.to(w.device), None if zp is None else zp.to(w.device))
        self.leaf.weight_replaced = True
        if isinstance(self.leaf, QuantLinear):
            self.leaf.invalidate_cache()


def leaf_targets(module: nn.Module) -> list[_Target]:
    """Every leaf of the unit with a quantizing weight spec (QuantLinear / WoAQuant), with its
    input layout (``groups``, ``C``) and the module whose input it reads (``hook_module``)."""
    from .hessians import quant_leaves

    return [_Target(name, m) for name, m in quant_leaves(module)]


def _stages(module: nn.Module, targets: list[_Target], call: UnitCall, device) -> list[list[_Target]]:
    """Leaves grouped by the tensor they read, in order of first use (one recorded call)."""
    seen: list[tuple[_Target, torch.Tensor]] = []   # the tensors are kept alive: ids stay unique
    handles = []
    for t in targets:
        def hook(_m, args, t=t):
            if args and isinstance(args[0], torch.Tensor) and all(s[0] is not t for s in seen):
                seen.append((t, args[0]))
        handles.append(t.hook_module.register_forward_pre_hook(hook))
    try:
        _replay(module, [call], device)
    finally:
        for h in handles:
            h.remove()
    stages: dict[int, list[_Target]] = {}
    for t, x in seen:
        stages.setdefault(id(x), []).append(t)
    return list(stages.values())


def _accumulate_stages(module: nn.Module, stages: list[list[_Target]], calls: Sequence[UnitCall],
                       device) -> dict:
    """One replay of ``calls`` accumulating the Hessian of each stage's input: {leaf name:
    LeafStat}. A stage's leaves read one tensor, so within a stage the leaves of one input
    layout (width, groups) share one statistic (counted once), as on the statistics path;
    different stages never share (they read different tensors, maybe of one width)."""
    from .hessians import LeafStat

    shared: dict[tuple[int, int, int], _Target] = {}
    members: dict[tuple[int, int, int], list[str]] = {}
    for k, stage in enumerate(stages):
        for t in stage:
            key = (k, t.C, t.groups)
            shared.setdefault(key, t)
            members.setdefault(key, []).append(t.name)
    handles = [t.hook_module.register_forward_pre_hook(lambda _m, args, t=t: t.add(args[0], device))
               for t in shared.values()]
    try:
        _replay(module, calls, device)
    finally:
        for h in handles:
            h.remove()
    out = {}
    for key, t in shared.items():
        ls = LeafStat(H=t.H, n=t.n, leaves=list(members[key]))
        t.H = None
        for name in members[key]:
            out[name] = ls
    return out


def _all_token_calls(datas: Sequence[UnitData], chunk_rows: int = 4096) -> list[UnitCall]:
    """Every token of the layer (the union of the experts' inputs), without routing weights."""
    xs = [c.args[0].reshape(-1, c.args[0].shape[-1]) for d in datas for c in d.calls]
    if not xs:
        return []
    x = torch.cat(xs)
    return [UnitCall((x[i:i + chunk_rows],), {}, None) for i in range(0, x.shape[0], chunk_rows)]


@register
@dataclass
class GPTQ(Algorithm):
    """GPTQ on every quantized leaf of a unit (see the module doc)."""

    name: ClassVar[str] = "gptq"
    group_kinds: ClassVar[tuple[str, ...]] = ("expert",)

    block_size: int = 128
    percdamp: float = 0.01
    act_order: bool = False
    sequential: bool = True
    all_tokens: bool = False
    # experts solved per batched pass: 16 keeps a V4-Flash layer's GPTQ under 64 GB of device
    # memory (an Ascend 910B); 32 peaked at 66.7 GiB, 16 at 51.7 GiB on the H200 (RESULTS §0.5)
    expert_chunk: int = 16

    def check(self) -> None:
        if self.block_size < 1:
            raise RecipeError(f"gptq.block_size must be >= 1, got {self.block_size}")
        if not (0 <= self.percdamp <= 1):
            raise RecipeError(f"gptq.percdamp must lie in [0, 1], got {self.percdamp}")
        if self.expert_chunk < 1:
            raise RecipeError(f"gptq.expert_chunk must be >= 1, got {self.expert_chunk}")

    def needs(self) -> Needs:
        # all_tokens feeds every token to every expert: it needs the stored calls. Otherwise the
        # Hessians come from the capture's statistics (no call stored): the float layer's for
        # sequential=false; for the sequential GPTQ stage 0's from the capture and each later
        # stage's from a re-run of the layer with the earlier stages quantized
        # (SolveContext.recollect). With stored calls (another algorithm of the recipe replays
        # them) replays of the calls give the same Hessians.
        return Needs(calls=self.all_tokens)

    def solves_layer_jointly(self, statistics: bool) -> bool:
        # sequential on statistics: every unit of the layer at once, downstream first, so one
        # re-run of the layer per stage serves a whole run of parallel units (all experts)
        return statistics and self.sequential and not self.all_tokens

    def apply(self, unit, data: UnitData, ctx: SolveContext) -> dict[str, Any]:
        return self.apply_group([unit], [data], ctx)[0]

    def apply_group(self, units, datas, ctx: SolveContext) -> list[dict[str, Any]]:
        on_statistics = bool(datas) and all(d.hessians is not None for d in datas)
        if on_statistics and self.sequential:
            return self._apply_sequential_statistics(units, datas, ctx)
        if not self.sequential and not self.all_tokens:
            return self._apply_float_hessians(units, datas, ctx)
        return self._apply_replayed(units, datas, ctx)

    @staticmethod
    def _new_stats() -> dict[str, Any]:
        return {"leaves": 0, "gptq_loss": 0.0, "hessian_tokens": 0, "kept_rtn": 0, "leaf_loss": {}}

    # ------------------------------------------------------------------ replayed calls
    def _apply_replayed(self, units, datas, ctx: SolveContext) -> list[dict[str, Any]]:
        """Sequential stages from the stored calls: stage s's Hessians from a replay of each
        unit's calls with its earlier stages already solved (all quantizers on); each stage
        solved by the same joint solver as the statistics path (w1 / w3 stacked, the RTN guard)."""
        dev = ctx.device
        # all_tokens concerns routed experts only (the other kinds already see every token)
        routed = all(u.kind == "expert" for u in units)
        all_calls = _all_token_calls(datas) if self.all_tokens and routed else None
        per_unit = []
        for u, d in zip(units, datas):
            calls = all_calls if all_calls is not None else d.calls
            targets = leaf_targets(u.module)
            plan = _stages(u.module, targets, calls[0], dev) if calls and targets else []
            per_unit.append((u, calls, plan))
        out = [self._new_stats() for _ in units]
        if not self.sequential:
            # all_tokens without stages: every stage's Hessian from ONE float replay (each stage
            # its own statistic: the stages read different tensors), then every leaf solved
            items = []
            for ui, (u, calls, plan) in enumerate(per_unit):
                if plan:
                    with _quant_off(u.module):
                        stats = _accumulate_stages(u.module, plan, calls, dev)
                    items.append((ui, u, stats, set(stats)))
            self._solve_statistics(items, out, dev, free=True)
        n_stages = max((len(p) for _, _, p in per_unit), default=0) if self.sequential else 0
        for s in range(n_stages):
            items = []
            for ui, (u, calls, plan) in enumerate(per_unit):
                if s < len(plan):
                    stats = _accumulate_stages(u.module, [plan[s]], calls, dev)
                    items.append((ui, u, stats, set(stats)))
            self._solve_statistics(items, out, dev, free=True)
        for o in out:
            o.pop("leaf_loss")
            o["hessian"] = "sequential, replayed calls" if self.sequential else "replayed calls"
        return out

    # ------------------------------------------------------------------ statistics, sequential
    def _apply_sequential_statistics(self, units, datas, ctx: SolveContext) -> list[dict[str, Any]]:
        """Sequential GPTQ on capture statistics, no call stored. The layer's units are taken
        in runs of parallel units (``ptq_units.parallel_groups``: the attention; the routed +
        shared experts), the LAST run first: while a run is solved, every unit upstream of it is
        still unsolved, so a re-run of the layer with quantization on in that run only gives
        each unit exactly the inputs a replay of its float calls would, with its own earlier
        stages quantized. Per run: stage 0 from the capture's Hessians (float inputs), then per
        later stage one re-run of the layer collecting only that stage's leaves
        (``SolveContext.recollect``). Stages come from the capture (``LeafStat.stage``)."""
        from ..pipeline.ptq_units import parallel_groups

        if ctx.recollect is None:
            raise RecipeError("gptq (sequential) on capture statistics needs the layer's re-run "
                              "(SolveContext.recollect); give gptq:sequential=false or stored calls")
        dev = ctx.device
        index = {u.name: i for i, u in enumerate(units)}
        out = [self._new_stats() for _ in units]
        forwards, forward_s = 0, 0.0
        for group in reversed(parallel_groups(units)):
            captured = {u.name: datas[index[u.name]].hessians for u in group}
            stages = sorted({ls.stage for st in captured.values() for ls in st.values()})
            for k, stage in enumerate(stages):
                want = {u.name: {n for n, ls in captured[u.name].items() if ls.stage == stage} for u in group}
                want = {n: leaves for n, leaves in want.items() if leaves}
                if k == 0:
                    source = captured
                else:
                    if ctx.consume_statistics:        # superseded by the re-collection: free first
                        for name, leaves in want.items():
                            for leaf in leaves:
                                captured[name][leaf].H = None
                    t0 = time.perf_counter()
                    source = ctx.recollect([u for u in group if u.name in want], want)
                    forward_s += time.perf_counter() - t0
                    forwards += 1
                    _check_recollected_rows(captured, source, want)
                items = [(index[u.name], u, source.get(u.name, {}), want[u.name]) for u in group if u.name in want]
                # a re-collection is this algorithm's own; the capture's only once nobody reads it
                self._solve_statistics(items, out, dev, free=k > 0 or ctx.consume_statistics)
        for o in out:
            o["hessian"] = "sequential"
        if out:   # the layer's re-runs, once (on the first unit; the others say 0)
            out[0]["recollect_forwards"], out[0]["recollect_seconds"] = forwards, round(forward_s, 3)
        return out

    # ------------------------------------------------------------------ float Hessians
    def _apply_float_hessians(self, units, datas, ctx: SolveContext) -> list[dict[str, Any]]:
        """``sequential=false``: every leaf's Hessian from the FLOAT unit (llm-compressor's
        choice). From the capture's statistics when the workflow collected them
        (``UnitData.hessians``), else from one replay of the stored calls with quantization
        off. Leaves reading one tensor (an expert's w1 / w3) share a Hessian and are solved as
        one matrix of stacked rows (GPTQ treats rows independently: the same result).

        Guard per leaf, exact: the leaf keeps GPTQ's weights only where
        ``tr(dW H dW^T)`` (= its output error on the calibration rows, float inputs) is not
        above RTN's; otherwise it stays RTN."""
        from .hessians import HessianCollector

        dev = ctx.device
        items = []
        for ui, (u, d) in enumerate(zip(units, datas)):
            st = d.hessians
            if st is None:          # stored calls: replay the float unit once
                col = HessianCollector([u])
                col.attach(u.module)
                try:
                    with _quant_off(u.module):
                        _replay(u.module, d.calls, dev)
                finally:
                    col.detach()
                st = col.stats(u.name)
            items.append((ui, u, st, set(st)))
        out = [self._new_stats() for _ in units]
        self._solve_statistics(items, out, dev, free=ctx.consume_statistics)
        for o in out:
            o["hessian"] = "float"
        return out

    def _solve_statistics(self, items, out, dev, free: bool) -> None:
        """Solve the named leaves of each unit from their statistics, every unit's leaves of
        one shape / spec batched: ``items`` = [(index into ``out``, unit, {leaf: LeafStat},
        leaf names to solve)]. ``free``: drop each statistic once its leaves are solved."""
        from .hessians import fake_quant_weight, quant_leaves

        buckets: dict[tuple, list[tuple[int, list[tuple[str, nn.Module]], Any]]] = {}
        for ui, u, st, names in items:
            leaves = dict(quant_leaves(u.module))
            joint: dict[int, list[str]] = {}
            for name in leaves:
                ls = st.get(name)
                if name in names and ls is not None and ls.n > 0 and ls.H is not None:
                    joint.setdefault(id(ls), []).append(name)
            for names_j in joint.values():
                # leaves sharing a Hessian are stacked only with equal spec / dtype / width
                sub: dict[tuple, list[str]] = {}
                for n in names_j:
                    lf = leaves[n]
                    sub.setdefault((lf.weight_quantizer.spec, lf.weight.dtype, _groups_of(lf)), []).append(n)
                for (spec, dtype, g), ns in sub.items():
                    ls = st[ns[0]]
                    key = (tuple(ns), tuple(leaves[n].weight.shape for n in ns), dtype, spec, g)
                    buckets.setdefault(key, []).append((ui, [(n, leaves[n]) for n in ns], ls))
        for bucket in buckets.values():
            self._solve_joint(bucket, out, dev, fake_quant_weight)
            if free:
                for _, _, ls in bucket:
                    ls.H = None

    def _solve_joint(self, items, out, dev, fake_quant_weight) -> None:
        first = items[0][1][0][1]
        spec = first.weight_quantizer.spec
        B = _groups_of(first) or 1
        dynamic = spec.format == "int" and spec.granularity == "group" and not self.act_order
        per_chunk = max(1, self.expert_chunk // B)
        graphs: dict = {}   # the column sweep's CUDA graph, captured once per bucket
        for c0 in range(0, len(items), per_chunk):
            chunk = items[c0:c0 + per_chunk]
            Ws, Hs, Rs, Ss, Zs, clips = [], [], [], [], [], []
            for _, leaves, ls in chunk:
                for _, lf in leaves:
                    w = lf.weight.detach()
                    Ws.append(w.to(dev, torch.float32).reshape(B, -1, w.shape[-1]))
                    Rs.append(fake_quant_weight(lf).to(dev, torch.float32).reshape(B, -1, w.shape[-1]))
                    if dynamic:
                        c = lf.weight_quantizer.effective_clip()
                        clips.append(None if c is None else c.detach().to(dev).reshape(B, -1, c.shape[-1]))
                    else:
                        c = lf.weight_quantizer.effective_clip()
                        sc, zp = formats.qparams(w.to(dev), spec, None if c is None else c.detach().to(dev))
                        Ss.append(formats.expand_qparam(sc, w.shape, spec).reshape(B, -1, w.shape[-1]))
                        if zp is not None:
                            Zs.append(formats.expand_qparam(zp, w.shape, spec).reshape(B, -1, w.shape[-1]))
                Hs.append(ls.H)
            n_leaves = len(chunk[0][1])
            # [chunk * B, rows of the joint leaves, C]
            W = torch.cat([torch.cat(Ws[j * n_leaves:(j + 1) * n_leaves], 1) for j in range(len(chunk))])
            RTN = torch.cat([torch.cat(Rs[j * n_leaves:(j + 1) * n_leaves], 1) for j in range(len(chunk))])
            # one copy of the chunk's Hessians (3.3 GB for 16 V4-Pro experts), scaled in place
            H = torch.cat([h.to(dev) for h in Hs])
            H.mul_(torch.cat([torch.full((h.shape[0],), 2.0 / ls.n, dtype=torch.float32, device=dev)
                              for h, (_, _, ls) in zip(Hs, chunk)])[:, None, None])
            S = Z = clip = None
            if dynamic:
                if any(c is not None for c in clips):
                    full = [c if c is not None else torch.ones(B, Ws[k].shape[1], Ws[k].shape[2] // spec.group_size,
                                                                 device=dev) for k, c in enumerate(clips)]
                    clip = torch.cat([torch.cat(full[j * n_leaves:(j + 1) * n_leaves], 1) for j in range(len(chunk))])
            else:
                S = torch.cat([torch.cat(Ss[j * n_leaves:(j + 1) * n_leaves], 1) for j in range(len(chunk))])
                if Zs:
                    Z = torch.cat([torch.cat(Zs[j * n_leaves:(j + 1) * n_leaves], 1) for j in range(len(chunk))])
            Q, S, Z, loss = gptq_solve(W, H, spec, S=S, Z=Z, clip=clip, block_size=self.block_size,
                                       percdamp=self.percdamp, act_order=self.act_order, graphs=graphs)
            # exact output errors per row on the calibration rows: tr(dW H dW^T) with H = sum x^T x
            # (H above is 2/n of it: undo the factor per matrix)
            scale = torch.cat([torch.full((B,), ls.n / 2.0, device=dev) for _, _, ls in chunk])
            err_q = _row_error(Q - W, H) * scale[:, None]
            err_r = _row_error(RTN - W, H) * scale[:, None]
            del H, RTN
            rows = [lf.weight.shape[0] // B for _, lf in chunk[0][1]]
            bounds = [0]
            for r in rows:
                bounds.append(bounds[-1] + r)
            # per leaf sums, one host read per chunk
            per_leaf_q = torch.stack([err_q[j * B:(j + 1) * B, bounds[k]:bounds[k + 1]].sum()
                                      for j in range(len(chunk)) for k in range(n_leaves)])
            per_leaf_r = torch.stack([err_r[j * B:(j + 1) * B, bounds[k]:bounds[k + 1]].sum()
                                      for j in range(len(chunk)) for k in range(n_leaves)])
            lq, lr = per_leaf_q.tolist(), per_leaf_r.tolist()
            obj = loss.view(len(chunk), B).sum(1).tolist()
            for j, (ui, leaves, ls) in enumerate(chunk):
                st = out[ui]
                st["hessian_tokens"] += ls.n * len(leaves)
                st["gptq_loss"] += obj[j]
                sl = slice(j * B, (j + 1) * B)
                for k, (name, lf) in enumerate(leaves):
                    st["leaves"] += 1
                    i = j * n_leaves + k
                    if lq[i] <= lr[i]:
                        rs = slice(bounds[k], bounds[k + 1])
                        _Target(name, lf).write(Q[sl, rs], S[sl, rs], None if Z is None else Z[sl, rs])
                        st["leaf_loss"][name] = lq[i]
                    else:
                        st["kept_rtn"] += 1
                        st["leaf_loss"][name] = lr[i]


def _groups_of(leaf: nn.Module) -> int:
    return int(getattr(leaf, "n_groups", 0) or 0)


def _row_error(dW: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """[B, R]: per row r of matrix b, dW_br H_b dW_br^T (fp32)."""
    return (torch.bmm(dW, H) * dW).sum(-1)


class _quant_off:
    """Quantization of every quantized leaf inside ``module`` off (the float function) for the
    duration; restored after."""

    def __init__(self, module: nn.Module):
        self.leaves = [m for m in module.modules() if isinstance(getattr(m, "enabled", None), bool)
                       and (hasattr(m, "weight_quantizer") or hasattr(m, "a_quantizer"))]
        self.saved = [m.enabled for m in self.leaves]

    def _set(self, values) -> None:
        for m, v in zip(self.leaves, values):
            m.enabled = v
            if isinstance(m, QuantLinear):
                m.invalidate_cache()

    def __enter__(self):
        self._set([False] * len(self.leaves))
        return self

    def __exit__(self, *exc):
        self._set(self.saved)
