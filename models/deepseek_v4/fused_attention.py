"""Fused sparse attention of DeepSeek-V4 as one Triton kernel (CUDA, inference only).

It computes exactly what ``Attention.sparse_attention`` computes -- for query t and head h,

    softmax over { window keys p, t-W < p <= t } + { chosen compressed entries } + { sink_h }

of ``scale * q[t, h] . key`` with keys == values (one shared KV head), the sink adding
``exp(sink_h)`` to the denominator and nothing to the output -- but as an online softmax
(flash-attention style) that never writes the S x H x (W + K) logits to memory. The torch path
materialises them in fp32 and makes ~10 elementwise passes over them; at V4-Flash shape that was
most of the attention time (benchmarks/RESULTS.md §4).

One program handles one (batch, token, head block, value slice). The heads of one token share all
their keys, so they are the rows of the two small GEMMs (the same folding the torch path uses).

Numerics (why this is as faithful as the torch path): logits are fp32 dot products of bf16
operands (the torch path rounds them to bf16 first), the softmax is fp32, and the probabilities
are rounded to bf16 before the value GEMM, as in the torch path. ``tests/test_fused_attention.py``
compares both against an fp32 computation.

The kernel is used only when ``fused_attention_supported`` says so: a CUDA device, Triton present,
no autograd (PTQ's backward pass uses the torch path), plain (unquantized, unhooked) matmuls.
"""
from __future__ import annotations

import functools

import torch

