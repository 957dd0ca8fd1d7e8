#!/usr/bin/env python
"""Write a deterministic random tiny DeepSeek-V4 checkpoint in the released flat layout.

    python tools/make_tiny_checkpoint.py --out DIR [--format bf16|fp8] [--seed N]

The folder gets an official-style config.json, >= 2 safetensors shards with an index, mtp.0.* keys,
and a byte-level BPE tokenizer trained on the Wikitext-2 validation split (AutoTokenizer loads it
offline). Every layer kind is present: ratio 0 / 4 (with indexer) / 128, hash and score routing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.deepseek_v4.tiny import make_tiny_checkpoint  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--format", choices=["bf16", "fp8"], default="bf16", help="storage format (fp8 = FP8 + FP4 experts)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--text", default=None, help="tokenizer training text (default: the shipped WikiText-2 validation split)")
    args = ap.parse_args(argv)
    out = make_tiny_checkpoint(args.out, fmt=args.format, seed=args.seed, text_path=args.text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
