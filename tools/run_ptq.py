#!/usr/bin/env python
"""Blockwise post-training quantization of DeepSeek-V4 (a recipe of algorithms per unit: GPTQ,
clipping, ...), with Wikitext-2 perplexity of the float, RTN and PTQ models.

    python tools/run_ptq.py --model tiny --output-dir out/tiny
    python tools/run_ptq.py --model tiny-trained --scheme w3a16-g128 --algo clip,gptq --propagate quant \
        --output-dir out/w3
    python tools/run_ptq.py --model tiny-trained --recipe my_recipe.json --output-dir out/r
    python tools/run_ptq.py --model v4-flash --model-path /data/DeepSeek-V4-Flash --output-dir out/flash \\
        --quant-target attn-linear,moe --scheme w8a8 --device npu

Models
  tiny       a random tiny checkpoint (4 layers, dim 64, 8 experts), generated once into
             $AMCT_CACHE/tiny-v4-<key> (default ~/.cache/amct_ext/...) and reused; <key> hashes
             the tiny config, the generator version and the tokenizer's training text
             (--calib-data when given, else the shipped validation split).
  tiny-trained
             the tiny V4 trained on the Wikitext-2 validation split that ships in assets/tiny-v4
             (4 layers, dim 128, 8 experts; perplexity means something here).
  v4-flash / v4-pro
             the released checkpoints: pass --model-path DIR, or --download (modelscope).

Data (shipped with the package, so nothing is downloaded): calibration and tokenizer training
use the WikiText-2 validation split (amct_ext/data/wikitext-2/wiki.valid.tokens), perplexity the
wikitext-2-raw-v1 test split (amct_ext/data/wikitext-2-raw/wiki.test.raw); --calib-data /
--eval-data override them, --calib-dataset PATH[:CONFIG[:SPLIT]] fetches a calibration split
with the optional `datasets` package (online). Calibration text sharing any 64-word run with
the evaluation text is refused.

Defaults for --model tiny (chosen so the whole run, PPL included, takes well under two minutes
on 2 CPU cores): 8 calibration windows x 128 tokens, 2 epochs, lr 5e-3, fp32 compute,
PPL on the first 32 test windows of 128 tokens (float + RTN + PTQ), 1 intra-op thread.
For v4-*: 128 x 2048 calibration tokens, bf16, PPL off unless --eval-ppl (then every window).

Recipes
  --algo a,b,c runs the algorithms in order on every unit (rtn, clip, gptq, and whatever else is
  registered; options as gptq:act_order=true:percdamp=0.05); --recipe FILE the same as JSON /
  YAML. Without either, the scheme's default recipe and propagation (algorithms/recipe.py,
  measured on the quality table) apply. --legacy-solver is the old learned-clip-only solver.

Outputs (OUTPUT = --output-dir)
  OUTPUT/ptq_params/meta.json          the run's fingerprint: scheme, targets, solver settings,
                                       dtype, device type, calibration hash, model, checkpoint
  OUTPUT/ptq_params/layer_{i}_{unit}.pt learned parameters of each unit (+ .json: its losses)
  OUTPUT/report.json                   PPLs, per-unit losses, wall time, peak memory
An interrupted run resumes: rerun the same command (finished units are skipped). An output
folder holding parameters of another run (any fingerprint field differs) is refused with one
line naming the field and both values.

Several processes: `torchrun --nproc-per-node N [--nnodes M --rdzv-...] tools/run_ptq.py ...`
spreads the layers over the ranks (amct_ext/pipeline/distributed.py): each rank solves a cost-balanced
layer range into the same OUTPUT, perplexity runs as a pipeline over the ranks, rank 0 writes
the report. The parameters and PPLs are those of one process. If a rank dies the others stop
with one `error:` line (torchrun on its node; a heartbeat watchdog across nodes,
AMCT_DIST_HEARTBEAT_S=120; collectives time out after AMCT_DIST_TIMEOUT_S=7200); rerun to resume.

Errors in the input (missing checkpoint, bad config, impossible sequence length, unknown
scheme or target, mismatched output folder) print one line `error: ...` and exit with code 2.
"""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from amct_ext.base import DEFAULT_EPOCHS, DEFAULT_LR  # noqa: E402
from amct_ext.data import CALIB_DEFAULT, EVAL_DEFAULT  # noqa: E402
from amct_ext.errors import AmctError, CheckpointError, ConfigError  # noqa: E402

DEFAULT_EVAL_PATH = EVAL_DEFAULT

