"""One DeepSeek-V4 decoder layer, three ways, on the same inputs:

  (a) ours      models.deepseek_v4.modeling.Block.forward(x, 0, input_ids), bf16 + fp32 islands
  (b) hf:<impl> transformers' native DeepseekV4DecoderLayer holding the SAME weights (key renames of
                transformers' loader), called like DeepseekV4Model.forward calls it; <impl> is its experts
                implementation ('grouped_mm' = what a transformers model picks by default, 'eager' = the
                per-expert loop of the class)
  (c) ours-w8a8 ours with w8a8 fake-quant on attn-linear + moe (quantize_block; wraps in place, so it is
                timed last, after (a) and (b); the fake-quant weights are cached by the first call)

for each layer kind (V4-Flash: 0 = window-only + hash MoE, 3 = ratio 128 (HCA) + score MoE, 4 = ratio 4
(CSA + indexer) + score MoE), at B x S for every --batch. Random weights are drawn on the device (a Flash
layer is ~13 GB in bf16). Before timing, (b) is checked against (a); (c) is compared with (a) for
information (quantization error). Floors printed per kind and batch: FLOPs / measured bf16 matmul rate
and bytes (weights + input + output) / measured device copy bandwidth.

    python benchmarks/bench_layer.py --device cuda --json $OUT/layer.json     # V4-Flash shape
    python benchmarks/bench_layer.py --smoke                                  # tiny config, CPU, seconds

Agreement rule (b vs a, bf16): the continuous part must agree -- median per-token relative error
<= --tol (2e-2); the relative Frobenius error is reported and must also be <= --tol unless the excess
comes from discrete flips (MoE routing / indexer top-k ties resolved differently in bf16: few tokens
with a large error, median still small). With --fp32-check (on in --smoke) both layers are also built in
fp32 and must agree to 1e-4 (bit-identical on CPU): that proves the weight mapping. A failed check is
printed as FAILED, the timings are still taken, and the exit code is 1.
"""
from __future__ import annotations

import argparse
import gc
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from common import D  # noqa: E402
from amct_ext.runtime.device_checks import deferred_checks  # noqa: E402
from amct_ext.quant.formats import NonFiniteInputError  # noqa: E402

