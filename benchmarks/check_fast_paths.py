#!/usr/bin/env python
"""Accuracy and speed of the fast paths at V4-Flash shape, each against an fp32 or float64 computation:

1. the fused sparse-attention kernel (models/deepseek_v4/fused_attention.py) vs the torch path,
   for the three attention kinds (window only; window + indexer picks; window + causal entries);
2. the fp32-island GEMMs on bf16 tensor cores with fp32 output (amct_ext/runtime/exact_gemm.py) vs a
   true fp32 GEMM, both against float64 (reported: tensor cores accumulate fp32 less exactly);
3. the hc, indexer-score, SwiGLU and per-token int8 kernels vs their torch expressions;
4. with --layers: whole bf16 layers with the fast paths on and off, each against the same layer
   in fp32 -- the criterion for everything above: the fast paths must not move the bf16 layer
   further from the float model.

Every kernel must be at least as close to float64 / fp32 as the torch path it replaces (the int8
fake quant: bit-identical). Optionally sweeps the attention kernel's launch shape.

    python benchmarks/check_fast_paths.py --device cuda --layers 4,3,0 --json $OUT/fast_paths.json [--sweep]
    python benchmarks/check_fast_paths.py --smoke        # tiny shapes on CPU (torch paths only)
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common as C  # noqa: E402
from amct_ext.runtime import device as D  # noqa: E402
from amct_ext.runtime.exact_gemm import linear_fp32  # noqa: E402
from models.deepseek_v4 import DeepseekV4Config  # noqa: E402
from models.deepseek_v4.fused_attention import fused_sparse_attention  # noqa: E402
from models.deepseek_v4.modeling import Attention  # noqa: E402

SWEEP = [dict(block_n=bn, value_splits=vs, num_warps=nw, num_stages=ns)
         for bn in (32, 64) for vs in (1, 2) for nw in (4, 8) for ns in (1, 2, 3)] + [
    dict(block_n=128, value_splits=1, num_warps=8, num_stages=1), dict(block_n=128, value_splits=2, num_warps=8, num_stages=1)]


def attention_inputs(attn: Attention, bsz: int, seqlen: int, topk: int, device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h, dh = attn.n_heads, attn.head_dim
    # unit-RMS q and kv as after the model's norms (the float model's attention inputs)
    q = torch.randn(bsz, seqlen, h, dh, generator=g).to(device)
    kv = torch.randn(bsz, seqlen, dh, generator=g).to(device)
    comp_kv = comp_idx = None
    if attn.ratio:
        n = seqlen // attn.ratio
        comp_kv = torch.randn(bsz, n, dh, generator=g).to(device)
        if attn.ratio == 4:
            # topk picks among the allowed entries of each query (random scores, -1 past the limit)
            limit = ((torch.arange(seqlen) + 1) // attn.ratio).view(1, seqlen, 1)
            score = torch.rand(bsz, seqlen, n, generator=g).masked_fill(torch.arange(n).view(1, 1, n) >= limit, -1)
            idx = score.topk(min(topk, n), dim=-1).indices
            comp_idx = torch.where(idx < limit, idx, -1).to(device)
    sink = torch.randn(h, generator=g).to(device)
    return q, kv, comp_kv, comp_idx, sink


def check_attention(config: DeepseekV4Config, layer_id: int, bsz: int, seqlen: int, device, repeats: int,
                    sweep: bool, fused_ok: bool) -> dict:
    attn = Attention(config, layer_id, torch.bfloat16).to(device)
    q, kv, comp_kv, comp_idx, sink = attention_inputs(attn, bsz, seqlen, config.index_topk, device)
    with torch.no_grad():
        attn.attn_sink.copy_(sink)
    res = {"layer": layer_id, "ratio": attn.ratio, "batch": bsz, "seq_len": seqlen}
    bf = lambda t: None if t is None else t.bfloat16()  # noqa: E731
    with torch.inference_mode():
        ref = attn.float().sparse_attention(q.float(), kv.float(), None if comp_kv is None else comp_kv.float(),
                                            comp_idx).float()
        attn.bfloat16()
        torch_bf16 = lambda: attn.sparse_attention_torch(  # noqa: E731
            bf(q), bf(kv), bf(comp_kv), _allowed(attn, q, comp_kv, comp_idx))
        out_t = torch_bf16().float()
        res["torch_bf16"] = C.compare(out_t, ref)
        res["torch_bf16_time"] = C.time_fn(torch_bf16, device, repeats, 2)
        if fused_ok:
            fused = lambda **kw: fused_sparse_attention(  # noqa: E731
                bf(q), bf(kv), attn.attn_sink, attn.softmax_scale, attn.window, bf(comp_kv), comp_idx, attn.ratio, **kw)
            res["fused"] = C.compare(fused().float(), ref)
            res["fused_time"] = C.time_fn(fused, device, repeats, 2)
            res["fused_ok"] = res["fused"]["rel_fro"] <= 1.5 * res["torch_bf16"]["rel_fro"] + 1e-6
            if sweep and attn.ratio == 4:  # the kind the speed target is set on
                res["sweep"] = []
                for launch in SWEEP:
                    try:
                        t = C.time_fn(lambda: fused(**launch), device, repeats, 1)
                        err = C.compare(fused(**launch).float(), ref)["rel_fro"]
                        res["sweep"].append({**launch, "median_ms": t["median_ms"], "rel_fro": err})
                    except Exception as e:  # a launch shape may not fit (registers / shared memory)
                        res["sweep"].append({**launch, "error": str(e)[:200]})
    return res


def _allowed(attn: Attention, q, comp_kv, comp_idx):
    if comp_kv is None:
        return None
    seqlen, n = q.shape[1], comp_kv.shape[1]
    if comp_idx is None:
        from models.deepseek_v4.modeling import causal_entry_mask
        return causal_entry_mask(seqlen, n, attn.ratio, q.device).expand(q.shape[0], -1, -1)
    allowed = torch.zeros(q.shape[0], seqlen, n + 1, dtype=torch.bool, device=q.device)
    allowed.scatter_(-1, torch.where(comp_idx < 0, n, comp_idx), True)
    return allowed[..., :n]


def check_gemm(m: int, k: int, n: int, device, repeats: int) -> dict:
    """linear_fp32 of a bf16 x with (a) an fp32 weight (3-way split) and (b) a bf16-valued weight
    (one bf16 GEMM, exact products), each against the true fp32 GEMM, errors vs float64."""
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(m, k, generator=g).bfloat16().to(device)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(device)
    res = {"shape": [m, k, n]}
    with torch.inference_mode():
        for name, weight in (("fp32_weight", w), ("bf16_weight", w.bfloat16())):
            ref = x.double() @ weight.double().t()
            plain = lambda: torch.nn.functional.linear(x.float(), weight.float())  # noqa: E731
            fast = lambda: linear_fp32(x, weight)  # noqa: E731
            r = {"fp32_gemm": _rel64(plain(), ref), "fast": _rel64(fast(), ref),
                 "fp32_gemm_time": C.time_fn(plain, device, repeats, 2), "fast_time": C.time_fn(fast, device, repeats, 2)}
            r["error_ratio"] = r["fast"]["rel_fro"] / max(r["fp32_gemm"]["rel_fro"], 1e-30)
            res[name] = r
    return res


def check_hc(config: DeepseekV4Config, bsz: int, seqlen: int, device, repeats: int) -> dict:
    """hc_post through the Triton mix vs the torch expression (bf16 stream, fp32 weights)."""
    from models.deepseek_v4.fused_hc import hc_mix

    g = torch.Generator(device="cpu").manual_seed(2)
    hc, dim = config.hc_mult, config.dim
    res = torch.randn(bsz, seqlen, hc, dim, generator=g).bfloat16().to(device)
    y = torch.randn(bsz, seqlen, dim, generator=g).bfloat16().to(device)
    post = (torch.rand(bsz, seqlen, hc, generator=g) * 2).to(device)
    comb = torch.rand(bsz, seqlen, hc, hc, generator=g).to(device)
    torch_path = lambda: (post.unsqueeze(-1) * y.float().unsqueeze(-2)  # noqa: E731
                          + torch.einsum("bskj,bskd->bsjd", comb, res.float())).bfloat16()
    fused = lambda: hc_mix(res, comb, y, post)  # noqa: E731
    with torch.inference_mode():
        want, got = torch_path(), fused()
        ref = post.double().unsqueeze(-1) * y.double().unsqueeze(-2) + torch.einsum(
            "bskj,bskd->bsjd", comb.double(), res.double())
        out = {"shape": list(res.shape), "elements_differing": int((got != want).sum()), "elements": want.numel(),
               "torch_vs_fp64": _rel64(want, ref), "fused_vs_fp64": _rel64(got, ref),
               "torch_time": C.time_fn(torch_path, device, repeats, 2), "fused_time": C.time_fn(fused, device, repeats, 2)}
    # both round the fp32 sum to bf16 once; the kernel's FMAs may move a rare result across a
    # rounding boundary, which must not make it less accurate overall
    out["ok"] = out["fused_vs_fp64"]["rel_fro"] <= 1.001 * out["torch_vs_fp64"]["rel_fro"]
    return out


def check_layer(config: DeepseekV4Config, layer_id: int, bsz: int, seqlen: int, device) -> dict:
    """End to end: one bf16 layer with the fast paths on and off, each against the same layer in
    fp32 (the float model). The fast paths must not take the bf16 layer further from it."""
    block = C.build_block(config, layer_id, device)
    g = torch.Generator(device="cpu").manual_seed(5)
    x = torch.randn(bsz, seqlen, config.hc_mult, config.dim, generator=g).bfloat16().to(device)
    ids = torch.randint(0, config.vocab_size, (bsz, seqlen), generator=g).to(device)
    saved = os.environ.get(D.FAST_PATHS_ENV)
    try:
        with torch.inference_mode():
            os.environ[D.FAST_PATHS_ENV] = "1"
            fast = block(x, 0, ids).float()
            os.environ[D.FAST_PATHS_ENV] = "0"
            strict = block(x, 0, ids).float()
            block.float()
            ref = block(x.float(), 0, ids)
    finally:
        if saved is None:
            os.environ.pop(D.FAST_PATHS_ENV, None)
        else:
            os.environ[D.FAST_PATHS_ENV] = saved
    out = {"layer": layer_id, "kind": C.layer_kind(config, layer_id),
           "fast_vs_fp32": C.compare(fast, ref, x), "strict_vs_fp32": C.compare(strict, ref, x),
           "fast_vs_strict": C.compare(fast, strict, x)}
    f, st = out["fast_vs_fp32"], out["strict_vs_fp32"]
    out["ok"] = f["tok_rel_median"] <= 1.05 * st["tok_rel_median"] and f["rel_fro_update"] <= 1.1 * st["rel_fro_update"]
    del block
    D.empty_cache(device)
    return out


def check_index_score(config: DeepseekV4Config, bsz: int, seqlen: int, device, repeats: int) -> dict:
    """The indexer score through the kernel vs the torch path (bf16 operands), both vs float64."""
    from models.deepseek_v4.fused_attention import fused_index_score
    from models.deepseek_v4.modeling import causal_entry_mask
    from amct_ext.runtime.exact_gemm import matmul_fp32

    g = torch.Generator(device="cpu").manual_seed(6)
    ih, idim, r = config.index_n_heads, config.index_head_dim, 4
    q = torch.randn(bsz, seqlen, ih, idim, generator=g).bfloat16().to(device)
    keys = torch.randn(bsz, seqlen // r, idim, generator=g).bfloat16().to(device)
    w = (torch.randn(bsz, seqlen, ih, generator=g) * (idim * ih) ** -0.5).to(device)
    allowed = causal_entry_mask(seqlen, keys.shape[1], r, device)

    def torch_path():
        logits = matmul_fp32(q.reshape(bsz, seqlen * ih, idim), keys.transpose(1, 2))
        logits = logits.view(bsz, seqlen, ih, -1).relu_()
        return torch.matmul(w.unsqueeze(-2), logits).squeeze(-2).masked_fill(~allowed, float("-inf"))

    fused = lambda: fused_index_score(q, keys, w, r)  # noqa: E731
    with torch.inference_mode():
        want, got = torch_path(), fused()
        ref = torch.einsum("bshd,bnd->bshn", q.double(), keys.double()).relu()
        ref = torch.einsum("bsh,bshn->bsn", w.double(), ref)
        fin = allowed.expand_as(want)
        out = {"shape": [bsz, seqlen, ih, idim, keys.shape[1]],
               "same_mask": bool(torch.equal(torch.isinf(got), torch.isinf(want))),
               "torch_vs_fp64": _rel64(want[fin], ref[fin]), "fused_vs_fp64": _rel64(got[fin], ref[fin]),
               "torch_time": C.time_fn(torch_path, device, repeats, 2), "fused_time": C.time_fn(fused, device, repeats, 2)}
    out["ok"] = out["same_mask"] and out["fused_vs_fp64"]["rel_fro"] <= 1.5 * out["torch_vs_fp64"]["rel_fro"] + 1e-9
    return out


def check_hc_weights(config: DeepseekV4Config, bsz: int, seqlen: int, device, repeats: int) -> dict:
    """hc_pre's per-token weights (sigmoids, softmax, Sinkhorn) through the kernel vs torch, fp32."""
    from models.deepseek_v4.fused_hc import hc_weights

    hc, iters, eps = config.hc_mult, config.hc_sinkhorn_iters, config.hc_eps
    g = torch.Generator(device="cpu").manual_seed(7)
    mix = torch.randn(bsz, seqlen, (2 + hc) * hc, generator=g).to(device)
    scale, base = (torch.rand(3, generator=g) + 0.5).to(device), torch.randn((2 + hc) * hc, generator=g).to(device)

    def torch_path():
        pre, post, comb = mix.split([hc, hc, hc * hc], dim=-1)
        pre = torch.sigmoid(pre * scale[0] + base[:hc]) + eps
        post = 2 * torch.sigmoid(post * scale[1] + base[hc:2 * hc])
        comb = (comb * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc)).softmax(-1) + eps
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + eps)
            comb = comb / (comb.sum(-2, keepdim=True) + eps)
        return pre, post, comb

    fused = lambda: hc_weights(mix, scale, base, hc, iters, eps)  # noqa: E731
    with torch.inference_mode():
        diffs = [(a - b).abs().max().item() for a, b in zip(fused(), torch_path())]
        out = {"shape": [bsz, seqlen, hc], "max_abs_diff_pre_post_comb": diffs,
               "torch_time": C.time_fn(torch_path, device, repeats, 2), "fused_time": C.time_fn(fused, device, repeats, 2)}
    out["ok"] = max(diffs) < 1e-5
    return out


