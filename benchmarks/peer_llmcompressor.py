#!/usr/bin/env python
"""llm-compressor 0.14 on the trained tiny DeepSeek-V4, with the project's quality protocol.

The peer side of the quality table (issue 13, item 3): GPTQ, AWQ and SmoothQuant + GPTQ
through llm-compressor's ``oneshot`` on transformers' own ``DeepseekV4ForCausalLM`` loaded
from ``assets/tiny-v4``, evaluated with the SAME windows as ``benchmarks/quality_table.py``:

- evaluation: Wikitext-2 test rows joined with "\\n\\n", tokenized once, the first 64
  non-overlapping windows of 256 tokens (``amct_ext.pipeline.perplexity``);
- calibration: 16 windows of 256 tokens drawn from the validation split with seed 0
  (``amct_ext.pipeline.calibration.load_calibration_windows``, imported from this repository);
- fp32 on CPU; the quantized model is compressed-tensors' in-memory fake-quant model.

llm-compressor is NOT a project dependency. Without ``--smoke`` the script creates (or
reuses) a virtual environment of its own, ``benchmarks/.venv-peers`` (git-ignored), installs
``torch==2.13.0`` first (the local CPU wheel, so no CUDA build is fetched) and then
``llmcompressor==0.14.*`` (which pins transformers <= 5.17), and re-runs itself there::

    python benchmarks/peer_llmcompressor.py --eval-data PATH/wiki.test.raw \\
        [--schemes w4a16-g128,...] [--algos gptq,awq,smoothquant+gptq] \\
        [--json benchmarks/quality/peer_llmcompressor.json] [--md benchmarks/quality/peer_llmcompressor.md]

``--smoke`` runs in the project venv without llm-compressor: it checks the protocol code
paths (windows, digests, recipe specs, module-name mapping) on a few windows.

Finished (scheme, algorithm) cells are kept in the JSON and skipped on a rerun (``--redo``
recomputes them), so an interrupted run resumes.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
for _p in (REPO, BENCH):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# The peer-independent pieces (venv, re-run, protocol windows, records) live in peers_common;
# default_calib_path and digest stay importable from here for the tests that read them so.
import peers_common as _pc  # noqa: E402
from peers_common import (  # noqa: E402,F401
    default_calib_path, digest, file_sha256, load_tokenizer, machine, protocol_windows, save)
from peers_common import fail as _fail  # noqa: E402

DEFAULT_VENV = REPO / "benchmarks" / ".venv-peers"
DEFAULT_MODEL = REPO / "assets" / "tiny-v4"
DEFAULT_JSON = REPO / "benchmarks" / "quality" / "peer_llmcompressor.json"
PEER_REQUIREMENTS = ("torch==2.13.0", "llmcompressor==0.14.*")
IN_PEER_ENV = "AMCT_PEER_LLMC_INSIDE"

#: Our float PPL of assets/tiny-v4 on the 64 x 256 protocol (benchmarks/RESULTS.md §3).
OUR_FLOAT_PPL = 274.007
#: The float check passes when transformers' model reproduces it to this relative tolerance
#: (RESULTS.md rounds to 3 decimals; our model and transformers' agree to 1e-4 in logits).
FLOAT_RTOL = 1e-4

# --------------------------------------------------------------------------- schemes
# compressed-tensors QuantizationArgs for the project's schemes (amct_ext/quant/schemes.py):
# "channel" = one scale per output row; "group" = group_size consecutive input elements;
# activations "token" = dynamic, one scale per token (but see ACT_NOTE).
_W = lambda bits, sym, strategy, gs=None: {  # noqa: E731
    "num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy,
    **({"group_size": gs} if gs else {}), "observer": "minmax"}
SCHEMES = {
    "w8a8": {"weights": _W(8, True, "channel"),
             "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                   "strategy": "token", "dynamic": True}},
    "w4a16-g128": {"weights": _W(4, False, "group", 128)},
    "w3a16-g128": {"weights": _W(3, False, "group", 128)},
    "w4a16": {"weights": _W(4, False, "channel")},
    "w2a16-g64": {"weights": _W(2, False, "group", 64)},
}
ALGOS = ("gptq", "awq", "smoothquant+gptq")
#: Algorithms run only when named (not in the default --algos). "gptq" above pins
#: actorder=None (the project's own GPTQ has no activation ordering); "gptq-default" leaves
#: every GPTQModifier knob at llm-compressor's default (0.14: block_size 128, dampening_frac
#: 0.01, actorder "static" for group / channel weights), the peer "at its defaults".
EXTRA_ALGOS = ("gptq-default",)

# --------------------------------------------------------------------------- targets
# Our default targets attn-linear + moe (models/deepseek_v4/quant_module.py) in transformers'
# names. Not targeted (as in ours): compressor / indexer linears, routers, lm_head.
#   ours attn.wq_a / wq_b / wkv / wo_a / wo_b  -> self_attn.q_a_proj / q_b_proj / kv_proj /
#                                                  o_a_proj (grouped) / o_b_proj
#   ours ffn.experts.{e}.w1 / w3 / w2           -> mlp.experts.{e}.gate_proj / up_proj / down_proj
#                                                  (after llm-compressor's linearize_moe)
#   ours ffn.shared_experts.w1 / w3 / w2        -> mlp.shared_experts.gate_proj / up_proj / down_proj
NAME_MAP = {
    "attn.wq_a": "self_attn.q_a_proj", "attn.wq_b": "self_attn.q_b_proj",
    "attn.wkv": "self_attn.kv_proj", "attn.wo_a": "self_attn.o_a_proj",
    "attn.wo_b": "self_attn.o_b_proj",
    "ffn.experts.{e}.w1": "mlp.experts.{e}.gate_proj", "ffn.experts.{e}.w3": "mlp.experts.{e}.up_proj",
    "ffn.experts.{e}.w2": "mlp.experts.{e}.down_proj",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
}
TARGETS = [
    r"re:.*\.self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj)$",
    r"re:.*\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)$",
    r"re:.*\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)$",
]

# --------------------------------------------------------------------------- smoothing maps
# llm-compressor ships none for DeepSeek-V4. Every module that READS the smoothed tensor must
# be a balance layer, targeted or not, or the float function changes:
#  - input_layernorm's output feeds q_a_proj and kv_proj, and in compressed layers also the
#    compressor (kv_proj, gate_proj) and its indexer (kv_proj, gate_proj, scorer weights_proj);
#  - q_a_norm's output (q_residual) feeds q_b_proj and the indexer's q_b_proj;
#  - post_attention_layernorm's output feeds the router (mlp.gate: score or hash router,
#    whose [E, H] weight takes the scale like a Linear), every routed expert's gate/up and
#    the shared expert's gate/up;
#  - o_a_proj -> o_b_proj (the grouped output rows are o_b's input columns, in order);
#  - up_proj -> down_proj inside each SwiGLU (AWQ only, as llm-compressor's DeepSeek-V3 maps;
#    NOT exact in V4: up is clamped to +-swiglu_limit before the product, see the casebook).
# compressed-tensors' match_modules_set groups matches per parent and needs EVERY pattern of
# a mapping to match inside each group: a separate pattern for the compressor (absent in
# sliding-only layers) would glue two layers into one set. So each balance side is ONE regex.
_ATTN_IN = [r"re:.*\.self_attn\.(q_a_proj|kv_proj|compressor\.kv_proj|compressor\.gate_proj"
            r"|compressor\.indexer\.kv_proj|compressor\.indexer\.gate_proj"
            r"|compressor\.indexer\.scorer\.weights_proj)$"]
_Q_RES = [r"re:.*\.self_attn\.(q_b_proj|compressor\.indexer\.q_b_proj)$"]
_MOE_IN = [r"re:.*\.mlp\.(gate|experts\.\d+\.gate_proj|experts\.\d+\.up_proj"
           r"|shared_experts\.gate_proj|shared_experts\.up_proj)$"]
SMOOTHQUANT_MAPPINGS = [
    [_ATTN_IN, r"re:.*\.input_layernorm$"],
    [_Q_RES, r"re:.*\.self_attn\.q_a_norm$"],
    [_MOE_IN, r"re:.*\.post_attention_layernorm$"],
]
AWQ_MAPPINGS = [
    {"smooth_layer": r"re:.*\.input_layernorm$", "balance_layers": _ATTN_IN},
    # replaced per model by awq_mappings(): not in layers with an indexer (casebook/peer-llm-compressor.md P9)
    {"smooth_layer": r"re:.*\.self_attn\.q_a_norm$", "balance_layers": _Q_RES},
    {"smooth_layer": r"re:.*\.self_attn\.o_a_proj$", "balance_layers": [r"re:.*\.self_attn\.o_b_proj$"]},
    {"smooth_layer": r"re:.*\.post_attention_layernorm$", "balance_layers": _MOE_IN},
    {"smooth_layer": r"re:.*\.mlp\.experts\.\d+\.up_proj$",
     "balance_layers": [r"re:.*\.mlp\.experts\.\d+\.down_proj$"]},
    {"smooth_layer": r"re:.*\.mlp\.shared_experts\.up_proj$",
     "balance_layers": [r"re:.*\.mlp\.shared_experts\.down_proj$"]},
]
SMOOTHQUANT_STRENGTH = 0.5  # llm-compressor's default migration strength


def awq_mappings(indexer_layers=()) -> list[dict]:
    """AWQ_MAPPINGS without the q_a_norm mapping in the layers that have an indexer.

    llm-compressor 0.14's AWQ caches the inputs of each mapping's parent module (the lowest
    common ancestor of its balance layers) and deletes that cache after the FIRST mapping that
    uses it. With an indexer, q_a_norm's balance layers (q_b_proj, compressor.indexer.q_b_proj)
    have the parent self_attn, the same as input_layernorm's mapping: the second one fails with
    ``KeyError: DeepseekV4Attention(...)``. Sharing the cache would not do either: it holds
    self_attn inputs from BEFORE the first smoothing, stale once that is folded. So those layers
    get no q_a_norm smoothing from AWQ (dropping the indexer's q_b_proj from the balance
    instead would change the float function)."""
    out = [dict(m) for m in AWQ_MAPPINGS]
    if indexer_layers:
        skip = "|".join(str(i) for i in sorted(indexer_layers))
        # BOTH sides restricted: a balance pattern that still matched in the skipped layers
        # would glue their q_b_proj onto the next kept layer's set (P3; the mapping check
        # caught exactly that: max |logit diff| 3.2).
        keep = rf"re:.*\.layers\.(?!({skip})\.)\d+\.self_attn\."
        for m in out:
            if m["smooth_layer"] == r"re:.*\.self_attn\.q_a_norm$":
                m["smooth_layer"] = keep + r"q_a_norm$"
                m["balance_layers"] = [keep + r"(q_b_proj|compressor\.indexer\.q_b_proj)$"]
    return out


def indexer_layers_of(model) -> list[int]:
    """Indices of the decoder layers whose attention has an indexer (CSA layers)."""
    return [i for i, layer in enumerate(model.model.layers)
            if getattr(getattr(layer.self_attn, "compressor", None), "indexer", None) is not None]


# =========================================================================== recipes
def recipe_spec(algo: str, scheme: str, indexer_layers=()) -> list[dict]:
    """The modifiers of one run as plain data (what goes into the JSON; built into objects
    by :func:`build_recipe` inside the peer venv)."""
    if algo not in ALGOS + EXTRA_ALGOS:
        _fail(f"unknown algorithm {algo!r}; valid: {', '.join(ALGOS + EXTRA_ALGOS)}")
    if scheme not in SCHEMES:
        _fail(f"unknown scheme {scheme!r}; valid: {', '.join(SCHEMES)}")
    groups = {"group_0": {"targets": list(TARGETS), **SCHEMES[scheme]}}
    if algo == "gptq":
        return [{"modifier": "GPTQModifier", "config_groups": groups, "block_size": 128,
                 "dampening_frac": 0.01, "actorder": None}]
    if algo == "gptq-default":
        return [{"modifier": "GPTQModifier", "config_groups": groups}]
    if algo == "awq":
        return [{"modifier": "AWQModifier", "mappings": awq_mappings(indexer_layers), "duo_scaling": True,
                 "n_grid": 20},
                {"modifier": "QuantizationModifier", "config_groups": groups}]
    return [{"modifier": "SmoothQuantModifier", "mappings": SMOOTHQUANT_MAPPINGS,
             "smoothing_strength": SMOOTHQUANT_STRENGTH},
            {"modifier": "GPTQModifier", "config_groups": groups, "block_size": 128,
             "dampening_frac": 0.01, "actorder": None}]


def build_recipe(spec: list[dict]):
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQMapping, AWQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    out = []
    for m in spec:
        kw = {k: v for k, v in m.items() if k != "modifier"}
        name = m["modifier"]
        if name == "GPTQModifier":
            out.append(GPTQModifier(**kw))
        elif name == "QuantizationModifier":
            out.append(QuantizationModifier(**kw))
        elif name == "AWQModifier":
            kw["mappings"] = [AWQMapping(**mp) for mp in kw["mappings"]]
            out.append(AWQModifier(**kw))
        elif name == "SmoothQuantModifier":
            out.append(SmoothQuantModifier(**kw))
        else:  # pragma: no cover - recipe_spec only emits the above
            raise ValueError(name)
    return out


# =========================================================================== peer side
def versions(packages=("torch", "transformers", "llmcompressor", "compressed-tensors", "accelerate")) -> dict:
    """Python and the installed versions of ``packages`` (None: not installed)."""
    return _pc.versions(packages)


def load_hf_model(model_path: Path, linearize: bool = True):
    """transformers' DeepseekV4ForCausalLM, fp32, eval mode; experts unfused when asked.

    V4's routed experts are ONE fused module per layer (3-D ``gate_up_proj`` [E, 2I, H] and
    ``down_proj`` [E, H, I] parameters), not Linear modules, so no quantization config can
    target them. llm-compressor's ``linearize_moe`` swaps each for a ModuleList of per-expert
    gate/up/down Linears (its LinearExperts2D keeps V4's clamped SwiGLU gate). Loading with
    ``load_quantizable_moe`` instead fails here (see casebook/peer-llm-compressor.md: it imports every
    transformers model module, some of which need torchvision), so we linearize after load.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=torch.float32, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "mismatched_keys")}
    if bad:
        _fail(f"{model_path}: transformers did not load every tensor: {bad}")
    if linearize:
        from llmcompressor.modeling.moe.linearize import linearize_moe

        linearize_moe(model)
    return model.eval()


