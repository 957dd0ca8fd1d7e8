#!/usr/bin/env python
"""Intel auto-round 0.16 on the trained tiny DeepSeek-V4, with the project's quality protocol.

The peer side of issue 24, item 2: "each weight-only default is at least as good as Intel's
auto-round itself". auto-round's own SignRound (``AutoRound(...).quantize()``) at ITS default
settings runs on transformers' ``DeepseekV4ForCausalLM`` loaded from ``assets/tiny-v4``; only the
calibration data is ours, and the evaluation is exactly ``benchmarks/peer_llmcompressor.py``'s
(whose protocol helpers this script imports):

- evaluation: Wikitext-2 test rows joined with "\\n\\n", tokenized once, the first 64
  non-overlapping windows of 256 tokens (``amct_ext.pipeline.perplexity``);
- calibration: 16 windows of 256 tokens drawn from the validation split with seed 0
  (``amct_ext.pipeline.calibration.load_calibration_windows``), handed to auto-round as its
  ``dataset`` (nsamples 16, seqlen 256 instead of its 128 x 2048);
- fp32 on CPU (``amp=False``); the quantized model is auto-round's in-memory fake-quant model
  (weights replaced by their dequantized values), no export.

Everything else is auto-round's default: SignRound, 200 iterations, lr = 1/iters, min-max tuning
on, batch 8, quantized block inputs (``enable_quanted_input``), seed 42, best-MSE iterate. The
scheme fields are the project's (auto-round's presets are symmetric, ours asymmetric):
w4a16-g128 = int4 asym groups of 128, w3a16-g128 = int3 asym g128, w4a16 = int4 asym per channel.

auto-round runs V4 only with the workarounds of :func:`install_v4_adapters` and
:func:`patch_autoround_loss` (each says why; casebook/peer-auto-round.md), and it quantizes
only the modules that the project's default targets quantize (:data:`TARGET_LEAVES`; the rest of
the Linears are pinned to 16 bit through ``layer_config``). The module counts of both sides are
recorded and compared.

auto-round is NOT a project dependency. Without ``--smoke`` the script creates (or reuses) a
virtual environment of its own (``--venv``, default ``benchmarks/.venv-peers-autoround``,
git-ignored), installs ``torch==2.13.0`` first (the CPU wheel) then ``auto-round==0.16.*``,
and re-runs itself there::

    python benchmarks/peer_autoround.py [--venv /work/venvs/autoround] \\
        [--schemes w4a16-g128,w3a16-g128,w4a16] [--threads 1] \\
        [--json benchmarks/quality/peer_autoround.json] [--md benchmarks/quality/peer_autoround.md]

``--ours`` runs the project's side of the same table instead (project venv, no auto-round):
``tools/run_ptq.py --model tiny-trained --scheme S --eval-windows 64 --ppl-modes '' --threads 1
--quiet`` per scheme, with ``--algo`` / ``--quant-target`` passed through, and records the PPL
and the project's quantized-module counts beside the peer's cells.

``--smoke`` (project venv, no auto-round) checks the protocol code paths: windows and digests
equal the workflow's, the target / layer-config mapping selects exactly the project's default
Linears, and the scheme fields are the project's.

Finished cells are kept in the JSON and skipped on a rerun (``--redo`` recomputes them).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
for _p in (REPO, BENCH):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

# The protocol (windows, digests, PPL loop, records) is llm-compressor's peer script's and
# peers_common's, so the two peers are measured the same way; both import only the stdlib at load.
import peer_llmcompressor as _plc  # noqa: E402
import peers_common as _pc  # noqa: E402
from peers_common import fail as _fail  # noqa: E402

DEFAULT_VENV = REPO / "benchmarks" / ".venv-peers-autoround"
DEFAULT_MODEL = _plc.DEFAULT_MODEL
DEFAULT_JSON = REPO / "benchmarks" / "quality" / "peer_autoround.json"
PEER_REQUIREMENTS = ("torch==2.13.0", "auto-round==0.16.*")
PEER_VERSION_PREFIX = "0.16"
IN_PEER_ENV = "AMCT_PEER_AUTOROUND_INSIDE"
OUR_FLOAT_PPL = _plc.OUR_FLOAT_PPL
FLOAT_RTOL = _plc.FLOAT_RTOL

# --------------------------------------------------------------------------- schemes
#: the project's schemes (amct_ext/quant/schemes/*.json) as auto-round scheme fields; group_size
#: -1 = one scale per output channel. All four are ASYMMETRIC in the project, so sym=False
#: (auto-round's W4A16 / W3A16 presets are symmetric g128: naming them would compare other grids).
SCHEMES = {
    "w4a16-g128": {"bits": 4, "group_size": 128, "sym": False, "data_type": "int", "act_bits": 16},
    "w3a16-g128": {"bits": 3, "group_size": 128, "sym": False, "data_type": "int", "act_bits": 16},
    "w4a16": {"bits": 4, "group_size": -1, "sym": False, "data_type": "int", "act_bits": 16},
    "w2a16-g64": {"bits": 2, "group_size": 64, "sym": False, "data_type": "int", "act_bits": 16},
}

# --------------------------------------------------------------------------- targets
#: The project's default targets ``attn-linear,moe`` (models/deepseek_v4/quant_module.py with
#: serving.ENGINE_ATTN_LEAVES: what vLLM quantizes) in transformers' module names. wo_a
#: (transformers' grouped ``o_a_proj``), the compressors, the indexer's other linears, the
#: routers and lm_head stay float on both sides.
#:   ours attn.wq_a / wkv / wq_b / wo_b / indexer.wq_b
#:     -> self_attn.q_a_proj / kv_proj / q_b_proj / o_b_proj / compressor.indexer.q_b_proj
#:   ours ffn.experts.{e}.w1 / w3 / w2 -> mlp.experts.{e}.gate_proj / up_proj / down_proj
#:     (auto-round unfuses transformers' 3-D expert parameters into per-expert Linears)
#:   ours ffn.shared_experts.w1 / w3 / w2 -> mlp.shared_experts.gate_proj / up_proj / down_proj
NAME_MAP = {
    "attn.wq_a": "self_attn.q_a_proj", "attn.wkv": "self_attn.kv_proj",
    "attn.wq_b": "self_attn.q_b_proj", "attn.wo_b": "self_attn.o_b_proj",
    "attn.indexer.wq_b": "self_attn.compressor.indexer.q_b_proj",
    "ffn.experts.{e}.w1": "mlp.experts.{e}.gate_proj", "ffn.experts.{e}.w3": "mlp.experts.{e}.up_proj",
    "ffn.experts.{e}.w2": "mlp.experts.{e}.down_proj",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj",
    "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
}
#: one regex over the name inside a decoder layer (``model.layers.{i}.``)
TARGET_LEAVES = re.compile(
    r"self_attn\.(q_a_proj|kv_proj|q_b_proj|o_b_proj|compressor\.indexer\.q_b_proj)"
    r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj)")
LAYER_PREFIX = re.compile(r"^model\.layers\.\d+\.")


def is_target(name: str) -> bool:
    """Is transformers' module ``name`` one the project's default targets quantize?"""
    m = LAYER_PREFIX.match(name)
    return bool(m) and TARGET_LEAVES.fullmatch(name[m.end():]) is not None


def module_kind(name: str) -> str:
    """``model.layers.3.mlp.experts.5.up_proj`` -> ``mlp.experts.*.up_proj`` (counting key)."""
    return re.sub(r"experts\.\d+\.", "experts.*.", LAYER_PREFIX.sub("", name))


def kind_group(kind: str) -> str:
    """attention / shared expert / routed experts: the three groups the counts are compared in."""
    if kind.startswith("self_attn."):
        return "attention"
    return "shared expert" if kind.startswith("mlp.shared_experts.") else "routed experts"


def our_name_to_hf(name: str) -> str:
    """The project's module name (``layers.1.attn.indexer.wq_b``) in transformers' naming."""
    m = re.match(r"^layers\.(\d+)\.(.*)$", name)
    if not m:
        raise ValueError(f"not a layer module name: {name!r}")
    layer, leaf = m.groups()
    key = re.sub(r"experts\.\d+\.", "experts.{e}.", leaf)
    if key not in NAME_MAP:
        raise KeyError(f"{name}: no transformers name known for {key!r}")
    e = re.search(r"experts\.(\d+)\.", leaf)
    return f"model.layers.{layer}." + NAME_MAP[key].format(e=e.group(1) if e else "")


# =========================================================================== V4 adapters
def install_v4_adapters(model) -> list[str]:
    """Make transformers' V4 decoder layers replayable the way auto-round replays blocks.

    auto-round caches each block's call (its kwargs) in one model forward and then calls
    ``block(**cached)`` on its own, batch by batch. Two of V4's layer inputs do not survive that:

    - ``position_embeddings`` is a dict ({"main": (cos, sin), "compress": (cos, sin)}); auto-round
      caches tensors, lists and tuples only and drops the dict ("not currently used in
      quantization fine-tuning"), so the replay would miss a required argument. The layer
      therefore rebuilds it, when absent, from the cached ``position_ids`` with the model's own
      rotary module (what DeepseekV4Model.forward does).
    - ``input_ids`` (the token ids the hash-routed MoE layers route by) is the very key under
      which auto-round stores the block's hidden states (calibration/utils._update_inputs), so
      the cached token ids are overwritten and the hash router gets None. A forward pre-hook
      renames the layer's ``input_ids`` kwarg to ``hash_token_ids`` before auto-round's capture
      sees it; the layer passes it back as ``input_ids`` to transformers' forward.

    The wrapped forward is transformers' own; :func:`check_replay` asserts that a layer replayed
    through auto-round's own runner equals the real forward bit for bit."""
    rotary = model.model.rotary_emb
    rope_types = [t for t in rotary.layer_types]
    applied = []
    for layer in model.model.layers:
        layer.forward = _replayable_forward(layer, rotary, rope_types)
        layer.register_forward_pre_hook(_rename_token_ids, with_kwargs=True)
    applied.append("decoder layers rebuild position_embeddings from position_ids (auto-round drops the dict)")
    applied.append("token ids reach the layers as hash_token_ids (auto-round's input_ids key holds hidden states)")
    return applied


def _replayable_forward(layer, rotary, rope_types):
    """transformers' DeepseekV4DecoderLayer.forward of ``layer``, callable from a replay."""
    real_forward = type(layer).forward

    def forward(hidden_states, hash_token_ids=None, position_ids=None, position_embeddings=None, **kwargs):
        if position_embeddings is None:
            position_embeddings = {t: rotary(hidden_states, position_ids=position_ids, layer_type=t)
                                   for t in rope_types}
        return real_forward(layer, hidden_states, input_ids=hash_token_ids, position_ids=position_ids,
                            position_embeddings=position_embeddings, **kwargs)

    return forward


def _rename_token_ids(module, args, kwargs):
    """Forward pre-hook: the model's ``input_ids=`` kwarg to a layer becomes ``hash_token_ids=``."""
    if "input_ids" in kwargs:
        kwargs = dict(kwargs)
        kwargs["hash_token_ids"] = kwargs.pop("input_ids")
    return args, kwargs


def patch_autoround_loss() -> str:
    """auto-round's masked block loss multiplies the [B, S] valid-token mask, unsqueezed to
    [B, S, 1], into the block output; V4's block output is [B, S, hc_mult, D] (the hyper-
    connection streams), so the mask would broadcast against the wrong axes. The patch views
    the two outputs as [B, S, hc_mult * D] before the original loss: same elements, same MSE."""
    from auto_round.algorithms.quantization.sign_round.quantizer import SignRoundQuantizer

    if getattr(SignRoundQuantizer._get_loss, "_amct_flattened", False):
        return "SignRoundQuantizer._get_loss: 4-D block outputs viewed as 3-D for the token mask"
    orig = SignRoundQuantizer._get_loss

    def _get_loss(self, pred_output, ref_output, *args, **kwargs):
        if pred_output.dim() == 4:
            pred_output = pred_output.flatten(2)
            ref_output = ref_output.flatten(2)
        return orig(self, pred_output, ref_output, *args, **kwargs)

    _get_loss._amct_flattened = True
    SignRoundQuantizer._get_loss = _get_loss
    return "SignRoundQuantizer._get_loss: 4-D block outputs viewed as 3-D for the token mask"


def layer_config_for(model) -> dict:
    """auto-round ``layer_config``: every Linear the project's default targets leave float is
    pinned to 16 bit (auto-round would otherwise quantize the compressors and the indexer's
    kv / gate projections). lm_head is not quantized by auto-round's default; the routers
    (``mlp.gate``) are no Linears and auto-round ignores them by itself."""
    import torch

    return {name: {"bits": 16} for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and name != "lm_head" and not is_target(name)}


# =========================================================================== peer side
def versions() -> dict:
    return _pc.versions(("auto-round", "torch", "transformers", "accelerate"))


def load_model(model_path: Path, unfuse: bool = False):
    """transformers' DeepseekV4ForCausalLM (fp32, eval) with the replay adapters installed;
    ``unfuse``: auto-round's own per-expert Linears (what it quantizes) instead of the 3-D
    fused expert parameters."""
    model = _plc.load_hf_model(model_path, linearize=False)
    install_v4_adapters(model)
    if unfuse:
        from auto_round.modeling.fused_moe.moe_experts_interface import prepare_model_for_moe_quantization

        if not prepare_model_for_moe_quantization(model):
            _fail(f"{model_path}: auto-round found no fused experts to unfuse")
    return model.eval()


def new_autoround(model, tokenizer, scheme: str, calib, seed: int):
    """auto-round's entry with its own defaults except the calibration data and the fp32 / CPU
    settings V4 needs (each workaround says why)."""
    from auto_round import AutoRound

    return AutoRound(
        model, tokenizer,
        **SCHEMES[scheme],
        # our 16 x 256 windows, one [1, 256] tensor per sample (auto-round's default is 128 x 2048
        # of pile-10k, which is not reachable here and not what the project calibrates on)
        dataset=[w[None] for w in calib], nsamples=int(calib.shape[0]), seqlen=int(calib.shape[1]),
        # fp32 is the project's protocol. amp=True would tune in bf16 where the CPU has it (and
        # was reported to fail there with "expected m1 and m2 to have the same dtype"); on this
        # machine auto-round switches it off by itself ("cpu device does not support the
        # 'bf16' data type"), so amp=False only pins what happens anyway (casebook AR1)
        amp=False,
        # low_cpu_mem_usage=True offloads finished blocks; it was reported to lose V4's rotary
        # buffers. Not reproduced with 0.16.1 (same PPL bit for bit at iters=1), kept off: a
        # 20 MB model has nothing to offload (casebook AR5)
        low_cpu_mem_usage=False,
        device_map="cpu",
        layer_config=layer_config_for(model),
        seed=seed,
    )


def check_replay(model_path: Path, tokenizer, calib, n_samples: int = 8) -> dict:
    """auto-round's own capture and replay of every decoder layer equal the real forward.

    The block inputs are captured by auto-round's calibrator (``cache_data``: its forward
    replacement, the kwargs it keeps) in one model forward per window, then each layer is
    replayed through auto-round's own preprocessing and ``BlockForwardRunner`` (batches of
    8, as in tuning) and compared with the input the next layer received in the real forward.
    Layers 0-2 are the three V4 layer kinds (sliding + hash routing, ratio 4 with indexer,
    ratio 128); the last layer's real output is not captured (auto-round stops the forward at
    its input), layer 3 is the same kind as layer 1."""
    import torch
    from auto_round.calibration.utils import _update_inputs

    model = load_model(model_path)
    ar = new_autoround(model, tokenizer, "w4a16-g128", calib[:n_samples], seed=42)
    ar.post_init()
    names = [f"model.layers.{i}" for i in range(len(ar.model_context.model.model.layers))]
    cached = ar.cache_data(names, n_samples, [], last_cache_name=names[-1])
    cached.pop("input_ids", None)          # the token ids auto-round keeps for its loss mask
    out = {}
    for i, name in enumerate(names[:-1]):
        inputs, _ = _update_inputs(dict(cached[name]), None)
        hidden, others = ar._preprocess_block_inputs(inputs)
        block = ar.model_context.model.get_submodule(name)
        with torch.no_grad():
            got = ar.block_forward(block, hidden, others)
        want = torch.cat(cached[names[i + 1]]["hidden_states"], dim=0)
        got = torch.cat(got, dim=0) if isinstance(got, list) else got
        out[name] = {"equal": bool(torch.equal(got, want)), "shape": list(want.shape),
                     "max_abs_diff": float((got - want).abs().max()),
                     "cached_keys": sorted(k for k in others if k != "positional_inputs")}
    return out


def _weight_grid_check(weight, bits: int, group_size: int) -> bool:
    """Does every quantization group of ``weight`` hold at most 2**bits distinct values?"""
    w = weight.detach().float()
    rows, cols = w.shape
    g = cols if group_size in (-1, 0) else group_size
    if cols % g:
        return False
    groups = w.reshape(rows, cols // g, g)
    levels = max(int(groups[r, c].unique().numel()) for r in range(rows) for c in range(cols // g))
    return levels <= 2 ** bits


def quantized_modules(model, float_model, scheme: str, layer_config: dict) -> dict:
    """Which Linears auto-round quantized, counted two independent ways.

    ``by_layer_config``: the Linears whose final layer_config entry (auto-round's own record)
    says bits < 16. ``by_weights``: the Linears whose weight changed from the float model's
    (same unfused names) and whose every group holds <= 2**bits values (a quantization grid).
    Both are counted by kind and must agree (``agree``)."""
    import torch

    bits = SCHEMES[scheme]["bits"]
    gs = SCHEMES[scheme]["group_size"]
    float_w = {n: m.weight for n, m in float_model.named_modules() if isinstance(m, torch.nn.Linear)}
    by_cfg: dict[str, int] = {}
    by_w: dict[str, int] = {}
    off_grid = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name == "lm_head":
            continue
        cfg = layer_config.get(name, {})
        if isinstance(cfg, dict) and cfg.get("bits", 16) < 16:
            by_cfg[module_kind(name)] = by_cfg.get(module_kind(name), 0) + 1
        if name in float_w and not torch.equal(mod.weight, float_w[name]):
            if _weight_grid_check(mod.weight, bits, gs):
                by_w[module_kind(name)] = by_w.get(module_kind(name), 0) + 1
            else:
                off_grid.append(name)
    targets = sorted(n for n in float_w if is_target(n))
    return {"by_layer_config": dict(sorted(by_cfg.items())), "by_weights": dict(sorted(by_w.items())),
            "changed_off_grid": off_grid, "total": sum(by_w.values()),
            "agree": by_cfg == by_w and not off_grid, "project_targets": len(targets),
            "groups": _groups(by_w)}


def _groups(counts: dict) -> dict:
    out: dict[str, int] = {}
    for kind, n in counts.items():
        out[kind_group(kind)] = out.get(kind_group(kind), 0) + n
    return dict(sorted(out.items()))


def run_cell(args, scheme: str, tok, calib) -> dict:
    """One auto-round run on a fresh model; its PPL on the evaluation windows and wall times."""
    import torch

    t0 = time.perf_counter()
    model = load_model(args.model)
    ar = new_autoround(model, tok, scheme, calib, seed=args.ar_seed)
    t1 = time.perf_counter()
    qmodel, layer_config = ar.quantize()
    t2 = time.perf_counter()
    qmodel.eval()
    counts = quantized_modules(qmodel, load_model(args.model, unfuse=True), scheme, layer_config)
    ppl = _plc.hf_perplexity(qmodel, args._eval_windows)
    t3 = time.perf_counter()
    cell = {"scheme": scheme, "ppl": ppl, "vs_float_pct": 100.0 * (ppl / args._float_ppl - 1.0),
            "quantize_s": round(t2 - t1, 2), "eval_s": round(t3 - t2, 2), "load_s": round(t1 - t0, 2),
            "scheme_fields": SCHEMES[scheme], "autoround_settings": autoround_settings(ar),
            "quantized_modules": counts}
    if args._dev_windows is not None:   # the same quantized model on the dev split
        cell["ppl_dev"] = _plc.hf_perplexity(qmodel, args._dev_windows)
    return cell


def dev_windows(tok, args):
    """The dev split: the ``eval_windows`` windows that follow the reported ones in the same cut
    (``tools/run_ptq.py --eval-first-window N``, where the defaults are chosen)."""
    from amct_ext.pipeline.perplexity import load_eval_text, tokenize_windows

    return tokenize_windows(load_eval_text(args.eval_data), tok, args.seq_len, args.eval_windows,
                            first_window=args.eval_windows)


def autoround_settings(ar) -> dict:
    """The algorithm settings auto-round resolved (its SignRound config; lr None = its own
    rule from iters) and the calibration batch: what "auto-round's defaults" were."""
    cfg = ar.quantize_config
    keep = {k: v for k, v in vars(cfg).items() if not k.startswith("_") and k != "scheme"}
    keep["algorithm"] = type(cfg).__name__
    keep["batch_size"] = getattr(ar.calibration_context, "batch_size", None)
    keep["seed"] = getattr(ar, "seed", None)
    return _jsonable(keep)


def _jsonable(d: dict) -> dict:
    return {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v)) for k, v in d.items()}


def peer_main(args) -> int:
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    applied = [patch_autoround_loss()]
    out_path = Path(args.json)
    res = _pc.load_results(out_path, args.fresh)

    tok = _pc.load_tokenizer(args.model)
    ev, cal = _pc.protocol_windows(tok, args.eval_data, args.calib_data, args.seq_len,
                                   args.eval_windows, args.calib_samples, args.seed)
    args._eval_windows = ev
    args._dev_windows = dev_windows(tok, args) if args.dev_split else None
    res["protocol"] = _plc.protocol_record(args, ev, cal)
    if args._dev_windows is not None:
        res["protocol"]["dev_first_window"] = args.eval_windows
        res["protocol"]["dev_windows_sha256"] = _pc.digest(args._dev_windows)
    res["versions"] = versions()
    res["machine"] = _pc.machine()
    res["command"] = _pc.command_line(sys.argv[0], sys.argv[1:])
    res["date"] = _pc.utc_date()
    res["workarounds"] = applied + install_v4_adapters(_plc.load_hf_model(args.model, linearize=False)) + [
        "amp=False (fp32; auto-round turns amp off on this CPU by itself)",
        "low_cpu_mem_usage=False (nothing to offload; True gave the same result here)",
        "layer_config pins the non-target Linears to 16 bit"]

    if "float" not in res or args.redo:
        t0 = time.perf_counter()
        plain = _plc.load_hf_model(args.model, linearize=False)
        ppl = _plc.hf_perplexity(plain, ev)
        t1 = time.perf_counter()
        adapted = load_model(args.model, unfuse=True)
        ppl_adapted = _plc.hf_perplexity(adapted, ev)
        with torch.no_grad():   # the adapters and auto-round's unfused experts change nothing
            a = plain(input_ids=ev[:2], use_cache=False).logits
            b = adapted(input_ids=ev[:2], use_cache=False).logits
        res["float"] = {"ppl": ppl, "ppl_adapted_unfused": ppl_adapted, "ours": OUR_FLOAT_PPL,
                        "rel_diff": ppl / OUR_FLOAT_PPL - 1.0,
                        "adapted_logits_max_abs_diff": float((a - b).abs().max()),
                        "ok": abs(ppl / OUR_FLOAT_PPL - 1.0) <= FLOAT_RTOL
                        and abs(ppl_adapted / ppl - 1.0) <= 1e-6,
                        "eval_s": round(t1 - t0, 2)}
        if args._dev_windows is not None:
            res["float"]["ppl_dev"] = _plc.hf_perplexity(plain, args._dev_windows)
        _pc.save(out_path, res)
    f = res["float"]
    print(f"float PPL (transformers, fp32): {f['ppl']:.4f}  ours {OUR_FLOAT_PPL}  adapted + unfused "
          f"{f['ppl_adapted_unfused']:.4f} (max |logit diff| {f['adapted_logits_max_abs_diff']:.1e})  "
          f"ok={f['ok']}", flush=True)
    args._float_ppl = f["ppl"]
    if not f["ok"] and not args.allow_float_mismatch:
        print("error: transformers' float PPL does not reproduce ours; the protocol differs", file=sys.stderr)
        return 2
    if "replay_check" not in res or args.redo:
        res["replay_check"] = check_replay(args.model, tok, cal)
        _pc.save(out_path, res)
    for name, r in res["replay_check"].items():
        print(f"replay check {name}: equal={r['equal']} (max |diff| {r['max_abs_diff']:.1e}, "
              f"cached {', '.join(r['cached_keys'])})", flush=True)
    if not all(r["equal"] for r in res["replay_check"].values()):
        print("error: a layer replayed the way auto-round calls it differs from the real forward",
              file=sys.stderr)
        return 2

    if "autoround_defaults" not in res or args.redo:
        res["autoround_defaults"] = autoround_settings(
            new_autoround(load_model(args.model), tok, "w4a16-g128", cal, seed=args.ar_seed))
        _pc.save(out_path, res)
    print("auto-round settings: " + json.dumps(res["autoround_defaults"]), flush=True)

    for scheme in args.schemes:
        if scheme in res["cells"] and not args.redo and "error" not in res["cells"][scheme]:
            print(f"{scheme}: kept ({res['cells'][scheme]['ppl']:.4f})", flush=True)
            continue
        print(f"{scheme}: running auto-round ...", flush=True)
        try:
            cell = run_cell(args, scheme, tok, cal)
            q = cell["quantized_modules"]
            print(f"{scheme}: PPL {cell['ppl']:.4f} ({cell['vs_float_pct']:+.2f} %), quantize "
                  f"{cell['quantize_s']} s, {q['total']} Linears quantized {q['groups']} "
                  f"(counts agree: {q['agree']})", flush=True)
        except Exception as e:  # noqa: BLE001  a failed peer run is a result to report
            cell = {"scheme": scheme, "error": f"{type(e).__name__}: {e}"[:2000],
                    "traceback_tail": traceback.format_exc()[-4000:]}
            print(f"{scheme}: FAILED {cell['error'][:300]}", flush=True)
        res["cells"][scheme] = cell
        _pc.save(out_path, res)
    if args.md:
        write_markdown(Path(args.md), res)
    return 0


# =========================================================================== our side
def our_quantized_names(scheme: str, quant_target: str | None, model_path: Path = DEFAULT_MODEL) -> list[str]:
    """The project's quantized Linears for ``scheme`` and the targets (default attn-linear,moe)
    in transformers' names: the project's V4 built on the meta device from the checkpoint's
    config.json, each block wrapped by ``quantize_block`` (no weights read)."""
    import torch
    from amct_ext.quant.quant_linear import QuantLinear
    from amct_ext.quant.schemes import load_scheme
    from models.deepseek_v4.configuration import DeepseekV4Config
    from models.deepseek_v4.modeling import DeepseekV4ForCausalLM
    from models.deepseek_v4.quant_module import quantize_block

    config = DeepseekV4Config.from_json_file(str(Path(model_path) / "config.json"))
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config, dtype=torch.float32)
    sch = load_scheme(scheme)
    names = []
    for i, block in enumerate(model.layers):
        quantize_block(block, sch, quant_target or "attn-linear,moe")
        names += [our_name_to_hf(f"layers.{i}.{name}") for name, mod in block.named_modules()
                  if isinstance(mod, QuantLinear) and not mod.weight_quantizer.is_identity]
    return sorted(names)


def our_quantized_modules(scheme: str, quant_target: str | None, model_path: Path = DEFAULT_MODEL) -> dict:
    """:func:`our_quantized_names` counted by kind like the peer's."""
    counts: dict[str, int] = {}
    for name in our_quantized_names(scheme, quant_target, model_path):
        counts[module_kind(name)] = counts.get(module_kind(name), 0) + 1
    counts = dict(sorted(counts.items()))
    return {"by_kind": counts, "total": sum(counts.values()), "groups": _groups(counts)}


def run_ours(scheme: str, algo: str | None, quant_target: str | None, threads: int,
             propagate: str | None = None, first_window: int = 0) -> dict:
    """``tools/run_ptq.py`` with the headline protocol (benchmarks/quality_headlines.py) in a
    subprocess of the project venv; its PTQ PPL from report.json."""
    cmd = [sys.executable, str(REPO / "tools" / "run_ptq.py"), "--model", "tiny-trained", "--scheme", scheme,
           "--eval-windows", "64", "--ppl-modes", "", "--threads", str(threads), "--quiet"]
    if algo:
        cmd += ["--algo", algo]
    if quant_target:
        cmd += ["--quant-target", quant_target]
    if propagate:
        cmd += ["--propagate", propagate]
    if first_window:
        cmd += ["--eval-first-window", str(first_window)]
    with tempfile.TemporaryDirectory(prefix="amct-peer-ar-ours-") as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd + ["--output-dir", tmp], capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=str(REPO))
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["failed"],
                    "command": _shell(cmd)}
        report = json.loads((Path(tmp) / "report.json").read_text())
    ppl = report["ppl"]
    value = ppl.get("ptq", ppl.get("quant")) if isinstance(ppl, dict) else ppl
    return {"ppl": value, "wall_s": round(wall, 1), "command": _shell(cmd) + " --output-dir OUT",
            "recipe": report.get("recipe") or report.get("algorithms") or algo,
            "quantized_modules": our_quantized_modules(scheme, quant_target)}


