"""Reading exported checkpoints back: weight decoding for ``CheckpointReader.load_prefix`` and
the dynamic activation quantization the exported config declares.

Decoding is by tensor names, dtypes and shapes (both formats are self-describing that way once
the model's expected ``[out, in]`` is known), for a module ``M``:

- ``M.weight_packed`` int32 (+ ``M.weight_shape``, ``M.weight_scale``, ``M.weight_zero_point``):
  compressed-tensors pack-quantized; bits = 32 * words / in;
- ``M.weight_packed`` uint8 + uint8 ``M.weight_scale``: MXFP4 (e8m0 scales per 32);
- ``M.weight`` int8 + ``M.weight_scale`` (+ ``M.weight_offset`` / ``M.weight_zero_point``):
  int8 [out, in] (compressed-tensors int-quantized, Ascend W8A8_DYNAMIC) or Ascend int4 rows
  [out/2, in] (W4A8_DYNAMIC);
- ``M.weight`` float8_e4m3fn + fp32 ``M.weight_scale``: per channel [out, 1], per group
  [out, in/g] or 128x128 blocks; + uint8 ``M.weight_scale``: MXFP8.

The arithmetic is the fake quantizer's own: ``(q - zp) * scale`` in fp32, so a read-back weight
equals the fake-quant weight of the run bit for bit.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from ..errors import CheckpointError, ConfigError
from ..quant.schemes import QuantScheme, TargetScheme, TensorSpec, valid_targets, wider_targets
from ..io.storage_formats import decode_fp4, e8m0_to_float32
from . import ascend
from ..quant.packing import unpack_int4_rows, unpack_int32, unpack_int32_dim0

#: suffixes of the tensors that make up one exported weight (besides ``.weight`` itself)
PART_SUFFIXES = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_offset",
                 ".scale_bias")


def group_parts(keys: list[str]) -> dict[str, dict[str, str]]:
    """logical ``M.weight`` -> {part: key} for every module with exported parts."""
    groups: dict[str, dict[str, str]] = {}
    present = set(keys)
    for k in keys:
        for suf in PART_SUFFIXES:
            if k.endswith(suf):
                base = k[: -len(suf)]
                groups.setdefault(base + ".weight", {})[suf[1:]] = k
                break
    out = {}
    for logical, parts in groups.items():
        if "weight_scale" not in parts:
            continue  # not an exported weight (e.g. a foreign tensor that happens to match)
        if logical in present:
            parts["weight"] = logical
        out[logical] = parts
    return out


def _per_block(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, name: str) -> torch.Tensor:
    """(q - zp) * scale with scale [out, 1] (channel) or [out, G] (groups of in/G columns)."""
    out_f, in_f = q.shape
    if scale.dim() != 2 or scale.shape[0] != out_f or in_f % scale.shape[1]:
        raise CheckpointError(f"{name}: scale of shape {tuple(scale.shape)} does not fit a weight [{out_f}, {in_f}]")
    g = scale.shape[1]
    qv = q.float().reshape(out_f, g, in_f // g)
    if zp is not None:
        qv = qv - zp.float().reshape(out_f, g, 1)
    return (qv * scale.float().reshape(out_f, g, 1)).reshape(out_f, in_f)


def decode(raw: Callable[[str], torch.Tensor], parts: Mapping[str, str], want: tuple[int, ...] | None,
           device, name: str) -> torch.Tensor:
    """The fp32 weight of one exported module (see the module doc)."""
    get = {p: raw(k) for p, k in parts.items()}
    if device is not None:
        get = {p: t.to(device) for p, t in get.items()}
    scale = get["weight_scale"]
    if "weight_packed" in get:
        packed = get["weight_packed"]
        if packed.dtype == torch.uint8 and scale.dtype == torch.uint8:      # MXFP4
            return decode_fp4(packed, scale, dtype=torch.float32, name=name)
        if packed.dtype != torch.int32 or "weight_shape" not in get:
            raise CheckpointError(f"{name}: weight_packed must be int32 with a weight_shape (got {packed.dtype})")
        out_f, in_f = (int(v) for v in get["weight_shape"].tolist())
        bits = packed.shape[1] * 32 // in_f if in_f else 0
        if not 1 <= bits <= 8 or math.ceil(in_f * bits / 32) != packed.shape[1]:
            raise CheckpointError(f"{name}: packed width {packed.shape[1]} fits no bit width for {in_f} columns")
        q = unpack_int32(packed, bits, in_f)
        zp = get.get("weight_zero_point")
        if zp is not None:
            zp = unpack_int32_dim0(zp, bits, out_f)
        return _per_block(q, scale, zp, name)
    w = get.get("weight")
    if w is None:
        raise CheckpointError(f"{name}: has {sorted(parts)} but no weight / weight_packed")
    if w.dtype == torch.int8:
        if want is not None and w.shape[0] * 2 == want[0] and w.shape[0] != want[0]:
            w = unpack_int4_rows(w)                                         # Ascend W4A8
        zp = get.get("weight_zero_point", get.get("weight_offset"))
        return _per_block(w, scale.float(), zp, name)
    if w.dtype == torch.float8_e4m3fn:
        if scale.dtype == torch.uint8:                                      # MXFP8
            return _per_block(w, e8m0_to_float32(scale, name), None, name)
        out_f, in_f = w.shape
        blocks = (math.ceil(out_f / 128), math.ceil(in_f / 128))
        if tuple(scale.shape) == blocks and scale.shape[0] != out_f:
            s = scale.float().repeat_interleave(128, 0)[:out_f].repeat_interleave(128, 1)[:, :in_f]
            return w.float() * s
        return _per_block(w, scale.float(), None, name)
    raise CheckpointError(f"{name}: exported weight of dtype {w.dtype} is not a known layout")


# ----------------------------------------------------------------------------- activations
@dataclass
class ExportedQuant:
    """What an exported checkpoint asks its reader to apply: dynamic activation (and cache)
    quantization, with weights already on the grid (their specs are None)."""

    scheme: QuantScheme
    targets: list[str]
    layers: set[int]
    format: str
    #: weights the description labels FLOAT (Ascend): a leaf of a quantized target that the
    #: writer left float (msModelSlim keeps ``wo_b`` FLOAT) is run float by vllm-ascend, input
    #: included, so its reader must not quantize that input either (casebook/export.md E18)
    float_weights: frozenset[str] = frozenset()


def exported_quant(model_path: str | Path) -> ExportedQuant | None:
    """None for an ordinary release; else the activation quantization its config declares."""
    root = Path(model_path)
    try:
        cfg = json.loads((root / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    meta = cfg.get("amct_export") if isinstance(cfg, dict) else None
    qc = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    desc_path = root / ascend.DESCRIPTION_NAME
    inputs: dict[str, TensorSpec | None] = {}
    cache = None
    float_weights: frozenset[str] = frozenset()
    if isinstance(qc, dict) and qc.get("quant_method") == "compressed-tensors":
        from .compressed_tensors import spec_from_args

        for gname, group in (qc.get("config_groups") or {}).items():
            if gname not in ("attn-linear", "moe"):
                raise ConfigError(f"{root / 'config.json'}: quantization_config.config_groups.{gname}: "
                                  "not written by this tool (groups are named attn-linear / moe)")
            inputs[gname] = spec_from_args(group.get("input_activations"),
                                           f"config_groups.{gname}.input_activations")
        cache = spec_from_args(qc.get("kv_cache_scheme"), "kv_cache_scheme")
        fmt = "compressed-tensors"
    elif desc_path.is_file():
        try:
            desc = json.loads(desc_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{desc_path}: unreadable ({e})") from None
        found, cache = ascend.activation_targets(desc)
        inputs.update(found)
        float_weights = frozenset(k for k, t in desc.items() if t == ascend.FLOAT and k.endswith(".weight"))
        fmt = "ascend"
    else:
        return None
    targets = {t: TargetScheme(None, s) for t, s in inputs.items() if s is not None}
    names = list(targets) + (["attn-cache"] if cache is not None else [])
    # the config group is named after the scheme key; the run's module set may be a wider target
    # (V4's attn-linear-all: its activation quantizers then sit on wo_a / compressors too)
    for wide, key in wider_targets().items():
        if key in names and meta and wide in (meta.get("targets") or []):
            names = [wide if t == key else t for t in names]
    order = valid_targets()
    if meta and isinstance(meta.get("quantized_layers"), list):
        layers = {int(i) for i in meta["quantized_layers"]}
    else:
        layers = set(range(int(cfg.get("num_hidden_layers", cfg.get("n_layers", 0)))))
    scheme = QuantScheme(name=f"exported-{fmt}-activations", targets=targets, cache=cache)
    return ExportedQuant(scheme=scheme, targets=[t for t in order if t in names], layers=layers, format=fmt,
                         float_weights=float_weights)
