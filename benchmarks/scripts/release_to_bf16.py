#!/usr/bin/env python
"""A bf16 copy of a DeepSeek-V4 checkpoint in the released FP8 / FP4 layout, for transformers.

    python benchmarks/scripts/release_to_bf16.py SRC DST [--device cuda]

transformers' ``DeepseekV4ForCausalLM`` (5.17) renames the release's keys at load time
(``conversion_mapping``: ``layers.N.attn.wq_a`` -> ``model.layers.N.self_attn.q_a_proj``, the
routed experts ``w1`` / ``w3`` / ``w2`` merged into its fused ``gate_up_proj`` / ``down_proj``),
but it does not decode the release's packed FP4 experts, and its FP8 path wants its own
quantizer. So the copy keeps the release's key names and writes every FP8 block weight
(e4m3 + ue8m0 128 x 128 scales) and every FP4 expert (packed e2m1 + e8m0 per-32 scales) decoded
to bf16 with the project's own decoders (``amct_ext.io.storage_formats``: the same values our
loader builds the float model from); the ``.scale`` tensors are dropped; every other tensor is
copied as stored (fp32 islands stay fp32). config.json loses ``quantization_config`` and gets
``expert_dtype: null``; the tokenizer files are copied. One shard per source shard, written
atomically; the index last (a folder without one is not a checkpoint), so an interrupted copy
is redone shard by shard. A V4-Flash layer is ~12.3 GiB in bf16: the free disk is checked
before the first shard. Errors print ``error: ...`` and exit 2.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from amct_ext.errors import AmctError, CheckpointError  # noqa: E402
from amct_ext.io.io_utils import atomic_write, atomic_write_json  # noqa: E402
from amct_ext.io.storage_formats import FP4_PACKED_DTYPES, decode_fp4, decode_fp8_block  # noqa: E402

INDEX = "model.safetensors.index.json"
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
G = 2 ** 30


def decoded_bytes(src: Path, shard_keys: dict[str, list[str]]) -> int:
    """Bytes the copy will take (headers only: nothing decoded)."""
    total = 0
    for shard, keys in shard_keys.items():
        with safe_open(str(src / shard), "pt") as f:
            names = set(keys)
            for k in keys:
                if k.endswith(".scale") and k[: -len("scale")] + "weight" in names:
                    continue
                sl = f.get_slice(k)
                shape, dt = sl.get_shape(), sl.get_dtype()
                n = 1
                for d in shape:
                    n *= d
                if k.endswith(".weight") and k[: -len("weight")] + "scale" in names:
                    n = n * 2 if dt in ("I8", "U8", "F4") else n   # packed FP4: two values a byte
                    total += 2 * n
                else:
                    total += n * {"F32": 4, "I64": 8, "I32": 4, "BF16": 2, "F16": 2}.get(dt, 1)
    return total


def convert_shard(src_file: Path, keys: list[str], dev: torch.device) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    names = set(keys)
    with safe_open(str(src_file), "pt") as f:
        for k in keys:
            scale_key = k[: -len("weight")] + "scale" if k.endswith(".weight") else None
            if k.endswith(".scale") and k[: -len("scale")] + "weight" in names:
                continue                      # consumed with its weight
            t = f.get_tensor(k)
            if scale_key is not None and scale_key in names:
                s = f.get_tensor(scale_key)
                if t.dtype == torch.float8_e4m3fn:
                    w = decode_fp8_block(t, s, dtype=torch.bfloat16, device=dev, name=f"{src_file.name}:{k}")
                elif t.dtype in FP4_PACKED_DTYPES:
                    w = decode_fp4(t, s, dtype=torch.bfloat16, device=dev, name=f"{src_file.name}:{k}")
                else:
                    raise CheckpointError(f"{src_file.name}: {k} has a scale but dtype {t.dtype}: "
                                          "neither FP8 e4m3 nor packed FP4")
                out[k] = w.cpu()
            else:
                out[k] = t
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--device", default="cpu", help="where the weights are decoded (cpu | cuda | npu)")
    ap.add_argument("--reserve-gb", type=float, default=2.0, help="free disk to leave beyond the copy")
    a = ap.parse_args(argv)
    try:
        return run(a)
    except AmctError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(a) -> int:
    from amct_ext.runtime import device as devmod

    src, dst = a.src, a.dst
    if not (src / INDEX).is_file():
        raise CheckpointError(f"{src}: no {INDEX} (not a checkpoint, or its write did not finish)")
    if (dst / INDEX).is_file():
        print(f"{dst}: already a checkpoint (index present); nothing to do", flush=True)
        return 0
    index = json.loads((src / INDEX).read_text())
    shard_keys: dict[str, list[str]] = {}
    for k, shard in index["weight_map"].items():
        shard_keys.setdefault(shard, []).append(k)
    need = decoded_bytes(src, shard_keys)
    dst.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dst).free
    done_bytes = sum((dst / s).stat().st_size for s in shard_keys if (dst / s).is_file())
    if need - done_bytes + a.reserve_gb * G > free:
        raise CheckpointError(f"{dst}: the bf16 copy needs {need / G:.1f} GiB ({done_bytes / G:.1f} written), "
                              f"the disk has {free / G:.1f} GiB free (+{a.reserve_gb} GiB reserve); free space "
                              f"or pass another DST")
    dev = devmod.resolve_device(a.device)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    config["expert_dtype"] = None
    weight_map: dict[str, str] = {}
    t0 = time.perf_counter()
    for shard in sorted(shard_keys):
        t1 = time.perf_counter()
        tensors = convert_shard(src / shard, shard_keys[shard], dev)
        tensors = {k: v.contiguous() for k, v in sorted(tensors.items())}
        atomic_write(dst / shard, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
        weight_map.update({k: shard for k in tensors})
        nb = sum(t.numel() * t.element_size() for t in tensors.values())
        print(f"{shard}: {len(tensors)} tensors, {nb / G:.2f} GiB bf16 copy, {time.perf_counter() - t1:.1f} s",
              flush=True)
        del tensors
        devmod.empty_cache(dev)
    for name in COPY_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    atomic_write_json(config, dst / "config.json")
    total = sum((dst / s).stat().st_size for s in shard_keys)
    atomic_write_json({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                      dst / INDEX)
    print(f"wrote {dst}: {total / G:.2f} GiB in {len(shard_keys)} shards, {time.perf_counter() - t0:.1f} s "
          f"(decoded on {dev})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
