#!/usr/bin/env python
"""Export a quantized DeepSeek-V4 checkpoint that servers can load.

  python tools/export.py --model tiny-trained --from OUTPUT --format compressed-tensors --out E
  python tools/export.py --model v4-flash --model-path DIR --scheme w8a8 --format ascend --out E

Formats
  compressed-tensors  vLLM: config.json quantization_config (config_groups / ignore /
                      kv_cache_scheme), model-*.safetensors + model.safetensors.index.json
  ascend              vllm-ascend (--quantization ascend), ModelSlim v1:
                      quant_model_description.json, quant_model_weights-*.safetensors + index

Source of the quantization
  --from OUTPUT       a run_ptq.py output folder: its ptq_params/meta.json gives the scheme,
                      targets and learned parameters (loaded as evaluation's 'ptq' mode does)
  --scheme/--quant-target  plain RTN of that scheme (no --from)

The release is streamed one decoder layer at a time (built and quantized on --device); each
layer becomes one shard; the index is written last, so an interrupted export has no index and
the same command resumes it. Tensors that are not quantized are copied as released (FP8 / FP4
with their scales) unless --dequantize-rest (the ascend format always stores them in bf16).
The MTP layer is kept: quantized with the scheme when the release holds all of its block
tensors, else copied. Tokenizer and generation files are copied.

Serving (the engine profile the export follows; --format compressed-tensors is vLLM's)
  --vllm-build gpu|cpu  vLLM's CUDA build (default) or its CPU build: W4A8 int (int4 weights x int8
                      inputs) runs only on the CPU build and is refused for the GPU one
  --mx-weight-only    vLLM's CUDA kernels below SM100 serve MX weights weight-only: without this flag an
                      MX scheme with activation quantization is refused; with it the export describes
                      the MX groups weight-only and its metadata (amct_export.serving) says so
  --allow-humming     2- / 3-bit experts load only with vLLM's optional Humming kernels: refused unless
                      the serving environment has them and this flag says so
  --tensor-parallel N refuse a layout the engine cannot shard N ways (a group or block split across
                      ranks); the metadata lists the sizes of 1, 2, 4, 8, 16 it can be served at

A run whose layers are incomplete (interrupted, or parameter files deleted) is refused before
anything is written, unless --allow-partial (those layers are exported float, and it says so).

Errors in the input print one line `error: ...` and exit with code 2.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from amct_ext.errors import AmctError, user_error_line  # noqa: E402
from models.deepseek_v4.cli import (MODELS, PlainHelpFormatter, add_model_arguments,  # noqa: E402,F401
                                    check_weights_present, resolve_checkpoint)

from amct_ext.export.export_format import FORMATS  # noqa: E402  (each format's rules: export_format.py)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=PlainHelpFormatter)
    add_model_arguments(ap.add_argument_group("model"))
    src = ap.add_argument_group("source of the quantization")
    src.add_argument("--from", dest="from_dir", default=None, help="run_ptq.py output folder (learned parameters)")
    src.add_argument("--scheme", default=None, help="scheme for RTN (default w8a8); with --from: the run's scheme file")
    src.add_argument("--quant-target", default=None,
                     help="comma list of attn-linear, attn-cache, moe (default attn-linear,moe)")
    src.add_argument("--allow-partial", action="store_true",
                     help="with --from: export a run whose layers are incomplete, those layers float (said)")
    out = ap.add_argument_group("output")
    out.add_argument("--format", required=True, choices=FORMATS)
    out.add_argument("--out", required=True, help="output folder (must be empty unless --overwrite)")
    out.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty --out")
    out.add_argument("--dequantize-rest", action="store_true", help="store not-quantized FP8 / FP4 tensors in bf16")
    sv = ap.add_argument_group("serving")
    sv.add_argument("--vllm-build", choices=("gpu", "cpu"), default="gpu",
                    help="the vLLM build that serves a compressed-tensors export (default gpu: CUDA)")
    sv.add_argument("--mx-weight-only", action="store_true",
                    help="export MX schemes weight-only, as vLLM's CUDA build serves them (said in the metadata)")
    sv.add_argument("--allow-humming", action="store_true",
                    help="accept 2- / 3-bit experts, which vLLM runs only with its optional Humming kernels")
    sv.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                    help="check that the engine can serve the export at tensor-parallel size N")
    rt = ap.add_argument_group("runtime")
    rt.add_argument("--device", default="auto", help="auto | npu | cuda | cpu: where each layer is built and quantized")
    rt.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                    help="compute dtype of the layer (default: with --from the run's dtype -- replaced "
                         "weights (GPTQ, smoothing) were learned in it -- else bf16)")
    rt.add_argument("--quiet", action="store_true")
    return ap


def serve_options(args):
    from amct_ext.export.engine import ServeOptions

    return ServeOptions(build=args.vllm_build, mx_weight_only=args.mx_weight_only,
                        allow_humming=args.allow_humming, tensor_parallel=args.tensor_parallel)


def request_from_args(args, model_path: Path | None = None):
    from amct_ext.export.job import ExportRequest

    model_path = model_path or resolve_checkpoint(args.model, args.model_path, args.download)
    check_weights_present(model_path)
    return ExportRequest(model_path=model_path, format=args.format, out_dir=Path(args.out),
                         from_dir=Path(args.from_dir) if args.from_dir else None, scheme=args.scheme,
                         targets=args.quant_target, dequantize_rest=args.dequantize_rest,
                         overwrite=args.overwrite, device=args.device, dtype=args.dtype,
                         progress=not args.quiet, allow_partial=args.allow_partial, serve=serve_options(args))


def export_from_args(args, model_path: Path | None = None, allow_distributed: bool = True) -> dict:
    """``allow_distributed``: under torchrun, spread the layers over the ranks."""
    from amct_ext.export.job import export_run
    from amct_ext.pipeline import distributed

    d = export_run(request_from_args(args, model_path), allow_distributed=allow_distributed)
    env = distributed.env_from() if allow_distributed else None
    if env is None or env.rank == 0:
        print(json.dumps({k: d[k] for k in ("out_dir", "format", "quantized_layers", "extra_layers", "bytes_read",
                                             "bytes_written", "seconds", "peak_host_rss_bytes")}), flush=True)
    return d


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers\..*")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        export_from_args(args)
        return 0
    except AmctError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:   # the OS refusing a file (read-only folder, full disk, permission): one line
        line = user_error_line(e)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume (written layers are kept)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
