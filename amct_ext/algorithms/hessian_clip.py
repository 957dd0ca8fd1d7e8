"""Clipping from the capture's statistics (``hclip``): clip factors chosen on each quantized
leaf's exact output error, with no stored call.

``clip`` replays the unit's calls (its grid start ranks candidates by ``E[x^2]``, the diagonal
of the input Hessian, then checks the unit's output MSE). Here the statistics path of the
workflow (``Needs(calls=False)``: ``hessians.HessianCollector`` accumulates ``H = sum x^T x`` of
every quantized leaf during the layer's one float forward) is all there is, and it is enough:
for a linear ``y = x W^T`` and a weight error ``d = W - fake_quant(W, c)``, row r's squared output
error over the calibration rows is exactly ``d_r H d_r^T`` (float inputs). So per leaf and per
weight-scale block the clip factor of a grid (``linspace(1, grid_min, grid)``, 1.0 first, ties
keep RTN) is chosen on that error:

- Narrow column blocks (granularity 'group', or 'block' tiles: w4a16-g128, w3a16-g128, w4a8,
  w2a16-g64): every candidate is scored on the block's
  diagonal part of H, ``d_g H_gg d_g^T`` per row and group (summed over a tile's rows for
  'block'), which is exact for the block alone and ignores the coupling of neighbouring blocks
  through H's off-diagonal blocks. Cost per candidate ``2 R C g`` (the group width g), a fraction
  g / C of one full evaluation. Because the per-block choices interact through that coupling, a
  row guard follows: each row (each row-block of tiles) keeps its choice only where its FULL
  error ``d_r H d_r^T`` is not above the incoming one's (RTN's, two full evaluations); so the
  leaf's exact output error is never above RTN's.
- Wide blocks (granularity 'channel' or 'tensor': w4a16, w8a8, fp8): a block is a whole row, and its exact error costs ``2 C^2`` per row and candidate
  (``2 R C^2`` per leaf). Every candidate is first ranked by the diagonal of H
  (``sum_j H_jj d_j^2``, ``R C`` per candidate: what ``clip`` uses), and only the incoming state
  plus the ``exact_top - 1`` best-ranked other candidates are scored exactly. ``exact_top >=
  grid`` scores every candidate (a brute force). The chosen row error is then exact, and never above
  the incoming one's (it is a candidate).

Cost on one V4-Flash layer (256 routed experts; w1 / w3 [2048, 4096], w2 [4096, 2048], fp32
bmm, ~50 TFLOP/s on an H200): one full evaluation of every expert leaf is
``256 * (2 * 2 * 2048 * 4096^2 + 2 * 4096 * 2048^2) = 4.4e13`` FLOP (~0.9 s).
- g128, 20 candidates: ``20 * 256 * (2 * 2 * 2048 * 4096 * 128 + 2 * 4096 * 2048 * 128) =
  3.3e13`` (~0.7 s) + the guard's two full evaluations 8.8e13 (~1.8 s).
- per channel: 20 candidates exactly would be ``8.8e14`` (~18 s, too slow for the 60 s layer
  target beside capture and GPTQ); the default ``exact_top = 4`` costs ``4 * 4.4e13 = 1.8e14``
  (~3.5 s), the diagonal ranking of 20 candidates ``~4e10`` (elementwise, memory bound).
- ``sweeps=N`` (group specs): per sweep the narrow score of every candidate again plus the
  ``H d`` updates (``2 R C^2``): ~``3.3e13 + 4.4e13 = 7.7e13`` (~1.5 s), in ``C / g`` steps of
  one batched op each (32 for w1 / w3, 16 for w2 at g128); the candidates of a step sit on the
  device together ([20, 16, 2048, 128] fp32 = 0.7 GB for a chunk of 16 experts).
The attention and shared expert add less than 10 % of that.

Layouts: ``wo_a`` (a grouped einsum, weight [G * R, C], one Hessian per output group [G, C, C]):
row r of the 2-D weight uses group ``r // R``'s Hessian. The routed experts of a layer are
solved together (``group_kinds``): the stacked weights [E, R, C] and the experts' Hessians
[E, C, C] (views into the collector's stack), ``expert_chunk`` experts at a time; every choice
is per expert and per block (a test holds the batched result to the one-by-one one in float64).
Per-tensor scales are solved one matrix at a time (a stacked per-tensor scale would be one for
all experts).

Result: ``{leaf}.weight_quantizer.clip`` (the contract of ``base.py``), so ``gptq`` after it folds
the clips into its grid (``effective_clip``) and export is unchanged. MX weights (power-of-two
scales: no clip to choose) and leaves without a weight grid are left alone ("nothing to clip"),
as ``clip`` does. Static activation ranges are not clipped (that needs the unit's output, i.e.
stored calls: use ``clip``); the statistics say so.

With stored calls (the recipe also holds a call-replaying algorithm, e.g. ``hclip,autoround``),
the Hessians are computed from one float replay of the calls, as
``gptq:sequential=false`` does. After an algorithm that replaced the weight or fixed the grid
(``gptq``, ``autoround``) the float weight is gone: :class:`RecipeError`, naming the leaf.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from ..quant import formats
from ..runtime import device as devmod
from ..quant.quant_linear import QuantLinear
from ..quant.quantizers import ActivationQuantizer
from .base import Algorithm, Needs, SolveContext, UnitData
from .recipe import RecipeError, register


def _groups(leaf: nn.Module) -> int:
    return int(getattr(leaf, "n_groups", 0) or 0)


def clip_grid(grid: int, grid_min: float) -> list[float]:
    """The candidate factors, 1.0 first (as ``clipping.grid_clip``)."""
    return torch.linspace(1.0, grid_min, grid).tolist()


def _row_errors(d: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """``d`` [N, R2, C], ``H`` [N, B, C, C] (row r of matrix n uses H[n, r // (R2 / B)]) ->
    [N, R2]: ``d_r H d_r^T``."""
    N, R2, C = d.shape
    B = H.shape[1]
    dv = d.reshape(N * B, R2 // B, C)
    return (torch.bmm(dv, H.reshape(N * B, C, C)) * dv).sum(-1).reshape(N, R2)


def _narrow_errors(d: torch.Tensor, Hb: torch.Tensor, width: int) -> torch.Tensor:
    """Per row and column block of ``width``: ``d_rg H_gg d_rg^T`` -> [N, R2, K]. ``Hb``: the
    diagonal blocks [N, B, K, w, w]; ``d`` [N, R2, K * w] (padded to whole blocks)."""
    N, R2, Cp = d.shape
    B, K = Hb.shape[1], Hb.shape[2]
    R = R2 // B
    dv = d.reshape(N, B, R, K, width).permute(0, 1, 3, 2, 4).reshape(N * B * K, R, width)
    e = (torch.bmm(dv, Hb.reshape(N * B * K, width, width)) * dv).sum(-1)        # [N*B*K, R]
    return e.reshape(N, B, K, R).permute(0, 1, 3, 2).reshape(N, R2, K)


def _pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % width
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


class _Plan:
    """How a spec's scale blocks map onto rows and column blocks of a [N, R2, C] weight."""

    def __init__(self, spec, R2: int, C: int):
        g = spec.granularity
        self.spec, self.R2, self.C = spec, R2, C
        self.rows_per_block = 1
        if g == "group":
            self.width = spec.group_size
        elif g == "block":
            self.rows_per_block, self.width = spec.block_size
        else:
            self.width = None                       # wide: a block is a whole row (or the matrix)
        self.narrow = self.width is not None
        self.per_tensor = g == "tensor"

    def to_public(self, e: torch.Tensor) -> torch.Tensor:
        """Row / column-block errors [N, R2, K] (narrow) or [N, R2] (wide) summed into the
        spec's public scale shape [N, ...]."""
        if self.narrow:
            if self.rows_per_block == 1:
                return e
            br = self.rows_per_block
            pad = (-self.R2) % br
            if pad:
                e = torch.nn.functional.pad(e, (0, 0, 0, pad))
            return e.reshape(e.shape[0], -1, br, e.shape[-1]).sum(2)
        if self.per_tensor:
            return e.sum(-1)
        return e

    def rows_of(self, v: torch.Tensor) -> torch.Tensor:
        """A per-guard-unit value [N, R2 / rows_per_block] (or [N] per tensor) repeated per row [N, R2]."""
        if self.per_tensor:
            return v[:, None].expand(-1, self.R2)
        if self.rows_per_block == 1:
            return v
        return v.repeat_interleave(self.rows_per_block, dim=1)[:, :self.R2]

    def guard_units(self, row_e: torch.Tensor) -> torch.Tensor:
        """Per-row errors [N, R2] summed over the rows that share scale blocks."""
        if self.per_tensor:
            return row_e.sum(-1)
        if self.rows_per_block == 1:
            return row_e
        br = self.rows_per_block
        pad = (-self.R2) % br
        if pad:
            row_e = torch.nn.functional.pad(row_e, (0, pad))
        return row_e.reshape(row_e.shape[0], -1, br).sum(-1)


@torch.no_grad()
def hessian_clip_choice(W: torch.Tensor, H: torch.Tensor, spec, base_clip: torch.Tensor | None, *,
                        grid: int = 20, grid_min: float = 0.5, exact_top: int = 4,
                        sweeps: int = 0) -> dict[str, torch.Tensor]:
    """The clip factors of the module doc for N matrices at once.

    ``W`` [N, R2, C] (the 2-D weights, stacked), ``H`` [N, B, C, C] ``sum x^T x`` (B: output
    groups of wo_a, else 1), ``base_clip`` [N, *scale] the incoming clip (None: RTN). Returns
    ``clip`` [N, *scale] and the exact leaf errors ``incoming`` / ``chosen`` [N] (float64) and
    ``improved`` [N]: the guard units (rows; a tile's rows for 'block'; the matrix per tensor)
    whose exact error went below the incoming one's."""
    N, R2, C = W.shape
    if spec.granularity == "tensor" and N != 1:
        raise ValueError("per-tensor scales: one matrix at a time")
    plan = _Plan(spec, R2, C)
    scale_shape = (N, *formats.scale_shape((R2, C), spec))
    cands = clip_grid(grid, grid_min)

    def fq(clip) -> torch.Tensor:
        if clip is not None and spec.granularity == "tensor":
            clip = clip.reshape(())
        return formats.fake_quant(W, spec, clip)

    base = torch.ones(scale_shape, dtype=torch.float32, device=W.device) if base_clip is None \
        else base_clip.to(W.device, torch.float32).reshape(scale_shape)
    d_base = W - fq(None if base_clip is None else base)
    inc_rows = _row_errors(d_base, H)                                   # [N, R2], exact
    if plan.narrow:
        w = plan.width
        Hp = H
        pad = (-C) % w
        if pad:
            Hp = torch.nn.functional.pad(H, (0, pad, 0, pad))
        K = Hp.shape[-1] // w
        idx = torch.arange(K, device=W.device)
        Hb = Hp.reshape(N, H.shape[1], K, w, K, w)[:, :, idx, :, idx, :]   # [K, N, B, w, w]
        Hb = Hb.permute(1, 2, 0, 3, 4).contiguous()                         # [N, B, K, w, w]
        best_c = torch.ones(scale_shape, dtype=torch.float32, device=W.device)
        best_e = None
        for c in cands:
            e = plan.to_public(_narrow_errors(_pad_cols(W - fq(torch.full(scale_shape, c, device=W.device)), w), Hb, w))
            if best_e is None:
                best_e = e
                continue
            better = e < best_e
            best_c = torch.where(better, torch.full_like(best_c, c), best_c)
            best_e = torch.where(better, e, best_e)
        del Hb, Hp
        new_rows = _row_errors(W - fq(best_c), H)
        keep_new = plan.guard_units(new_rows) < plan.guard_units(inc_rows)        # ties keep the incoming
        keep_rows = plan.rows_of(keep_new)
        chosen_rows = torch.where(keep_rows, new_rows, inc_rows)
        mask = _scale_mask(plan, keep_new, scale_shape)
        clip = torch.where(mask, best_c, base)
        changed = keep_new
        if sweeps and spec.granularity == "group":
            clip = _coordinate_sweeps(W, H, spec, clip, cands, sweeps)
            chosen_rows = _row_errors(W - fq(clip), H)
            changed = chosen_rows < inc_rows
    else:
        # rank every candidate on the diagonal of H, score the incoming state + the best-ranked exactly
        diag = H.diagonal(dim1=-2, dim2=-1)                                  # [N, B, C]
        diag_rows = diag[:, :, None, :].expand(N, H.shape[1], R2 // H.shape[1], C).reshape(N, R2, C)
        ranks = []
        for c in cands:
            dq = W - fq(torch.full(scale_shape, c, device=W.device))
            ranks.append(plan.to_public((dq.square() * diag_rows).sum(-1)))
        ranks = torch.stack(ranks, -1)                                       # [N, *scale, grid]
        if base_clip is None:           # factor 1.0 IS the incoming state: no slot for it twice
            ranks[..., 0] = float("inf")
        k = max(1, min(exact_top - 1, grid - (base_clip is None)))
        order = torch.argsort(ranks, dim=-1, stable=True)[..., :k]           # ties: larger factor first
        cand_t = torch.tensor(cands, dtype=torch.float32, device=W.device)
        best_c = base.clone()
        best_e = plan.to_public(inc_rows)
        for j in range(k):
            cj = cand_t[order[..., j]]
            e = plan.to_public(_row_errors(W - fq(cj), H))
            better = e < best_e
            best_c = torch.where(better, cj, best_c)
            best_e = torch.where(better, e, best_e)
        clip = best_c
        chosen_rows = None
        changed = best_e < plan.to_public(inc_rows)
        chosen = best_e.reshape(N, -1).double().sum(-1)
    out = {"clip": clip, "incoming": inc_rows.double().sum(-1), "improved": changed.reshape(N, -1).sum(-1)}
    out["chosen"] = chosen_rows.double().sum(-1) if chosen_rows is not None else chosen
    return out


@torch.no_grad()
def _coordinate_sweeps(W: torch.Tensor, H: torch.Tensor, spec, clip: torch.Tensor, cands, sweeps: int) -> torch.Tensor:
    """Exact coordinate descent on the full row error for a 'group' spec: group by group (in
    column order, ``sweeps`` times), each row's group takes the candidate that lowers
    ``d_r H d_r^T`` most with the row's other groups as they are:
    ``delta^T H_gg delta + 2 delta^T (H d_r)_g`` for ``delta = d_g' - d_g``; ``H d`` is kept up to
    date after each group. Never raises a row's error (the current factor is the reference, ties
    keep it). Cost per sweep: the narrow score of every candidate plus one full ``2 R C^2``."""
    N, R2, C = W.shape
    B = H.shape[1]
    R, gs = R2 // B, spec.group_size
    Hf = H.reshape(N * B, C, C)
    rows = lambda x: x.reshape(N * B, R, x.shape[-1])              # noqa: E731
    clip = clip.clone()
    d = W - formats.fake_quant(W, spec, clip)
    v = torch.bmm(rows(d), Hf)                                      # [N*B, R, C]: d H (H symmetric)
    cand_t = torch.tensor(cands, dtype=torch.float32, device=W.device)
    M = len(cands)
    for _ in range(sweeps):
        for k in range(C // gs):
            cols = slice(k * gs, (k + 1) * gs)
            Wg, dg = W[..., cols], d[..., cols]
            # every candidate at once: [M, N, R2, gs] (one batched score, few launches a group)
            Wm = Wg.unsqueeze(0).expand(M, N, R2, gs)
            dn = Wm - formats.fake_quant(Wm, spec, cand_t.reshape(M, 1, 1, 1).expand(M, N, R2, 1))
            delta = (dn - dg).reshape(M, N * B, R, gs)
            Hgg = Hf[:, cols, cols].unsqueeze(0).expand(M, N * B, gs, gs).reshape(M * N * B, gs, gs)
            de = (torch.bmm(delta.reshape(M * N * B, R, gs), Hgg).reshape(M, N * B, R, gs) * delta).sum(-1) \
                + 2 * (delta * v[..., cols].unsqueeze(0)).sum(-1)                       # [M, N*B, R]
            de_min, j = de.min(0)                      # first of equals: the larger factor
            better = (de_min < 0).reshape(N, R2)       # the current factor is the reference
            j = j.reshape(N, R2)
            best_d = torch.where(better[..., None], dn.gather(0, j[None, ..., None].expand(1, N, R2, gs))[0], dg)
            step = rows(best_d - dg)
            d[..., cols] = best_d
            v += torch.bmm(step, Hf[:, cols, :])
            clip[..., k] = torch.where(better, cand_t[j], clip[..., k])
    return clip


def _scale_mask(plan: _Plan, keep: torch.Tensor, scale_shape) -> torch.Tensor:
    """A per-guard-unit flag [N, row-blocks] broadcast to the scale shape [N, row-blocks, K]."""
    return keep[..., None].expand(scale_shape)


@register
@dataclass
class HessianClip(Algorithm):
    """Weight clipping chosen on the leaves' exact output errors from the capture's Hessians."""

    name: ClassVar[str] = "hclip"
    group_kinds: ClassVar[tuple[str, ...]] = ("expert",)

    grid: int = 20
    grid_min: float = 0.5
    # wide blocks (per channel / tensor): candidates scored on the full Hessian (the incoming
    # state included); the rest are only ranked on its diagonal. >= grid: every candidate
    exact_top: int = 4
    # 'group' specs: exact coordinate-descent sweeps on the full row error after the
    # block-diagonal choice (0: none; each costs about the choice plus one full evaluation)
    sweeps: int = 0
    # routed experts per batched solve: their weights and Hessians sit on the device together
    # (16 V4-Flash experts: w1 / w3 Hessians 1 GiB, weights 0.5 GiB per leaf, a few temporaries)
    expert_chunk: int = 16
    #: an expert's working set in a chunk, in float32 values: its weight, the differences and
    #: fake-quant temporaries beside it (``WORK_COPIES`` copies of R x C), and its Hessian with the
    #: padded copy the narrow path makes (2 x B x C x C)
    WORK_COPIES: ClassVar[int] = 8
    #: the share of the device's free memory a chunk may take (the allocator's slack aside)
    FREE_SHARE: ClassVar[float] = 0.8

    def check(self) -> None:
        if self.grid < 2:
            raise RecipeError(f"hclip.grid must be >= 2, got {self.grid}")
        if not (0 < self.grid_min < 1):
            raise RecipeError(f"hclip.grid_min must lie in (0, 1), got {self.grid_min}")
        if self.exact_top < 1:
            raise RecipeError(f"hclip.exact_top must be >= 1, got {self.exact_top}")
        if self.sweeps < 0:
            raise RecipeError(f"hclip.sweeps must be >= 0, got {self.sweeps}")
        if self.expert_chunk < 1:
            raise RecipeError(f"hclip.expert_chunk must be >= 1, got {self.expert_chunk}")

    def needs(self) -> Needs:
        return Needs(calls=False, statistics=True)

    def apply(self, unit, data: UnitData, ctx: SolveContext) -> dict[str, Any]:
        return self.apply_group([unit], [data], ctx)[0]

    # ------------------------------------------------------------------ statistics
    def _statistics(self, unit, data: UnitData, dev) -> dict:
        """The capture's statistics, else (stored calls) the float unit's Hessians from one replay."""
        if data.hessians is not None:
            return data.hessians
        if not len(data):
            return {}
        from .gptq import _quant_off, _replay
        from .hessians import HessianCollector

        col = HessianCollector([unit])
        col.attach(unit.module)
        try:
            with _quant_off(unit.module):
                _replay(unit.module, data.calls, dev)
        finally:
            col.detach()
        return col.stats(unit.name)

    def apply_group(self, units, datas, ctx: SolveContext) -> list[dict[str, Any]]:
        from .hessians import quant_leaves

        dev = ctx.device
        out: list[dict[str, Any]] = [{"leaves": 0, "improved_rows": 0, "leaf_loss": {}, "incoming_loss": {}}
                                     for _ in units]
        buckets: dict[tuple, list[tuple[int, str, nn.Module, Any]]] = {}
        for ui, (u, d) in enumerate(zip(units, datas)):
            leaves = quant_leaves(u.module)
            clippable = [(n, lf) for n, lf in leaves if lf.weight_quantizer.spec.format in ("int", "fp8")]
            static = any(isinstance(m, ActivationQuantizer) and m.is_static for m in u.module.modules())
            if static:
                out[ui]["activation"] = "static activation ranges not clipped (hclip has no calls; use clip)"
            if not clippable:
                out[ui].update(choice="incoming", reason="nothing to clip")
                continue
            for n, lf in clippable:
                wq = lf.weight_quantizer
                if getattr(lf, "weight_replaced", False) or wq.has_fixed_qparams or wq.round_offset is not None:
                    raise RecipeError(
                        f"hclip: leaf {n!r} of {u.name} carries a replaced weight / fixed grid / rounding offset "
                        f"from an earlier algorithm of the recipe (gptq, autoround): hclip needs the float "
                        f"weight, put it before them")
            st = self._statistics(u, d, dev)
            for n, lf in clippable:
                ls = st.get(n)
                if ls is None or ls.H is None or ls.n == 0:
                    out[ui].setdefault("no_statistics", []).append(n)
                    continue
                spec = lf.weight_quantizer.spec
                key = (n, tuple(lf.weight.shape), lf.weight.dtype, spec, _groups(lf))
                buckets.setdefault(key, []).append((ui, n, lf, ls))
        for (name, shape, _dtype, spec, g), items in buckets.items():
            per_chunk = 1 if spec.granularity == "tensor" else self.fitting_chunk(shape, g, dev)
            for c0 in range(0, len(items), per_chunk):
                self._solve_chunk(items[c0:c0 + per_chunk], spec, g, dev, out)
        for o in out:
            o.setdefault("choice", "hclip")
        return out

    def memory_advice(self) -> str:
        return (f"; lower hclip:expert_chunk (now {self.expert_chunk}; a chunk of routed experts holds their "
                f"weights and Hessians on the device together)")

    def fitting_chunk(self, shape: tuple[int, int], groups: int, dev: torch.device) -> int:
        """``expert_chunk``, or as many experts as the device's free memory holds where that is
        fewer: a V4-Pro layer resident in 60 GiB leaves about 6 GiB, and 16 of its experts'
        working sets (about 1 GiB each) ran out there (casebook i34-24). The CPU has no budget."""
        total = devmod.total_memory_bytes(dev)
        if total is None:
            return max(1, self.expert_chunk)
        free = max(0, total - devmod.memory_allocated(dev))
        return max(1, min(self.expert_chunk, int(free * self.FREE_SHARE) // self.expert_working_bytes(shape, groups)))

    @classmethod
    def expert_working_bytes(cls, shape: tuple[int, int], groups: int = 1) -> int:
        """The estimate of one routed expert's working set in a chunk (float32): ``WORK_COPIES``
        copies of its [R, C] weight and two of its [B, C, C] Hessian."""
        rows, cols = shape
        return 4 * (cls.WORK_COPIES * rows * cols + 2 * (groups or 1) * cols * cols)

    def _solve_chunk(self, chunk, spec, groups: int, dev, out) -> None:
        B = groups or 1
        w0 = chunk[0][2].weight
        dt = torch.float64 if (w0.dtype == torch.float64 or chunk[0][3].H.dtype == torch.float64) else torch.float32
        W = torch.stack([lf.weight.detach().to(dev, dt) for _, _, lf, _ in chunk])            # [N, R2, C]
        H = torch.stack([ls.H.to(dev, dt).reshape(B, W.shape[-1], W.shape[-1]) for _, _, _, ls in chunk])
        clips = [lf.weight_quantizer.effective_clip() for _, _, lf, _ in chunk]
        base = None
        if any(c is not None for c in clips):
            base = torch.stack([(torch.ones(formats.scale_shape(lf.weight.shape, spec)) if c is None else c.detach())
                                .to(dev, torch.float32) for c, (_, _, lf, _) in zip(clips, chunk)])
        r = hessian_clip_choice(W, H, spec, base, grid=self.grid, grid_min=self.grid_min,
                                exact_top=self.exact_top, sweeps=self.sweeps)
        del W, H
        inc, cho, chg = r["incoming"].tolist(), r["chosen"].tolist(), r["improved"].tolist()
        for j, (ui, n, lf, _) in enumerate(chunk):
            wq = lf.weight_quantizer
            wq.init_clip(lf.weight)
            with torch.no_grad():
                wq.clip.copy_(r["clip"][j].reshape(wq.clip.shape).to(wq.clip.device, torch.float32))
            if isinstance(lf, QuantLinear):
                lf.invalidate_cache()
            o = out[ui]
            o["leaves"] += 1
            o["improved_rows"] += int(chg[j])
            o["leaf_loss"][n] = cho[j]
            o["incoming_loss"][n] = inc[j]
