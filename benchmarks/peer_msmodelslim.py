#!/usr/bin/env python
"""Huawei msModelSlim 26.1 (its shipped DeepSeek-V4 W8A8 / W4A8 recipes) on the release testbed tiny.

Issue 35.2's third peer: "msModelSlim's V4 W8A8 / W4A8 recipes, on the same model, from its exact
bf16 dequantization" (``python tools/dequantize_release.py --src assets/tiny-v4-release --out DEQ``).

Peer side (msModelSlim's own venv, its own CLI ``msmodelslim quant ... --device cpu``):

- recipes: the ones the package ships, ``lab_practice/deepseek_v4/deepseek_v4_flash_w8a8.yaml``
  (quarot + flex_smooth_quant + W8A8_DYNAMIC, ``--model_type DeepSeek-V4-Flash``) and
  ``deepseek_v4_pro_w4a8.yaml`` (quarot + flex_awq_ssz + flex_smooth_quant; routed experts
  W4A8_DYNAMIC per channel, attention and shared expert W8A8_DYNAMIC, ``DeepSeek-V4-Pro``);
  only their ``dataset`` line is changed, to the project's calibration windows;
- calibration: the project's 16 windows x 256 of the Wikitext-2 validation split (seed 0), decoded
  to text (each re-tokenizes to its window exactly; checked) and written as msModelSlim's jsonl
  (``inputs_pretokenized``); msModelSlim's tokenizer call adds the BOS (257 tokens a sample);
- output: its "ascendv1" folder, what vllm-ascend serves with ``--quantization ascend``.

msModelSlim 26.1 runs the tiny only with the workarounds of :data:`WORKAROUNDS` (applied by
``--inside``, which wraps its CLI; each says why; casebook/peer-msmodelslim.md). None changes a
recipe step; they make msModelSlim's own model the tiny (its config reader fills ~10 fields and
keeps V4-Flash values for the rest) and let its CPU path run.

Evaluation (project venv): the project's own evaluator reads the exported folder back
(``tools/run_ptq.py --model tiny-trained-release --model-path OUT --no-ptq --eval-ppl --ppl-modes
float``): weights decoded from the int8 / packed int4 codes and scales, and dynamic symmetric int8
per-token activations on exactly the leaves the description types W8A8_DYNAMIC / W4A8_DYNAMIC
(what vllm-ascend computes; a FLOAT leaf such as ``wo_b`` runs float). QuaRot is folded into the
saved weights (embed and head rotated, norms fused), so the folder is self-contained; its
``optional/quarot.safetensors`` is read by vllm-ascend only for an eagle3 draft model. The float
check is the same evaluator on DEQ. Whole test split (1487 windows), fp32, CPU.

    python benchmarks/peer_msmodelslim.py --venv /work/venvs/msmodelslim --model DEQ \\
        [--recipes flash-w8a8,pro-w4a8] [--threads 1] [--work-dir DIR] \\
        [--json benchmarks/results/release-testbed-peers-msmodelslim.json]

``--smoke`` (project venv, no msModelSlim) checks the protocol code paths: the calibration text
re-tokenizes to the windows, the recipes' dataset line is replaced and nothing else.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
for _p in (REPO, BENCH):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import peers_common as _pc  # noqa: E402  (stdlib only at import: the venv, protocol and record helpers)
from peers_common import fail as _fail  # noqa: E402

DEFAULT_VENV = REPO / "benchmarks" / ".venv-peers-msmodelslim"
DEFAULT_JSON = REPO / "benchmarks" / "results" / "release-testbed-peers-msmodelslim.json"
# torch first (the local CPU wheel), then msModelSlim; it does not declare transformers, which its
# DeepSeek-V4 adapter imports (its tokenizer): the project venv's version
PEER_REQUIREMENTS = ("torch==2.13.0", "msmodelslim==26.1.0", "transformers==5.25.0")
PEER_VERSION_PREFIX = "26.1"
CALIB_NAME = "wikitext2_valid_16x256.jsonl"
#: recipe label -> (scheme it is compared with, shipped recipe file, --model_type)
RECIPES = {
    "flash-w8a8": ("w8a8", "deepseek_v4_flash_w8a8.yaml", "DeepSeek-V4-Flash"),
    "pro-w4a8": ("w4a8", "deepseek_v4_pro_w4a8.yaml", "DeepSeek-V4-Pro"),
}
WORKAROUNDS = (
    "config: every ModelArgs field is read from config.json (msModelSlim maps ~10 and keeps V4-Flash "
    "values for vocab, head_dim, rope, window, indexer, hc: the tiny would not load otherwise)",
    "config: n_mtp_layers = 0 (the asset's partial mtp.0.* would be detected as an MTP layer; its MTP path "
    "moves modules to 'npu' unconditionally)",
    "rope: no YaRN on the uncompressed (ratio-0) layers, as in the model (msModelSlim's forward applies it "
    "to every layer; affects its calibration statistics only)",
    "flex_smooth alpha/beta search: activation and weights promoted to one dtype (bf16 activations x the "
    "fp32 compressor weights of the ratio-4 layers: 'expected m1 and m2 to have the same dtype' on CPU)",
)


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# =========================================================================== inside the peer venv
def _config_args(model_path: Path) -> dict:
    """msModelSlim's ModelArgs fields from the checkpoint's config.json (HF V4 names)."""
    cfg = json.loads((model_path / "config.json").read_text())
    rs = cfg.get("rope_scaling") or {}
    return {"vocab_size": cfg["vocab_size"], "n_hash_layers": cfg["num_hash_layers"],
            "n_shared_experts": cfg["n_shared_experts"], "n_activated_experts": cfg["num_experts_per_tok"],
            "score_func": cfg["scoring_func"], "swiglu_limit": cfg["swiglu_limit"], "head_dim": cfg["head_dim"],
            "rope_head_dim": cfg["qk_rope_head_dim"], "norm_eps": cfg["rms_norm_eps"],
            "o_lora_rank": cfg["o_lora_rank"], "window_size": cfg["sliding_window"],
            "max_seq_len": cfg["max_position_embeddings"],
            "original_seq_len": rs.get("original_max_position_embeddings", 0), "rope_theta": cfg["rope_theta"],
            "compress_rope_theta": cfg["compress_rope_theta"], "rope_factor": rs.get("factor", 1),
            "beta_fast": rs.get("beta_fast", 32), "beta_slow": rs.get("beta_slow", 1),
            "index_n_heads": cfg["index_n_heads"], "index_head_dim": cfg["index_head_dim"],
            "hc_mult": cfg["hc_mult"], "hc_sinkhorn_iters": cfg["hc_sinkhorn_iters"], "hc_eps": cfg["hc_eps"],
            "n_mtp_layers": 0}


def install_workarounds(model_path: Path) -> None:
    """The patches of :data:`WORKAROUNDS` (in this order), on msModelSlim's modules."""
    import torch
    import msmodelslim.model.deepseek_v4.model as v4_model
    import msmodelslim.model.deepseek_v4.model_adapter as v4_adapter
    from msmodelslim.processor.anti_outlier.flex_smooth import alpha_beta_search as abs_

    fields = _config_args(model_path)
    read_config = v4_adapter.DeepSeekV4ModelAdapter._load_config

    def _load_config(self, trust_remote_code=False):
        args = read_config(self, trust_remote_code)
        for k, v in fields.items():
            setattr(args, k, v)
        return args

    v4_adapter.DeepSeekV4ModelAdapter._load_config = _load_config
    freqs = v4_model.precompute_freqs_cis

    # ratio-0 layers are the ones built with rope_theta (compressed layers use compress_rope_theta)
    def precompute_freqs_cis(dim, seqlen, original_seq_len, base, factor, beta_fast, beta_slow):
        if base == fields["rope_theta"] != fields["compress_rope_theta"]:
            original_seq_len = 0
        return freqs(dim, seqlen, original_seq_len, base, factor, beta_fast, beta_slow)

    v4_model.precompute_freqs_cis = precompute_freqs_cis
    evaluate = abs_.FlexSmoothAlphaBetaSearcher.evaluate_alpha_beta

    def evaluate_alpha_beta(self, act, weights, alpha, beta, **kwargs):
        if act.dtype != weights.dtype:
            dt = torch.promote_types(act.dtype, weights.dtype)
            act, weights = act.to(dt), weights.to(dt)
        return evaluate(self, act, weights, alpha, beta, **kwargs)

    abs_.FlexSmoothAlphaBetaSearcher.evaluate_alpha_beta = evaluate_alpha_beta


