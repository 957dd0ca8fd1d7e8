"""How the release stores each DeepSeek-V4 tensor, and the writer of a checkpoint in that layout.

Storage rules (spec §3) for ``fmt="fp8"``:
- attention linears (wq_a, wq_b, wkv, wo_a, wo_b), the indexer's wq_b and the shared expert:
  FP8 e4m3 with ue8m0 128x128 block scales (companion ``<module>.scale``);
- routed experts: FP4 e2m1 packed two per byte with e8m0 per-32 scales (``expert_dtype: fp4``);
- everything else as in ``fmt="bf16"``: the fp32 islands in fp32, other floats in bf16,
  ``tid2eid`` int64.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from amct_ext.io.checkpoint_writer import save_sharded
from amct_ext.io.io_utils import atomic_write_json
from amct_ext.io.storage_formats import encode_fp4, encode_fp8_block

from .configuration import DeepseekV4Config

FP8_LINEAR = re.compile(r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$")
FP4_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
FORMATS = ("bf16", "fp8")


def release_tensors(state_dict: dict[str, torch.Tensor], fmt: str = "bf16") -> dict[str, torch.Tensor]:
    """Model state dict (any float dtype) -> the tensors a release of format ``fmt`` stores."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; expected one of {FORMATS}")
    out: dict[str, torch.Tensor] = {}
    for key, t in state_dict.items():
        t = t.detach().cpu()
        if not t.dtype.is_floating_point:
            out[key] = t.to(torch.int64) if key.endswith("tid2eid") else t
        elif fmt == "fp8" and FP4_EXPERT.match(key):
            out[key], out[key[: -len("weight")] + "scale"] = encode_fp4(t.float())
        elif fmt == "fp8" and FP8_LINEAR.match(key):
            out[key], out[key[: -len("weight")] + "scale"] = encode_fp8_block(t.float(), scale_fmt="ue8m0")
        else:
            out[key] = t if t.dtype == torch.float32 and _is_fp32_island(key) else t.to(torch.bfloat16)
    return out


def _is_fp32_island(key: str) -> bool:
    leaf = key.rsplit(".", 1)[-1]
    return (
        ".hc_" in key or key.startswith("hc_head_") or leaf == "attn_sink" or leaf == "ape"
        or key.endswith("norm.weight") or ".compressor.wkv." in key or ".compressor.wgate." in key
        or key == "head.weight" or key.endswith("gate.bias")
    )


def official_config_dict(config: DeepseekV4Config, fmt: str) -> dict:
    """config.json content with HF names only (as released)."""
    d = config.to_dict()
    for k in ("arch_dtype", "_name_or_path", "id2label", "label2id", "output_attentions", "return_dict",
              "output_hidden_states", "chunk_size_feed_forward", "is_encoder_decoder", "problem_type",
              "transformers_version"):
        d.pop(k, None)
    d["torch_dtype"] = "bfloat16"
    d.pop("dtype", None)
    if fmt == "fp8":
        d["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
        d["expert_dtype"] = "fp4"
    else:
        d.pop("quantization_config", None)
        d["expert_dtype"] = None
    return d


def write_release_checkpoint(state_dict: dict[str, torch.Tensor], config: DeepseekV4Config,
                             out_dir: str | os.PathLike, fmt: str = "bf16", n_shards: int = 2,
                             extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Write config.json + shards + index (index last, so an interrupted write is not a checkpoint)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = release_tensors(state_dict, fmt)
    if extra:
        tensors.update(release_tensors(extra, "bf16"))
    atomic_write_json(official_config_dict(config, fmt), out_dir / "config.json")
    save_sharded(tensors, out_dir, n_shards)
    return out_dir