def hf_perplexity(model, windows, batch_size: int = 1) -> float:
    """The project's NLL accumulation over transformers' logits, one window at a time
    (transformers' V4 forward is only checked at batch 1 here; rows are independent)."""
    import torch
    from amct_ext.pipeline.perplexity import perplexity

    def fn(ids):
        return model(input_ids=ids, use_cache=False).logits

    with torch.no_grad():
        return perplexity(fn, windows, batch_size, "cpu", progress=False)


def quantized_modules(model) -> dict:
    """What compressed-tensors attached: how many modules of each leaf kind carry a scheme."""
    kinds: dict[str, int] = {}
    for name, mod in model.named_modules():
        if getattr(mod, "quantization_scheme", None) is not None:
            kind = re.sub(r"layers\.\d+\.", "layers.*.", name)
            kind = re.sub(r"experts\.\d+\.", "experts.*.", kind)
            kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items()))


def probe_token_granularity() -> dict:
    """How compressed-tensors' dynamic 'token' activation scales are shaped for the input
    ranks V4's targeted linears see: 3-D [B, S, H] (attention linears, shared expert),
    4-D [B, S, G, K] (the grouped o_a_proj) and 2-D [T, H] (routed experts: the MoE block
    flattens tokens before dispatch)."""
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    out = {}
    for label, shape in (("3d [B,S,H] (attention, shared expert)", (2, 5, 16)),
                         ("4d [B,S,G,K] (o_a_proj)", (2, 5, 2, 8)),
                         ("2d [T,H] (routed experts)", (10, 16))):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
        scale, _ = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Linear(1, 1))
        n_scales = int(scale.numel())
        n_tokens = int(torch.tensor(shape[:-1]).prod()) if len(shape) > 1 else 1
        out[label] = {"input_shape": list(shape), "scale_shape": list(scale.shape),
                      "scales": n_scales, "tokens": n_tokens,
                      "meaning": ("per-token" if n_scales == n_tokens else
                                  "per-tensor" if n_scales == 1 else
                                  f"one scale per token over its {shape[2]} groups "
                                  f"({n_scales} scales for {n_tokens} rows)")}
    return out


