#!/usr/bin/env python
"""Write a random DeepSeek-V4-shaped checkpoint in the released FP8 / FP4 layout.

    python tools/make_synthetic_checkpoint.py --like v4-flash --layers 4 --out DIR --device cuda
    python tools/make_synthetic_checkpoint.py --like tiny --layers 4 --out DIR          # CI-sized

--like v4-flash | v4-pro: the official config (models/deepseek_v4/configs/) with num_hidden_layers
and compress_ratios cut to --layers, so layer i has the kind it has in the full model (V4-Flash
layers 0-3: ratio 0 hash, ratio 0 hash, ratio 4 hash, ratio 128 score). --like tiny: the same layer
pattern at the tiny dims (hidden 64, 8 experts). Weights are drawn and FP8 / FP4-encoded on --device
(seconds per layer on a GPU, minutes on a CPU at real size) and written one shard per layer (host
memory ~ one stored layer), then the stem, mtp.0, config.json, the tokenizer and the index (last).

Errors (unknown --like, bad --layers or --override, an --out that already holds a checkpoint) print
`error: ...` and exit 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from amct_ext.errors import AmctError, ConfigError  # noqa: E402


def parse_overrides(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not key or not sep:
            raise ConfigError(f"--override {item!r}: expected KEY=VALUE (config.json names, JSON values)")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--like", required=True, choices=("v4-flash", "v4-pro", "tiny"))
    ap.add_argument("--layers", type=int, required=True, help="number of decoder layers (the first N of the model)")
    ap.add_argument("--out", required=True, help="output folder (must not hold a checkpoint yet)")
    ap.add_argument("--device", default="cpu", help="where weights are drawn and encoded: cpu | cuda | npu | auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="config.json field override, repeatable (e.g. n_routed_experts=16)")
    ap.add_argument("--no-mtp-block", action="store_true", help="mtp.0 holds only its projections, not a block")
    ap.add_argument("--tokenizer-from", default=None, help="copy tokenizer.json / tokenizer_config.json from DIR")
    ap.add_argument("--tokenizer-text", default=None, help="BPE training text (default: the calibration text)")
    ap.add_argument("--tokenizer-vocab", type=int, default=4096, help="BPE vocabulary size (<= the model's)")
    args = ap.parse_args(argv)
    try:
        from models.deepseek_v4.synthetic import write_synthetic_checkpoint

        t0 = time.perf_counter()
        summary = write_synthetic_checkpoint(
            args.out, args.like, args.layers, device=args.device, seed=args.seed,
            overrides=parse_overrides(args.override), mtp_block=not args.no_mtp_block,
            tokenizer_from=args.tokenizer_from, text_path=args.tokenizer_text,
            tokenizer_vocab=args.tokenizer_vocab, log=lambda s: print(s, flush=True))
    except AmctError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {summary['total_bytes'] / 2**30:.2f} GiB in {len(summary['shards'])} shards, "
          f"{time.perf_counter() - t0:.1f} s on {summary['device']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
