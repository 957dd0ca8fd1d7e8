"""Smoothing: migrate quantization difficulty between an activation and the weights reading it.

For a subgraph ``producer -> readers`` (a unit's ``smoothing_subgraphs()``, e.g. q_norm ->
wq_b / indexer.wq_b) and a per-channel vector s > 0, the producer's output channel j is
divided by s_j and every reader's weight column j multiplied by s_j: the float function is
unchanged (up to the rounding of the stored weights), while the quantizers see a flatter
activation (large s on outlier channels) or more precise salient weight columns.

- :class:`SmoothQuant` (Xiao et al.): ``s_j = max|X_j|^alpha / max|W_:,j|^(1-alpha)`` with a
  fixed migration strength alpha; ``max|W|`` over the quantized readers' columns.
- :class:`AWQ` (Lin et al.): a grid search of alpha per subgraph, ``s = mean|X_j|^alpha``
  (normalised to a geometric mean of 1; ``duo_scaling`` divides by ``max|W_:,j|^(1-alpha)``),
  keeping the alpha whose quantized unit output has the smallest MSE to the float output on
  the captured calls -- or no smoothing when none beats it.

Both run subgraph by subgraph in the unit's order (attention: attn_norm, q_norm, wo_a;
experts: w3 -> w2); channel statistics come from one float pass over the training calls. With
``validate`` (default) the last ``SolveContext.holdout`` share of the calls is held out: a
pair's scales chosen on the others are kept only when they also lower the held-out loss.

The attention's attn_norm lives in the Block, outside the unit: the unit folds s into that
norm (``fold_input_smooth``, saved as ``input_smooth``) and the captured inputs become x / s
(:meth:`UnitData.map_inputs`), so the algorithms after this one see consistent data.

The expert's up projection is clamped, ``clamp(w3 x, -L, L)``: dividing w3's rows by s alone
would move the clamp (``clamp(u / s) != clamp(u) / s``), so the unit's clamp limit becomes
per channel, L / s_j (``QuantV4Expert.up_limit``), which is exact for every input. A
deployment whose kernel has a scalar clamp must leave that pair out (``pairs`` option).

Static activation quantizers observed before this ran are re-observed on the smoothed unit.

AWQ solves the routed experts of a layer together (``group_kinds``), ``expert_chunk`` at a
time: their one pair (w3 -> w2) on stacked weights [E, out, in], the float channel statistics
and every candidate's loss from the model's ``grouped_forward`` (one bmm-batched forward per
call slot), the alpha, the held-out check and the commit per expert. A test holds it to the
one-by-one result in float64. Where the batched forward cannot reproduce an expert (its
``grouped_forward_blocker``, a per-tensor or MX weight grid, a fixed grid, a rounding offset)
the experts go one by one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch
from torch import nn

from ..base import GatedProjections, SmoothableUnit, known_smoothing_pairs
from ..pipeline.capture import CALL_METER, LazyCalls, UnitCall, call_nbytes
from ..errors import ConfigError
from ..quant.quant_linear import QuantLinear
from ..quant.quantizers import ActivationQuantizer
from ..pipeline.capture import detach_to as _to
from ..pipeline.replay import unit_mse
from ..quant import formats
from .base import Algorithm, SolveContext, UnitData
from .recipe import register
from .stacked import StackedCalls, common_group_blocker, expert_call_blocker, expert_projections, solve_ready_in_chunks

#: floor of channel statistics (a dead channel must not give s = 0 or inf)
STAT_EPS = 1e-5


# --------------------------------------------------------------------------- the scale formulas
def smoothquant_scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)``; channels without signal (a zero
    activation or weight column) keep s = 1."""
    a, w = act_absmax.float(), weight_absmax.float()
    s = a.clamp(min=STAT_EPS).pow(alpha) / w.clamp(min=STAT_EPS).pow(1.0 - alpha)
    return torch.where((a > 0) & (w > 0), s, torch.ones_like(s))


