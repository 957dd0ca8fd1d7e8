"""Helpers of the algorithms that solve a layer's routed experts as one batched problem
(AutoRound, clip, AWQ): the experts' captured calls as padded device batches, and the
straight-through clamp their stacked parameters use."""
from __future__ import annotations

import torch

from ..pipeline.capture import CALL_METER
from ..pipeline.replay import output_tensor as _output_tensor


def common_group_blocker(expert_chunk: int, units) -> str | None:
    """Why a layer's routed experts cannot be solved as one stacked problem, for the reasons every
    batched algorithm (clip, AWQ, AutoRound) shares: one expert per solve, a unit class without
    ``grouped_forward``, or what that class's own ``grouped_forward_blocker`` says (None: no
    shared reason; the algorithm then checks its own)."""
    if expert_chunk < 2 or len(units) < 2:
        return "one expert per solve"
    m0 = units[0].module
    blocker = getattr(type(m0), "grouped_forward_blocker", None)
    if blocker is None:
        return f"{type(m0).__name__} has no grouped_forward"
    return blocker([u.module for u in units]) or None


def expert_projections(units) -> dict[str, list]:
    """Each grouped projection's leaf in every expert, in the units' order:
    ``{name: [leaf of expert 0, leaf of expert 1, ...]}`` for ``GROUPED_PROJECTIONS`` of the
    units' class (the stacked problem's weights, one list per projection)."""
    names = type(units[0].module).GROUPED_PROJECTIONS
    return {n: [getattr(u.module, n) for u in units] for n in names}


def expert_call_blocker(datas) -> str | None:
    """A reason the stacked forward cannot replay the captured calls: every expert call must be
    ``(x, routing weights)`` (None: all are)."""
    for d in datas:
        for c in d.calls:
            if c.kwargs.keys() - {"weights"} or len(c.args) > 2 or not isinstance(c.args[0], torch.Tensor):
                return "an expert call is not (x, routing weights)"
    return None


def solve_ready_in_chunks(units, datas, ready: list[int], expert_chunk: int, solve_one, solve_chunk) -> list:
    """The experts not in ``ready`` one by one (``solve_one(unit, data)``: their own per-expert
    message), the ready ones ``expert_chunk`` at a time (``solve_chunk(units, datas)``); the
    results in the units' order."""
    out: list = [None] * len(units)
    for i, (u, d) in enumerate(zip(units, datas)):
        if i not in ready:
            out[i] = solve_one(u, d)
    for c0 in range(0, len(ready), expert_chunk):
        idx = ready[c0:c0 + expert_chunk]
        for i, r in zip(idx, solve_chunk([units[i] for i in idx], [datas[i] for i in idx])):
            out[i] = r
    return out


def ste_clamp(p: torch.Tensor, lo, hi) -> torch.Tensor:
    """``p`` clamped to [lo, hi] in the forward, identity gradient (the quantizers' effective_*)."""
    clamped = torch.clamp(p, lo, hi)
    return p + (clamped - p).detach()


class StackedCalls:
    """The calls of E experts on the device as padded batches: ``slot(k)`` gives every expert
    e its call ``k[e]`` (x [E, T, D], target [E, T, D], routing weights [E, T, 1], a row mask
    [E, T, 1] and the rows per expert), T the longest call of all. An expert past its last
    call gets an all-padding slot (0 rows). Indices stay on the device: no host sync a step."""

    def __init__(self, datas, dev: torch.device):
        # on a cpu device the stacked copy is host memory: counted (capture.CALL_METER) while
        # it lives, and the per-call pieces while they wait to be concatenated
        host = torch.device(dev).type == "cpu"
        building = [0]
        try:
            xs, ys, ws, starts, lens = self._gather(datas, dev, building if host else None)
            self.x, self.y, self.w = torch.cat(xs), torch.cat(ys), torch.cat(ws)
            if host:
                CALL_METER.hold(self, sum(t.numel() * t.element_size() for t in (self.x, self.y, self.w)))
            del xs, ys, ws
        finally:
            CALL_METER.sub(building[0])
        k_max = max(len(s) for s in starts)
        self.max_calls = k_max
        self.n_calls = torch.tensor([len(s) for s in starts], dtype=torch.long, device=dev)
        pad = lambda rows: [r + [0] * (k_max - len(r)) for r in rows]   # noqa: E731
        self.starts = torch.tensor(pad(starts), dtype=torch.long, device=dev)     # [E, K]
        self.lens = torch.tensor(pad(lens), dtype=torch.long, device=dev)         # [E, K] (0: no call)
        self.t_max = max(max(ln) for ln in lens)
        self.arange = torch.arange(self.t_max, device=dev)

    @staticmethod
    def _gather(datas, dev, building: list[int] | None):
        """Per call (x rows, target rows, routing weights) on ``dev`` and per expert the calls'
        first rows and lengths; ``building``: the host bytes gathered, counted as they come."""
        xs, ys, ws, starts, lens = [], [], [], [], []
        at = 0
        for d in datas:
            st, ln = [], []
            for c in d.calls:
                x = c.args[0]
                x = x.reshape(-1, x.shape[-1])
                w = c.args[1] if len(c.args) > 1 else c.kwargs.get("weights")
                # no routing weight: a weight of exactly 1 (h * 1.0 == h bit for bit)
                w = torch.ones(x.shape[0], 1) if w is None else w.reshape(-1, 1)
                xs.append(x.to(dev))
                ys.append(_output_tensor(c.output).reshape(x.shape[0], -1).to(dev))
                ws.append(w.to(device=dev, dtype=torch.float32))
                if building is not None:
                    n = sum(t.numel() * t.element_size() for t in (xs[-1], ys[-1], ws[-1]))
                    CALL_METER.add(n)
                    building[0] += n
                st.append(at)
                ln.append(x.shape[0])
                at += x.shape[0]
            starts.append(st)
            lens.append(ln)
        return xs, ys, ws, starts, lens

    def slot(self, k: torch.Tensor):
        kk = k.clamp(max=self.max_calls - 1).unsqueeze(1)
        start = self.starts.gather(1, kk).squeeze(1)
        n_rows = torch.where(k < self.n_calls, self.lens.gather(1, kk).squeeze(1), 0)     # [E]
        valid = self.arange.unsqueeze(0) < n_rows.unsqueeze(1)                            # [E, T]
        idx = torch.where(valid, start.unsqueeze(1) + self.arange.unsqueeze(0), 0)
        mask = valid.unsqueeze(-1)
        x = torch.where(mask, self.x[idx], 0)
        return x, self.y[idx], torch.where(mask, self.w[idx], 0.0), mask, n_rows
