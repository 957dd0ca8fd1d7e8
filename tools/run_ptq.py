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
  tiny-serve a random tiny V4 of the geometry vLLM's kernels accept (head_dim 512, rope 64,
             64 experts top-6, index_topk 512; hidden 128, 4 layers, ~14 MB), cached like tiny as
             $AMCT_CACHE/tiny-serve-<key>; models/deepseek_v4/tiny_serve.py lists the vLLM rules.
  tiny-trained
             the tiny V4 trained on the Wikitext-2 validation split that ships in assets/tiny-v4
             (4 layers, dim 128, 8 experts; perplexity means something here).
  tiny-trained-release
             that tiny trained further on the release's grids and stored like the release
             (assets/tiny-v4-release: FP8 e4m3 128x128 attention / shared expert, FP4 e2m1
             routed experts, ue8m0 scales; tools/train_release_tiny.py). What users start from.
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
  measured on the quality table) apply: it is chosen to run a V4-Flash layer within a minute on
  one H200. --recipe best takes the scheme's best-quality recipe instead, which may replay every
  captured call and take several minutes a layer (benchmarks/RESULTS.md §0).
  --legacy-solver is the old learned-clip-only solver.

Outputs (OUTPUT = --output-dir)
  OUTPUT/ptq_params/meta.json          the run's fingerprint: scheme, targets, solver settings,
                                       dtype, device type, calibration hash, model, checkpoint
  OUTPUT/ptq_params/layer_{i}_{unit}.pt learned parameters of each unit (+ .json: its losses)
  OUTPUT/ptq_params/layers.json        the run's layer range and which layers are complete (the
                                       export refuses incomplete layers unless --allow-partial)
  OUTPUT/report.json                   PPLs, the summary per layer and unit kind, per-unit losses,
                                       wall time, peak memory
  OUTPUT/layer_errors.png              loss vs RTN per layer and unit kind (with matplotlib)
The final summary prints one row per layer and unit kind (units, how many the guard kept at RTN,
loss vs RTN, the worst unit) and the float / RTN / PTQ perplexities with their deltas. Progress:
bars on a terminal, one plain line per finished layer in a log file.
An interrupted run resumes: rerun the same command (finished units are skipped). An output
folder holding parameters of another run (any fingerprint field differs) is refused with one
line naming the field and both values.

Several processes: `torchrun --nproc-per-node N [--nnodes M --rdzv-...] tools/run_ptq.py ...`
spreads the layers over the ranks (amct_ext/pipeline/distributed.py): each rank solves a cost-balanced
layer range into the same OUTPUT, perplexity runs as a pipeline over the ranks, rank 0 writes
the report. The parameters and PPLs are those of one process. If a rank dies the others stop
with one `error:` line (torchrun on its node; a heartbeat watchdog across nodes,
AMCT_DIST_HEARTBEAT_S=120; collectives time out after AMCT_DIST_TIMEOUT_S=7200); rerun to resume.

