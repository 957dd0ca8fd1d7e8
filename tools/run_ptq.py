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
Every model's defaults: models/deepseek_v4/cli.py MODEL_DEFAULTS.

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

The flags become the library's options (amct_ext/pipeline/options.py: PtqOptions, one field
per flag); its plan_job (amct_ext/pipeline/job.py) checks every input before any work, reading
no tensor data: flags, scheme, recipe (a JSON recipe file may also hold propagate, holdout, guard,
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
import sys
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from amct_ext.base import DEFAULT_EPOCHS, DEFAULT_LR  # noqa: E402
from amct_ext.errors import AmctError, user_error_line  # noqa: E402
# the built-in model names and their flags are shared with tools/export.py through a library module
# (no tool imports the other); importing it registers the model (its ModelBinding) for plan_job
from models.deepseek_v4.cli import PlainHelpFormatter, add_model_arguments  # noqa: E402


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
    rt.add_argument("--device-memory-gb", type=float, default=None,
                    help="use at most this much of the accelerator (GiB): every memory budget (Hessian "
                         "passes, fake-quant chunks, blockround's turns) is planned against it and the "
                         "allocator refuses more; e.g. 60 to run on a larger card as a 64-GB Ascend 910B "
                         "would (default: the whole device)")
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


def options_from_args(args: argparse.Namespace):
    """The parsed flags as the library's options (``amct_ext.pipeline.options.PtqOptions``: one
    field per flag, by its name)."""
    from amct_ext.pipeline.options import PtqOptions

    return PtqOptions(**vars(args))


def run(args, phases=None) -> int:
    """The whole job: the flags as options, the library's plan (``plan_job``), then its ``run_job``.
    ``phases``: an ``amct_ext.pipeline.phases.PhaseTimer`` given to the PTQ loop."""
    from amct_ext.pipeline.job_runner import run_job
    from amct_ext.pipeline.options import plan_job

    t_start = time.perf_counter()
    run_job(plan_job(options_from_args(args)), phases=phases, t_start=t_start)
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