MODELS = ("tiny", "tiny-trained", "v4-flash", "v4-pro")
TRAINED_TINY = REPO / "assets" / "tiny-v4"   # trained on the Wikitext-2 validation split (tools/train_tiny.py)
MODELSCOPE_IDS = {"v4-flash": "deepseek-ai/DeepSeek-V4-Flash", "v4-pro": "deepseek-ai/DeepSeek-V4-Pro"}

# per-model defaults for options left unset on the command line
DEFAULTS = {
    "tiny": dict(calib_samples=8, seq_len=128, eval_windows=32, eval_ppl=True, dtype="fp32", threads=1,
                 batch_size=1, eval_batch_size=8),
    "tiny-trained": dict(calib_samples=16, seq_len=256, eval_windows=64, eval_ppl=True, dtype="fp32", threads=1,
                         batch_size=1, eval_batch_size=8),
    "v4": dict(calib_samples=128, seq_len=2048, eval_windows=None, eval_ppl=False, dtype="bf16", threads=None,
               batch_size=1, eval_batch_size=1, capture_memory_gb=8.0),
}


def cache_root() -> Path:
    return Path(os.environ.get("AMCT_CACHE") or Path.home() / ".cache" / "amct_ext")


# ----------------------------------------------------------------------------- model resolution
def tiny_checkpoint(text_path: Path | None = None) -> Path:
    """The cached random tiny checkpoint; generated atomically (temp folder, then rename).
    Its tokenizer is trained on ``text_path`` (default: the shipped validation split); the folder
    name carries a hash of the config, generator version and that text, so a changed generator
    or text never reuses a stale checkpoint."""
    from models.deepseek_v4.tiny import make_tiny_checkpoint, tiny_cache_key

    text_path = Path(text_path) if text_path is not None else CALIB_DEFAULT
    target = cache_root() / f"tiny-v4-{tiny_cache_key(text_path)}"
    if (target / "config.json").is_file() and (target / "model.safetensors.index.json").is_file():
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-v4.", dir=target.parent))
    try:
        make_tiny_checkpoint(tmp, fmt="bf16", seed=0, text_path=text_path)
        if target.exists():          # an incomplete earlier attempt
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def download_checkpoint(model: str, dest: Path | None) -> Path:
    try:
        from modelscope import snapshot_download  # imported lazily: optional dependency
    except ImportError:
        raise CheckpointError(f"--download needs modelscope (pip install modelscope), which is not installed; "
                              f"or download {MODELSCOPE_IDS[model]} yourself and pass --model-path DIR") from None
    dest = dest or cache_root() / model
    try:
        return Path(snapshot_download(MODELSCOPE_IDS[model], local_dir=str(dest)))
    except Exception as e:  # offline, auth, disk: one line
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"downloading {MODELSCOPE_IDS[model]} with modelscope failed ({first}); "
                              f"are you offline? download it elsewhere and pass --model-path DIR") from None


def resolve_model_path(args, calib_path: Path | None = None) -> Path:
    if args.model in ("tiny", "tiny-trained"):
        if args.model_path:
            path = Path(args.model_path)
            if not path.is_dir():
                raise CheckpointError(f"--model-path {path} does not exist or is not a folder "
                                      f"(omit --model-path to use the built-in {args.model} checkpoint)")
            return path
        return tiny_checkpoint(calib_path) if args.model == "tiny" else TRAINED_TINY
    if args.download:
        return download_checkpoint(args.model, Path(args.model_path) if args.model_path else None)
    if not args.model_path:
        raise ConfigError(f"--model {args.model} needs --model-path DIR (the checkpoint folder) or --download")
    path = Path(args.model_path)
    if not path.is_dir():
        raise CheckpointError(f"--model-path {path} does not exist or is not a folder")
    return path