The job plan (amct_ext/pipeline/job.py) checks every input before any work, reading no tensor
data: flags, scheme, recipe (a JSON recipe file may also hold propagate, holdout, guard,
targets), config.json's required fields, every layer's keys in the index and every shard file,
the scheme against every targeted weight's shape, the export (format x scheme x targets, and
smoothing that leaves state no format writes), the output folder and the resume fingerprint.
Each refusal prints one line `error: ...` naming the flag or file and exits with code 2 within
seconds, before any perplexity.
"""
from __future__ import annotations

import argparse
import functools
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
from amct_ext.data import EVAL_DEFAULT  # noqa: E402
from amct_ext.errors import AmctError, ConfigError  # noqa: E402
# model resolution is shared with tools/export.py through a library module (no tool imports the other)
from models.deepseek_v4.cli import (MODELS, MODELSCOPE_IDS, TRAINED_TINY, PlainHelpFormatter,  # noqa: E402,F401
                                    add_model_arguments, cache_root, check_weights_present,
                                    download_checkpoint, resolve_model_path, tiny_checkpoint)

DEFAULT_EVAL_PATH = EVAL_DEFAULT

# per-model defaults for options left unset on the command line
DEFAULTS = {
    "tiny": dict(calib_samples=8, seq_len=128, eval_windows=32, eval_ppl=True, dtype="fp32", threads=1,
                 batch_size=1, eval_batch_size=8),
    "tiny-serve": dict(calib_samples=8, seq_len=128, eval_windows=32, eval_ppl=True, dtype="fp32", threads=1,
                       batch_size=1, eval_batch_size=8),
    "tiny-trained": dict(calib_samples=16, seq_len=256, eval_windows=64, eval_ppl=True, dtype="fp32", threads=1,
                         batch_size=1, eval_batch_size=8),
    "tiny-trained-release": dict(calib_samples=16, seq_len=256, eval_windows=64, eval_ppl=True, dtype="fp32",
                                 threads=1, batch_size=1, eval_batch_size=8),
    "v4": dict(calib_samples=128, seq_len=2048, eval_windows=None, eval_ppl=False, dtype="bf16", threads=None,
               batch_size=1, eval_batch_size=1, capture_memory_gb=8.0),
}


# ----------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    from amct_ext.algorithms.recipe import known_algorithms
    from amct_ext.quant.schemes import builtin_schemes

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=PlainHelpFormatter)
    md = ap.add_argument_group("model and data")
    add_model_arguments(md)
    md.add_argument("--calib-data", default=None,
                    help="calibration (and tiny tokenizer training) text; default: the shipped "
                         "WikiText-2 validation split")
    md.add_argument("--calib-dataset", default=None, metavar="PATH[:CONFIG[:SPLIT]]",
                    help="fetch the calibration text with `datasets` (optional extra, online), e.g. "
                         "wikitext:wikitext-2-raw-v1:validation")
    md.add_argument("--calib-samples", type=int, default=None, help="calibration windows (default: tiny 8, V4 128)")
    md.add_argument("--seq-len", type=int, default=None, help="tokens per calibration and evaluation window")
    md.add_argument("--eval-data", "--data-path", dest="eval_data", default=None,
                    help="wikitext-2-raw test file (default: the shipped wikitext-2-raw-v1 test split)")
    md.add_argument("--eval-windows", type=int, default=None, help="evaluate the first N windows (default: tiny 32, else all)")
    md.add_argument("--eval-first-window", type=int, default=0,
                    help="start evaluating at window K (default 0, the reported windows; a later disjoint range "
                         "is the dev split recipes are chosen on, benchmarks/quality_table.py)")
    md.add_argument("--eval-ppl", action=argparse.BooleanOptionalAction, default=None,
                    help="float / RTN / PTQ perplexity (default: on for tiny, off otherwise)")
    md.add_argument("--ppl-modes", default="float,rtn",
                    help="reference perplexities computed before PTQ (comma list of float, rtn; '' for none)")

    sr = ap.add_argument_group("scheme and recipe")
    sr.add_argument("--scheme", default="w8a8",
                    help="built-in scheme (" + ", ".join(builtin_schemes()) + ") or a .json/.yaml scheme file")
    sr.add_argument("--quant-target", default=None,
                    help="comma list of attn-linear, attn-cache, moe (default attn-linear,moe)")
    sr.add_argument("--algo", default=None,
                    help="comma list of algorithms run in order on every unit (" + ", ".join(known_algorithms())
                         + "), options after ':' e.g. gptq:act_order=true, awq:pairs=attn_norm+q_norm "
                         "(default: the default recipe of the scheme's content, algorithms/recipe.py)")
    sr.add_argument("--recipe", default=None,
                    help="'default' (the scheme's default recipe: within the real-size time target), "
                         "'best' (the scheme's best-quality recipe, may be much slower at real size), or a "
                         "recipe file (JSON; YAML with PyYAML; a file named like those: ./best) instead of "
                         "--algo; a JSON file may also hold propagate, holdout, guard and targets (the whole job spec)")
    sr.add_argument("--propagate", choices=("float", "quant"), default=None,
                    help="calibrate later layers on float predecessors or on the quantized ones "
                         "(default: the scheme's default recipe's choice)")
    sr.add_argument("--holdout", type=float, default=None,
                    help="share of each unit's calibration calls held out by validating algorithms (clip); default 0.25")
    sr.add_argument("--no-guard", action="store_true",
                    help="keep an algorithm's result even where a unit ends worse than RTN on its calls")
    sr.add_argument("--legacy-solver", action="store_true",
                    help="the pre-recipe solver: learned clipping only, --epochs / --lr (no held-out check)")
    sr.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, help="--legacy-solver epochs")
    sr.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"--legacy-solver learning rate (default {DEFAULT_LR})")
    sr.add_argument("--seed", type=int, default=0)
    sr.add_argument("--start-layer", type=int, default=None, help="first layer to quantize")
    sr.add_argument("--end-layer", type=int, default=None, help="layers [start, end) are quantized (end exclusive)")
    sr.add_argument("--no-ptq", action="store_true", help="skip learning (PPL of float and RTN only)")

    rt = ap.add_argument_group("runtime and memory")
    rt.add_argument("--device", default="auto", help="auto | npu | cuda | cpu (or cuda:1, npu:2)")
    rt.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="compute dtype (default: tiny fp32, V4 bf16)")
    rt.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: tiny 1, else torch's)")
    rt.add_argument("--batch-size", type=int, default=None, help="calibration windows per forward")
    rt.add_argument("--eval-batch-size", type=int, default=None)
    rt.add_argument("--sharded-eval", action="store_true",
                    help="evaluate with each layer spread over every device (needed when one layer does not "
                         "fit one device, e.g. V4-Pro on 64 GB); otherwise each layer is built on --device")
    rt.add_argument("--sharded-ptq", action="store_true",
                    help="PTQ with each layer spread over every device (the --sharded-eval placement), each unit "
                         "solved on the device that holds it: for layers that do not fit one device (V4-Pro on 64 GB)")
    rt.add_argument("--capture-memory-gb", type=float, default=None,
                    help="host memory for one layer's captured unit inputs / outputs; the rest spills to "
                         "OUTPUT/.scratch (removed as units finish). Default: V4 8, tiny unlimited; 0 = spill all")
    rt.add_argument("--hessian-memory-gb", type=float, default=None,
                    help="device memory for one capture pass's Hessians (recipes that replay no calls: rtn, "
                         "hclip, gptq); a layer needing more is captured in several passes "
                         "(default: 35%% of the accelerator's memory, no limit on cpu)")
    rt.add_argument("--boundary", choices=("recompute", "send"), default="recompute",
                    help="under torchrun: how a rank gets the float inputs of its first layer (recompute the "
                         "layers before it, or receive them from the previous rank); same results")

    oe = ap.add_argument_group("output and export")
    oe.add_argument("--output-dir", required=True)
    oe.add_argument("--export", choices=("compressed-tensors", "ascend"), default=None,
                    help="after the run, export the quantized model into OUTPUT/export-FORMAT (checked "
                         "against the scheme, targets and recipe before any work)")
    oe.add_argument("--dequantize-rest", action="store_true",
                    help="with --export: store the tensors left as released (FP8 / FP4) in bf16 (vLLM's "
                         "compressed-tensors loader needs it for an FP8 release)")
    oe.add_argument("--quiet", action="store_true", help="no progress display")
    return ap


def _default(args, name: str):
    value = getattr(args, name)
    if value is not None:
        return value
    return DEFAULTS[args.model if args.model in DEFAULTS else "v4"].get(name)


def job_request(args, model_path: Path, calib_path: Path, eval_path: Path):
    """The job as asked (``amct_ext.pipeline.job.JobRequest``), the per-model defaults filled in."""
    from amct_ext.pipeline.job import JobRequest

    return JobRequest(
        model_path=model_path, output_dir=args.output_dir, scheme=args.scheme, quant_target=args.quant_target,
        algo=args.algo, recipe=args.recipe, propagate=args.propagate, holdout=args.holdout,
        no_guard=args.no_guard, legacy_solver=args.legacy_solver, calib_path=calib_path,
        calib_samples=_default(args, "calib_samples"), seq_len=_default(args, "seq_len"),
        batch_size=_default(args, "batch_size"), seed=args.seed, epochs=args.epochs, lr=args.lr,
        eval_path=eval_path, eval_ppl=bool(_default(args, "eval_ppl")), eval_windows=_default(args, "eval_windows"),
        eval_batch_size=_default(args, "eval_batch_size"), ppl_modes=args.ppl_modes, no_ptq=args.no_ptq,
        device=args.device, dtype=_default(args, "dtype"), threads=_default(args, "threads"),
        capture_memory_gb=_default(args, "capture_memory_gb"), hessian_memory_gb=args.hessian_memory_gb,
        sharded_ptq=args.sharded_ptq, sharded_eval=args.sharded_eval, start_layer=args.start_layer,
        end_layer=args.end_layer, export=args.export, dequantize_rest=args.dequantize_rest, allow_partial=False)


def _resume_check(out_dir: Path, scheme, targets, r, dtype: str) -> bool:
    """The fingerprint fields known before the model is opened (scheme, targets, recipe, dtype)
    against OUTPUT/ptq_params/meta.json; the full check (calibration windows, checkpoint) follows
    once the tokenizer ran, still before any perplexity."""
    import json

    from amct_ext.pipeline.workflow import META_NAME, PARAMS_DIR, ParamsMismatchError

    meta_path = Path(out_dir) / PARAMS_DIR / META_NAME
    if not meta_path.is_file():
        return False
    try:
        old = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ParamsMismatchError(f"{meta_path}: unreadable ({e}); pass a fresh --output-dir") from None
    now = {"scheme": scheme.fingerprint(), "targets": list(targets), "dtype": dtype}
    was = {"scheme": old.get("scheme_fingerprint"), "targets": old.get("targets"), "dtype": old.get("dtype")}
    # the recipe part of meta.json's "solver" entry (PtqSpec.solver_meta); --legacy-solver's
    # learned_clip settings are compared by the full check (prepare_params_dir) that follows
    rm = {} if r.recipe is None else {"recipe": r.recipe.settings(), "propagate": r.propagate,
                                      "holdout": r.holdout, "guard": r.guard}
    for key, value in rm.items():
        now[f"solver.{key}"], was[f"solver.{key}"] = value, (old.get("solver") or {}).get(key)
    now, was = json.loads(json.dumps(now)), json.loads(json.dumps(was))   # as meta.json stores them
    for key in now:
        if now[key] != was[key]:
            shown = (old.get("scheme"), scheme.name) if key == "scheme" else (was[key], now[key])
            raise ParamsMismatchError(f"{Path(out_dir) / PARAMS_DIR} holds PTQ parameters of another run: {key}: "
                                      f"{shown[0]!r} in the folder, {shown[1]!r} now; pass a fresh --output-dir "
                                      "or delete that folder")
    return True


def run(args, phases=None) -> int:
    """The whole job. ``phases``: an ``amct_ext.pipeline.phases.PhaseTimer`` given to the PTQ loop
    (benchmarks/bench_ptq.py reads its per-phase times and memory)."""
    import torch

    from amct_ext.runtime import device as devmod
    from amct_ext.pipeline import distributed
    from amct_ext.base import EvalConfig, PtqConfig, RunConfig
    from amct_ext.pipeline.calibration import DEFAULT_CALIBRATION_PATH, refuse_test_split
    from amct_ext.errors import DataError
    from amct_ext.export.job import write_layers_record
    from amct_ext.io.io_utils import atomic_write_json
    from amct_ext.pipeline.job import build_job, check_request
    from amct_ext.pipeline.progress import PtqProgress, done_units, interactive
    from amct_ext.pipeline.summary import format_ppl, format_summary, summarize_units, write_error_plot
    from amct_ext.algorithms.recipe import parse_algo
    from amct_ext.pipeline.mtp_eval import evaluate_mtp
    from amct_ext.pipeline.ptq_spec import PtqSpec
    from amct_ext.pipeline.workflow import (PARAMS_DIR, PtqRuntime, check_seq_len, evaluate_blockwise, layer_range,
                                            load_calib_windows, load_eval_windows, prepare_params_dir,
                                            run_blockwise_ptq)
    from models.deepseek_v4.adapter import DeepseekV4Adapter
    from models.deepseek_v4.plan import DeepseekV4PlanSpec

    t_start = time.perf_counter()
    dist = distributed.env_from()

    # ---- the plan: every input checked before anything is computed or written
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
    threads = _default(args, "threads")
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads {threads}: must be >= 1 (omit it for torch's default)")
    # flags, scheme, recipe, targets, output folder first: they need neither the model nor the text
    check_request(job_request(args, Path(args.model_path or "."), calib_path, eval_path))
    # by content, before anything is trained or computed on it (also guards tokenizer training)
    refuse_test_split(calib_path, "calibration", [eval_path])
    model_path = resolve_model_path(args, calib_path)
    check_weights_present(model_path, args.model)
    plan_spec = DeepseekV4PlanSpec()
    job = build_job(job_request(args, model_path, calib_path, eval_path), plan_spec, check_resume=_resume_check)
    if threads:
        torch.set_num_threads(threads)
    scheme, targets = job.scheme.scheme, job.scheme.targets
    recipe, propagate, holdout, guard = job.recipe.recipe, job.recipe.propagate, job.recipe.holdout, job.recipe.guard
    if recipe is None:   # --legacy-solver: the pre-recipe solver, an algorithm of the recipe now
        recipe = parse_algo(f"learned_clip:epochs={args.epochs}:lr={args.lr!r}", "--legacy-solver")
    if dist is not None:   # quantized predecessors make the layers sequential: refused under torchrun
        distributed.check_propagate(propagate)
    dtype_name = job.runtime.dtype
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    if dist is not None:   # each rank on the device of its LOCAL_RANK, in the job's process group
        dist = distributed.init(dist, args.device)
        distributed.install_stop_handler(dist)
        distributed.start_watchdog(dist)
    main_rank = dist is None or dist.is_main
    tty = interactive()
    if main_rank and not args.quiet:
        print(job.describe(), flush=True)
    # bars on a terminal; in a log file (not a TTY) plain lines instead (PtqProgress), no escape codes
    run_cfg = RunConfig(model_path=model_path, device=str(dist.device) if dist else args.device, dtype=dtype,
                        progress=not args.quiet and main_rank and tty)
    seq_len = job.calibration.seq_len
    eval_ppl = job.evaluation.enabled
    ptq_cfg = PtqConfig(epochs=args.epochs, lr=args.lr, n_samples=job.calibration.samples, seq_len=seq_len,
                        batch_size=job.calibration.batch_size, seed=args.seed,
                        calib_path=calib_path, eval_paths=(str(eval_path),))
    ptq_cfg.check()
    spec = PtqSpec(scheme, targets, ptq_cfg, recipe=recipe, propagate=propagate, holdout=holdout,
                   guard=guard).resolved()
    eval_cfg = EvalConfig(seq_len=seq_len, max_windows=job.evaluation.windows, first_window=args.eval_first_window,
                          batch_size=job.evaluation.batch_size, data_path=eval_path,
                          sharded=args.sharded_eval)
    eval_cfg.check()
    capture_gb = job.runtime.capture_memory_gb
    runtime = PtqRuntime(capture_memory_bytes=None if capture_gb is None else int(capture_gb * 2 ** 30),
                         sharded=args.sharded_ptq,
                         hessian_memory_bytes=None if args.hessian_memory_gb is None
                         else int(args.hessian_memory_gb * 2 ** 30))
    runtime.check()

    out = job.output.dir
    with DeepseekV4Adapter(run_cfg) as adapter:
        check_seq_len(adapter, seq_len, "--seq-len")
        layers = layer_range(adapter, args.start_layer, args.end_layer)
        exported = adapter.exported is not None
        if exported and not args.no_ptq:
            raise ConfigError(f"{model_path} is an exported quantized checkpoint ({adapter.exported.format}); "
                              "evaluate it with --no-ptq --eval-ppl (its float PPL applies the declared "
                              "activation quantization)")
        calib = load_calib_windows(adapter, ptq_cfg)
        if not args.no_ptq:
            prepare_params_dir(adapter, out, spec, create=False, calib_windows=calib)
        # one process: the workflow itself; torchrun: its scale-out over the ranks
        evaluate = evaluate_blockwise if dist is None else functools.partial(distributed.evaluate, dist)
        windows = load_eval_windows(adapter, eval_cfg) if eval_ppl else None

        # ---- work
        ppl = {"float": None, "rtn": None, "quant": None}
        peaks = []
        evals = {}
        # static activation quantizers left in float because no calibration data reached them
        unobserved = {}
        if eval_ppl:
            modes = ("float",) if exported else job.evaluation.modes
            for mode in modes:
                r = evaluate(adapter, windows, eval_cfg, mode, scheme=scheme, targets=targets,
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
        groups = []
        mtp_report = None
        if not args.no_ptq:
            stems = plan_spec.unit_stems(adapter.config, scheme, targets, list(layers))
            pdir = out / PARAMS_DIR
            if main_rank:   # the run's range first: an interrupted run is then known to be incomplete
                pdir.mkdir(parents=True, exist_ok=True)
                write_layers_record(pdir, layers, stems)
            progress = PtqProgress(job.scheme.units_per_layer, enabled=main_rank and not args.quiet and not tty,
                                   done_before=done_units(pdir, stems),
                                   on_layer_done=lambda i: write_layers_record(pdir, layers, stems))
            t_ptq = time.perf_counter()
            runtime.phases = phases
            if dist is None:
                runtime.on_unit_done = progress.unit_done
                res = run_blockwise_ptq(adapter, spec, out, layers=layers, calib_windows=calib, runtime=runtime)
            else:
                res = distributed.run_ptq(dist, adapter, spec, out, layers=layers, calib_windows=calib,
                                          boundary=args.boundary, runtime=runtime)
            ptq_wall = time.perf_counter() - t_ptq
            units = res.units
            unobserved["ptq_calibration"] = res.unobserved_static
            ptq_memory = res.memory.to_dict()
            peaks.append(res.memory.peak_memory_bytes)
            if main_rank:
                write_layers_record(pdir, layers, stems)
            if eval_ppl:
                r = evaluate(adapter, windows, eval_cfg, "ptq", scheme=scheme, targets=targets,
                             layers=layers, params_dir=out / PARAMS_DIR)
                ppl["quant"] = r.ppl
                evals["ptq"] = r.to_dict()
                unobserved["ptq"] = r.unobserved_static
                peaks.append(r.memory.peak_memory_bytes)
                if main_rank:
                    print(f"ppl[ptq] = {r.ppl:.4f}  ({r.seconds:.1f} s)", flush=True)
                    # issue 23.6: the MTP layer's quantization cost (amct_ext/pipeline/mtp_eval.py)
                    mtp_report = evaluate_mtp(adapter, windows, eval_cfg, scheme, targets, out / PARAMS_DIR)
                    if mtp_report is not None:
                        print(f"mtp: {mtp_report}", flush=True)
            groups = summarize_units(units)
            if main_rank:
                print(format_summary(groups, ppl if eval_ppl else None), flush=True)
        elif main_rank and eval_ppl:
            print(format_ppl(ppl), flush=True)

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
                                                   "holdout": holdout, "guard": guard,
                                                   "source": job.recipe.source},
            "plan_seconds": job.seconds,
            "ptq_wall_s": ptq_wall,
            "ppl": ppl,
            "summary": [g.to_dict() for g in groups],
            # units whose stored codes the run kept bit for bit (already on the target grid)
            "units_keeping_source_codes": sum(g.kept_source for g in groups),
            "units": [{"name": u.name, "kind": u.kind, "layer": u.layer, "loss_before": u.loss_before,
                       "loss_after": u.loss_after, "seconds": u.seconds, "n_calls": u.n_calls,
                       "resumed": u.resumed, "stats": u.stats} for u in units],
            "evaluations": evals,
            "mtp": mtp_report,
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
    if job.export is not None:
        from amct_ext.export.job import ExportRequest, export_run

        eout = job.export.out_dir
        # a finished export of an earlier run is replaced; a partial one is resumed (the export's
        # own fingerprint refuses one made from other parameters)
        complete = any((eout / n).is_file() for n in ("model.safetensors.index.json",
                                                       "quant_model_weights.safetensors.index.json"))
        ereq = ExportRequest(model_path=model_path, format=job.export.format, out_dir=eout, from_dir=out,
                             scheme=args.scheme, device=args.device, dtype=dtype_name, overwrite=complete,
                             dequantize_rest=job.export.dequantize_rest,
                             progress=not args.quiet)
        # rank 0 alone (the other ranks have returned): the export must not start a group
        report["export"] = {k: v for k, v in export_run(ereq, allow_distributed=False).items()
                            if k in ("out_dir", "format", "mtp", "seconds", "bytes_written")}
    atomic_write_json(report, out / "report.json")
    plot = write_error_plot(groups, out / "layer_errors.png") if groups else None
    if ptq_memory is not None and ptq_memory.get("call_memory_peak_bytes"):
        # the capture's own accounting (capture.CALL_METER): what the budget bounds
        print(f"captured calls in host memory at once: {ptq_memory['call_memory_peak_bytes'] / 2**30:.2f} GiB "
              f"(the capture store {ptq_memory['capture_memory_peak_bytes'] / 2**30:.2f} GiB, budget "
              + (f"{capture_gb:g} GiB" if capture_gb is not None else "none")
              + f"; spilled {ptq_memory['capture_spilled_bytes'] / 2**30:.2f} GiB)", flush=True)
    if any(unobserved.values()):
        print("static activation quantizers left in float (no calibration data reached them): "
              + ", ".join(f"{k} {v}" for k, v in unobserved.items()), flush=True)
    print(f"wrote {out / 'report.json'}" + (f" and {plot.name}" if plot else "")
          + f"  (wall {report['wall_s']:.1f} s, peak memory {report['peak_memory_bytes'] / 2**20:.0f} MiB)",
          flush=True)
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