def _shell(cmd: list[str]) -> str:
    parts = [Path(cmd[0]).name if i == 0 else c for i, c in enumerate(cmd)]
    parts[0] = "python"
    return " ".join(p if p else "''" for p in parts)


def ours_main(args) -> int:
    out_path = Path(args.json)
    res = json.loads(out_path.read_text()) if out_path.is_file() else {}
    ours = res.setdefault("ours", {})
    for scheme in args.schemes:
        key = f"{scheme}|{args.algo or 'default'}|{args.quant_target or 'default'}"
        if args.propagate:
            key += f"|{args.propagate}"
        if args.dev_split:
            key += "|dev"
        if key in ours and not args.redo and "error" not in ours[key]:
            print(f"ours {key}: kept ({ours[key]['ppl']:.4f})", flush=True)
            continue
        print(f"ours {key}: running tools/run_ptq.py ...", flush=True)
        cell = run_ours(scheme, args.algo, args.quant_target, args.threads, args.propagate,
                        args.eval_windows if args.dev_split else 0)
        cell.update({"scheme": scheme, "algo": args.algo, "quant_target": args.quant_target,
                     "propagate": args.propagate, "split": "dev" if args.dev_split else "test",
                     "date": _pc.utc_date()})
        ours[key] = cell
        print(f"ours {key}: " + (f"PPL {cell['ppl']:.4f}, {cell['wall_s']} s wall, "
                                 f"{cell['quantized_modules']['total']} Linears" if "ppl" in cell
                                 else f"FAILED {cell['error']}"), flush=True)
        _pc.save(out_path, res)
    if args.md:
        write_markdown(Path(args.md), res)
    return 0