def check_weights_present(path: Path, model: str = "v4-flash") -> None:
    has_index = (path / "model.safetensors.index.json").is_file() or \
        (path / "quant_model_weights.safetensors.index.json").is_file()  # an Ascend export
    has_single = (path / "model.safetensors").is_file()
    if not (has_index or has_single):
        hint = ("download the checkpoint there or use --download" if model in MODELSCOPE_IDS
                else f"omit --model-path to use the built-in {model} checkpoint")
        raise CheckpointError(f"{path}: no weights (neither model.safetensors.index.json nor model.safetensors); "
                              + hint)


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS, default="tiny")
    ap.add_argument("--model-path", default=None, help="checkpoint folder (config.json, shards, tokenizer)")
    ap.add_argument("--download", action="store_true", help="fetch v4-flash / v4-pro with modelscope")
    ap.add_argument("--quant-target", default="attn-linear,moe", help="comma list of attn-linear, attn-cache, moe")
    ap.add_argument("--scheme", default="w8a8", help="built-in scheme name or a .json/.yaml scheme file")
    ap.add_argument("--calib-data", default=None,
                    help="calibration (and tiny tokenizer training) text; default: the shipped "
                         "WikiText-2 validation split")
    ap.add_argument("--calib-dataset", default=None, metavar="PATH[:CONFIG[:SPLIT]]",
                    help="fetch the calibration text with `datasets` (optional extra, online), e.g. "
                         "wikitext:wikitext-2-raw-v1:validation")
    ap.add_argument("--calib-samples", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per calibration and evaluation window")
    ap.add_argument("--eval-data", "--data-path", dest="eval_data", default=None, help="wikitext-2-raw test file (default: the shipped wikitext-2-raw-v1 test split)")
    ap.add_argument("--eval-windows", type=int, default=None, help="evaluate the first N windows (default: tiny 32, else all)")
    ap.add_argument("--eval-first-window", type=int, default=0,
                    help="start evaluating at window K (default 0, the reported windows; a later disjoint range "
                         "is the dev split recipes are chosen on, benchmarks/quality_table.py)")
    ap.add_argument("--eval-ppl", action=argparse.BooleanOptionalAction, default=None,
                    help="float / RTN / PTQ perplexity (default: on for tiny, off otherwise)")
    ap.add_argument("--no-ptq", action="store_true", help="skip learning (PPL of float and RTN only)")
    ap.add_argument("--ppl-modes", default="float,rtn",
                    help="reference perplexities computed before PTQ (comma list of float, rtn; '' for none)")
    ap.add_argument("--device", default="auto", help="auto | npu | cuda | cpu (or cuda:1, npu:2)")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="compute dtype (default: tiny fp32, V4 bf16)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: tiny 1, else torch's)")
    ap.add_argument("--sharded-eval", action="store_true",
                    help="evaluate with each layer spread over every device (needed when one layer does not "
                         "fit one device, e.g. V4-Pro on 64 GB); otherwise each layer is built on --device")
    ap.add_argument("--sharded-ptq", action="store_true",
                    help="PTQ with each layer spread over every device (the --sharded-eval placement), each unit "
                         "solved on the device that holds it: for layers that do not fit one device (V4-Pro on 64 GB)")
    ap.add_argument("--capture-memory-gb", type=float, default=None,
                    help="host memory for one layer's captured unit inputs / outputs; the rest spills to "
                         "OUTPUT/.scratch (removed as units finish). Default: V4 8, tiny unlimited; 0 = spill all")
    ap.add_argument("--hessian-memory-gb", type=float, default=None,
                    help="device memory for one capture pass's Hessians (recipes that replay no calls: rtn, "
                         "gptq:sequential=false); a layer needing more is captured in several passes "
                         "(default: 35%% of the accelerator's memory, no limit on cpu)")
    ap.add_argument("--start-layer", type=int, default=None, help="first layer to quantize")
    ap.add_argument("--end-layer", type=int, default=None, help="layers [start, end) are quantized (end exclusive)")
    ap.add_argument("--algo", default=None,
                    help="comma list of algorithms run in order on every unit, e.g. gptq or clip,gptq or "
                         "gptq:act_order=true (default: the scheme's default recipe, algorithms/recipe.py)")
    ap.add_argument("--recipe", default=None, help="recipe file (JSON; YAML with PyYAML), instead of --algo")
    ap.add_argument("--propagate", choices=("float", "quant"), default=None,
                    help="calibrate later layers on float predecessors or on the quantized ones "
                         "(default: the scheme's default recipe's choice)")
    ap.add_argument("--holdout", type=float, default=0.25,
                    help="share of each unit's calibration calls held out by validating algorithms (clip)")
    ap.add_argument("--no-guard", action="store_true",
                    help="keep an algorithm's result even where a unit ends worse than RTN on its calls")
    ap.add_argument("--legacy-solver", action="store_true",
                    help="the pre-recipe solver: learned clipping only, --epochs / --lr (no held-out check)")
    ap.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, help="--legacy-solver epochs")
    ap.add_argument("--lr", type=float, default=DEFAULT_LR,
                    help=f"--legacy-solver learning rate (default {DEFAULT_LR})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=None, help="calibration windows per forward")
    ap.add_argument("--eval-batch-size", type=int, default=None)
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--export", choices=("compressed-tensors", "ascend"), default=None,
                    help="after the run, export the quantized model (tools/export.py --from OUTPUT) "
                         "into OUTPUT/export-FORMAT")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--boundary", choices=("recompute", "send"), default="recompute",
                    help="under torchrun: how a rank gets the float inputs of its first layer (recompute the "
                         "layers before it, or receive them from the previous rank); same results")
    return ap