def awq_scales(act_absmean: torch.Tensor, alpha: float, weight_absmax: torch.Tensor | None = None) -> torch.Tensor:
    """``s_j = mean|X_j|^alpha`` (``/ max|W_j|^(1 - alpha)`` with ``weight_absmax``), divided by
    its geometric-mean-like centre sqrt(max s * min s); alpha = 0 without weights is s = 1."""
    s = act_absmean.float().clamp(min=STAT_EPS).pow(alpha)
    if weight_absmax is not None:
        s = s / weight_absmax.float().clamp(min=STAT_EPS).pow(1.0 - alpha)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))


# ----------------------------------------------------------------------------- folding
def _module(unit_module: nn.Module, name: str) -> nn.Module:
    return unit_module.get_submodule(name)


def _is_quantizing(m: nn.Module) -> bool:
    return isinstance(m, QuantLinear) and m.enabled and not (
        m.weight_quantizer.is_identity and m.input_quantizer.is_identity)


def _touched(unit_module: nn.Module, pair) -> list[str]:
    """Unit-relative parameter names a fold of ``pair`` rewrites."""
    names = [f"{r}.weight" for r in pair.readers]
    if pair.producer is not None:
        names.append(f"{pair.producer}.weight")
    return names


@torch.no_grad()
def fold_scales(unit_module: nn.Module, pair, s: torch.Tensor) -> None:
    """Divide the producer's channels by ``s`` and multiply the readers' input columns by it
    (in fp32, stored back in each weight's own dtype). For the unit-input pair (producer
    None) only the readers change here; the caller folds the norm and rescales the inputs."""
    for r in pair.readers:
        w = _module(unit_module, r).weight
        w.copy_((w.float() * s.to(w.device).view(1, -1)).to(w.dtype))
    if pair.producer is None:
        return
    prod = _module(unit_module, pair.producer)
    w = prod.weight
    sv = s.to(w.device)
    if pair.producer_kind == "norm":
        w.copy_((w.float() / sv).to(w.dtype))
    elif pair.producer_kind in ("rows", "up_rows"):
        w.copy_((w.float() / sv.view(-1, 1)).to(w.dtype))
        if pair.producer_kind == "up_rows":
            unit_module.scale_up_limit(sv)
    else:
        raise ConfigError(f"smoothing pair {pair.name!r}: unknown producer kind {pair.producer_kind!r}")
    _invalidate(unit_module)


def _invalidate(module: nn.Module) -> None:
    for m in module.modules():
        if isinstance(m, QuantLinear):
            m.invalidate_cache()


class _Snapshot:
    """The tensors a trial fold changes, to undo it exactly."""

    def __init__(self, unit_module: nn.Module, pair):
        named = dict(unit_module.named_parameters())
        self.params = {n: (named[n], named[n].detach().clone()) for n in _touched(unit_module, pair)}
        self.unit = unit_module
        # a gated MLP's per-channel clamp (smoothing its up rows scales it, fold_scales)
        self.clamp = unit_module.channel_clamp() if isinstance(unit_module, GatedProjections) else None

    @torch.no_grad()
    def restore(self) -> None:
        for p, value in self.params.values():
            p.copy_(value)
        if isinstance(self.unit, GatedProjections):
            self.unit.set_channel_clamp(self.clamp)
        _invalidate(self.unit)


def _scaled_call(c: UnitCall, s: torch.Tensor) -> UnitCall:
    x = c.args[0]
    x2 = (x.float() / s.to(x.device)).to(x.dtype)
    out = UnitCall((x2,) + tuple(c.args[1:]), c.kwargs, c.output)
    # counted whole while it lives: it keeps the base call's output alive too (a call read
    # back from disk dies with its UnitCall otherwise); an in-memory base counts twice (an upper bound)
    CALL_METER.hold(out, call_nbytes(out))
    return out