# =========================================================================== records
def write_markdown(path: Path, res: dict) -> None:
    from amct_ext.io.io_utils import atomic_write

    lines = ["# Intel auto-round 0.16 beside ours: trained tiny V4 (`assets/tiny-v4`)", ""]
    if "float" in res:
        f = res["float"]
        p = res["protocol"]
        lines += [
            f"**Command**: `python benchmarks/peer_autoround.py --venv /work/venvs/autoround --json "
            f"{_rel(DEFAULT_JSON)} --md {_rel(DEFAULT_JSON.with_suffix('.md'))}` (this run: `{res['command']}`); "
            "our side: `python benchmarks/peer_autoround.py --ours [--algo A] [--quant-target T]`.", "",
            f"**Machine**: {res['machine']['description']}; **date**: {res['date']}.", "",
            "**Versions**: " + ", ".join(f"{k} {v}" for k, v in res["versions"].items()) + ".", "",
            f"**Protocol** (= RESULTS §3): first {p['eval_windows']} x {p['seq_len']} windows of the "
            "Wikitext-2 test split; calibration "
            f"{p['calib_samples']} x {p['seq_len']} windows of the validation split, seed {p['seed']} "
            f"(the project's own draw, digests in the JSON); fp32, CPU, {p['threads']} thread(s).", "",
            f"**Float check**: transformers' DeepseekV4ForCausalLM PPL **{f['ppl']:.4f}** (ours "
            f"{f['ours']}; relative difference {f['rel_diff']:+.1e}); with the replay adapters and "
            f"auto-round's unfused experts {f['ppl_adapted_unfused']:.4f} (max |logit diff| "
            f"{f['adapted_logits_max_abs_diff']:.1e}) — {'matches' if f['ok'] else 'DOES NOT match'}.", ""]
        rc = res.get("replay_check", {})
        if rc:
            lines += ["**Replay check**: each decoder layer replayed through auto-round's own capture "
                      "and BlockForwardRunner equals the real forward bit for bit: "
                      + ", ".join(f"{k.split('.')[-1]}: {'equal' if v['equal'] else 'DIFFERS'}"
                                  for k, v in rc.items()) + " (layers 0-2: the three layer kinds).", ""]
    lines += ["| scheme | auto-round PPL | vs float | quantize s | Linears (attn / shared / routed) | "
              "ours PPL | vs float | ours wall s | ours recipe | Linears (attn / shared / routed) |",
              "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | --- |"]
    fl = res.get("float", {}).get("ppl", OUR_FLOAT_PPL)
    for scheme in SCHEMES:
        peer = res.get("cells", {}).get(scheme)
        mine = [c for k, c in res.get("ours", {}).items() if k.startswith(scheme + "|")]
        if peer is None and not mine:
            continue
        rows = mine or [None]
        for c in rows:
            row = [scheme]
            if peer is None:
                row += ["not run", "", "", ""]
            elif "error" in peer:
                row += ["failed", "", "", ""]
            else:
                row += [f"{peer['ppl']:.4f}", f"{peer['vs_float_pct']:+.2f} %", f"{peer['quantize_s']:.0f}",
                        _count_cell(peer["quantized_modules"]["groups"], peer["quantized_modules"]["total"])]
            if c is None:
                row += ["-", "", "", "", ""]
            elif "error" in c:
                row += ["failed", "", "", c.get("algo") or "default", ""]
            else:
                row += [f"{c['ppl']:.4f}", f"{100 * (c['ppl'] / fl - 1):+.2f} %", f"{c['wall_s']:.0f}",
                        _recipe_label(c) + (f" ({c['quant_target']})" if c.get("quant_target") else ""),
                        _count_cell(c["quantized_modules"]["groups"], c["quantized_modules"]["total"])]
            lines.append("| " + " | ".join(row) + " |")
    some = next((c for c in res.get("cells", {}).values() if "quantized_modules" in c), None)
    if some:
        q = some["quantized_modules"]
        lines += ["", "**auto-round's quantized modules** (weights changed and on a 2^bits grid per group, "
                  "= its layer_config record: " + ("agree" if q["agree"] else "DISAGREE") + "): "
                  + ", ".join(f"`{k}` x{v}" for k, v in q["by_weights"].items()) + f" = {q['total']} Linears."]
    if res.get("workarounds"):
        lines += ["", "**Workarounds** (casebook/peer-auto-round.md): " + "; ".join(res["workarounds"]) + "."]
    fails = {k: c["error"] for k, c in res.get("cells", {}).items() if "error" in c}
    if fails:
        lines += ["", "**Failed runs**:", ""] + [f"- `{k}`: {v.splitlines()[0][:400]}" for k, v in fails.items()]
    body = "\n".join(lines) + "\n"
    atomic_write(path, lambda tmp: Path(tmp).write_text(body, encoding="utf-8"))