def _default(args, name: str):
    value = getattr(args, name)
    if value is not None:
        return value
    return DEFAULTS[args.model if args.model in DEFAULTS else "v4"].get(name)


def run(args, phases=None) -> int:
    """The whole job. ``phases``: an ``amct_ext.pipeline.phases.PhaseTimer`` given to the PTQ loop
    (benchmarks/bench_ptq.py reads its per-phase times and memory)."""
    import torch

    from amct_ext.runtime import device as devmod
    from amct_ext.pipeline import distributed
    from amct_ext.base import EvalConfig, PtqConfig, RunConfig
    from amct_ext.pipeline.calibration import DEFAULT_CALIBRATION_PATH, refuse_test_split
    from amct_ext.errors import DataError
    from amct_ext.io.io_utils import atomic_write_json
    from amct_ext.quant.schemes import load_scheme, parse_targets
    from amct_ext.pipeline.workflow import (PARAMS_DIR, PtqRuntime, check_seq_len, layer_range, load_calib_windows,
                                   load_eval_windows, prepare_params_dir, recipe_meta, summary_table)
    from models.deepseek_v4.adapter import DeepseekV4Adapter

    t_start = time.perf_counter()
    dist = distributed.env_from()
    threads = _default(args, "threads")
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads {threads}: must be >= 1 (omit it for torch's default)")
    if threads:
        torch.set_num_threads(threads)

    # ---- validate everything before writing anything
    scheme = load_scheme(args.scheme)
    from amct_ext.algorithms.recipe import default_recipe, resolve_recipe

    if args.legacy_solver and (args.algo or args.recipe):
        raise ConfigError("--legacy-solver runs the learned-clip solver alone: drop --algo / --recipe")
    recipe, default_propagate = None, "float"
    if not args.legacy_solver:
        d_algo, default_propagate = default_recipe(scheme.name)
        recipe = resolve_recipe(args.algo, args.recipe, default=d_algo)
    propagate = args.propagate or default_propagate
    if dist is not None:   # quantized predecessors make the layers sequential: refused under torchrun
        distributed.check_propagate(propagate)
    targets = scheme.check_targets(parse_targets(args.quant_target))
    if args.calib_data and args.calib_dataset:
        raise ConfigError("pass either --calib-data FILE or --calib-dataset NAME, not both")
    eval_path = Path(args.eval_data) if args.eval_data else DEFAULT_EVAL_PATH
    if args.calib_dataset:
        from amct_ext.data import dataset_calibration_file

        calib_path = dataset_calibration_file(args.calib_dataset, cache_root())
    else:
        calib_path = Path(args.calib_data) if args.calib_data else DEFAULT_CALIBRATION_PATH
    if not calib_path.is_file():
        raise DataError(f"calibration text not found: {calib_path} (pass --calib-data FILE)")
    # by content, before anything is trained or computed on it (also guards tokenizer training)
    refuse_test_split(calib_path, "calibration", [eval_path])
    model_path = resolve_model_path(args, calib_path)
    check_weights_present(model_path, args.model)
    dtype_name = _default(args, "dtype")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    if dist is not None:   # each rank on the device of its LOCAL_RANK, in the job's process group
        dist = distributed.init(dist, args.device)
        distributed.install_stop_handler(dist)
        distributed.start_watchdog(dist)
    main_rank = dist is None or dist.is_main
    run_cfg = RunConfig(model_path=model_path, device=str(dist.device) if dist else args.device, dtype=dtype,
                        progress=not args.quiet and main_rank)
    seq_len = _default(args, "seq_len")
    eval_ppl = _default(args, "eval_ppl")
    ptq_cfg = PtqConfig(epochs=args.epochs, lr=args.lr, n_samples=_default(args, "calib_samples"), seq_len=seq_len,
                        batch_size=_default(args, "batch_size"), seed=args.seed,
                        calib_path=calib_path, eval_paths=(str(eval_path),))
    ptq_cfg.check()
    eval_cfg = EvalConfig(seq_len=seq_len, max_windows=_default(args, "eval_windows"), first_window=args.eval_first_window,
                          batch_size=_default(args, "eval_batch_size"), data_path=eval_path,
                          sharded=args.sharded_eval)
    eval_cfg.check()
    capture_gb = _default(args, "capture_memory_gb")
    runtime = PtqRuntime(capture_memory_bytes=None if capture_gb is None else int(capture_gb * 2 ** 30),
                         sharded=args.sharded_ptq,
                         hessian_memory_bytes=None if args.hessian_memory_gb is None
                         else int(args.hessian_memory_gb * 2 ** 30))
    runtime.check()
    if eval_ppl and not eval_path.is_file():
        raise DataError(f"evaluation text not found: {eval_path} (pass --eval-data wiki.test.raw)")

    out = Path(args.output_dir)
    with DeepseekV4Adapter(run_cfg) as adapter:
        check_seq_len(adapter, seq_len, "--seq-len")
        layers = layer_range(adapter, args.start_layer, args.end_layer)
        exported = adapter.exported is not None
        if exported and not args.no_ptq:
            raise ConfigError(f"{model_path} is an exported quantized checkpoint ({adapter.exported.format}); "
                              "evaluate it with --no-ptq --eval-ppl (its float PPL applies the declared "
                              "activation quantization)")
        if args.export and args.no_ptq:
            raise ConfigError("--export needs learned parameters: drop --no-ptq (or use tools/export.py --scheme for RTN)")
        rmeta = recipe_meta(recipe, propagate, args.holdout, not args.no_guard)
        calib = load_calib_windows(adapter, ptq_cfg)
        if not args.no_ptq:
            prepare_params_dir(adapter, out, scheme, targets, ptq_cfg, create=False, calib_windows=calib,
                               recipe_settings=rmeta)
        windows = load_eval_windows(adapter, eval_cfg) if eval_ppl else None

        # ---- work
        ppl = {"float": None, "rtn": None, "quant": None}
        peaks = []
        evals = {}
        # static activation quantizers left in float because no calibration data reached them
        unobserved = {}
        if eval_ppl:
            modes = ("float",) if exported else [m for m in args.ppl_modes.split(",") if m]
            for mode in modes:
                if mode not in ("float", "rtn"):
                    raise ConfigError(f"--ppl-modes: {mode!r} is not float or rtn")
                r = distributed.evaluate(dist, adapter, windows, eval_cfg, mode, scheme=scheme, targets=targets,
                                         layers=layers, calib_windows=calib, calib_batch_size=ptq_cfg.batch_size)
                ppl[mode] = r.ppl
                evals[mode] = r.to_dict()
                if mode == "rtn":
                    unobserved["rtn"] = r.unobserved_static
                peaks.append(r.memory.peak_memory_bytes)
                if main_rank:
                    print(f"ppl[{mode}] = {r.ppl:.4f}  ({r.n_windows} windows x {r.seq_len}, {r.seconds:.1f} s)", flush=True)
        units = []
        ptq_memory = None
        ptq_wall = None
        if not args.no_ptq:
            t_ptq = time.perf_counter()
            res = distributed.run_ptq(dist, adapter, scheme, targets, ptq_cfg, out, layers=layers,
                                      calib_windows=calib, boundary=args.boundary,
                                      meta_kwargs={"recipe_settings": rmeta},
                                      recipe=recipe, propagate=propagate, holdout=args.holdout,
                                      guard=not args.no_guard, runtime=runtime, phases=phases)
            ptq_wall = time.perf_counter() - t_ptq
            units = res.units
            unobserved["ptq_calibration"] = res.unobserved_static
            ptq_memory = res.memory.to_dict()
            peaks.append(res.memory.peak_memory_bytes)
            if main_rank:
                print(summary_table(units), flush=True)
            if eval_ppl:
                r = distributed.evaluate(dist, adapter, windows, eval_cfg, "ptq", scheme=scheme, targets=targets,
                                         layers=layers, params_dir=out / PARAMS_DIR)
                ppl["quant"] = r.ppl
                evals["ptq"] = r.to_dict()
                unobserved["ptq"] = r.unobserved_static
                peaks.append(r.memory.peak_memory_bytes)
                if main_rank:
                    print(f"ppl[ptq] = {r.ppl:.4f}  ({r.seconds:.1f} s)", flush=True)

        report = {
            "model": args.model, "model_path": str(model_path), "scheme": scheme.name,
            "scheme_fingerprint": scheme.fingerprint(), "quant_target": list(targets),
            "layers": [layers.start, layers.stop], "device": str(adapter.device), "dtype": dtype_name,
            "threads": torch.get_num_threads(),
            "calibration": {"path": str(calib_path), "samples": ptq_cfg.n_samples, "seq_len": seq_len,
                            "epochs": ptq_cfg.epochs, "lr": ptq_cfg.lr, "seed": ptq_cfg.seed},
            "eval": None if not eval_ppl else {"path": str(eval_path), "windows": int(windows.shape[0]),
                                               "first_window": eval_cfg.first_window, "seq_len": seq_len},
            "recipe": None if recipe is None else {"algorithms": recipe.settings(), "propagate": propagate,
                                                   "holdout": args.holdout, "guard": not args.no_guard},
            "ptq_wall_s": ptq_wall,
            "ppl": ppl,
            "units": [{"name": u.name, "kind": u.kind, "layer": u.layer, "loss_before": u.loss_before,
                       "loss_after": u.loss_after, "seconds": u.seconds, "n_calls": u.n_calls,
                       "resumed": u.resumed, "stats": u.stats} for u in units],
            "evaluations": evals,
            "unobserved_static_quantizers": unobserved,
            "ptq_runtime": {"capture_memory_gb": capture_gb, "sharded": args.sharded_ptq,
                            "hessian_memory_gb": args.hessian_memory_gb,
                            "batch_size": ptq_cfg.batch_size, "memory": ptq_memory},
            "wall_s": time.perf_counter() - t_start,
            "peak_memory_bytes": max(peaks) if peaks else devmod.peak_memory_bytes(adapter.device),
            "peak_memory_note": ("process peak RSS (cpu)" if adapter.device.type == "cpu"
                                 else f"{adapter.device.type} allocator peak"),
        }
        if dist is not None:   # PTQ peaks are gathered over the ranks; evaluation peaks are rank 0's
            report["distributed"] = {"world_size": dist.world_size, "boundary": args.boundary,
                                     "ptq_ranges": ([[r.start, r.stop] for r in res.ranges] if not args.no_ptq
                                                    else None),
                                     "ptq_rank_seconds": None if args.no_ptq else res.rank_seconds}
    if not main_rank:
        return 0
    if args.export:
        from tools.export import build_parser as export_parser, export_from_args

        eout = out / f"export-{args.export}"
        # a finished export of an earlier run is replaced; a partial one is resumed (the export's
        # own fingerprint refuses one made from other parameters)
        complete = any((eout / n).is_file() for n in ("model.safetensors.index.json",
                                                       "quant_model_weights.safetensors.index.json"))
        eargs = export_parser().parse_args(["--model", args.model, "--from", str(out), "--format", args.export,
                                            "--out", str(eout), "--device", args.device, "--dtype", dtype_name]
                                           + (["--overwrite"] if complete else [])
                                           + (["--scheme", args.scheme] if args.scheme else []) + (["--quiet"] if args.quiet else []))
        # rank 0 alone (the other ranks have returned): export_from_args must not start a group
        report["export"] = {k: v for k, v in export_from_args(eargs, model_path, allow_distributed=False).items()
                            if k in ("out_dir", "format", "mtp", "seconds", "bytes_written")}
    atomic_write_json(report, out / "report.json")
    if any(unobserved.values()):
        print("static activation quantizers left in float (no calibration data reached them): "
              + ", ".join(f"{k} {v}" for k, v in unobserved.items()), flush=True)
    print(f"wrote {out / 'report.json'}  (wall {report['wall_s']:.1f} s, peak memory "
          f"{report['peak_memory_bytes'] / 2**20:.0f} MiB)", flush=True)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    # transformers' config base class warns about rope_scaling on every load: not the user's concern
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\..*")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from amct_ext.pipeline import distributed

    ok = False
    try:
        try:
            code = run(args)
            ok = code == 0
            return code
        finally:
            distributed.shutdown(ok)
    except AmctError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a rank lost its peers: one line instead of a traceback per rank
        if distributed.env_from() is None or not distributed.is_comm_failure(e):
            raise
        rank = os.environ.get("RANK", "?")
        distributed.mark_stop_reported()   # before the line: torchrun's SIGTERM may follow at once
        print(f"error: rank {rank}: another rank stopped or is unreachable ({type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}); rerun the same command to resume, finished units "
              "are kept", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume (finished units are kept)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