def check_swiglu(config: DeepseekV4Config, rows: int, device, repeats: int) -> dict:
    """The grouped experts' clamped SwiGLU through the kernel vs the torch expression, both vs fp64."""
    import torch.nn.functional as F
    from models.deepseek_v4.fused_moe import clamped_swiglu

    inter, limit = config.moe_inter_dim, config.swiglu_limit
    g = torch.Generator(device="cpu").manual_seed(9)
    h = (torch.randn(rows, 2 * inter, generator=g) * 3).bfloat16().to(device)
    w = torch.rand(rows, generator=g).to(device)

    def expr(gate, up, weights):
        if limit > 0:
            up, gate = up.clamp(-limit, limit), gate.clamp(max=limit)
        return F.silu(gate) * up * weights.unsqueeze(-1)

    torch_path = lambda: expr(h[:, :inter].float(), h[:, inter:].float(), w).bfloat16()  # noqa: E731
    fused = lambda: clamped_swiglu(h, limit, w)  # noqa: E731
    with torch.inference_mode():
        want, got = torch_path(), fused()
        ref = expr(h[:, :inter].double(), h[:, inter:].double(), w.double())
        out = {"shape": [rows, 2 * inter], "elements_differing": int((got != want).sum()), "elements": want.numel(),
               "torch_vs_fp64": _rel64(want, ref), "fused_vs_fp64": _rel64(got, ref),
               "torch_time": C.time_fn(torch_path, device, repeats, 2), "fused_time": C.time_fn(fused, device, repeats, 2)}
    out["ok"] = out["fused_vs_fp64"]["rel_fro"] <= 1.001 * out["torch_vs_fp64"]["rel_fro"]
    return out