def _recipe_label(cell: dict) -> str:
    """``clip,gptq@float`` (default) from the recipe run_ptq recorded in report.json."""
    r = cell.get("recipe")
    label = (",".join(a["name"] for a in r["algorithms"]) + "@" + r.get("propagate", "?")
             if isinstance(r, dict) and "algorithms" in r else str(cell.get("algo") or "?"))
    return label + ("" if cell.get("algo") else " (default)")


def _count_cell(groups: dict, total: int) -> str:
    return f"{groups.get('attention', 0)} / {groups.get('shared expert', 0)} / {groups.get('routed experts', 0)} = {total}"


_rel = _pc.rel_to_repo


def load_peer_table(path=DEFAULT_JSON) -> dict:
    """The measured cells (reads only the JSON; needs no auto-round):
    ``{"float_ppl", "versions", "cells": {scheme: {"ppl", "vs_float_pct", "quantize_s"} or {"error"}}}``."""
    res = json.loads(Path(path).read_text())
    cells = {s: ({"error": c["error"]} if "error" in c else
                 {k: c[k] for k in ("ppl", "vs_float_pct", "quantize_s")})
             for s, c in res.get("cells", {}).items()}
    return {"float_ppl": res["float"]["ppl"], "versions": res.get("versions", {}), "cells": cells,
            "ours": res.get("ours", {})}