def scaled_calls(calls: Sequence[UnitCall], s: torch.Tensor) -> list[UnitCall]:
    """The calls with their first argument (the unit input x) divided by s per channel."""
    return [_scaled_call(c, s) for c in calls]


class ScaledCalls(LazyCalls):
    """``scaled_calls(calls, s)`` computed call by call as it is read (the same bits each time):
    the committed smoothing of a unit's inputs holds no second copy of them (the eager list
    held every call of the unit, and with spilled calls read them all back)."""

    def __init__(self, calls: Sequence[UnitCall], s: torch.Tensor):
        self.base, self.s = calls, s

    def __len__(self) -> int:
        return len(self.base)

    def __iter__(self):
        for c in self.base:
            yield _scaled_call(c, self.s)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return ScaledCalls(self.base[i], self.s)
        return _scaled_call(self.base[i], self.s)


# ----------------------------------------------------------------------------- statistics
def _set_enabled(module: nn.Module, enabled: bool) -> None:
    for m in module.modules():
        if isinstance(getattr(m, "enabled", None), bool):
            m.enabled = enabled
    _invalidate(module)


@torch.no_grad()
def channel_stats(unit_module: nn.Module, calls: Sequence[UnitCall], device: torch.device,
                  sources: dict[str, str | None]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(max |x_j|, mean |x_j|) per channel of each source's input over every token of the FLOAT
    unit (quantizers off) on ``calls``; source None is the unit's first argument."""
    acc: dict[str, list] = {k: [None, None, 0] for k in sources}

    def add(key: str, x: torch.Tensor) -> None:
        flat = x.detach().float().reshape(-1, x.shape[-1]).abs()
        if flat.shape[0] == 0:
            return
        a = acc[key]
        mx, sm = flat.amax(0), flat.sum(0)
        a[0] = mx if a[0] is None else torch.maximum(a[0], mx)
        a[1] = sm if a[1] is None else a[1] + sm
        a[2] += flat.shape[0]

    handles = []
    for key, name in sources.items():
        if name is None:
            continue
        handles.append(_module(unit_module, name).register_forward_pre_hook(
            lambda _m, args, key=key: add(key, args[0])))
    was = [(m, m.enabled) for m in unit_module.modules() if isinstance(getattr(m, "enabled", None), bool)]
    _set_enabled(unit_module, False)
    try:
        for c in calls:
            args = _to(c.args, device)
            for key, name in sources.items():
                if name is None:
                    add(key, args[0])
            unit_module(*args, **_to(c.kwargs, device))
    finally:
        for h in handles:
            h.remove()
        for m, e in was:
            m.enabled = e
        _invalidate(unit_module)
    return {k: (a[0], a[1] / a[2]) for k, a in acc.items() if a[0] is not None}


def weight_col_absmax(unit_module: nn.Module, readers: Sequence[str]) -> torch.Tensor:
    """max over the quantizing readers (all of them if none quantizes) of |W[:, j]|."""
    mods = [_module(unit_module, r) for r in readers]
    q = [m for m in mods if _is_quantizing(m)] or mods
    cols = [m.weight.detach().float().abs().amax(0) for m in q]
    out = cols[0]
    for c in cols[1:]:
        out = torch.maximum(out, c.to(out.device))
    return out


@torch.no_grad()
def reobserve_static(unit_module: nn.Module, calls: Sequence[UnitCall], device: torch.device) -> int:
    """Re-record the ranges of the unit's static activation quantizers that were in use (their
    inputs changed); returns how many there were."""
    qs = [m for m in unit_module.modules() if isinstance(m, ActivationQuantizer) and m.is_static and m.mode != "off"]
    if not qs:
        return 0
    for q in qs:
        q.reset_stats()
        q.mode = "observe"
    for c in calls:
        unit_module(*_to(c.args, device), **_to(c.kwargs, device))
    for q in qs:
        q.mode = "quant" if q.observed else "off"
    return len(qs)


# ----------------------------------------------------------------------------- the driver
def _pairs(unit_module: nn.Module, wanted: str) -> list:
    if not isinstance(unit_module, SmoothableUnit):
        return []
    pairs = unit_module.smoothing_subgraphs()
    if wanted.strip() == "all":
        return pairs
    names = set(pair_names(wanted))
    return [p for p in pairs if p.name in names]


def pair_names(pairs: str) -> list[str]:
    """``pairs`` as a list of names: 'all', or names joined by '+' (typeable inside --algo, where
    ',' separates algorithms: ``--algo awq:pairs=attn_norm+q_norm``); ',' is accepted too, for
    recipe files."""
    if pairs.strip() == "all":
        return list(known_smoothing_pairs())
    return [w.strip() for w in pairs.replace(",", "+").split("+") if w.strip()]


def _check_pairs(pairs: str) -> None:
    """The pair names of the registered models (``ModelBinding.smoothing_pairs``) are the known ones."""
    if pairs.strip() != "all":
        known = known_smoothing_pairs()
        bad = sorted(set(pair_names(pairs)) - set(known))
        if bad or not pairs.strip():
            example = "+".join(known[:2]) if known else "A+B"
            raise ConfigError(f"pairs={pairs!r}: expected 'all' or names joined by '+' from "
                              f"{', '.join(known) or '(none: no model package imported)'} (e.g. pairs={example})")


def smooth_unit(unit_module: nn.Module, data: UnitData, device: torch.device, pairs: str,
                candidates, held_out: Sequence[UnitCall] = ()) -> dict[str, Any]:
    """Run ``candidates(pair, stats, loss_fn) -> (s or None, info)`` on every quantizing pair
    of the unit and commit the chosen scales. ``loss_fn`` measures the training calls (all
    calls but ``held_out``, given by position: the last ones); with held-out calls a chosen s
    is kept only when it also lowers their loss. Returns per-pair statistics."""
    if any(getattr(m, "has_fixed_qparams", False) for m in unit_module.modules()):
        # a fixed grid (GPTQ) holds values of the unscaled weights: scaling them breaks it
        raise ConfigError("smoothing must run before gptq in the recipe (the unit already has fixed "
                          "GPTQ grids), e.g. --algo smoothquant,gptq")
    todo = [p for p in _pairs(unit_module, pairs)
            if any(_is_quantizing(_module(unit_module, r)) for r in p.readers)]
    if not todo or not len(data):
        return {"pairs": {}, "skipped": "no calls" if todo else "no quantized smoothing pair"}
    n_train = len(data) - len(held_out)
    stats = channel_stats(unit_module, data.calls[:n_train], device, {p.name: p.stat_module for p in todo})
    has_static = any(isinstance(m, ActivationQuantizer) and m.is_static and m.mode != "off"
                     for m in unit_module.modules())
    report: dict[str, Any] = {}
    loss_start = unit_mse(unit_module, data.calls, device)
    for pair in todo:
        if pair.name not in stats:
            continue

        def loss_of(s: torch.Tensor | None, pair=pair, part: str = "train") -> float:
            """Quantized output MSE with ``s`` folded in (then undone); None = as it is now."""
            calls = data.calls[:n_train] if part == "train" else data.calls[n_train:]
            if s is None:
                return unit_mse(unit_module, calls, device)
            snap = _Snapshot(unit_module, pair)
            fold_scales(unit_module, pair, s)
            calls = scaled_calls(calls, s) if pair.producer is None else calls
            try:
                if has_static:
                    reobserve_static(unit_module, calls, device)
                return unit_mse(unit_module, calls, device)
            finally:
                snap.restore()
                if has_static:
                    reobserve_static(unit_module, data.calls, device)

        s, info = candidates(pair, stats[pair.name], loss_of)
        if s is not None and n_train < len(data):
            h0, h1 = loss_of(None, part="held_out"), loss_of(s, part="held_out")
            info = {**info, "held_out_before": h0, "held_out_after": h1}
            if not h1 < h0:   # better on the calls it was chosen on only: not kept
                s, info["kept"] = None, False
        if s is not None:
            commit_scales(unit_module, data, pair, s)
            if has_static:
                reobserve_static(unit_module, data.calls, device)
        report[pair.name] = info
    return {"pairs": report, "loss_before": loss_start, "loss_after": unit_mse(unit_module, data.calls, device)}


def commit_scales(unit_module: nn.Module, data: UnitData | None, pair, s: torch.Tensor) -> None:
    """Fold ``s`` for good: weights (recorded as replaced), the norm / clamp limit, and for the
    unit-input pair the block's attn_norm plus the captured inputs."""
    fold_scales(unit_module, pair, s)
    if pair.producer is None:
        unit_module.fold_input_smooth(s)
        if data is not None:
            data.set_calls(ScaledCalls(data.calls, s))
    for name in _touched(unit_module, pair):
        unit_module.mark_replaced(name)


def _held_out(data: UnitData, ctx: SolveContext, validate: bool) -> list[UnitCall]:
    return ctx.split(data.calls)[1] if validate else []


@register
@dataclass
class SmoothQuant(Algorithm):
    """SmoothQuant with a fixed migration strength ``alpha`` on every pair of ``pairs``.

    ``keep_if_better``: a pair's scales are kept only when they lower the quantized unit's
    output MSE on the training calls (otherwise that pair stays unsmoothed). ``validate``: and
    on the held-out calls (``SolveContext.holdout``, the last calls of the unit)."""

    name: ClassVar[str] = "smoothquant"
    alpha: float = 0.5
    pairs: str = "all"
    keep_if_better: bool = True
    validate: bool = True

    def check(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"alpha={self.alpha}: the migration strength must lie in [0, 1]")
        _check_pairs(self.pairs)

    def apply(self, unit, data: UnitData, ctx: SolveContext) -> dict[str, Any]:
        module = unit.module

        def choose(pair, stat, loss_of):
            s = smoothquant_scales(stat[0], weight_col_absmax(module, pair.readers).to(stat[0].device), self.alpha)
            if not self.keep_if_better:
                return s, {"alpha": self.alpha}
            before, after = loss_of(None), loss_of(s)
            keep = after < before
            return (s if keep else None), {"alpha": self.alpha if keep else None, "loss_before": before,
                                           "loss_with_alpha": after}

        with torch.no_grad():
            return smooth_unit(module, data, ctx.device, self.pairs, choose, _held_out(data, ctx, self.validate))


@register
@dataclass
class AWQ(Algorithm):
    """Activation-aware scale search: per pair, alpha over ``i / n_grid`` (i < n_grid) with
    ``s = mean|X|^alpha`` (``duo_scaling``: ``/ max|W|^(1-alpha)``); keeps the alpha with the
    smallest quantized unit output MSE on the training calls, or no scaling when none beats
    the unsmoothed unit; ``validate``: the chosen alpha is kept only when it also beats the
    unsmoothed unit on the held-out calls (``SolveContext.holdout``)."""

    name: ClassVar[str] = "awq"
    group_kinds: ClassVar[tuple[str, ...]] = ("expert",)
    n_grid: int = 20
    duo_scaling: bool = False
    pairs: str = "all"
    validate: bool = True
    # routed experts per batched solve (1 = one by one): their calls and weights on the device
    expert_chunk: int = 32

    def check(self) -> None:
        if self.n_grid < 1:
            raise ConfigError(f"n_grid={self.n_grid}: need at least one grid point")
        if self.expert_chunk < 1:
            raise ConfigError(f"expert_chunk={self.expert_chunk}: must be >= 1 (1 = one expert at a time)")
        _check_pairs(self.pairs)

    def apply(self, unit, data: UnitData, ctx: SolveContext) -> dict[str, Any]:
        module = unit.module

        def choose(pair, stat, loss_of):
            wmax = weight_col_absmax(module, pair.readers).to(stat[1].device) if self.duo_scaling else None
            best_loss, best_alpha, best_s = loss_of(None), None, None
            base = best_loss
            for i in range(self.n_grid):
                alpha = i / self.n_grid
                if alpha == 0.0 and wmax is None:
                    continue  # s = 1: the unsmoothed unit, already measured
                s = awq_scales(stat[1], alpha, wmax)
                loss = loss_of(s)
                if loss < best_loss:
                    best_loss, best_alpha, best_s = loss, alpha, s
            return best_s, {"alpha": best_alpha, "loss_before": base, "loss_after": best_loss}

        with torch.no_grad():
            return smooth_unit(module, data, ctx.device, self.pairs, choose, _held_out(data, ctx, self.validate))

    # ------------------------------------------------------------------ routed experts, batched
    def _group_blocker(self, units, datas) -> str | None:
        """Why the experts cannot be smoothed batched (None: they can)."""
        why = common_group_blocker(self.expert_chunk, units)
        if why:
            return why
        for u in units:
            if not isinstance(u.module, GatedProjections):
                return "the expert is not a gated MLP (GatedProjections)"
            up, down = u.module.PROJECTIONS["up"], u.module.PROJECTIONS["down"]
            pairs = _pairs(u.module, self.pairs)
            if [(p.producer, p.readers) for p in pairs] != [(up, [down])]:
                return f"the expert's smoothing pairs are not exactly {up} -> {down} (up -> down)"
            if not _is_quantizing(u.module.projection("down")):
                return f"{down} (down) does not quantize in every expert"
            if any(isinstance(m, ActivationQuantizer) and m.is_static and m.mode != "off" for m in u.module.modules()):
                return "static activation quantizers are re-observed one unit at a time"
        for name, lins in expert_projections(units).items():
            ref = lins[0]
            for lin in lins:
                wq = lin.weight_quantizer
                if wq.spec != ref.weight_quantizer.spec or lin.enabled != ref.enabled:
                    return f"{name}'s weight specs differ between experts"
                if wq.spec is not None and wq.spec.format not in ("int", "fp8"):
                    return f"{name}'s {wq.spec.format} grid is quantized one expert at a time"
                if wq.has_fixed_qparams or wq.round_offset is not None:
                    return f"{name} carries a fixed grid or a rounding offset"
                if lin.weight.shape != ref.weight.shape or lin.weight.dtype != ref.weight.dtype:
                    return f"{name}'s weight shapes or dtypes differ between experts"
            if ref.weight_quantizer.spec is not None and ref.weight_quantizer.spec.granularity == "tensor":
                return "a per-tensor weight scale is not per expert once stacked"
        return expert_call_blocker(datas)

    def apply_group(self, units, datas, ctx: SolveContext) -> list[dict[str, Any]]:
        why = self._group_blocker(units, datas)
        ready = [i for i, d in enumerate(datas) if len(d)]
        if why is not None or len(ready) < 2:
            return [self.apply(u, d, ctx) for u, d in zip(units, datas)]
        # the rest one by one (the per-expert "no calls"), the ready experts in stacked chunks
        return solve_ready_in_chunks(units, datas, ready, self.expert_chunk, lambda u, d: self.apply(u, d, ctx),
                                     lambda us, ds: self._awq_chunk(us, ds, ctx))

    @torch.no_grad()
    def _awq_chunk(self, units, datas, ctx: SolveContext) -> list[dict[str, Any]]:
        """smooth_unit + AWQ.choose on the up -> down pair of ``len(units)`` experts at once (the
        projections by role, ``GatedProjections``)."""
        dev = ctx.device
        members = [u.module for u in units]
        cls = type(members[0])
        up, down = cls.PROJECTIONS["up"], cls.PROJECTIONS["down"]
        lins = expert_projections(units)
        names, E = tuple(lins), len(members)
        held = [_held_out(d, ctx, self.validate) for d in datas]
        n_train = [len(d) - len(h) for d, h in zip(datas, held)]
        rows_all = StackedCalls(datas, dev)
        rows_train = StackedCalls([UnitData(d.calls[:k]) for d, k in zip(datas, n_train)], dev)
        has_held = [len(h) > 0 for h in held]
        # an expert without held-out calls gets its training calls there (its result is unused)
        rows_held = (StackedCalls([UnitData(h or d.calls) for h, d in zip(held, datas)], dev)
                     if any(has_held) else None)
        W = {n: torch.stack([l.weight.detach().to(dev) for l in lins[n]]) for n in names}
        quantizes = {n: lins[n][0].enabled and not lins[n][0].weight_quantizer.is_identity for n in names}
        clips = {n: (torch.stack([(l.weight_quantizer.effective_clip().detach() if l.weight_quantizer.clip is not None
                                   else torch.ones(l.weight_quantizer.scale_shape(l.weight))).to(dev, torch.float32)
                                  for l in lins[n]])
                     if any(l.weight_quantizer.clip is not None for l in lins[n]) else None) for n in names}
        limit = members[0].clamp_limit      # the experts' own clamp of |up| (0: none)
        inter = W[up].shape[1]
        base_lim = (torch.stack([m.channel_clamp().to(dev) if m.channel_clamp() is not None else
                                 torch.full((inter,), float(limit), dtype=torch.float32, device=dev) for m in members])
                    if limit > 0 else None)
        own_lim = [m.channel_clamp() for m in members]

        def fq(n, w):
            if not quantizes[n]:
                return w
            return formats.fake_quant(w, lins[n][0].weight_quantizer.spec, clips[n])

        def weights(s):         # the members' quantized weights with s folded in (None: as they are)
            if s is None:
                return {n: fq(n, W[n]) for n in names}, None
            scaled = {**W, up: (W[up].float() / s[:, :, None]).to(W[up].dtype),
                      down: (W[down].float() * s[:, None, :]).to(W[down].dtype)}
            return {n: fq(n, scaled[n]) for n in names}, (None if base_lim is None else base_lim / s.float())

        def run(rows, wq, lim, taps=None):
            """Per slot: (squared error fp32 [E], elements [E]); lim: the members' up limits."""
            if lim is not None:
                for m, l in zip(members, lim):
                    m.set_channel_clamp(l)
            try:
                for k in range(rows.max_calls):
                    x, y, w, mask, n_rows = rows.slot(torch.full((E,), k, dtype=torch.long, device=dev))
                    out = cls.grouped_forward(members, x, w, wq, taps)
                    diff = (out.float() - y.float()) * mask
                    yield diff.square().sum(dim=(1, 2)), n_rows * out.shape[-1], taps, n_rows
            finally:
                for m, l in zip(members, own_lim):
                    m.set_channel_clamp(l)

        def mse(rows, s=None):   # [E] float64, unit_mse per expert
            wq, lim = weights(s)
            total = torch.zeros(E, dtype=torch.float64, device=dev)
            count = torch.zeros(E, dtype=torch.float64, device=dev)
            for se, n, _, _ in run(rows, wq, lim):
                total += se.double()
                count += n.double()
            return total / count.clamp(min=1)

        # float channel statistics of the down projection's input over the training calls (quantizers off)
        iq = [getattr(members[0], n).input_quantizer for n in names]
        modes = [q.mode for q in iq]
        for q in iq:
            q.mode = "off"
        try:
            mx, sm = None, None
            cnt = torch.zeros(E, dtype=torch.float32, device=dev)
            taps: dict[str, torch.Tensor] = {}
            for _, _, t, n_rows in run(rows_train, dict(W), None, taps):
                h = t[down].float().abs()                   # padding rows are zeros
                mx = h.amax(1) if mx is None else torch.maximum(mx, h.amax(1))
                sm = h.sum(1) if sm is None else sm + h.sum(1)
                cnt += n_rows
        finally:
            for q, m in zip(iq, modes):
                q.mode = m
        mean = sm / cnt[:, None]
        loss_start = mse(rows_all)
        wmax = W[down].float().abs().amax(1) if self.duo_scaling else None       # [E, I]
        base = mse(rows_train)
        best_loss, best_alpha, best_s = _awq_grid_rows(lambda sc: mse(rows_train, sc), mean, wmax, base, self.n_grid)
        chosen = best_alpha >= 0
        h0 = h1 = None
        if rows_held is not None:
            h0, h1 = mse(rows_held), mse(rows_held, best_s)
        host = {k: v.tolist() for k, v in (("base", base), ("best", best_loss), ("alpha", best_alpha),
                                           ("start", loss_start), ("chosen", chosen))}
        if h0 is not None:
            host["h0"], host["h1"] = h0.tolist(), h1.tolist()
        results = []
        for e, (u, m) in enumerate(zip(units, members)):
            info: dict[str, Any] = {"alpha": host["alpha"][e] if host["chosen"][e] else None,
                                    "loss_before": host["base"][e], "loss_after": host["best"][e]}
            keep = bool(host["chosen"][e])
            if keep and has_held[e]:
                info = {**info, "held_out_before": host["h0"][e], "held_out_after": host["h1"][e]}
                if not host["h1"][e] < host["h0"][e]:
                    keep, info["kept"] = False, False
            pair = _pairs(m, self.pairs)[0]
            if keep:
                commit_scales(m, None, pair, best_s[e].to(m.projection("up").weight.device))
            results.append({"pairs": {pair.name: info}, "loss_before": host["start"][e], "batched_experts": E})
        # the loss after, of the committed state (the experts' own weights and limits now)
        for lin_n in names:
            for l in lins[lin_n]:
                l.invalidate_cache()
        W = {n: torch.stack([l.weight.detach().to(dev) for l in lins[n]]) for n in names}
        own_lim = [m.channel_clamp() for m in members]
        after = mse(rows_all).tolist()
        for r, a in zip(results, after):
            r["loss_after"] = a
        return results


def _awq_grid_rows(loss_of, mean: torch.Tensor, wmax: torch.Tensor | None, base: torch.Tensor, n_grid: int):
    """AWQ's alpha grid on every expert at once: (best loss [E], best alpha [E] (-1: none beat
    ``base``), best scales [E, C]); ``loss_of(scales)`` is the experts' training loss [E]."""
    E = base.shape[0]
    best_loss, best_alpha = base.clone(), torch.full((E,), -1.0, dtype=torch.float64, device=base.device)
    best_s = torch.ones_like(mean)
    for i in range(n_grid):
        alpha = i / n_grid
        if alpha == 0.0 and wmax is None:
            continue
        s = _awq_scales_rows(mean, alpha, wmax)
        loss = loss_of(s)
        better = loss < best_loss
        best_loss = torch.where(better, loss, best_loss)
        best_alpha = torch.where(better, torch.full_like(best_alpha, alpha), best_alpha)
        best_s = torch.where(better[:, None], s, best_s)
    return best_loss, best_alpha, best_s


def _awq_scales_rows(act_absmean: torch.Tensor, alpha: float, weight_absmax: torch.Tensor | None) -> torch.Tensor:
    """:func:`awq_scales` on every row of [E, C] statistics at once (the same numbers per row)."""
    s = act_absmean.float().clamp(min=STAT_EPS).pow(alpha)
    if weight_absmax is not None:
        s = s / weight_absmax.float().clamp(min=STAT_EPS).pow(1.0 - alpha)
    s = s / (s.amax(-1, keepdim=True) * s.amin(-1, keepdim=True)).sqrt()
    return torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
