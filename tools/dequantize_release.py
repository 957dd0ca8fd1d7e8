#!/usr/bin/env python
"""Write the exact dequantization of a release-format DeepSeek-V4 checkpoint as a plain float one.

    python tools/dequantize_release.py --src assets/tiny-v4-release --out DIR [--dtype bf16|fp32]

The release stores the attention / shared-expert linears as FP8 e4m3 with ue8m0 scales per 128x128
block and the routed experts as FP4 e2m1 with ue8m0 scales per 32. Peers (auto-round,
llm-compressor, msModelSlim) start from a float model, so this writes the layout ``assets/tiny-v4``
uses: the same keys (no ``.scale`` companions), every other tensor byte for byte as stored, a
config.json without the release's ``quantization_config`` (``expert_dtype`` null), and the
tokenizer files.

Decoding is the project's own (``CheckpointReader`` -> ``storage_formats.decode_fp8_block`` /
``decode_fp4``, in fp32), the same path ``--model tiny-trained-release`` loads through.

Why bf16 is exact (the default): an e4m3 value has at most 4 significant bits and an e2m1 value at
most 2; a ue8m0 scale is a power of two, so the product keeps those bits and only moves the
exponent. bf16 holds 8 significant bits over fp32's exponent range (normals down to 2^-126,
subnormals to 2^-133), so the product is exact unless its exponent leaves that range -- possible
only for scales near 2^-127 or 2^127, which no trained weight has. That proviso is not assumed:
every decoded tensor is cast to bf16, cast back and compared with the fp32 decode; any difference
stops the tool naming the tensor (then ``--dtype fp32`` writes the decoded tensors in fp32, exact
by construction). Tensors stored unquantized keep their stored dtype (bf16 or the fp32 islands).

The folder is built under a temporary sibling and renamed into place at the end, so ``--out``
either does not exist or is complete.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from amct_ext.errors import CheckpointError  # noqa: E402
from amct_ext.io.checkpoint import INDEX_NAME, QUANT_STORAGE, CheckpointReader  # noqa: E402
from amct_ext.io.checkpoint_writer import save_sharded  # noqa: E402
from amct_ext.io.io_utils import _umask, atomic_write_json  # noqa: E402

OUT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class DequantizeError(Exception):
    """A one-line reason the release cannot be dequantized as asked."""


def plain_config(src: Path) -> dict:
    """The release's config.json as a float checkpoint's: no quantization_config, no FP4 experts."""
    path = src / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DequantizeError(f"{path}: cannot read config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise DequantizeError(f"{path}: config.json is not a JSON object")
    cfg.pop("quantization_config", None)
    cfg["expert_dtype"] = None
    return cfg


def decoded_tensors(src: Path, out_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every logical tensor of ``src``: decoded weights in ``out_dtype`` (checked exact), the rest
    as stored. Returns (tensors, names of the decoded ones)."""
    with CheckpointReader(src) as reader:
        quantized = {k for k in reader.keys() if k.endswith(".weight") and reader.stored_dtype(k) in QUANT_STORAGE
                     and k[: -len(".weight")] + ".scale" in reader}
        # target_dtype keeps each tensor's own dtype: the decoded ones come back in fp32
        result = reader.load_prefix("", None, dtype=torch.float32, target_dtype=lambda _n, d: d,
                                    skip_prefixes=())
    if not quantized:
        raise DequantizeError(f"{src}: no FP8 / FP4 weight with a .scale companion (not a release-format checkpoint)")
    tensors = {}
    for name, t in result.tensors.items():
        if name in quantized:
            if t.dtype != torch.float32:
                raise DequantizeError(f"{src}: tensor {name!r} decoded to {t.dtype}, expected float32")
            cast = t.to(out_dtype)
            if not torch.equal(cast.to(torch.float32), t):
                raise DequantizeError(f"{src}: tensor {name!r} is not exact in {out_dtype} "
                                      "(a scale at the exponent range's edge); rerun with --dtype fp32")
            t = cast
        tensors[name] = t.contiguous()
    return tensors, sorted(quantized)


def shard_count(src: Path) -> int:
    index = src / INDEX_NAME
    if not index.is_file():
        return 1
    return max(1, len(set(json.loads(index.read_text())["weight_map"].values())))


def dequantize_release(src: str | os.PathLike, out: str | os.PathLike, dtype: str = "bf16") -> list[str]:
    """Write the dequantized checkpoint of ``src`` at ``out`` (which must not exist); the decoded keys."""
    src, out = Path(src), Path(out)
    if dtype not in OUT_DTYPES:
        raise DequantizeError(f"--dtype: {dtype!r} is not one of {', '.join(OUT_DTYPES)}")
    if not (src / "config.json").is_file():
        raise DequantizeError(f"--src {src}: no config.json (not a checkpoint folder)")
    if out.exists():
        raise DequantizeError(f"--out {out}: already exists (remove it or choose another folder)")
    if not out.parent.is_dir():
        raise DequantizeError(f"--out {out}: parent folder {out.parent} does not exist")
    config = plain_config(src)
    missing = [n for n in TOKENIZER_FILES if not (src / n).is_file()]
    if missing:
        raise DequantizeError(f"--src {src}: missing tokenizer file(s) {', '.join(missing)}")
    try:
        tensors, decoded = decoded_tensors(src, OUT_DTYPES[dtype])
    except CheckpointError as e:
        raise DequantizeError(str(e)) from None
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_sharded(tensors, tmp, shard_count(src))
        atomic_write_json(config, tmp / "config.json")
        for name in TOKENIZER_FILES:
            shutil.copyfile(src / name, tmp / name)
        os.chmod(tmp, 0o777 & ~_umask())   # mkdtemp makes it 0700; the result is an ordinary folder
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return decoded


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, required=True, help="release-format checkpoint folder")
    ap.add_argument("--out", type=Path, required=True, help="output folder (must not exist)")
    ap.add_argument("--dtype", choices=tuple(OUT_DTYPES), default="bf16",
                    help="dtype of the decoded weights (bf16 is exact for e4m3 / e2m1 x ue8m0; checked)")
    args = ap.parse_args(argv)
    try:
        decoded = dequantize_release(args.src, args.out, args.dtype)
    except DequantizeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: {len(decoded)} FP8/FP4 weights decoded exactly to {args.dtype}, "
          "the other tensors as stored")
    return 0


if __name__ == "__main__":
    sys.exit(main())