# =========================================================================== venv
def ensure_peer_venv(venv: Path) -> Path:
    """Create / reuse ``venv`` with torch (CPU wheel) then auto-round 0.16; its python."""
    return _pc.ensure_peer_venv(venv, module="auto_round", dist="auto-round", version_prefix=PEER_VERSION_PREFIX,
                                requirements=PEER_REQUIREMENTS)


# =========================================================================== smoke
def smoke_main(args) -> int:
    """Protocol code paths in the project venv, no auto-round: windows and digests equal the
    workflow's, the target mapping selects exactly the project's default Linears, the scheme
    fields are the project's scheme files'."""
    import torch
    from amct_ext.quant.schemes import load_scheme

    tok = _pc.load_tokenizer(args.model)
    ev, cal = _pc.protocol_windows(tok, args.eval_data, args.calib_data, args.seq_len,
                                   args.eval_windows, args.calib_samples, args.seed)
    ev_ref, cal_ref, dev_ref = _pc.workflow_windows(args, dev=True)
    checks = {"eval_windows_equal_workflow": bool(torch.equal(ev, ev_ref)),
              "dev_windows_equal_workflow": bool(torch.equal(dev_windows(tok, args), dev_ref)),
              "calib_windows_equal_workflow": bool(torch.equal(cal, cal_ref)),
              "eval_shape": list(ev.shape), "calib_shape": list(cal.shape)}
    # the scheme fields handed to auto-round are the project's scheme files'
    checks["schemes_match_project"] = all(_scheme_matches(load_scheme(s), f) for s, f in SCHEMES.items())
    # our quantized Linears, mapped to transformers' names, are exactly the peer's targets
    ours = our_quantized_modules("w4a16-g128", None, args.model)
    checks["our_counts"] = ours["groups"]
    checks["our_total"] = ours["total"]
    hf_names = hf_linear_names(args.model)
    targets = [n for n in hf_names if is_target(n)]
    target_kinds: dict[str, int] = {}
    for n in targets:
        target_kinds[module_kind(n)] = target_kinds.get(module_kind(n), 0) + 1
    checks["peer_targets_equal_ours"] = dict(sorted(target_kinds.items())) == ours["by_kind"]
    checks["peer_target_total"] = len(targets)
    return _pc.smoke_report(args.json, _plc.protocol_record(args, ev, cal), checks)