FLASH_LAYERS = "0,3,4"
TINY_LAYERS = "0,2,3"  # tiny: 0 ratio0/hash, 1 ratio4/hash, 2 ratio128/score, 3 ratio4/score


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto | cuda | npu | cpu | cuda:1 ...")
    p.add_argument("--smoke", action="store_true", help="tiny config on CPU, every variant, 1-2 repeats")
    p.add_argument("--config", default=None, help="config.json (default: models/deepseek_v4/configs V4-Flash)")
    p.add_argument("--layers", default=None, help=f"layer ids (default {FLASH_LAYERS}; smoke {TINY_LAYERS})")
    p.add_argument("--batch", default=None, help="comma list of batch sizes (default 1,4; smoke 2)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default 4096; smoke 160)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5; smoke 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up calls (default 2; smoke 1)")
    p.add_argument("--hf-experts", default="grouped_mm,eager",
                   help="transformers experts implementations to time ('' = skip transformers)")
    p.add_argument("--no-quant", action="store_true", help="skip (c)")
    p.add_argument("--scheme", default="w8a8")
    p.add_argument("--targets", default="attn-linear,moe")
    p.add_argument("--fp32-check", dest="fp32_check", action="store_true", default=None,
                   help="also build both layers in fp32 and require near-exact agreement (default: smoke only)")
    p.add_argument("--no-fp32-check", dest="fp32_check", action="store_false")
    p.add_argument("--fp32-check-seq", type=int, default=512, help="sequence length of the fp32 check (B=1)")
    p.add_argument("--tol", type=float, default=2e-2)
    p.add_argument("--mm-size", type=int, default=None, help="matmul size for the rate (default 8192; smoke 256)")
    p.add_argument("--copy-mib", type=int, default=None, help="copy size for the bandwidth (default 4096; smoke 32)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; remaining layer kinds are skipped once spent (results so far are kept)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="config.json field override, repeatable (e.g. n_routed_experts=16 for a quick run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write all results here")
    a = p.parse_args(argv)
    s = a.smoke
    if s and a.device == "auto":
        a.device = "cpu"
    a.layers = [int(v) for v in (a.layers or (TINY_LAYERS if s else FLASH_LAYERS)).split(",") if v != ""]
    a.batch = [int(v) for v in (a.batch or ("2" if s else "1,4")).split(",") if v != ""]
    a.seq_len = a.seq_len or (160 if s else 4096)
    a.repeats = a.repeats or (1 if s else 5)
    a.warmup = a.warmup if a.warmup is not None else (1 if s else 2)
    a.mm_size = a.mm_size or (256 if s else 8192)
    a.copy_mib = a.copy_mib or (32 if s else 4096)
    a.fp32_check = s if a.fp32_check is None else a.fp32_check
    a.fp32_check_seq = min(a.fp32_check_seq, a.seq_len)
    a.hf_experts = [v for v in a.hf_experts.split(",") if v]
    return a


# ------------------------------------------------------------------------------------ counting
def layer_counts(block, config, batch: int, seq: int) -> dict:
    """FLOPs the layer must do and bytes it must move (ideal sparse attention, each weight read once)."""
    tokens = batch * seq
    D_, I_ = config.dim, config.moe_inter_dim
    moe = tokens * (config.n_activated_experts + config.n_shared_experts) * 3 * 2 * D_ * I_
    attn_proj = 2 * tokens * sum(m.weight.numel() for m in block.attn.modules()
                                 if isinstance(m, torch.nn.Linear))
    mix = (2 + config.hc_mult) * config.hc_mult
    other = 2 * tokens * config.n_routed_experts * D_ + 2 * 2 * tokens * mix * config.hc_mult * D_
    r = config.compress_ratios[block.layer_id]
    W = config.window_size
    t = torch.arange(1, seq + 1, dtype=torch.float64)  # t + 1 for query positions 0..S-1
    keys = t.clamp(max=W)
    if r == 4:
        keys = keys + torch.div(t, 4, rounding_mode="floor").clamp(max=config.index_topk)
    elif r == 128:
        keys = keys + torch.div(t, 128, rounding_mode="floor")
    core = 4 * config.n_heads * config.head_dim * float(keys.sum()) * batch  # QK^T and PV
    indexer = 0.0
    if r == 4:
        indexer = 2 * config.index_n_heads * config.index_head_dim * float(
            torch.div(t, 4, rounding_mode="floor").sum()) * batch
    act_bytes = 2 * tokens * config.hc_mult * D_ * 2  # x in + out, bf16
    return {"tokens": tokens, "moe_flops": moe, "attn_proj_flops": attn_proj, "attn_core_flops": core,
            "indexer_score_flops": indexer, "router_hc_flops": other,
            "total_flops": moe + attn_proj + core + indexer + other,
            "weight_bytes": C.tensor_bytes(block), "act_bytes": act_bytes}


def floors(counts: dict, ceil: dict) -> dict:
    rate, bw = ceil["matmul"]["flop_per_s"], ceil["copy"]["bytes_per_s"]
    f = {
        "moe_compute_ms": counts["moe_flops"] / rate * 1e3,
        "all_compute_ms": counts["total_flops"] / rate * 1e3,
        "weight_bytes_ms": counts["weight_bytes"] / bw * 1e3,
        "all_bytes_ms": (counts["weight_bytes"] + counts["act_bytes"]) / bw * 1e3,
    }
    f["floor_ms"] = max(f["all_compute_ms"], f["all_bytes_ms"])
    f["bound"] = "compute" if f["all_compute_ms"] >= f["all_bytes_ms"] else "bytes"
    return f


def judge_bf16(cmp: dict, tol: float) -> tuple[bool, str]:
    if not cmp["finite"]:
        return False, "non-finite output"
    if cmp["tok_rel_median"] > tol:
        return False, f"median per-token relative error {cmp['tok_rel_median']:.2e} > {tol:g}"
    if cmp["rel_fro"] > tol:
        if cmp["tok_share_above_5pct"] <= 0.10:
            return True, (f"relative Frobenius {cmp['rel_fro']:.2e} > {tol:g} from discrete flips only "
                          f"({100 * cmp['tok_share_above_5pct']:.1f}% of tokens above 5%, median "
                          f"{cmp['tok_rel_median']:.2e})")
        return False, (f"relative Frobenius {cmp['rel_fro']:.2e} > {tol:g} and "
                       f"{100 * cmp['tok_share_above_5pct']:.1f}% of tokens above 5%")
    return True, "ok"


# ------------------------------------------------------------------------------------------ run
def make_inputs(config, batch, seq, device, seed, dtype=torch.bfloat16):
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    x = torch.randn(batch, seq, config.hc_mult, config.dim, generator=gen, device=device).to(dtype)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen, device=device)
    return x, ids


def free(device):
    gc.collect()
    D.empty_cache(device)


def main(argv=None) -> int:
    args = parse_args(argv)
    dev = D.resolve_device(args.device)
    cfg_dict, cfg_src, config = C.bench_config(args)
    hf_cfg = C.hf_config(cfg_dict) if args.hf_experts or args.fp32_check else None
    deadline = C.Deadline(args.time_budget)
    results: dict = {"env": C.environment(dev), "config_source": cfg_src, "args": vars(args),
                     "ceilings": {}, "layers": [], "failures": [], "notes": []}

    def save():
        C.write_json(args.json, results)

    print(f"bench_layer: device {dev}, config {cfg_src}, layers {args.layers}, batch {args.batch}, "
          f"S={args.seq_len}, repeats {args.repeats} (warm-up {args.warmup})", flush=True)

    quantize_block = scheme = None
    if not args.no_quant:
        try:
            from amct_ext.quant.schemes import load_scheme
            from models.deepseek_v4.quant_module import quantize_block

            scheme = load_scheme(args.scheme)
        except ImportError as e:
            quantize_block = None
            note = f"(c) skipped: quantize_block not importable ({e})"
            print(note)
            results["notes"].append(note)

    # ---- ceilings
    with torch.inference_mode():
        mm = C.matmul_rate(dev, args.mm_size)
        cp = C.copy_bandwidth(dev, args.copy_mib * 1024 ** 2)
    results["ceilings"] = {"matmul": mm, "copy": cp}
    print(f"ceilings: bf16 matmul {args.mm_size}^3 {mm['median_ms']:.3f} ms = {mm['flop_per_s'] / 1e12:.1f} TFLOP/s; "
          f"copy {C.fmt_bytes(cp['bytes'])} {cp['median_ms']:.3f} ms = {cp['bytes_per_s'] / 1e9:.0f} GB/s "
          f"(read + write)", flush=True)
    free(dev)
    save()

    for layer_id in args.layers:
        if deadline.spent():
            note = f"layer {layer_id}: SKIPPED, time budget {args.time_budget}s spent"
            print(note)
            results["notes"].append(note)
            continue
        kind = C.layer_kind(config, layer_id)
        entry: dict = {"layer": layer_id, "kind": kind, "runs": [], "checks": {}}
        results["layers"].append(entry)
        print(f"\n=== layer {layer_id} ({kind}) ===", flush=True)
        try:
            run_layer(args, dev, config, hf_cfg, layer_id, entry, results, quantize_block, scheme, save)
        except Exception as e:  # keep the other kinds' numbers
            traceback.print_exc()
            msg = f"layer {layer_id}: ERROR {type(e).__name__}: {e}"
            results["failures"].append(msg)
            print(msg, flush=True)
        free(dev)
        save()

    print_report(results)
    save()
    if results["failures"]:
        print("\nFAILED:\n  " + "\n  ".join(results["failures"]))
        return 1
    return 0


def run_layer(args, dev, config, hf_cfg, layer_id, entry, results, quantize_block, scheme, save):
    kind = entry["kind"]
    inf = torch.inference_mode

    # ---- exact mapping check in fp32 (proves the weight copy; cheap on the tiny config)
    if args.fp32_check and hf_cfg is not None:
        try:
            blk32 = C.build_block(config, layer_id, dev, seed=args.seed + layer_id, dtype=torch.float32)
            hf32, _ = C.build_hf_layer(blk32, hf_cfg, layer_id, dev, all_fp32=True)
            x, ids = make_inputs(config, 1, args.fp32_check_seq, dev, args.seed + 100, torch.float32)
            # the per-expert reference loop: transformers' grouped_mm experts deviate in fp32 at 256
            # experts on CUDA (casebook S5), which would blame our mapping for their kernel
            C.set_experts_impl(hf_cfg, "eager")
            with inf():
                cmp = C.compare(C.HFCaller(hf_cfg, x, ids)(hf32, x), blk32(x, 0, ids), x)
        except Exception as e:
            traceback.print_exc()
            cmp = {"finite": False, "rel_fro": float("nan"), "max_abs": float("nan"), "tok_rel_median": float("nan"),
                   "tok_share_above_5pct": float("nan"), "error": f"{type(e).__name__}: {e}"}
            blk32 = hf32 = x = ids = None
        ok = cmp["finite"] and cmp["rel_fro"] <= 1e-4
        entry["checks"]["fp32_mapping"] = {**cmp, "ok": ok, "seq": args.fp32_check_seq}
        print(f"fp32 mapping check (B=1, S={args.fp32_check_seq}): rel_fro {cmp['rel_fro']:.2e}, "
              f"max_abs {cmp['max_abs']:.2e} -> {'ok' if ok else 'FAILED'}", flush=True)
        if not ok:
            results["failures"].append(f"layer {layer_id}: fp32 mapping check rel_fro {cmp['rel_fro']:.2e} > 1e-4")
        del blk32, hf32, x, ids
        free(dev)

    # ---- build ours (+ transformers' copy)
    with C.D.Timer(dev) as t:
        block = C.build_block(config, layer_id, dev, seed=args.seed + layer_id)
    wbytes = C.tensor_bytes(block)
    entry["build_ms"] = t.ms
    entry["weight_bytes"] = wbytes
    print(f"built ours on {dev} in {t.ms / 1e3:.1f} s: {C.fmt_bytes(wbytes)} of weights", flush=True)
    hf_layer = caller = None
    if args.hf_experts:
        try:
            with C.D.Timer(dev) as t:
                hf_layer, info = C.build_hf_layer(block, hf_cfg, layer_id, dev)
        except Exception as e:  # a transformers version whose layer we cannot fill: keep (a) and (c)
            traceback.print_exc()
            msg = f"layer {layer_id}: transformers' layer not built ({type(e).__name__}: {e}); (b) skipped"
            results["failures"].append(msg)
            print(msg, flush=True)
            hf_layer = None
            free(dev)
        else:
            entry["hf_build_ms"] = t.ms
            entry["hf_weight_bytes"] = info["hf_weight_bytes"]
            entry["hf_fp32_tensors"] = info["hf_fp32_tensors"]
            print(f"built transformers' layer (same weights) in {t.ms / 1e3:.1f} s: "
                  f"{C.fmt_bytes(info['hf_weight_bytes'])}", flush=True)

    inputs, refs = {}, {}
    for bsz in args.batch:
        x, ids = make_inputs(config, bsz, args.seq_len, dev, args.seed + 1000 + bsz)
        inputs[bsz] = (x, ids)
        counts = layer_counts(block, config, bsz, args.seq_len)
        fl = floors(counts, results["ceilings"])
        base = {"layer": layer_id, "kind": kind, "batch": bsz, "seq": args.seq_len, "counts": counts, "floors": fl}

        with inf():
            out_a = block(x, 0, ids)
        refs[bsz] = out_a
        runs = [("ours", lambda: block(x, 0, ids))]
        graphed = graph_replay(block, x, ids, out_a, "ours", dev, entry, results, layer_id, bsz)
        if graphed is not None:
            runs.append(("ours-graphed", lambda graphed=graphed: graphed(x, input_ids=ids)))
        if hf_layer is not None:
            caller = C.HFCaller(hf_cfg, x, ids)
            for impl in args.hf_experts:
                try:
                    C.set_experts_impl(hf_cfg, impl)
                    with inf():
                        out_b = caller(hf_layer, x)
                except Exception as e:  # e.g. an experts implementation this transformers lacks
                    traceback.print_exc()
                    msg = f"layer {layer_id} B={bsz}: transformers[{impl}] forward failed ({type(e).__name__}: {e})"
                    results["failures"].append(msg)
                    print(msg, flush=True)
                    free(dev)
                    continue
                cmp = C.compare(out_b, out_a, x)
                ok, why = judge_bf16(cmp, args.tol)
                entry["checks"][f"B{bsz}:hf:{impl}_vs_ours"] = {**cmp, "ok": ok, "why": why}
                print(f"B={bsz} check transformers[{impl}] vs ours (bf16): rel_fro {cmp['rel_fro']:.2e}, "
                      f"max_abs {cmp['max_abs']:.3g} (|ref| max {cmp['ref_max_abs']:.3g}), per-token median "
                      f"{cmp['tok_rel_median']:.2e}, tokens >5%: {100 * cmp['tok_share_above_5pct']:.2f}% "
                      f"-> {'ok' if ok else 'FAILED'}{'' if why == 'ok' else ' (' + why + ')'}", flush=True)
                if not ok:
                    results["failures"].append(f"layer {layer_id} B={bsz}: transformers[{impl}] vs ours: {why}")
                del out_b
                runs.append((f"hf:{impl}", (lambda impl=impl, caller=caller: (
                    C.set_experts_impl(hf_cfg, impl), caller(hf_layer, x))[1])))
        for name, fn in runs:
            entry["runs"].append(measure(name, fn, dev, args, base))
            save()
        runs = graphed = None
        free(dev)

    hf_layer = caller = None
    free(dev)

    # ---- (c): fake-quant, wrapped in place after (a) and (b)
    if quantize_block is not None:
        block = quantize_block(block, scheme, args.targets.split(",")) or block
        block.eval()
        name = f"ours-{args.scheme}"
        for bsz in args.batch:
            x, ids = inputs[bsz]
            base = {"layer": layer_id, "kind": kind, "batch": bsz, "seq": args.seq_len}
            # floors are the float layer's
            prev = next(r for r in entry["runs"] if r["batch"] == bsz and r["variant"] == "ours")
            base["counts"], base["floors"] = prev["counts"], prev["floors"]
            with inf():
                out_c = block(x, 0, ids)  # also fills the fake-quant weight cache
            cmp = C.compare(out_c, refs[bsz], x)
            entry["checks"][f"B{bsz}:{name}_vs_ours"] = cmp
            print(f"B={bsz} {name} vs ours (quantization error, informational): rel_fro {cmp['rel_fro']:.2e}, "
                  f"per-token median {cmp['tok_rel_median']:.2e}, finite {cmp['finite']}", flush=True)
            if not cmp["finite"]:
                results["failures"].append(f"layer {layer_id} B={bsz}: {name} output not finite")
            # as do_block_forward calls a layer: the quantizers' NaN/Inf flags are read once per
            # call, not once per quantizer (device_checks, casebook S14)
            entry["runs"].append(measure(name, lambda: deferred_call(block, x, ids), dev, args, base))
            # evaluation replays the quantized layer too (do_block_forward(graphed=True))
            graphed = graph_replay(block, x, ids, out_c, name, dev, entry, results, layer_id, bsz)
            if graphed is not None:
                entry["runs"].append(measure(f"{name}-graphed", lambda g=graphed: g(x, input_ids=ids), dev, args, base))
            graphed = None
            del out_c
            save()
            free(dev)
    del block, inputs, refs
    free(dev)


def deferred_call(block, x, ids):
    with deferred_checks():
        return block(x, 0, ids)


def graph_replay(block, x, ids, eager_out, name, dev, entry, results, layer_id, bsz):
    """The layer as evaluation runs it after a shape's first window: replayed from a CUDA graph
    (device.GraphedForward). Returns the replayer when it captured and its output is bit-identical
    to the eager forward's (else records why not and returns None)."""
    graphed = D.GraphedForward(block, dev)
    if not graphed.enabled:
        return None
    with torch.inference_mode():
        for _ in range(3):  # eager, capture + replay, replay
            out = graphed(x, input_ids=ids)
    same = bool(torch.equal(out, eager_out))
    # a replay makes the eager forward's checks (device_checks): a NaN input must still be refused
    n_checks = sum(len(g[-1]) for g in graphed.graphs.values())
    refused = None
    if n_checks:
        refused = False
        try:
            with torch.inference_mode():
                graphed(torch.full_like(x, float("nan")), input_ids=ids)
        except NonFiniteInputError:
            refused = True
    entry["checks"][f"B{bsz}:{name}-graphed_vs_{name}"] = {"bit_identical": same, "graphs": len(graphed.graphs),
                                                          "capture_error": graphed.capture_error,
                                                          "captured_checks": n_checks, "nan_input_refused": refused}
    failed = "" if graphed.capture_error is None else ", capture failed: " + graphed.capture_error
    print(f"B={bsz} check {name}-graphed vs {name}: bit-identical {same}, graphs captured {len(graphed.graphs)}, "
          f"captured checks {n_checks}, NaN input refused by a replay {refused}{failed}", flush=True)
    if not same:
        results["failures"].append(f"layer {layer_id} B={bsz}: {name} graph replay differs from the eager forward")
        return None
    if refused is False:
        results["failures"].append(f"layer {layer_id} B={bsz}: {name} graph replay did not refuse a NaN input")
    return graphed if graphed.graphs else None


def measure(name, fn, dev, args, base) -> dict:
    with torch.inference_mode():
        t = C.time_fn(fn, dev, args.repeats, args.warmup)
        mem = C.peak_extra(fn, dev)
    run = {**base, "variant": name, **t, **mem}
    run["vs_floor"] = t["median_ms"] / base["floors"]["floor_ms"] if base["floors"]["floor_ms"] > 0 else None
    run["tokens_per_s"] = base["counts"]["tokens"] / (t["median_ms"] * 1e-3)
    print(f"  B={base['batch']} {name:<16} median {C.fmt_ms(t['median_ms'])} ms (min {C.fmt_ms(t['min_ms'])}), "
          f"extra peak {C.fmt_bytes(mem['extra_peak_bytes'])} over {C.fmt_bytes(mem['resident_bytes'])} resident, "
          f"{run['vs_floor']:.1f}x floor", flush=True)
    return run


def print_report(results: dict) -> None:
    ce = results["ceilings"]
    print("\n==== bench_layer summary ====")
    print(f"device {results['env']['device']}  torch {results['env']['torch']}  transformers "
          f"{results['env']['transformers']}  config: {results['config_source']}")
    if ce:
        print(f"ceilings: bf16 matmul {ce['matmul']['flop_per_s'] / 1e12:.1f} TFLOP/s (n={ce['matmul']['n']}), "
              f"device copy {ce['copy']['bytes_per_s'] / 1e9:.0f} GB/s (read+write, {C.fmt_bytes(ce['copy']['bytes'])})")
    floor_rows, seen = [], set()
    rows = []
    for e in results["layers"]:
        for r in e["runs"]:
            key = (r["layer"], r["batch"])
            if key not in seen:
                seen.add(key)
                f, c = r["floors"], r["counts"]
                floor_rows.append([r["kind"], r["batch"], r["seq"], f"{c['moe_flops'] / 1e12:.2f}",
                                   C.fmt_ms(f["moe_compute_ms"]), f"{c['total_flops'] / 1e12:.2f}",
                                   C.fmt_ms(f["all_compute_ms"]), C.fmt_bytes(c["weight_bytes"]),
                                   C.fmt_ms(f["weight_bytes_ms"]), C.fmt_ms(f["floor_ms"]), f["bound"]])
            rows.append([r["kind"], r["batch"], r["variant"], C.fmt_ms(r["median_ms"]), C.fmt_ms(r["min_ms"]),
                         C.fmt_bytes(r["extra_peak_bytes"]), C.fmt_bytes(r["resident_bytes"]),
                         f"{r['vs_floor']:.1f}x", f"{r['tokens_per_s']:.0f}"])
    if floor_rows:
        print("\nfloors (FLOPs / matmul rate; bytes / copy bandwidth):")
        print(C.table(floor_rows, ["kind", "B", "S", "MoE TFLOP", "MoE ms", "all TFLOP", "compute ms",
                                   "weights", "weights ms", "floor ms", "bound"]))
    checks = []
    for e in results["layers"]:
        for k, v in e["checks"].items():
            if "rel_fro" not in v:  # the graph replay check: bit-identity, printed when it ran
                continue
            status = ("ok" if v.get("ok") else "FAILED") if "ok" in v else "info"
            checks.append([e["kind"], k, f"{v['rel_fro']:.2e}", f"{v['max_abs']:.3g}",
                           f"{v['tok_rel_median']:.2e}", f"{100 * v['tok_share_above_5pct']:.2f}%", status])
    if checks:
        print("\nagreement (relative Frobenius, max-abs, per-token median, share of tokens > 5%):")
        print(C.table(checks, ["kind", "check", "rel_fro", "max_abs", "tok median", "tok>5%", "status"]))
    if rows:
        print("\ntimings (median of repeats after warm-up; extra peak = peak - resident before the call):")
        print(C.table(rows, ["kind", "B", "variant", "median ms", "min ms", "extra peak", "resident",
                             "vs floor", "tok/s"]))
    for n in results["notes"]:
        print("note:", n)


if __name__ == "__main__":
    sys.exit(main())