def inside_forward(model_path: Path, ids_path: Path, out_path: Path) -> int:
    """msModelSlim's own DeepSeek-V4 model (bf16, as its quantization runs it), with the
    workarounds, on DEQ: its last-position logits of the windows in ``ids_path``."""
    import torch

    install_workarounds(model_path)
    import msmodelslim.model.deepseek_v4.model as v4_model
    import msmodelslim.model.deepseek_v4.model_adapter as v4_adapter
    from msmodelslim.model.common.weight_helper import get_state_dict

    class _Config(v4_adapter.DeepSeekV4ModelAdapter):
        def __init__(self):   # only its config reader is used
            self.model_path = model_path

    torch.set_default_dtype(torch.bfloat16)   # what its init_model does
    model = v4_model.Transformer(_Config()._load_config())
    model.load_state_dict(get_state_dict(model_path, model))
    with torch.no_grad():
        logits = model.eval()(torch.load(ids_path, weights_only=True))
    torch.save(logits.float(), out_path)
    return 0


def inside_main(cli_argv: list[str]) -> int:
    """msModelSlim's own CLI with :func:`install_workarounds` applied (``--inside quant ...``)."""
    if "--model_path" not in cli_argv[:-1]:   # the flag and a value after it
        _fail("--inside needs msModelSlim's --model_path PATH")
    install_workarounds(Path(cli_argv[cli_argv.index("--model_path") + 1]))
    from msmodelslim.cli.__main__ import main as msmodelslim_main

    sys.argv = ["msmodelslim"] + cli_argv
    msmodelslim_main()
    return 0