def hf_linear_names(model_path: Path) -> list[str]:
    """Every Linear of transformers' V4 for ``model_path``'s config, with the routed experts as
    auto-round unfuses them (``mlp.experts.{e}.gate_proj / up_proj / down_proj``); built on the
    meta device, no weights read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    n_exp = int(config.n_routed_experts)
    for n, m in model.named_modules():
        if type(m).__name__ == "DeepseekV4Experts":
            names += [f"{n}.{e}.{p}" for e in range(n_exp) for p in ("gate_proj", "up_proj", "down_proj")]
    return sorted(names)


def _scheme_matches(scheme, fields: dict) -> bool:
    """The project's scheme quantizes the weights of both linear targets (attn-linear, moe)
    exactly as ``fields`` say, and no activations (weight-only)."""
    for target in ("attn-linear", "moe"):
        t = scheme.target(target)
        w = t.weight
        if w is None or t.input is not None or w.granularity not in ("group", "channel"):
            return False
        gs = w.group_size if w.granularity == "group" else -1
        if (w.format, w.bits, w.symmetric, gs) != (fields["data_type"], fields["bits"], fields["sym"],
                                                    fields["group_size"]):
            return False
    return True


# =========================================================================== CLI
def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    _pc.add_protocol_args(ap)
    ap.add_argument("--ar-seed", type=int, default=42, help="auto-round's own seed (its default 42)")
    ap.add_argument("--schemes", default="w4a16-g128,w3a16-g128")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None, help="also write the markdown table here")
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV,
                    help="the peer's own virtual environment (created with auto-round if missing)")
    _pc.add_rerun_args(ap)
    ap.add_argument("--ours", action="store_true",
                    help="run the project's side (tools/run_ptq.py) in this venv; needs no auto-round")
    ap.add_argument("--algo", default=None, help="--ours: run_ptq --algo (default: the scheme's default recipe)")
    ap.add_argument("--quant-target", default=None, help="--ours: run_ptq --quant-target (default attn-linear,moe)")
    ap.add_argument("--propagate", choices=("float", "quant"), default=None,
                    help="--ours: run_ptq --propagate (default: the recipe's)")
    ap.add_argument("--dev-split", action="store_true",
                    help="also the PPL on the dev split (the next --eval-windows windows, where the defaults "
                         "are chosen); --ours: run_ptq on the dev split instead")
    ap.add_argument("--smoke", action="store_true",
                    help="check the protocol code paths in this venv; needs no auto-round")
    args = ap.parse_args(argv)
    # every check here is cheap and comes before the venv install and the model load
    _pc.check_model_dir(args.model, ap.error)
    _pc.resolve_data_paths(args, ap.error)
    _pc.check_numbers(args, ap.error)
    args.schemes = [s for s in args.schemes.split(",") if s]
    for s in args.schemes:
        if s not in SCHEMES:
            ap.error(f"--schemes: unknown scheme {s!r}; valid: {', '.join(SCHEMES)}")
    if args.json is None and not args.smoke:
        args.json = str(DEFAULT_JSON)
    if args.json is not None:   # --ours always reads it, a peer run unless --fresh, --smoke only writes it
        _pc.check_result_json(args.json, ap.error, read=args.ours or not (args.fresh or args.smoke))
    if not (args.smoke or args.ours):
        _pc.check_venv_dir(args.venv, ap.error)
    # the records use _plc.protocol_record, which reads these llm-compressor fields
    args.calibrate_all_experts = None
    args.pipeline = "auto-round SignRound (block-wise)"
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.smoke:
        return smoke_main(args)
    if args.ours:
        return ours_main(args)
    return _pc.peer_or_rerun(peer_main, args, argv, script=__file__, inside_env=IN_PEER_ENV,
                             ensure_venv=ensure_peer_venv, pythonpath=str(REPO))


if __name__ == "__main__":
    sys.exit(main())
