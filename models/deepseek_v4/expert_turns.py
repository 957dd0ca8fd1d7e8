"""A layer's routed experts tuned in turns, for block-wise rounding where they do not fit at once.

A V4-Pro layer's 384 experts are 47.2 GiB of bf16 weights; block-wise rounding would hold them
and their offsets (another 47.2 GiB in float16) on the device together, past a 64-GB Ascend
910B or an 80-GB H100. In turns (``blockround:turns``) only the experts of the current turn are
on the device as float weights with their learnable state; the float weights of the others wait
on the host, and every expert outside the turn enters the forward at its current fake-quant
value, decoded a chunk at a time from integer codes held on the device (:class:`StackCodes`:
11.8 GiB for a V4-Pro layer at 4 bits). On the host the float weights are a :class:`HostStack`:
the release's FP4 experts as their e2m1 codes (12.6 GiB for a V4-Pro layer, not 47.4 in bf16),
other weights as they are; outside its turn an expert's weights are meta placeholders (shape and
dtype, no values: whatever reads them raises rather than computing on stale values).

Lifecycle (driven by ``BlockRound``, through ``QuantV4MoE``):

    ExpertTurns(moe, n_turns)  codes of every expert's current state; float weights to the host
    begin(j) / end()           turn j's float weights to the device (its leaves tuned through the
                               usual stacked state) / its final state encoded into the codes (the
                               fold into a fixed grid, checked bit for bit) and its weights back
    finish(keep)               every float weight back on the device; ``keep``: each leaf folded
                               into its fixed grid (the weight replaced by the decoded codes,
                               the grid's scales fixed), else left as it started
"""
from __future__ import annotations

from torch import nn
import torch

from amct_ext.errors import QuantConfigError
from amct_ext.quant import formats
from amct_ext.io.host_stack import HostStack
from amct_ext.quant.leaf_stack import chunk_bounds
from amct_ext.quant.stack_codes import StackCodes