# =========================================================================== project side
def recipe_text(shipped: str, dataset: Path) -> str:
    """The shipped recipe with its ``dataset:`` line naming ``dataset`` (the only change)."""
    lines = shipped.splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if re.match(r"^\s+dataset:\s", line)]
    if len(hits) != 1:
        _fail(f"the shipped recipe has {len(hits)} 'dataset:' lines (expected one)")
    indent = re.match(r"^(\s+)", lines[hits[0]]).group(1)
    lines[hits[0]] = f"{indent}dataset: {dataset}\n"
    return "".join(lines)


def write_calibration(tokenizer, calib, path: Path) -> dict:
    """The calibration windows as msModelSlim's jsonl (one decoded window a line); each line must
    re-tokenize (without special tokens) to its window, else the peer would calibrate on other text."""
    from amct_ext.io.io_utils import atomic_write

    texts = [tokenizer.decode(w.tolist()) for w in calib]
    for i, (t, w) in enumerate(zip(texts, calib)):
        if tokenizer(t, add_special_tokens=False)["input_ids"] != w.tolist():
            _fail(f"calibration window {i} does not survive decode + tokenize; msModelSlim would see other tokens")
    body = "".join(json.dumps({"inputs_pretokenized": t}) + "\n" for t in texts)
    atomic_write(path, lambda tmp: Path(tmp).write_text(body))
    with_bos = {len(tokenizer(t)["input_ids"]) for t in texts}
    return {"path": str(path), "sha256": _sha256_text(body), "samples": len(texts),
            "tokens_per_sample_as_msmodelslim_tokenizes": sorted(with_bos)}


def peer_info(py: Path) -> dict:
    """Versions in the peer venv and where its shipped DeepSeek-V4 recipes are."""
    code = ("import json, os, importlib.metadata as m, msmodelslim; print(json.dumps({'versions': "
            "{p: m.version(p) for p in ('msmodelslim', 'torch', 'transformers', 'accelerate')}, "
            "'lab_practice': os.path.join(os.path.dirname(msmodelslim.__file__), 'lab_practice', 'deepseek_v4')}))")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        _fail(f"msModelSlim does not import in {py}: {r.stderr.strip().splitlines()[-1:]}")
    info = json.loads(r.stdout.strip().splitlines()[-1])
    info["versions"] = {"python": sys.version.split()[0], **info["versions"]}
    return info