MOE_SWEEP = [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, group_m=gm)
             for bm, bn, bk, nw, ns, gm in (
                 (64, 128, 64, 4, 4, 4), (64, 128, 128, 4, 3, 4), (64, 256, 64, 8, 4, 4), (64, 128, 64, 4, 5, 8),
                 (64, 64, 128, 4, 4, 8), (64, 256, 128, 8, 3, 4), (128, 128, 64, 8, 4, 4), (128, 128, 64, 4, 4, 4),
                 (128, 128, 64, 8, 3, 4), (128, 128, 128, 8, 3, 4), (128, 256, 64, 8, 3, 4), (128, 256, 64, 8, 4, 4),
                 (128, 128, 64, 8, 5, 4), (128, 64, 128, 4, 4, 4), (128, 128, 64, 8, 4, 8), (128, 128, 64, 8, 4, 1))]


SWIGLU_SWEEP = [dict(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, group_m=gm)
                for bm, bn, bk, nw, ns, gm in (
                    (128, 128, 64, 8, 3, 4), (128, 128, 64, 8, 4, 4), (128, 64, 64, 4, 4, 4), (128, 64, 64, 8, 4, 4),
                    (128, 128, 32, 8, 4, 4), (64, 128, 64, 4, 3, 4), (64, 128, 64, 8, 4, 4), (128, 128, 64, 8, 2, 4),
                    (128, 64, 128, 8, 3, 4), (128, 128, 64, 8, 3, 8), (128, 64, 64, 8, 5, 4), (64, 64, 128, 4, 4, 4))]


