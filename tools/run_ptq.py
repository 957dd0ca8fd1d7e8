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
from amct_ext.errors import AmctError, ConfigError, user_error_line  # noqa: E402
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
    sr.add_argument("--allow-fewer-layers", action="store_true",
                    help="accept a config.json whose num_hidden_layers is smaller than the checkpoint's layer "
                         "count (quantize and evaluate that shorter model on purpose); refused otherwise")

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
    from amct_ext.export.export_format import FORMATS

    oe.add_argument("--export", choices=FORMATS, default=None,
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
        end_layer=args.end_layer, export=args.export, dequantize_rest=args.dequantize_rest, allow_partial=False,
        model=args.model, eval_first_window=args.eval_first_window, boundary=args.boundary, quiet=args.quiet,
        allow_fewer_layers=args.allow_fewer_layers)


def _resume_check(out_dir: Path, scheme, targets, r, dtype: str) -> bool:
    """The fingerprint fields known before the model is opened (scheme, targets, recipe, dtype)
    against OUTPUT/ptq_params/meta.json; the full check (calibration windows, checkpoint) follows
    once the tokenizer ran, still before any perplexity."""
    from amct_ext.pipeline.run_folder import RunFolder

    now = {"scheme_fingerprint": scheme.fingerprint(), "targets": list(targets), "dtype": dtype}
    # the recipe part of meta.json's "solver" entry (PtqSpec.solver_meta); --legacy-solver's
    # learned_clip settings are compared by the full check (prepare_params_dir) that follows
    if r.recipe is not None:
        now.update({"solver.recipe": r.recipe.settings(), "solver.propagate": r.propagate,
                    "solver.holdout": r.holdout, "solver.guard": r.guard})
    return RunFolder(out_dir).check_settled(now, scheme_name=scheme.name)


def plan_job(args):
    """The checked job plan (``amct_ext.pipeline.job.PtqJob``) from the parsed flags: every input
    checked before anything is computed or written (the cheap checks first, the request checked
    once), the model resolved (the tiny checkpoints generated on first use)."""
    from amct_ext.pipeline.calibration import DEFAULT_CALIBRATION_PATH, refuse_test_split
    from amct_ext.errors import DataError
    from amct_ext.pipeline.job import build_job, check_request
    from models.deepseek_v4.plan import DeepseekV4PlanSpec

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
    checked = check_request(job_request(args, Path(args.model_path or "."), calib_path, eval_path))
    # by content, before anything is trained or computed on it (also guards tokenizer training)
    refuse_test_split(calib_path, "calibration", [eval_path])
    model_path = resolve_model_path(args, calib_path)
    check_weights_present(model_path, args.model)
    return build_job(job_request(args, model_path, calib_path, eval_path), DeepseekV4PlanSpec(),
                     check_resume=_resume_check, checked=checked)


def run(args, phases=None) -> int:
    """The whole job: the plan from the flags, then the library's ``run_job``. ``phases``: an
    ``amct_ext.pipeline.phases.PhaseTimer`` given to the PTQ loop."""
    from amct_ext.pipeline.job_runner import run_job

    t_start = time.perf_counter()
    run_job(plan_job(args), phases=phases, t_start=t_start)
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
            line = user_error_line(e)   # the OS refusing a file (read-only, full disk): one line
            if line is None:
                raise
            print(f"error: {line}", file=sys.stderr)
            return 2
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