def run_recipe(py: Path, model: Path, label: str, work: Path, calib_path: Path, lab: Path, threads: int) -> dict:
    """One msModelSlim run (its CLI, in its venv, through ``--inside``); the cell's peer fields."""
    scheme, fname, model_type = RECIPES[label]
    shipped = (lab / fname).read_text()
    recipe = work / f"{label}.yaml"
    recipe.write_text(recipe_text(shipped, calib_path))
    out = work / f"out-{label}"
    argv = ["quant", "--model_type", model_type, "--model_path", str(model), "--save_path", str(out),
            "--device", "cpu", "--config_path", str(recipe), "--trust_remote_code", "False"]
    env = _pc.peer_env(threads, keep_set=False)
    log = work / f"{label}.log"
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run([str(py), str(Path(__file__).resolve()), "--inside"] + argv, env=env,
                            stdout=fh, stderr=subprocess.STDOUT).returncode
    quantize_s = round(time.perf_counter() - t0, 2)
    if rc != 0 or not (out / "quant_model_description.json").is_file():
        tail = log.read_text().strip().splitlines()[-3:]
        return {"scheme": scheme, "algo": label, "error": f"msmodelslim exited {rc}: {' | '.join(tail)[-400:]}"}
    desc = json.loads((out / "quant_model_description.json").read_text())
    types = {}
    for k, t in desc.items():
        if k.endswith(".weight"):
            types[t] = types.get(t, 0) + 1
    return {"scheme": scheme, "algo": label, "recipe": f"lab_practice/deepseek_v4/{fname}",
            "layout_matches_reference_run": layout_matches_reference(out, label),
            "recipe_sha256": _sha256_text(shipped), "model_type": model_type,
            "argv": ["msmodelslim"] + argv, "quantize_s": quantize_s, "output": str(out),
            "weight_types": dict(sorted(types.items())),
            "quarot_rotation": (out / "optional" / "quarot.safetensors").is_file()}