def check_grouped_gemm(config: DeepseekV4Config, tokens: int, device, repeats: int, sweep: bool,
                       sweep_swiglu: bool = False) -> dict:
    """The routed experts' two grouped GEMMs (rows sorted by expert, top-k of random scores)
    through the Triton kernel vs torch._grouped_mm: time, weight bandwidth, and both outputs'
    error against float64 on the rows of the first experts."""
    from models.deepseek_v4.fused_moe import grouped_gemm

    g = torch.Generator(device="cpu").manual_seed(11)
    n_exp, dim, inter, k = config.n_routed_experts, config.dim, config.moe_inter_dim, config.n_activated_experts
    slots = torch.rand(tokens, n_exp, generator=g).topk(k, dim=-1).indices.flatten()
    counts = torch.bincount(slots, minlength=n_exp)
    ends = torch.cumsum(counts, 0).to(torch.int32).to(device)
    rows = int(counts.sum())
    check_rows = int(counts[:4].sum())  # float64 reference on the first experts' rows only
    res = {"tokens": tokens, "rows": rows, "rows_per_expert": [int(counts.min()), int(counts.max())], "gemms": []}
    for name, n, kdim in (("w13", 2 * inter, dim), ("w2", dim, inter)):
        w = (torch.randn(n_exp, n, kdim, generator=g) * kdim ** -0.5).bfloat16().to(device)
        a = torch.randn(rows, kdim, generator=g).bfloat16().to(device)
        ref = torch.cat([a[int(s):int(e)].double() @ w[i].double().t() for i, (s, e) in
                         enumerate(zip([0] + ends[:3].tolist(), ends[:4].tolist()))])
        with torch.inference_mode():
            theirs = lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=ends)  # noqa: E731
            ours = lambda **kw: grouped_gemm(a, w, ends, kw)  # noqa: E731
            r = {"gemm": name, "shape": [rows, kdim, n], "weight_bytes": w.numel() * w.element_size(),
                 "torch_vs_fp64": _rel64(theirs()[:check_rows], ref), "fused_vs_fp64": _rel64(ours()[:check_rows], ref),
                 "torch_time": C.time_fn(theirs, device, repeats, 2), "fused_time": C.time_fn(ours, device, repeats, 2)}
            r["ok"] = r["fused_vs_fp64"]["rel_fro"] <= 1.05 * r["torch_vs_fp64"]["rel_fro"] + 1e-6
            if name == "w13":  # the variant the MoE runs: SwiGLU in the epilogue, [T, I] out
                from models.deepseek_v4.fused_moe import clamped_swiglu
                limit, rw = config.swiglu_limit, torch.rand(rows, generator=g).to(device)
                g64, u64 = ref[:, :inter], ref[:, inter:]
                if limit > 0:
                    u64, g64 = u64.clamp(-limit, limit), g64.clamp(max=limit)
                sw_ref = torch.nn.functional.silu(g64) * u64 * rw[:check_rows].double().unsqueeze(-1)
                theirs_sw = lambda: clamped_swiglu(theirs(), limit, rw)  # noqa: E731
                ours_sw = lambda: grouped_gemm(a, w, ends, swiglu_limit=limit, row_weights=rw)  # noqa: E731
                r["swiglu"] = {"torch_vs_fp64": _rel64(theirs_sw()[:check_rows], sw_ref),
                               "fused_vs_fp64": _rel64(ours_sw()[:check_rows], sw_ref),
                               "torch_time": C.time_fn(theirs_sw, device, repeats, 2),
                               "fused_time": C.time_fn(ours_sw, device, repeats, 2)}
                r["swiglu"]["ok"] = (r["swiglu"]["fused_vs_fp64"]["rel_fro"]
                                     <= 1.05 * r["swiglu"]["torch_vs_fp64"]["rel_fro"] + 1e-6)
                if sweep_swiglu:
                    r["swiglu"]["sweep"] = []
                    for launch in SWIGLU_SWEEP:
                        run = lambda: grouped_gemm(a, w, ends, launch, swiglu_limit=limit, row_weights=rw)  # noqa: E731
                        try:
                            t = C.time_fn(run, device, repeats, 1)
                            err = _rel64(run()[:check_rows], sw_ref)["rel_fro"]
                            r["swiglu"]["sweep"].append({**launch, "median_ms": t["median_ms"], "rel_fro": err})
                        except Exception as e:  # a launch shape may not fit (registers / shared memory)
                            r["swiglu"]["sweep"].append({**launch, "error": str(e)[:200]})
                r["ok"] = r["ok"] and r["swiglu"]["ok"]
            if sweep:
                r["sweep"] = []
                for launch in MOE_SWEEP:
                    try:
                        t = C.time_fn(lambda: ours(**launch), device, repeats, 1)
                        err = _rel64(ours(**launch)[:check_rows], ref)["rel_fro"]
                        r["sweep"].append({**launch, "median_ms": t["median_ms"], "rel_fro": err})
                    except Exception as e:  # a launch shape may not fit (registers / shared memory)
                        r["sweep"].append({**launch, "error": str(e)[:200]})
        res["gemms"].append(r)
    res["ok"] = all(r["ok"] for r in res["gemms"])
    return res