def check_mappings(model_path: Path, windows, seed: int = 0) -> dict:
    """Are the smoothing mappings function-preserving? Independent of llm-compressor's
    algorithms: resolve each mapping with compressed-tensors' own ``match_modules_set``,
    fold RANDOM per-channel scales s in [0.5, 2] (smooth weight / s, balance weights * s),
    no quantization, and compare the logits with the untouched model's."""
    import torch
    from compressed_tensors.utils import match_modules_set

    ref_model = load_hf_model(model_path)
    with torch.no_grad():
        ref = ref_model(input_ids=windows, use_cache=False).logits
    out = {}
    for label, mappings in (("smoothquant", [(m[0], m[1]) for m in SMOOTHQUANT_MAPPINGS]),
                            ("awq", [(m["balance_layers"], m["smooth_layer"])
                                     for m in awq_mappings(indexer_layers_of(ref_model))])):
        for balance, smooth in mappings:
            model = load_hf_model(model_path)
            gen = torch.Generator().manual_seed(seed)
            n_sets = 0
            with torch.no_grad():
                for *bal_groups, smooth_group in match_modules_set(model, list(balance) + [smooth]):
                    (sm,) = smooth_group
                    bal = [b for g in bal_groups for b in g]
                    width = bal[0].weight.shape[1]
                    sc = torch.empty(width).uniform_(0.5, 2.0, generator=gen)
                    if sm.weight.ndim == 1:
                        sm.weight.div_(sc)
                    else:
                        sm.weight.div_(sc.view(-1, 1))
                    for b in bal:
                        b.weight.mul_(sc.view(1, -1))
                    n_sets += 1
                got = model(input_ids=windows, use_cache=False).logits
            diff = (got - ref).abs().max().item()
            out[f"{label}: {smooth}"] = {"sets": n_sets, "max_abs_logit_diff": diff,
                                         "logit_scale": ref.abs().max().item()}
    return out