def forward_check(py: Path, model: Path, windows, work: Path, threads: int) -> dict:
    """Does msModelSlim's model (with the workarounds) compute the tiny? Its bf16 last-position
    logits against the project's fp32 float model on the same windows."""
    import torch

    from models.deepseek_v4.loading import load_checkpoint_model

    ids, out = work / "forward-ids.pt", work / "forward-logits.pt"
    torch.save(windows.clone(), ids)
    env = _pc.peer_env(threads, keep_set=False)
    r = subprocess.run([str(py), str(Path(__file__).resolve()), "--inside-forward", str(model), str(ids), str(out)],
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:
        return {"error": r.stderr.strip()[-400:]}
    theirs = torch.load(out, weights_only=True)
    with torch.no_grad():
        ours = load_checkpoint_model(model)(windows)
    ours = (ours[0] if isinstance(ours, tuple) else ours)[:, -1].float()
    return {"windows": [int(x) for x in windows.shape], "max_abs_diff": float((ours - theirs).abs().max()),
            "max_abs_logit": float(ours.abs().max()),
            "min_cosine": float(torch.nn.functional.cosine_similarity(ours, theirs, dim=-1).min()),
            "argmax_agree": bool((ours.argmax(-1) == theirs.argmax(-1)).all()),
            "what": "last-position logits: msModelSlim's DeepSeek-V4 model (bf16) vs the project's (fp32) on DEQ"}


#: the layout an earlier msModelSlim 26.1 run wrote on assets/tiny-v4 (same architecture)
REFERENCE_LAYOUT = REPO / "tests" / "data" / "msmodelslim-26.1-tiny-v4"


def layout_matches_reference(out: Path, label: str) -> bool | None:
    """Same tensor names / dtypes / shapes and the same description as the reference run's."""
    from safetensors import safe_open

    ref = REFERENCE_LAYOUT / label
    if not (ref / "tensor_layout.json").is_file():
        return None
    mine = {}
    for shard in sorted(out.glob("quant_model_weights*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                mine[k] = {"dtype": str(sl.get_dtype()), "shape": list(sl.get_shape())}
    same_desc = (json.loads((out / "quant_model_description.json").read_text())
                 == json.loads((ref / "quant_model_description.json").read_text()))
    return same_desc and mine == json.loads((ref / "tensor_layout.json").read_text())


def eval_commands(model_or_out: Path, windows: int, threads: int, out_dir: Path) -> list[str]:
    """The project's evaluator on an exported folder (or on DEQ: the float check)."""
    return [sys.executable, str(REPO / "tools" / "run_ptq.py"), "--model", "tiny-trained-release",
            "--model-path", str(model_or_out), "--no-ptq", "--eval-ppl", "--ppl-modes", "float",
            "--eval-windows", str(windows), "--threads", str(threads), "--output-dir", str(out_dir), "--quiet"]


def run_evals(jobs: dict[str, list[str]], parallel: int) -> dict[str, dict]:
    """Run the evaluator commands (``parallel`` at a time); name -> {ppl, eval_s} or {error}."""
    env = _pc.with_pythonpath(dict(os.environ), str(REPO))
    pending, running, results = list(jobs.items()), {}, {}
    while pending or running:
        while pending and len(running) < max(1, parallel):
            name, cmd = pending.pop(0)
            running[name] = (subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True), time.perf_counter(), cmd)
        for name, (p, t0, cmd) in list(running.items()):
            if p.poll() is None:
                continue
            out = p.stdout.read()
            del running[name]
            report = Path(cmd[cmd.index("--output-dir") + 1]) / "report.json"
            if p.returncode != 0 or not report.is_file():
                results[name] = {"error": f"evaluator exited {p.returncode}: {out.strip()[-400:]}"}
                continue
            rep = json.loads(report.read_text())
            results[name] = {"ppl": rep["ppl"]["float"], "eval_s": round(time.perf_counter() - t0, 2),
                             "eval_windows": rep["eval"]["windows"]}
        time.sleep(0.5)
    return results


def _rel(p: Path) -> str:
    p = Path(p).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


def peer_main(args, argv: list[str]) -> int:
    """Quantize with each recipe, evaluate every output and DEQ, write the raw JSON."""
    model = Path(args.model)   # a folder with a config.json: parse_args checked it
    unknown = [r for r in args.recipes if r not in RECIPES]
    if unknown:
        _fail(f"unknown recipe(s) {unknown}; known: {', '.join(RECIPES)}")
    py = _pc.ensure_peer_venv(args.venv, module="msmodelslim", dist="msmodelslim",
                              version_prefix=PEER_VERSION_PREFIX, requirements=PEER_REQUIREMENTS)
    info = peer_info(py)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="peer-msmodelslim-"))
    work.mkdir(parents=True, exist_ok=True)
    tok = _pc.load_tokenizer(model)
    ev, cal = _pc.protocol_windows(tok, args.eval_data, args.calib_data, args.seq_len, args.eval_windows,
                                    args.calib_samples, args.seed)
    calib = write_calibration(tok, cal, work / "calib" / CALIB_NAME)
    fwd = forward_check(py, model, ev[1:3], work, args.threads)
    print(f"forward check: {fwd}", flush=True)
    cells = {}
    for label in args.recipes:
        cell = run_recipe(py, model, label, work, Path(calib["path"]), Path(info["lab_practice"]), args.threads)
        cells[f"{cell['scheme']}|{label}"] = cell
        print(f"{label}: " + (cell.get("error") or f"quantized in {cell['quantize_s']} s -> {cell['output']}"),
              flush=True)
    jobs = {"float": eval_commands(model, int(ev.shape[0]), args.threads, work / "eval-float")}
    jobs.update({k: eval_commands(Path(c["output"]), int(ev.shape[0]), args.threads, work / f"eval-{c['algo']}")
                 for k, c in cells.items() if "error" not in c})
    evals = run_evals(jobs, args.eval_jobs)
    if "error" in evals["float"]:
        _fail(f"the float check failed: {evals['float']['error']}")
    for key, cell in cells.items():
        if key in evals:
            cell.update(evals[key])
            if "ppl" in cell:
                cell["vs_float_pct"] = 100.0 * (cell["ppl"] / evals["float"]["ppl"] - 1.0)
    res = {"protocol": {"model": _rel(model), "eval_data": _rel(args.eval_data),
                        "eval_data_sha256": _pc.file_sha256(args.eval_data), "calib_data": _rel(args.calib_data),
                        "calib_data_sha256": _pc.file_sha256(args.calib_data), "seq_len": args.seq_len,
                        "eval_windows": int(ev.shape[0]), "calib_samples": int(cal.shape[0]), "seed": args.seed,
                        "eval_windows_sha256": _pc.digest(ev), "calib_windows_sha256": _pc.digest(cal),
                        "calib_jsonl": {k: v for k, v in calib.items() if k != "path"},
                        "dtype": "float32", "device": "cpu", "threads": args.threads,
                        "evaluator": "tools/run_ptq.py --model tiny-trained-release --model-path OUT --no-ptq "
                                     "--eval-ppl --ppl-modes float (exported read-back: dynamic int8 per-token "
                                     "inputs on the W8A8_DYNAMIC / W4A8_DYNAMIC leaves only)"},
           "float": {**evals["float"], "what": "the project's evaluator on DEQ"},
           "cells": cells, "versions": info["versions"], "machine": _pc.machine(),
           "workarounds": list(WORKAROUNDS), "forward_check": fwd,
           "command": _pc.command_line(__file__, argv), "date": _pc.utc_date()}
    _pc.save(args.json, res)
    for key, cell in cells.items():
        print(f"{key}: " + (f"ppl {cell['ppl']:.3f} ({cell['vs_float_pct']:+.2f} % vs float "
                            f"{evals['float']['ppl']:.3f})" if "ppl" in cell else cell.get("error", "")))
    print(f"wrote {args.json}")
    return 0 if all("ppl" in c for c in cells.values()) else 1


