"""The torch path of V4's sparse attention in its banded layout, and its own backward.

``Attention.sparse_attention_torch`` lays the queries out in blocks of W tokens (rows = (token,
head), one shared KV head) and calls ``banded_attention`` here:

    p = softmax over [ window logits | compressed logits | sink_h ]   (fp32, masked entries -inf)
    out = p_window(bf16) @ keys + p_compressed(bf16) @ comp_kv        (the sink adds no value)

with logits = scale * (q @ key^T rounded to the operands' dtype, then fp32; float64 operands
keep float64, so that the tests compare in float64).

Under autograd the plain composition of torch ops keeps about ten fp32 tensors of the size of
the logits for its backward (at a V4-Flash step: [8, 16, 128, 64, 512] fp32 is 2 GiB each) and
walks each of them again there; in a block-rounding step that was ~15 % of the time (casebook
i34-11). ``BandedAttention`` (an autograd Function) computes the forward with the same ops in
place, keeps only its inputs and the softmax's two statistics (max and denominator per row), and
in its backward recomputes p exactly as the forward did and applies the softmax gradient

    dlogit = scale * p * (dp - sum_row(p * dp)),   dp = d_out @ value^T

then the two GEMMs of each product. The forward is bit for bit the plain path's; the gradients
are the same function (checked in float64 against autograd through the plain path,
tests/test_banded_attention.py). The model uses it on the fast-path devices (CUDA) under autograd
with plain matmuls and a frozen sink; elsewhere, the plain path.
"""
from __future__ import annotations

from typing import Callable

import torch

Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _qk(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b.transpose(-1, -2))