def cpu_only_workarounds() -> list[str]:
    """Patches the peer needs on a machine without an accelerator (casebook/peer-llm-compressor.md P7)."""
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    applied = []
    if not torch.accelerator.is_available():
        # AWQModifier._apply_smoothing pins every cached CPU tensor before its grid search
        # (an H2D-transfer speed-up); pin_memory() raises without an accelerator.
        IntermediatesCache.pin_memory = lambda self, *a, **k: None
        applied.append("IntermediatesCache.pin_memory -> no-op (no accelerator)")
    return applied


def run_cell(args, scheme: str, algo: str, calib) -> dict:
    """One oneshot run on a fresh model; its PPL on the eval windows and wall times."""
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot

    t0 = time.perf_counter()
    model = load_hf_model(args.model)
    spec = recipe_spec(algo, scheme, indexer_layers_of(model))
    data = Dataset.from_dict({"input_ids": calib.tolist(),
                              "attention_mask": torch.ones_like(calib).tolist()})
    t1 = time.perf_counter()
    recipe = build_recipe(spec)
    gptq = gptq_knobs(build_recipe(spec))   # on a copy: the run's own modifiers stay untouched
    oneshot(model=model, dataset=data, recipe=recipe,
            num_calibration_samples=calib.shape[0], max_seq_length=calib.shape[1],
            shuffle_calibration_samples=False, pipeline=args.pipeline,
            moe_calibrate_all_experts=args.calibrate_all_experts)
    t2 = time.perf_counter()
    model.eval()
    ppl = hf_perplexity(model, args._eval_windows)
    t3 = time.perf_counter()
    return {"scheme": scheme, "algo": algo, "ppl": ppl,
            "vs_float_pct": 100.0 * (ppl / args._float_ppl - 1.0),
            "oneshot_s": round(t2 - t1, 2), "eval_s": round(t3 - t2, 2),
            "load_s": round(t1 - t0, 2), "quantized_modules": quantized_modules(model),
            "recipe": spec, "pipeline": args.pipeline, **({"gptq_knobs": gptq} if gptq else {})}


