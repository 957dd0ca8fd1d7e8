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

from amct_ext.errors import AmctError  # noqa: E402
from tools.run_ptq import MODELS, check_weights_present, resolve_model_path  # noqa: E402
import models.deepseek_v4  # noqa: E402,F401  (registers V4's binding: amct_ext.base.model_binding)

FORMATS = ("compressed-tensors", "ascend")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=MODELS, default="tiny")
    ap.add_argument("--model-path", default=None, help="checkpoint folder (config.json, shards, tokenizer)")
    ap.add_argument("--download", action="store_true", help="fetch v4-flash / v4-pro with modelscope")
    ap.add_argument("--from", dest="from_dir", default=None, help="run_ptq.py output folder (learned parameters)")
    ap.add_argument("--scheme", default=None, help="scheme for RTN (default w8a8); with --from: the run's scheme file")
    ap.add_argument("--quant-target", default=None, help="comma list of attn-linear, attn-cache, moe (default attn-linear,moe)")
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--out", required=True, help="output folder (must be empty unless --overwrite)")
    ap.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty --out")
    ap.add_argument("--dequantize-rest", action="store_true", help="store not-quantized FP8 / FP4 tensors in bf16")
    ap.add_argument("--device", default="auto", help="auto | npu | cuda | cpu: where each layer is built and quantized")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                    help="compute dtype of the layer (default: with --from the run's dtype -- replaced "
                         "weights (GPTQ, smoothing) were learned in it -- else bf16)")
    ap.add_argument("--quiet", action="store_true")
    return ap


def _run_dtype(params_dir: Path) -> str | None:
    """The compute dtype recorded in a run's ptq_params/meta.json (None if absent)."""
    try:
        meta = json.loads((Path(params_dir) / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = meta.get("dtype") if isinstance(meta, dict) else None
    return value if value in ("bf16", "fp32") else None


def export_from_args(args, model_path: Path | None = None, allow_distributed: bool = True) -> dict:
    """``allow_distributed``: under torchrun, spread the layers over the ranks (False: this
    process alone, e.g. rank 0 of a finished ``run_ptq --export``)."""
    import torch

    from amct_ext.export.exporter import ExportConfig, export_checkpoint, resolve_run
    from amct_ext.quant.schemes import load_scheme, parse_targets

    model_path = model_path or resolve_model_path(args)
    check_weights_present(model_path)
    dtype_name = args.dtype or "bf16"
    if args.from_dir:
        scheme, targets, pdir = resolve_run(args.from_dir, model_path, args.scheme, args.quant_target)
        if args.dtype is None:
            dtype_name = _run_dtype(pdir) or dtype_name
    else:
        scheme = load_scheme(args.scheme or "w8a8")
        targets, pdir = parse_targets(args.quant_target or "attn-linear,moe"), None
    cfg = ExportConfig(model_path=model_path, out_dir=Path(args.out), format=args.format, scheme=scheme,
                       targets=targets, params_dir=pdir, dequantize_rest=args.dequantize_rest,
                       overwrite=args.overwrite, device=args.device,
                       dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name],
                       progress=not args.quiet)
    from amct_ext.pipeline import distributed

    dist = distributed.env_from() if allow_distributed else None
    if dist is None:
        report = export_checkpoint(cfg)
    else:   # torchrun: one cost-balanced range of decoder layers per rank, rank 0 finishes
        from amct_ext.export.exporter import export_checkpoint_distributed

        dist = distributed.init(dist, args.device)
        distributed.install_stop_handler(dist)
        cfg.device = str(dist.device)
        ok = False
        try:
            report = export_checkpoint_distributed(cfg, dist)
            ok = True
        finally:
            distributed.shutdown(ok)
        if not dist.is_main:
            return dict(report.__dict__)
    d = dict(report.__dict__)
    print(json.dumps({k: d[k] for k in ("out_dir", "format", "quantized_layers", "mtp", "bytes_read",
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
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume (written layers are kept)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