from amct_ext.runtime.device import device_guard
from amct_ext.runtime.triton_support import triton, tl  # noqa: F401  (None without Triton)


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _attend(q, rows, valid, offs_d, offs_v, m_i, l_i, acc, scale, D: tl.constexpr, DV: tl.constexpr):
        """One block of keys (== values), row pointers ``rows`` [BN, 1]: fold exp(scale * q.k - m)
        into the running (max m, denominator l, output acc)."""
        keys = tl.load(rows + offs_d[None, :], mask=valid[:, None], other=0.0)     # [BN, D]
        if DV == D:
            values = keys
        else:                                                           # this program's value slice
            values = tl.load(rows + offs_v[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(keys)) * scale                           # [BH, BN] fp32
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))                           # m starts at the sink: finite
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
        return m_new, l_i, acc

    @triton.jit
    def _sparse_attention_kernel(
        q_ptr, kv_ptr, comp_ptr, idx_ptr, sink_ptr, out_ptr,
        H, scale,
        sq_b, sq_s, sq_h, skv_b, skv_s, sc_b, sc_n, si_b, si_s, so_b, so_s, so_h,
        WINDOW: tl.constexpr, N_SLOTS: tl.constexpr, CAUSAL_RATIO: tl.constexpr, N_ENTRIES: tl.constexpr,
        D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
        n_hb = tl.cdiv(H, BLOCK_H)
        hb = tl.program_id(2) % n_hb
        dv0 = (tl.program_id(2) // n_hb) * DV                           # this program's value slice

        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        offs_d = tl.arange(0, D)
        offs_v = dv0 + tl.arange(0, DV)
        offs_n = tl.arange(0, BLOCK_N)

        q = tl.load(q_ptr + b * sq_b + t * sq_s + offs_h[:, None] * sq_h + offs_d[None, :],
                    mask=hmask[:, None], other=0.0)                     # [BH, D]
        # the sink is the running max's start value: l starts at exp(sink - sink) = 1
        m_i = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0).to(tl.float32)
        l_i = tl.full([BLOCK_H], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_H, DV], dtype=tl.float32)

        # window: positions t-W+1 .. t of this sequence
        for n0 in range(0, WINDOW, BLOCK_N):
            pos = t - WINDOW + 1 + n0 + offs_n
            valid = (pos >= 0) & (pos <= t)                             # BLOCK_N may exceed WINDOW
            rows = kv_ptr + b * skv_b + pos[:, None] * skv_s
            m_i, l_i, acc = _attend(q, rows, valid, offs_d, offs_v, m_i, l_i, acc, scale, D, DV)

        # compressed entries: the indexer's picks (-1 = none), or every entry j < (t+1) // ratio
        # (loop bounds are compile-time constants; blocks past the causal limit are skipped)
        if N_SLOTS > 0:
            for n0 in range(0, N_SLOTS, BLOCK_N):
                slot = n0 + offs_n
                j = tl.load(idx_ptr + b * si_b + t * si_s + slot, mask=slot < N_SLOTS, other=-1).to(tl.int64)
                valid = j >= 0
                if tl.max(j, 0) >= 0:  # early tokens have fewer picks than slots: skip empty blocks
                    rows = comp_ptr + b * sc_b + tl.where(valid, j, 0)[:, None] * sc_n
                    m_i, l_i, acc = _attend(q, rows, valid, offs_d, offs_v, m_i, l_i, acc, scale, D, DV)
        elif CAUSAL_RATIO > 0:
            n_allowed = (t + 1) // CAUSAL_RATIO
            for n0 in range(0, N_ENTRIES, BLOCK_N):
                if n0 < n_allowed:
                    j = n0 + offs_n
                    valid = j < n_allowed
                    rows = comp_ptr + b * sc_b + j[:, None] * sc_n
                    m_i, l_i, acc = _attend(q, rows, valid, offs_d, offs_v, m_i, l_i, acc, scale, D, DV)

        out = acc / l_i[:, None]
        tl.store(out_ptr + b * so_b + t * so_s + offs_h[:, None] * so_h + offs_v[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=hmask[:, None])


if triton is not None:

    @triton.jit
    def _index_score_kernel(q_ptr, k_ptr, w_ptr, out_ptr, S, N,
                            sq_b, sq_s, sq_h, sk_b, sk_n, sw_b, sw_s, so_b, so_s,
                            RATIO: tl.constexpr, IH: tl.constexpr, ID: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
        """score[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j]) for j < (t + 1) // RATIO, else -inf."""
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        b = tl.program_id(2).to(tl.int64)
        tmask = t < S
        nmask = n < N
        d = tl.arange(0, ID)
        allowed = n[None, :] < ((t[:, None] + 1) // RATIO)
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        # blocks wholly above the causal limit only need their -inf
        if tl.program_id(1) * BLOCK_N < (tl.minimum(tl.program_id(0) * BLOCK_T + BLOCK_T, S)) // RATIO:
            keys = tl.load(k_ptr + b * sk_b + n[:, None].to(tl.int64) * sk_n + d[None, :], mask=nmask[:, None], other=0.0)
            for h in tl.static_range(IH):
                qh = tl.load(q_ptr + b * sq_b + t[:, None].to(tl.int64) * sq_s + h * sq_h + d[None, :],
                             mask=tmask[:, None], other=0.0)
                wh = tl.load(w_ptr + b * sw_b + t.to(tl.int64) * sw_s + h, mask=tmask, other=0.0)
                acc += wh[:, None] * tl.maximum(tl.dot(qh, tl.trans(keys)), 0.0)
        acc = tl.where(allowed, acc, float("-inf"))
        tl.store(out_ptr + b * so_b + t[:, None].to(tl.int64) * so_s + n[None, :], acc,
                 mask=tmask[:, None] & nmask[None, :])


def fused_index_score(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, ratio: int,
                      block_t: int = 64, block_n: int = 64) -> torch.Tensor:
    """The indexer's causal score: q [B, S, Ih, Id], keys [B, Nc, Id] (same dtype), weights
    [B, S, Ih] fp32 -> [B, S, Nc] fp32, -inf where entry j is not yet complete ((t + 1) // r <= j).

    Same math as the torch path (fp32 dot products of the bf16 operands, relu, weighted sum over
    heads) without its [B, S, Ih, Nc] fp32 logits (1 GiB at V4-Flash shape, S = 4096)."""
    if triton is None:
        raise RuntimeError("fused_index_score needs Triton")
    bsz, seqlen, n_heads, dim = q.shape
    n_entries = keys.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    weights = weights.float().contiguous()
    out = torch.empty(bsz, seqlen, n_entries, dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(seqlen, block_t), triton.cdiv(n_entries, block_n), bsz)
    with device_guard(q.device):
        _index_score_kernel[grid](q, keys, weights, out, seqlen, n_entries,
                                  q.stride(0), q.stride(1), q.stride(2), keys.stride(0), keys.stride(1),
                                  weights.stride(0), weights.stride(1), out.stride(0), out.stride(1),
                                  RATIO=ratio, IH=n_heads, ID=dim, BLOCK_T=block_t, BLOCK_N=block_n, num_warps=4)
    return out


# Launch shape chosen on the H200 at V4-Flash shape (H=64, D=512): benchmarks/RESULTS.md §4.
DEFAULT_LAUNCH = {"block_n": 64, "value_splits": 1, "num_warps": 8, "num_stages": 1}


def fused_sparse_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, scale: float, window: int,
                           comp_kv: torch.Tensor | None = None, comp_idx: torch.Tensor | None = None,
                           causal_ratio: int = 0, *, block_n: int | None = None, value_splits: int | None = None,
                           num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """q [B, S, H, D], kv [B, S, D], sink [H] fp32 -> out [B, S, H, D] in q's dtype.

    Compressed part: ``comp_kv`` [B, Nc, D] with either ``comp_idx`` [B, S, K] (entry per slot,
    -1 = none) or ``causal_ratio`` r (query t sees entries j < (t + 1) // r)."""
    if triton is None:
        raise RuntimeError("fused_sparse_attention needs Triton")
    bsz, seqlen, n_heads, dim = q.shape
    if dim & (dim - 1) or dim < 16:
        raise ValueError(f"fused_sparse_attention needs a power-of-two head_dim >= 16, got {dim}")
    launch = dict(DEFAULT_LAUNCH)
    for k, v in (("block_n", block_n), ("value_splits", value_splits), ("num_warps", num_warps),
                 ("num_stages", num_stages)):
        if v is not None:
            launch[k] = v
    q = q.contiguous() if q.stride(-1) != 1 else q
    kv = kv.contiguous() if kv.stride(-1) != 1 else kv
    out = torch.empty_like(q)
    has_comp = comp_kv is not None and comp_kv.shape[1] > 0
    has_idx = has_comp and comp_idx is not None
    if has_comp:
        comp_kv = comp_kv.contiguous() if comp_kv.stride(-1) != 1 else comp_kv
    else:
        comp_kv = kv  # never read
    if has_idx:
        comp_idx = comp_idx.to(torch.int32).contiguous()
        n_slots = comp_idx.shape[-1]
    else:
        comp_idx = torch.empty(1, 1, 1, dtype=torch.int32, device=q.device)
        n_slots = 0
    ratio = causal_ratio if (has_comp and not has_idx) else 0
    block_h = max(16, min(64, triton.next_power_of_2(n_heads)))
    splits = launch["value_splits"] if dim // launch["value_splits"] >= 16 else 1
    grid = (seqlen, bsz, triton.cdiv(n_heads, block_h) * splits)
    with device_guard(q.device):
        _sparse_attention_kernel[grid](
            q, kv, comp_kv, comp_idx, sink.float().contiguous(), out,
            n_heads, float(scale),
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1),
            comp_kv.stride(0), comp_kv.stride(1), comp_idx.stride(0), comp_idx.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            WINDOW=window, N_SLOTS=n_slots, CAUSAL_RATIO=ratio, N_ENTRIES=comp_kv.shape[1] if ratio else 0, D=dim, DV=dim // splits,
            BLOCK_H=block_h, BLOCK_N=launch["block_n"], num_warps=launch["num_warps"], num_stages=launch["num_stages"],
        )
    return out