def turn_bounds(n_experts: int, n_turns: int) -> list[tuple[int, int]]:
    """``n_turns`` consecutive expert ranges as even as integers allow (none empty)."""
    n = max(1, min(n_turns, n_experts))
    cuts = [n_experts * j // n for j in range(n + 1)]
    return [(cuts[j], cuts[j + 1]) for j in range(n)]


class ExpertTurns:
    """The routed experts of ``moe`` (a QuantV4MoE whose experts stack: ``attach_leaf_stacks``)
    split into ``n_turns`` turns. ``frozen_chunk_bytes``: the decoded weights one frozen chunk
    of experts takes in the forward (the codes are decoded per chunk, and again in the backward)."""

    def __init__(self, moe, n_turns: int, frozen_chunk_bytes: int):
        self.moe = moe
        experts = list(moe.experts)
        w13, w2 = moe._packed_quant_weights()
        self.device, self.dtype = w13.device, w13.dtype
        self.inter = w2.shape[-1]
        # the float weights wait on the host; the device copies go with the last reference (a
        # copy on the CPU too: the stacks the layer was built with are then freed there alike).
        # First, so that the codes never share the device with them (V4-Pro: 47 + 12 GiB)
        self.host13, self.host2 = HostStack(w13), HostStack(w2)
        shapes = tuple(w13.shape), tuple(w2.shape)
        self.parked = (torch.empty(shapes[0], dtype=self.dtype, device="meta"),
                       torch.empty(shapes[1], dtype=self.dtype, device="meta"))
        del w13, w2
        moe._bind_stacks(*self.parked, copy=False)
        self._invalidate()
        self.codes13 = StackCodes(shapes[0], experts[0].w1.weight_quantizer.spec, self.device)
        self.codes2 = StackCodes(shapes[1], experts[0].w2.weight_quantizer.spec, self.device)
        self.turns = turn_bounds(len(experts), n_turns)
        per_expert = (self.parked[0][0].numel() + self.parked[1][0].numel()) * self.parked[0].element_size()
        self.frozen_bounds = chunk_bounds(len(experts), per_expert, frozen_chunk_bytes)
        # every leaf's state before the turns (where the layer ends worse than it began, it goes
        # back to it), and its codes: each chunk of experts back on the device for its encoding
        self.start = {}
        with torch.no_grad():
            for e0, e1 in self.frozen_bounds:
                d13, d2 = self.host13.slice_to(e0, e1, self.device), self.host2.slice_to(e0, e1, self.device)
                for e, lin, codes, (r0, r1) in self.leaves(e0, e1):
                    wq = lin.weight_quantizer
                    self.start[id(lin)] = (wq.clip, wq.round_offset)
                    w = (d13 if codes is self.codes13 else d2)[e - e0, r0:r1]
                    codes.put(e, (r0, r1), *formats.quantize_int(w, wq.spec, wq.effective_clip(),
                                                                 wq.effective_round_offset()))
                del d13, d2
        self.current: tuple[int, int] | None = None
        #: the current turn's float weights on the device (w13, w2), its leaves' weights views of them
        self.device_stacks: tuple[torch.Tensor, torch.Tensor] | None = None
        #: per expert: offsets that moved off zero (a turn's statistics, for the unit results)
        self.moved = [0] * len(experts)

    def leaves(self, e0: int = 0, e1: int | None = None):
        """(expert, leaf, its codes, its rows there) of experts e0:e1."""
        inter = self.inter
        for e, ex in enumerate(list(self.moe.experts)[e0:e1], start=e0):
            yield e, ex.w1, self.codes13, (0, inter)
            yield e, ex.w3, self.codes13, (inter, 2 * inter)
            yield e, ex.w2, self.codes2, (0, ex.w2.weight.shape[0])

    def _invalidate(self) -> None:
        for e in self.moe.experts:
            for lin in (e.w1, e.w3, e.w2):
                lin.invalidate_cache()

    def _rebind(self, e0: int, e1: int, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Experts e0:e1's weights as Parameters viewing ``w13`` / ``w2`` (their rows 0:e1-e0)."""
        inter = self.inter
        for k, ex in enumerate(list(self.moe.experts)[e0:e1]):
            for lin, view in ((ex.w1, w13[k, :inter]), (ex.w3, w13[k, inter:]), (ex.w2, w2[k])):
                lin.weight = nn.Parameter(view, requires_grad=False)
                lin.invalidate_cache()

    def begin(self, j: int) -> tuple[int, int]:
        """Turn j: its experts' float weights on the device; returns its expert range."""
        e0, e1 = self.turns[j]
        self.device_stacks = (self.host13.slice_to(e0, e1, self.device), self.host2.slice_to(e0, e1, self.device))
        self._rebind(e0, e1, *self.device_stacks)
        self.current = (e0, e1)
        return e0, e1

    @torch.no_grad()
    def end(self) -> None:
        """The current turn's state into the codes, checked: the decoded value of every weight
        equals its fake-quant value under the learned offset and clip, and quantizes back to
        itself on the fixed grid (``formats.fixed_grid``, as the fold of one leaf). Its leaves back
        to their start state (the codes now hold the result) and their weights to the host."""
        e0, e1 = self.current
        for e, lin, codes, rows in self.leaves(e0, e1):
            wq, w = lin.weight_quantizer, lin.weight.detach()
            clip, off = wq.effective_clip(), wq.effective_round_offset()
            clip = None if clip is None else clip.detach()
            off = None if off is None else off.detach()
            d = formats.fixed_grid(w, wq.spec, clip, off)
            if d is None:
                raise QuantConfigError(
                    f"blockround in turns: expert {e}'s {type(lin).__name__} does not fold into a fixed grid "
                    f"bit for bit ({wq.spec}); tune this layer in one turn (blockround:turns=1)")
            codes.put(e, rows, d["q"], d["scale"], d.get("zero_point"))
            if off is not None:
                self.moved[e] += int((off != 0).sum())
            wq.clip, wq.round_offset = self.start[id(lin)]
        self._rebind(e0, e1, self.parked[0][e0:e1], self.parked[1][e0:e1])
        self.current = self.device_stacks = None

    def abort(self) -> None:
        """The current turn's leaves back to their start state, then :meth:`finish` without the fold."""
        if self.current is not None:
            e0, e1 = self.current
            for _, lin, _, _ in self.leaves(e0, e1):
                lin.weight_quantizer.clip, lin.weight_quantizer.round_offset = self.start[id(lin)]
            self._rebind(e0, e1, self.parked[0][e0:e1], self.parked[1][e0:e1])
            self.current = self.device_stacks = None
        try:
            self.finish(keep=False)
        except torch.OutOfMemoryError:
            # the error being raised still holds the failed step's tensors: the weights do not
            # come back (the layer is discarded with the error), and that error is the one reported
            pass

    def frozen_weights(self, e0: int, e1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts e0:e1's current fake-quant weights (w13, w2), decoded from their codes."""
        return self.codes13.decode(e0, e1, self.dtype), self.codes2.decode(e0, e1, self.dtype)

    def _codes_to_host(self) -> tuple[StackCodes, StackCodes]:
        """The codes moved to the host (the device's copies go with the last reference)."""
        parked = tuple(codes.part(0, codes.shape[0], "cpu") for codes in (self.codes13, self.codes2))
        self.codes13 = self.codes2 = None
        return parked

    def _fill(self, w: torch.Tensor, part) -> None:
        """``w`` (a device stack) a chunk of experts at a time from ``part(e0, e1)``, their
        weights on the device."""
        for e0, e1 in self.frozen_bounds:
            w[e0:e1].copy_(part(e0, e1))

    def _grids_to_host(self) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        """{id(leaf): (scale, zero point)} of every leaf's fixed grid from the codes, on the host;
        the leaf's start state (clip, offset), which that grid replaces, dropped. A function of
        its own: no loop variable may keep the codes alive after it."""
        grids = {}
        for e, lin, codes, rows in self.leaves():
            scale, zp = codes.qparams(e, rows)
            grids[id(lin)] = (scale.to("cpu"), None if zp is None else zp.to("cpu"))
            lin.weight_quantizer.clip = lin.weight_quantizer.round_offset = None
        return grids

    @torch.no_grad()
    def finish(self, keep: bool) -> int:
        """Every expert's float weights back on the device as the MoE's packed stacks; ``keep``:
        each leaf folded into its fixed grid (weight = decoded codes, scales fixed). Returns the
        leaves folded. The device never holds the float stacks beside the codes (a V4-Pro layer:
        47.4 + 13.3 GiB; casebook i34-21): with ``keep`` the float weights are no longer needed
        and the codes go to the host, to be decoded back a chunk at a time; else the codes go and
        the float weights come back from the host. The leaves hold their own state: the start's
        after end(), else the fixed grids set below."""
        if self.current is not None:
            self.end()
        grids = self._grids_to_host() if keep else {}
        self.start = None
        dev, dtype = self.device, self.dtype
        if keep:   # the decoded codes, from the host
            self.host13 = self.host2 = None
            sources = [lambda e0, e1, c=c: c.part(e0, e1, dev).decode(0, e1 - e0, dtype) for c in self._codes_to_host()]
        else:      # the float weights, from the host
            self.codes13 = self.codes2 = None
            sources = [lambda e0, e1, h=h: h.slice_to(e0, e1, dev) for h in (self.host13, self.host2)]
            self.host13 = self.host2 = None
        w13, w2 = self.moe._new_stacks(dtype, dev)
        self._fill(w13, sources[0])
        self._fill(w2, sources[1])
        del sources
        self.moe._bind_stacks(w13, w2, copy=False)
        for lin in (lin for ex in self.moe.experts for lin in (ex.w1, ex.w3, ex.w2)):
            lin.weight.requires_grad_(False)
        folded = 0
        for _, lin, _, _ in self.leaves():
            if keep:
                scale, zp = grids[id(lin)]
                lin.weight_quantizer.set_fixed_qparams(lin.weight, scale, zp)
                lin.weight_replaced = True
                folded += 1
            lin.invalidate_cache()
            if keep:   # the weight is the decoded codes, which end() checked against this grid
                lin.mark_on_grid()
        return folded