def check_norm_rope_hadamard(config: DeepseekV4Config, tokens: int, device, repeats: int) -> dict:
    """RMSNorm and rope (fused_norm_rope.py) and the +-1 Hadamard GEMM (modeling.hadamard_rotate)
    vs the torch expressions they replace, both vs float64."""
    from models.deepseek_v4 import modeling as M
    from models.deepseek_v4.fused_norm_rope import rms_norm, rope_inplace

    g = torch.Generator(device="cpu").manual_seed(14)
    out = {}
    with torch.inference_mode():
        x = (torch.randn(tokens, config.dim, generator=g) * 2).bfloat16().to(device)
        w = (torch.rand(config.dim, generator=g) + 0.5).to(device)
        xd = x.double()
        ref = w.double() * xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + config.norm_eps)

        def torch_norm():
            xf = x.float()
            return (w * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + config.norm_eps))).to(x.dtype)

        fused = lambda: rms_norm(x, w, config.norm_eps)  # noqa: E731
        out["rms_norm"] = _versus(torch_norm, fused, ref, device, repeats, [tokens, config.dim])

        rd = config.rope_head_dim
        q = torch.randn(1, tokens, config.n_heads, config.head_dim, generator=g).bfloat16().to(device)
        cos, sin = M._rope_table(M.layer_rope_frequencies(config, 4), tokens, str(device))
        a, b = q[..., -rd::2].double(), q[..., -rd + 1::2].double()
        c, s_ = cos.double().view(1, tokens, 1, -1), sin.double().view(1, tokens, 1, -1)
        ref = q.double().clone()
        ref[..., -rd::2], ref[..., -rd + 1::2] = a * c - b * s_, a * s_ + b * c
        out["rope"] = _versus(lambda: M.apply_rope(q, cos, sin), lambda: rope_inplace(q.clone(), cos, sin),
                              ref, device, repeats, list(q.shape))

        d = config.index_head_dim
        y = torch.randn(tokens * config.index_n_heads, d, generator=g).bfloat16().to(device)
        h = M._hadamard(d, str(device))
        ref = y.double() @ h.double()
        out["hadamard"] = _versus(lambda: linear_fp32(y, h, M._hadamard_split(d, str(device))).to(y.dtype),
                                  lambda: M.hadamard_rotate(y), ref, device, repeats, [tokens * config.index_n_heads, d])
    return out