def smoke_main(args) -> int:
    """Protocol code paths without msModelSlim: the calibration jsonl re-tokenizes to the
    project's windows and the recipe edit touches the dataset line only."""
    tok = _pc.load_tokenizer(Path(args.model))
    ev, cal = _pc.protocol_windows(tok, args.eval_data, args.calib_data, args.seq_len, 8, 4, args.seed)
    with tempfile.TemporaryDirectory() as d:
        calib = write_calibration(tok, cal, Path(d) / CALIB_NAME)
    shipped = "spec:\n  process:\n  - type: quarot\n  dataset: mix_calib.jsonl\n  save: []\n"
    edited = recipe_text(shipped, Path("/x/c.jsonl"))
    changed = [(a, b) for a, b in zip(shipped.splitlines(), edited.splitlines()) if a != b]
    ok = changed == [("  dataset: mix_calib.jsonl", "  dataset: /x/c.jsonl")] and calib["samples"] == 4
    print(json.dumps({"calib": calib, "recipe_lines_changed": changed, "ok": ok}, indent=1))
    return 0 if ok else 1


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="the dequantized release (tools/dequantize_release.py --out)")
    ap.add_argument("--recipes", type=lambda s: [x for x in s.split(",") if x], default=list(RECIPES))
    ap.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="msModelSlim's own venv (created if missing)")
    ap.add_argument("--work-dir", type=Path, default=None, help="recipes, calibration, outputs (default: a temp dir)")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON)
    _pc.add_protocol_args(ap, eval_windows=None, eval_windows_help="default: the whole test split")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-jobs", type=int, default=1, help="evaluations run at once")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    # every check here is cheap and comes before the venv install and the tokenizer load
    _pc.check_model_dir(args.model, _fail)
    _pc.resolve_data_paths(args, _fail)
    _pc.check_numbers(args, _fail, at_least_one=("calib_samples", "threads", "eval_jobs"))
    if args.smoke:   # reads no JSON, needs no venv, writes nothing under --work-dir
        return args
    _pc.check_result_json(args.json, _fail, read=False)
    _pc.check_venv_dir(args.venv, _fail)
    if args.work_dir is not None and args.work_dir.exists() and not args.work_dir.is_dir():
        _fail(f"--work-dir {args.work_dir}: not a folder")
    return args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--inside"]:
        return inside_main(argv[1:])
    if argv[:1] == ["--inside-forward"] and len(argv) == 4:
        return inside_forward(*(Path(a) for a in argv[1:]))
    args = parse_args(argv)
    return smoke_main(args) if args.smoke else peer_main(args, argv)


if __name__ == "__main__":
    sys.exit(main())