def banded_attention(qb: torch.Tensor, keys: torch.Tensor, win_allowed: torch.Tensor, sink: torch.Tensor,
                     scale: float, comp_kv: torch.Tensor | None = None, comp_allowed: torch.Tensor | None = None,
                     qk: Matmul = _qk, pv: Matmul = torch.matmul, inplace: bool = False,
                     stats: list | None = None) -> torch.Tensor:
    """The attention output [B, nb, W*H, Dh] of the banded layout.

    qb [B, nb, W*H, Dh]: query block b's rows (token, head); keys [B, nb, 2W, Dh]: the keys (==
    values) of blocks b-1 and b; win_allowed [1, nb, W, 1, 2W] bool; sink [H] fp32; comp_kv
    [B, Nc, Dh] with comp_allowed [B, nb, W, 1, Nc] bool, or None. ``qk`` / ``pv``: the two
    products (a quantization wrapper's modules). ``inplace``: fp32 ops in place (no autograd).
    ``stats``: filled with (peak, denominator) of the softmax, [B, nb, W, H, 1] each."""
    bsz, n_blocks, rows, dh = qb.shape
    w = keys.shape[2] // 2
    n_heads = rows // w
    acc = softmax_dtype(qb)

    def scaled_masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        if inplace:
            return logits.mul_(scale).masked_fill_(~allowed, float("-inf"))
        return (logits * scale).masked_fill(~allowed, float("-inf"))

    def exp_shifted(logits: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
        return logits.sub_(peak).exp_() if inplace else torch.exp(logits - peak)

    def normalized(e: torch.Tensor, denom: torch.Tensor) -> torch.Tensor:
        return (e.div_(denom) if inplace else e / denom).to(qb.dtype)

    # one softmax over [window | compressed | sink], computed per part: no concatenated copy of
    # the logits, and (in place) one fp32 buffer of the logits' size per part
    win = scaled_masked(qk(qb, keys).to(acc).view(bsz, n_blocks, w, n_heads, 2 * w), win_allowed)
    sink = sink.to(acc).view(1, 1, 1, n_heads, 1)
    peak = torch.maximum(win.amax(dim=-1, keepdim=True), sink)
    comp = None
    if comp_kv is not None and comp_kv.shape[1] > 0:
        n_entries = comp_kv.shape[1]
        comp = qk(qb.reshape(bsz, n_blocks * rows, dh), comp_kv).to(acc)
        comp = scaled_masked(comp.view(bsz, n_blocks, w, n_heads, n_entries), comp_allowed)
        peak = torch.maximum(peak, comp.amax(dim=-1, keepdim=True))
    win = exp_shifted(win, peak)
    denom = win.sum(dim=-1, keepdim=True) + torch.exp(sink - peak)
    if comp is not None:
        comp = exp_shifted(comp, peak)
        denom = denom + comp.sum(dim=-1, keepdim=True)
    if stats is not None:
        stats += [peak, denom]
    out = pv(normalized(win, denom).view(bsz, n_blocks, rows, 2 * w), keys)        # [B, nb, W*H, Dh]
    if comp is not None:
        comp_probs = normalized(comp, denom).view(bsz, n_blocks * rows, -1)
        out = out + pv(comp_probs, comp_kv).view(bsz, n_blocks, rows, dh)
    return out


def softmax_dtype(x: torch.Tensor) -> torch.dtype:
    """The softmax's dtype: fp32 for 16-bit and fp32 operands, float64 for float64 ones (tests)."""
    return torch.promote_types(x.dtype, torch.float32)


def _probs(logits: torch.Tensor, allowed: torch.Tensor, scale: float, peak: torch.Tensor,
           denom: torch.Tensor) -> torch.Tensor:
    """fp32 softmax probabilities from raw fp32 logits, in place, with the forward's own ops and
    statistics (so they equal the forward's to the bit)."""
    return logits.mul_(scale).masked_fill_(~allowed, float("-inf")).sub_(peak).exp_().div_(denom)


class BandedAttention(torch.autograd.Function):
    """``banded_attention`` with plain products and a frozen sink, and a backward that recomputes
    the probabilities instead of keeping the fp32 intermediates (module docstring)."""

    @staticmethod
    def forward(ctx, qb, keys, comp_kv, win_allowed, comp_allowed, sink, scale):
        if ctx.needs_input_grad[5]:
            raise ValueError("BandedAttention: the sink must be frozen (its gradient is not computed here)")
        stats: list = []
        out = banded_attention(qb, keys, win_allowed, sink, scale, comp_kv, comp_allowed, inplace=True, stats=stats)
        has_comp = comp_kv is not None and comp_kv.shape[1] > 0
        ctx.scale, ctx.has_comp = scale, has_comp
        ctx.save_for_backward(qb, keys, comp_kv if has_comp else None, win_allowed,
                              comp_allowed if has_comp else None, *stats)
        return out

    @staticmethod
    def backward(ctx, d_out):
        qb, keys, comp_kv, win_allowed, comp_allowed, peak, denom = ctx.saved_tensors
        scale = ctx.scale
        bsz, n_blocks, rows, dh = qb.shape
        w = keys.shape[2] // 2
        n_heads = rows // w
        d_out = d_out.to(qb.dtype)
        acc = softmax_dtype(qb)
        shape = (bsz, n_blocks, w, n_heads, -1)

        p_win = _probs(_qk(qb, keys).to(acc).view(shape), win_allowed, scale, peak, denom)
        dp_win = torch.matmul(d_out, keys.transpose(-1, -2)).to(acc).view(shape)
        delta = (p_win * dp_win).sum(dim=-1, keepdim=True)
        if ctx.has_comp:
            q_rows = qb.reshape(bsz, n_blocks * rows, dh)
            d_rows = d_out.reshape(bsz, n_blocks * rows, dh)
            p_comp = _probs(_qk(q_rows, comp_kv).to(acc).view(shape), comp_allowed, scale, peak, denom)
            dp_comp = torch.matmul(d_rows, comp_kv.transpose(-1, -2)).to(acc).view(shape)
            delta += (p_comp * dp_comp).sum(dim=-1, keepdim=True)

        # the value product's gradients take the probabilities as the forward used them (bf16)
        p_win_q = p_win.to(qb.dtype).view(bsz, n_blocks, rows, 2 * w)
        d_keys = torch.matmul(p_win_q.transpose(-1, -2), d_out)
        del p_win_q
        # the logits' gradient: scale * p * (dp - delta), rounded as the bf16 logits' gradient is
        d_win = dp_win.sub_(delta).mul_(p_win).mul_(scale).to(qb.dtype).view(bsz, n_blocks, rows, 2 * w)
        del p_win, dp_win
        d_q = torch.matmul(d_win, keys)
        d_keys += torch.matmul(d_win.transpose(-1, -2), qb)
        del d_win
        d_comp = None
        if ctx.has_comp:
            p_comp_q = p_comp.to(qb.dtype).view(bsz, n_blocks * rows, -1)
            d_comp = torch.matmul(p_comp_q.transpose(-1, -2), d_rows)
            del p_comp_q
            g = dp_comp.sub_(delta).mul_(p_comp).mul_(scale).to(qb.dtype).view(bsz, n_blocks * rows, -1)
            del p_comp, dp_comp
            d_q += torch.matmul(g, comp_kv).view(bsz, n_blocks, rows, dh)
            d_comp += torch.matmul(g.transpose(-1, -2), q_rows)
        return d_q, d_keys, d_comp, None, None, None, None