def gptq_knobs(recipe) -> dict:
    """block_size, dampening_frac and actorder of the recipe's GPTQModifier as it ran (the
    defaults it filled in included; actorder as the weights' resolved ordering); {} without GPTQ."""
    for m in recipe:
        if type(m).__name__ == "GPTQModifier":
            try:   # read only; an llm-compressor without this method must not cost the cell
                orders = sorted({str(getattr(g.weights, "actorder", None))
                                 for g in m.resolve_quantization_config().config_groups.values() if g.weights})
            except Exception as e:  # noqa: BLE001
                orders = [f"unresolved: {type(e).__name__}: {e}"[:200]]
            return {"block_size": m.block_size, "dampening_frac": m.dampening_frac,
                    "actorder_modifier": str(m.actorder), "actorder_weights": orders}
    return {}


def peer_main(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out_path = Path(args.json)
    res = _pc.load_results(out_path, args.fresh)

    tok = load_tokenizer(args.model)
    ev, cal = protocol_windows(tok, args.eval_data, args.calib_data, args.seq_len,
                               args.eval_windows, args.calib_samples, args.seed)
    args._eval_windows = ev
    res["protocol"] = protocol_record(args, ev, cal)
    res["versions"] = versions()
    res["machine"] = machine()
    res["command"] = _pc.command_line(sys.argv[0], sys.argv[1:])
    res["date"] = _pc.utc_date()
    res["token_granularity_probe"] = probe_token_granularity()
    res["workarounds"] = cpu_only_workarounds()

    if "float" not in res or args.redo:
        t0 = time.perf_counter()
        ppl = hf_perplexity(load_hf_model(args.model, linearize=False), ev)
        t1 = time.perf_counter()
        lin = hf_perplexity(load_hf_model(args.model, linearize=True), ev)
        res["float"] = {"ppl": ppl, "ppl_linearized_experts": lin, "ours": OUR_FLOAT_PPL,
                        "rel_diff": ppl / OUR_FLOAT_PPL - 1.0,
                        "ok": abs(ppl / OUR_FLOAT_PPL - 1.0) <= FLOAT_RTOL and lin == ppl,
                        "eval_s": round(t1 - t0, 2)}
        save(out_path, res)
    print(f"float PPL (transformers, fp32): {res['float']['ppl']:.4f}  ours {OUR_FLOAT_PPL}  "
          f"linearized {res['float']['ppl_linearized_experts']:.4f}  ok={res['float']['ok']}",
          flush=True)
    if ("mapping_check" not in res or args.redo) and not args.skip_mapping_check:
        res["mapping_check"] = check_mappings(args.model, ev[:2])
        save(out_path, res)
    for k, v in res.get("mapping_check", {}).items():
        print(f"mapping check {k}: {v['sets']} sets, max |logit diff| {v['max_abs_logit_diff']:.2e}",
              flush=True)
    args._float_ppl = res["float"]["ppl"]
    if not res["float"]["ok"] and not args.allow_float_mismatch:
        print("error: transformers' float PPL does not reproduce ours; the protocol differs", file=sys.stderr)
        return 2

    for scheme in args.schemes:
        for algo in args.algos:
            key = f"{scheme}|{algo}"
            if key in res["cells"] and not args.redo and "error" not in res["cells"][key]:
                print(f"{key}: kept ({res['cells'][key]['ppl']:.4f})", flush=True)
                continue
            print(f"{key}: running ...", flush=True)
            try:
                cell = run_cell(args, scheme, algo, cal)
                print(f"{key}: PPL {cell['ppl']:.4f} ({cell['vs_float_pct']:+.2f} %), "
                      f"oneshot {cell['oneshot_s']} s", flush=True)
            except Exception as e:  # noqa: BLE001  a failed peer run is a result to report
                tb = traceback.format_exc()
                cell = {"scheme": scheme, "algo": algo, "error": f"{type(e).__name__}: {e}"[:2000],
                        "traceback_tail": tb[-4000:], "recipe": recipe_spec(algo, scheme)}
                print(f"{key}: FAILED {cell['error'][:300]}", flush=True)
            res["cells"][key] = cell
            save(out_path, res)
    if args.md:
        write_markdown(Path(args.md), res)
    return 0


# =========================================================================== records
def protocol_record(args, ev, cal) -> dict:
    return {"model": _pc.rel_to_repo(args.model),
            "eval_data": str(args.eval_data), "eval_data_sha256": file_sha256(args.eval_data),
            "calib_data": str(args.calib_data), "calib_data_sha256": file_sha256(args.calib_data),
            "seq_len": args.seq_len, "eval_windows": int(ev.shape[0]),
            "calib_samples": int(cal.shape[0]), "seed": args.seed,
            "eval_windows_sha256": digest(ev), "calib_windows_sha256": digest(cal),
            "dtype": "float32", "device": "cpu", "threads": args.threads,
            "calibrate_all_experts": args.calibrate_all_experts, "pipeline": args.pipeline}


def write_markdown(path: Path, res: dict) -> None:
    from amct_ext.io.io_utils import atomic_write

    f = res["float"]
    lines = [
        "# llm-compressor 0.14 beside ours: trained tiny V4 (`assets/tiny-v4`)", "",
        "**Command**: `python benchmarks/peer_llmcompressor.py --eval-data PATH/wiki.test.raw "
        "--json benchmarks/quality/peer_llmcompressor.json --md benchmarks/quality/peer_llmcompressor.md` "
        "(creates / reuses benchmarks/.venv-peers)."
        + ("" if len(res.get("commands", [])) <= 1 else
           " This run was split over processes (one per algorithm, `--threads 1`) and merged "
           "with `--merge`: " + "; ".join(f"`{c}`" for c in res["commands"]) + "."), "",
        f"**Machine**: {res['machine']['description']}; **date**: {res['date']}.", "",
        "**Versions**: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()) + ".", "",
        "**Protocol** (= RESULTS §3): first "
        f"{res['protocol']['eval_windows']} x {res['protocol']['seq_len']} windows of the "
        "Wikitext-2 test split (rows joined with \"\\n\\n\", tokenized once); calibration "
        f"{res['protocol']['calib_samples']} x {res['protocol']['seq_len']} windows of the "
        f"validation split, seed {res['protocol']['seed']} (the project's own draw); fp32, CPU; "
        "targets attn-linear + moe (q_a/q_b/kv/o_a/o_b, routed + shared expert gate/up/down).",
        "",
        f"**Float check**: transformers' DeepseekV4ForCausalLM PPL **{f['ppl']:.4f}** "
        f"(ours {f['ours']}; relative difference {f['rel_diff']:+.1e}; with llm-compressor's "
        f"linearized experts {f['ppl_linearized_experts']:.4f}) — "
        f"{'matches' if f['ok'] else 'DOES NOT match'}.", "",
        "| scheme | GPTQ PPL | vs float | GPTQ s | AWQ PPL | vs float | AWQ s | "
        "SmoothQuant+GPTQ PPL | vs float | SQ+GPTQ s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    schemes = [s for s in SCHEMES if any(k.startswith(s + "|") for k in res["cells"])]
    for s in schemes:
        row = [s]
        for a in ALGOS:
            c = res["cells"].get(f"{s}|{a}")
            if c is None:
                row += ["not run", "", ""]
            elif "error" in c:
                row += ["failed", "", ""]
            else:
                row += [f"{c['ppl']:.3f}", f"{c['vs_float_pct']:+.2f} %", f"{c['oneshot_s']:.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "**Settings** (llm-compressor defaults unless said): pipeline `independent`, which "
              "runs each modifier through the `sequential` pipeline (layer by layer; later layers "
              "see the already quantized ones); `moe_calibrate_all_experts=True` (every expert "
              "sees every calibration token; routing of the output unchanged); GPTQ block 128, "
              "dampening 0.01, no act-order, min-max observer; AWQ duo scaling, 20-point grid; "
              "SmoothQuant strength 0.5; evaluation one window per forward. AWQ smooths q_a_norm "
              "only in the layers without an indexer (0 and 2 here; casebook/peer-llm-compressor.md P9). GPTQ's "
              "o_a_proj Hessian pools both output groups' inputs (P6).",
              "", "Wall time = `oneshot` only (calibration + algorithm), seconds, one thread, "
              "measured while 3-5 of these runs and other jobs shared the 2 cores (load average "
              "8-14): rough, comparable only within this table. Loading adds ~1 s; evaluating "
              "the 64 windows adds about "
              f"{_median([c.get('eval_s') for c in res['cells'].values() if 'eval_s' in c]):.0f} s.", ""]
    fails = {k: c["error"] for k, c in res["cells"].items() if "error" in c}
    if fails:
        lines += ["**Failed runs**:", ""] + [f"- `{k}`: {v.splitlines()[0][:400]}" for k, v in fails.items()] + [""]
    some = next((c for c in res["cells"].values() if "quantized_modules" in c), None)
    if some:
        lines += ["**Quantized modules** (compressed-tensors schemes attached, per run): "
                  + ", ".join(f"`{k}` x{v}" for k, v in some["quantized_modules"].items())
                  + f" = {sum(some['quantized_modules'].values())} Linears. Not quantized, as "
                  "in ours: compressor / indexer linears, routers, lm_head.", ""]
    mc = res.get("mapping_check")
    if mc:
        worst = max(v["max_abs_logit_diff"] for v in mc.values())
        lines += ["**Smoothing mappings** (written here; llm-compressor has none for V4): "
                  "input_layernorm -> q_a_proj, kv_proj + compressor / indexer readers; "
                  "q_a_norm -> q_b_proj, indexer.q_b_proj; post_attention_layernorm -> router, "
                  "experts' and shared expert's gate/up; AWQ also o_a_proj -> o_b_proj and "
                  "up_proj -> down_proj per expert. Random scales folded through each mapping, "
                  f"quantization off, change the logits by at most {worst:.1e} "
                  f"(logit scale {next(iter(mc.values()))['logit_scale']:.1f}): they preserve "
                  "the float function.", ""]
    if res.get("workarounds"):
        lines += ["**Workarounds applied to the peer**: " + "; ".join(res["workarounds"]) + ".", ""]
    probe = res.get("token_granularity_probe", {})
    if probe:
        lines += ["**Dynamic 'token' activation scales in compressed-tensors** (w8a8), measured:", ""]
        lines += [f"- {k}: input {v['input_shape']} -> scale {v['scale_shape']} = {v['meaning']}"
                  for k, v in probe.items()] + [""]
        lines += ["So in the w8a8 row llm-compressor's \"per-token\" int8 activations are "
                  "per-tensor for the routed experts' inputs (one scale for all tokens an expert "
                  "receives in a window: V4's MoE flattens tokens to [T, H] before dispatch) and "
                  "per-token-over-both-groups for o_a_proj; ours are per token (and per group "
                  "for wo_a) everywhere. Evaluation runs one window per forward, so the routed "
                  "experts' scale spans that window's tokens routed to the expert.", ""]
    body = "\n".join(lines)
    atomic_write(path, lambda tmp: Path(tmp).write_text(body, encoding="utf-8"))


def load_peer_table(path=DEFAULT_JSON) -> dict:
    """The measured cells for a table beside ours (quality_table.py can import this):
    ``{"float_ppl": x, "cells": {scheme: {algo: {"ppl", "vs_float_pct", "oneshot_s"} or
    {"error"}}}}``. Reads only the JSON; needs no llm-compressor."""
    res = json.loads(Path(path).read_text())
    cells: dict = {}
    for c in res.get("cells", {}).values():
        row = cells.setdefault(c["scheme"], {})
        row[c["algo"]] = ({"error": c["error"]} if "error" in c else
                          {k: c[k] for k in ("ppl", "vs_float_pct", "oneshot_s")})
    return {"float_ppl": res["float"]["ppl"], "versions": res.get("versions", {}), "cells": cells}


def _median(xs) -> float:
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else float("nan")


def merge_main(args) -> int:
    """Cells of several result files (same protocol digests) into one; later files win."""
    out_path = Path(args.json)
    res = json.loads(out_path.read_text()) if out_path.is_file() else {}
    res.setdefault("cells", {})
    for f in args.merge:
        part = json.loads(Path(f).read_text())
        for k in ("protocol", "float", "versions", "machine", "command", "date",
                  "token_granularity_probe", "mapping_check", "workarounds"):
            if k not in part:
                continue
            if k == "protocol" and "protocol" in res:
                for d in ("eval_windows_sha256", "calib_windows_sha256"):
                    if res["protocol"][d] != part["protocol"][d]:
                        print(f"error: {f}: {d} differs from {out_path}'s: other windows", file=sys.stderr)
                        return 2
            res.setdefault(k, part[k])
        res.setdefault("commands", [])
        if part.get("command") and part["command"] not in res["commands"]:
            res["commands"].append(part["command"])
        res["date"] = max(res.get("date", ""), part.get("date", ""))
        for key, cell in part.get("cells", {}).items():
            if "error" not in cell or key not in res["cells"] or "error" in res["cells"][key]:
                res["cells"][key] = cell
    save(out_path, res)
    if args.md:
        write_markdown(Path(args.md), res)
    return 0


# =========================================================================== venv
def ensure_peer_venv(venv: Path, quiet: bool = False) -> Path:
    """Create / reuse ``venv`` with torch (local CPU wheel) then llm-compressor 0.14; its python."""
    return _pc.ensure_peer_venv(venv, quiet, module="llmcompressor", dist="llmcompressor", version_prefix="0.14",
                                requirements=PEER_REQUIREMENTS)


# =========================================================================== smoke
def smoke_main(args) -> int:
    """Protocol code paths in the project venv, no llm-compressor: windows and digests equal
    the project workflow's, recipe specs and mappings are well formed, names map."""
    import torch

    tok = load_tokenizer(args.model)
    ev, cal = protocol_windows(tok, args.eval_data, args.calib_data, args.seq_len,
                               args.eval_windows, args.calib_samples, args.seed)
    ev_ref, cal_ref, _ = _pc.workflow_windows(args)
    checks = {"eval_windows_equal_workflow": bool(torch.equal(ev, ev_ref)),
              "calib_windows_equal_workflow": bool(torch.equal(cal, cal_ref)),
              "eval_shape": list(ev.shape), "calib_shape": list(cal.shape)}
    specs = {f"{s}|{a}": recipe_spec(a, s) for s in SCHEMES for a in ALGOS}
    checks["recipes"] = len(specs)
    # every target / mapping pattern is a valid regex and every targeted HF name is matched
    pats = [p[3:] for p in TARGETS]
    hf_names = [f"model.layers.0.{v.format(e=3)}" for v in NAME_MAP.values()]
    checks["targets_cover_mapped_names"] = all(any(re.fullmatch(p, n) for p in pats) for n in hf_names)
    untargeted = ["model.layers.1.self_attn.compressor.kv_proj", "model.layers.1.mlp.gate",
                  "lm_head", "model.layers.1.self_attn.compressor.indexer.q_b_proj"]
    checks["targets_skip_untargeted"] = not any(re.fullmatch(p, n) for p in pats for n in untargeted)
    return _pc.smoke_report(args.json, protocol_record(args, ev, cal), checks)


# =========================================================================== CLI
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    _pc.add_protocol_args(ap)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--algos", default=",".join(ALGOS))
    ap.add_argument("--pipeline", default="independent",
                    help="llm-compressor calibration pipeline (its default: independent)")
    ap.add_argument("--routed-only", dest="calibrate_all_experts", action="store_false",
                    help="moe_calibrate_all_experts=False (default True, llm-compressor's default)")
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (default 1: a 5 M-param model gains nothing from more, "
                         "and on a busy box extra threads cost far more than they give)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None, help="also write the markdown table here")
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV)
    _pc.add_rerun_args(ap)
    ap.add_argument("--skip-mapping-check", action="store_true",
                    help="do not run the smoothing-mapping check (another part of a split run does)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="merge the cells of these result files into --json, write --md, run nothing "
                         "(for runs split over several processes)")
    ap.add_argument("--smoke", action="store_true",
                    help="check the protocol code paths in this venv; needs no llm-compressor")
    args = ap.parse_args(argv)
    if args.merge:   # reads the parts and --json, runs nothing
        args.json = args.json or str(DEFAULT_JSON)
        for part in args.merge:
            _pc.read_json_object(part, ap.error, "--merge")
        _pc.check_result_json(args.json, ap.error, read=True)
        return args
    # every check here is cheap and comes before the venv install and the model load
    _pc.check_model_dir(args.model, ap.error)
    _pc.resolve_data_paths(args, ap.error)
    _pc.check_numbers(args, ap.error)
    args.schemes = [s for s in args.schemes.split(",") if s]
    args.algos = [a for a in args.algos.split(",") if a]
    for s in args.schemes:
        if s not in SCHEMES:
            ap.error(f"unknown scheme {s!r}; valid: {', '.join(SCHEMES)}")
    for a in args.algos:
        if a not in ALGOS + EXTRA_ALGOS:
            ap.error(f"unknown algorithm {a!r}; valid: {', '.join(ALGOS + EXTRA_ALGOS)}")
    if args.json is None and not args.smoke:
        args.json = str(DEFAULT_JSON)
    if args.json is not None:   # a run resumes from it unless --fresh; --smoke only writes it
        _pc.check_result_json(args.json, ap.error, read=not (args.fresh or args.smoke))
    if not args.smoke:
        _pc.check_venv_dir(args.venv, ap.error)
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.smoke:
        return smoke_main(args)
    if args.merge:
        return merge_main(args)
    return _pc.peer_or_rerun(peer_main, args, argv, script=__file__, inside_env=IN_PEER_ENV,
                             ensure_venv=ensure_peer_venv)


if __name__ == "__main__":
    sys.exit(main())