def _versus(torch_path, fused, ref, device, repeats, shape) -> dict:
    want, got = torch_path(), fused()
    r = {"shape": shape, "elements_differing": int((got != want).sum()), "elements": want.numel(),
         "torch_vs_fp64": _rel64(want, ref), "fused_vs_fp64": _rel64(got, ref),
         "torch_time": C.time_fn(torch_path, device, repeats, 2), "fused_time": C.time_fn(fused, device, repeats, 2)}
    r["ok"] = r["fused_vs_fp64"]["rel_fro"] <= 1.001 * r["torch_vs_fp64"]["rel_fro"] + 1e-9
    return r


def check_combine(tokens: int, k: int, dim: int, device, repeats: int) -> dict:
    """The routed-expert combine through the kernel vs gathering and adding in torch (bit-identical)."""
    from models.deepseek_v4.fused_moe import combine_rows

    g = torch.Generator(device="cpu").manual_seed(10)
    y = torch.randn(tokens * k, dim, generator=g).bfloat16().to(device)
    rows = torch.randperm(tokens * k, generator=g).view(tokens, k).sort(dim=1).values.to(device)

    def torch_path():
        out = y[rows[:, 0]].float()
        for j in range(1, k):
            out += y[rows[:, j]]
        return out

    fused = lambda: combine_rows(y, rows)  # noqa: E731
    with torch.inference_mode():
        out = {"shape": [tokens, k, dim], "elements_differing": int((fused() != torch_path()).sum()),
               "torch_time": C.time_fn(torch_path, device, repeats, 2), "fused_time": C.time_fn(fused, device, repeats, 2)}
    out["ok"] = out["elements_differing"] == 0
    return out


def check_int_token(rows: int, dim: int, device, repeats: int) -> dict:
    """w8a8's activation fake quant (int8, per token, dynamic) through the kernel vs formats' torch path."""
    from amct_ext.quant import formats
    from amct_ext.quant.schemes import TensorSpec

    spec = TensorSpec("int", 8, True, "token", dynamic=True)
    g = torch.Generator(device="cpu").manual_seed(3)
    x = (torch.randn(rows, dim, generator=g) * torch.rand(rows, 1, generator=g) * 4).bfloat16().to(device)
    torch_path = lambda: (formats._check_input(x), formats._fq_int(x, spec, None))[1]  # noqa: E731
    fused = lambda: formats.fake_quant(x, spec)  # noqa: E731
    with torch.inference_mode():
        want, got = torch_path(), fused()
        out = {"shape": [rows, dim], "elements_differing": int((got != want).sum()),
               "torch_time": C.time_fn(torch_path, device, repeats, 2), "fused_time": C.time_fn(fused, device, repeats, 2)}
    out["ok"] = out["elements_differing"] == 0
    return out


def _tail(r: dict) -> str:
    """'torch X ms, fused Y ms -> ok' for a kernel check result."""
    verdict = "" if "ok" not in r else f" -> {'ok' if r['ok'] else 'WORSE'}"
    return f"torch {r['torch_time']['median_ms']:.3f} ms, fused {r['fused_time']['median_ms']:.3f} ms{verdict}"


def _rel64(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Errors in float64 (an fp32 result's own error is ~1e-7: float32 arithmetic would hide it)."""
    diff = out.double() - ref
    return {"rel_fro": (diff.norm() / ref.norm()).item(), "max_abs": diff.abs().max().item()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--config", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny config on CPU")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--sweep", nargs="?", const="attention,moe", default="",
                    help="time every launch shape of the attention, grouped-GEMM and / or grouped-GEMM-with-SwiGLU "
                         "kernels (comma list of attention, moe, swiglu; default attention,moe)")
    ap.add_argument("--layers", default=None, help="comma list of layer ids for the end-to-end check")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.smoke:
        args.device, args.seq_len, args.repeats = "cpu", 64, 2
        cfg = C.our_config(C.tiny_config_dict())
    else:
        cfg = DeepseekV4Config.from_dict(C.flash_config_dict(args.config)[0])
    dev = D.resolve_device(args.device)
    fused_ok = D.fused_kernels_enabled(dev)
    layers = {}
    for r in (0, 4, 128):
        if r in cfg.compress_ratios:
            layers[r] = cfg.compress_ratios.index(r)
    print(f"check_fast_paths: device {dev}, fused kernel {'on' if fused_ok else 'unavailable'}, "
          f"fp32-out GEMM {'on' if D.fp32_out_gemm_supported(dev) else 'unavailable'}")
    out = {"environment": C.environment(dev), "attention": [], "gemm": []}
    for r, layer_id in layers.items():
        res = check_attention(cfg, layer_id, args.batch, args.seq_len, dev, args.repeats, "attention" in args.sweep,
                              fused_ok)
        out["attention"].append(res)
        line = (f"attention ratio {r:>3}: torch bf16 rel_fro {res['torch_bf16']['rel_fro']:.3e} "
                f"{res['torch_bf16_time']['median_ms']:.3f} ms")
        if fused_ok:
            line += (f" | fused rel_fro {res['fused']['rel_fro']:.3e} {res['fused_time']['median_ms']:.3f} ms"
                     f" -> {'ok' if res['fused_ok'] else 'WORSE'}")
        print(line)
        for s in res.get("sweep", []):
            print("   sweep", s)
    tokens = args.batch * args.seq_len
    for k, n in ((cfg.hc_mult * cfg.dim, (2 + cfg.hc_mult) * cfg.hc_mult), (cfg.dim, 2 * cfg.head_dim),
                 (cfg.dim, 2 * cfg.index_head_dim)):
        res = check_gemm(tokens, k, n, dev, args.repeats)
        out["gemm"].append(res)
        for name in ("fp32_weight", "bf16_weight"):
            r = res[name]
            print(f"gemm {res['shape']} {name}: fp32 GEMM rel_fro {r['fp32_gemm']['rel_fro']:.3e} "
                  f"{r['fp32_gemm_time']['median_ms']:.3f} ms | fast rel_fro {r['fast']['rel_fro']:.3e} "
                  f"{r['fast_time']['median_ms']:.3f} ms ({r['error_ratio']:.1f}x the fp32 GEMM's error; "
                  f"judged end to end by --layers)")
    if fused_ok:
        out["hc"] = r = check_hc(cfg, args.batch, args.seq_len, dev, args.repeats)
        print(f"hc_post {r['shape']}: vs fp64 rel_fro torch {r['torch_vs_fp64']['rel_fro']:.4e}, fused "
              f"{r['fused_vs_fp64']['rel_fro']:.4e} ({r['elements_differing']} of {r['elements']} elements "
              f"differ); {_tail(r)}")
        out["index_score"] = r = check_index_score(cfg, args.batch, args.seq_len, dev, args.repeats)
        print(f"index score {r['shape']}: vs fp64 rel_fro torch {r['torch_vs_fp64']['rel_fro']:.3e}, fused "
              f"{r['fused_vs_fp64']['rel_fro']:.3e}, same mask {r['same_mask']}; {_tail(r)}")
        out["hc_weights"] = r = check_hc_weights(cfg, args.batch, args.seq_len, dev, args.repeats)
        print(f"hc weights {r['shape']}: max |fused - torch| (pre, post, comb) {r['max_abs_diff_pre_post_comb']}; "
              f"{_tail(r)}")
        rows = tokens * cfg.n_activated_experts
        out["swiglu"] = r = check_swiglu(cfg, rows, dev, args.repeats)
        print(f"clamped SwiGLU {r['shape']}: vs fp64 rel_fro torch {r['torch_vs_fp64']['rel_fro']:.4e}, fused "
              f"{r['fused_vs_fp64']['rel_fro']:.4e} ({r['elements_differing']} of {r['elements']} differ); {_tail(r)}")
        out["grouped_gemm"] = []
        moe_sweep = "moe" in args.sweep
        for t in ((tokens, 4 * tokens) if moe_sweep else (tokens,)):
            r = check_grouped_gemm(cfg, t, dev, args.repeats, moe_sweep, "swiglu" in args.sweep and t == tokens)
            out["grouped_gemm"].append(r)
            for gm in r["gemms"]:
                gbs = lambda key: gm["weight_bytes"] / (gm[key]["median_ms"] * 1e-3) / 1e9  # noqa: E731
                print(f"grouped GEMM {gm['gemm']} {gm['shape']} (rows/expert {r['rows_per_expert']}): vs fp64 "
                      f"rel_fro torch {gm['torch_vs_fp64']['rel_fro']:.4e}, fused {gm['fused_vs_fp64']['rel_fro']:.4e}; "
                      f"weights at {gbs('torch_time'):.0f} / {gbs('fused_time'):.0f} GB/s; {_tail(gm)}")
                if "swiglu" in gm:
                    sg = gm["swiglu"]
                    print(f"   + SwiGLU epilogue: vs fp64 rel_fro torch {sg['torch_vs_fp64']['rel_fro']:.4e}, fused "
                          f"{sg['fused_vs_fp64']['rel_fro']:.4e}; {_tail(sg)}")
                    for sw in sorted(sg.get("sweep", []), key=lambda v: v.get("median_ms", 1e9)):
                        print("   sweep swiglu", sw)
                for sw in sorted(gm.get("sweep", []), key=lambda v: v.get("median_ms", 1e9)):
                    print("   sweep", sw)
        out["norm_rope"] = check_norm_rope_hadamard(cfg, tokens, dev, args.repeats)
        for name, r in out["norm_rope"].items():
            print(f"{name} {r['shape']}: vs fp64 rel_fro torch {r['torch_vs_fp64']['rel_fro']:.4e}, fused "
                  f"{r['fused_vs_fp64']['rel_fro']:.4e} ({r['elements_differing']} of {r['elements']} differ); {_tail(r)}")
        out["combine"] = r = check_combine(tokens, cfg.n_activated_experts, cfg.dim, dev, args.repeats)
        print(f"expert combine {r['shape']}: {r['elements_differing']} elements differ; {_tail(r)}")
        out["int_token"] = [check_int_token(rows, cfg.dim, dev, args.repeats),
                            check_int_token(rows, cfg.moe_inter_dim, dev, args.repeats)]
        for r in out["int_token"]:
            print(f"int8 per-token fake quant {r['shape']}: {r['elements_differing']} elements differ; {_tail(r)}")
    if args.layers:
        out["layer"] = []
        for layer_id in [int(v) for v in args.layers.split(",")]:
            r = check_layer(cfg, layer_id, args.batch, args.seq_len, dev)
            out["layer"].append(r)
            print(f"layer {layer_id} ({r['kind']}) bf16 vs fp32: fast paths per-token median "
                  f"{r['fast_vs_fp32']['tok_rel_median']:.4e}, update rel_fro {r['fast_vs_fp32']['rel_fro_update']:.4e}, "
                  f"tokens >5% {r['fast_vs_fp32']['tok_share_above_5pct']:.2%} | strict "
                  f"{r['strict_vs_fp32']['tok_rel_median']:.4e}, {r['strict_vs_fp32']['rel_fro_update']:.4e}, "
                  f"{r['strict_vs_fp32']['tok_share_above_5pct']:.2%} -> {'ok' if r['ok'] else 'WORSE'}")
    C.write_json(args.json, out)
    bad = [r for r in out.get("layer", []) if not r["ok"]]
    bad += [a for a in out["attention"] if a.get("fused_ok") is False]
    bad += [out[k] for k in ("hc", "index_score", "hc_weights", "swiglu", "combine") if k in out and not out[k]["ok"]]
    bad += [r for r in out.get("grouped_gemm", []) if not r["ok"]]
    bad += [r for r in out.get("norm_rope", {}).values() if not r["ok"]]
    bad += [q for q in out.get("int_token", []) if not q["ok"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
