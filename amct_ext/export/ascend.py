"""Ascend ModelSlim v1 layout (what vllm-ascend reads with ``--quantization ascend``).

Read from msModelSlim 26.1's own output on assets/tiny-v4 (tests/data/msmodelslim-26.1-tiny-v4):

- weights in ``quant_model_weights-*.safetensors`` + ``quant_model_weights.safetensors.index.json``,
  under the released flat names (``layers.1.attn.wq_a.weight``);
- ``quant_model_description.json``: ``model_quant_type``, ``version`` "1.0.0", ``metadata``,
  ``group_size``, and one type per tensor: ``W8A8_DYNAMIC`` / ``W4A8_DYNAMIC`` / ``FLOAT``;
- W8A8_DYNAMIC linear ``M``: ``M.weight`` int8 [out, in], ``M.weight_scale`` fp32 [out, 1],
  ``M.weight_offset`` fp32 zeros [out, 1]; no input scale (per-token dynamic int8 inputs);
- W4A8_DYNAMIC (routed experts): ``M.weight`` int8 [out/2, in] (rows 2j / 2j+1 in the low / high
  nibble), ``M.weight_scale`` / ``M.weight_offset`` fp32 [out, 1] and ``M.scale_bias`` fp32:
  8 x the row sum of the dequantized weight, [out, 1] for w1 / w3 and [out, 16] for w2 (one
  partial row sum per slice of a 16-way tensor-parallel split of w2's input dim);
- ``model_quant_type`` stays ``W8A8_DYNAMIC`` when only the experts are W4A8;
- FLOAT tensors keep their dtype; integer tables named by the profile (V4's ``tid2eid``) are int32.

Only symmetric int weights with dynamic per-token int8 inputs have a type here (w8a8, w4a8 and
per-channel variants); other schemes are refused by :func:`check_scheme`.

What vllm-ascend accepts per module is the model's engine profile for this format (DeepSeek-V4:
``models/deepseek_v4/serving_ascend.py``, each rule with its vllm-ascend file:line), which the
exporter follows leaf by leaf (``amct_ext.export.engine``); the scheme-level limits are checked here.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from ..errors import QuantConfigError
from ..quant.schemes import LINEAR_TARGETS, QuantScheme, TensorSpec
from ..quant.packing import pack_int4_rows
from . import engine

INDEX_NAME = "quant_model_weights.safetensors.index.json"
SHARD_STEM = "quant_model_weights"
DESCRIPTION_NAME = "quant_model_description.json"
VERSION = "1.0.0"
#: the tensor-parallel size msModelSlim fixes for the scale_bias slices of an expert's down projection
SCALE_BIAS_TP = 16
W8A8, W4A8, FLOAT = "W8A8_DYNAMIC", "W4A8_DYNAMIC", "FLOAT"



def _is_int8_token(spec: TensorSpec | None) -> bool:
    return (spec is not None and spec.format == "int" and spec.bits == 8 and spec.symmetric
            and spec.granularity == "token" and spec.dynamic)


def weight_type(weight: TensorSpec, act: TensorSpec | None, where: str) -> str:
    if not _is_int8_token(act):
        raise QuantConfigError(f"ascend export: {where}: the input spec must be int8 per-token dynamic "
                               f"symmetric (W*A8_DYNAMIC), got {act}")
    if weight.format != "int" or not weight.symmetric or weight.bits not in (4, 8):
        raise QuantConfigError(f"ascend export: {where}: weights must be symmetric int8 or int4, got {weight}")
    if weight.granularity not in ("channel", "group"):
        raise QuantConfigError(f"ascend export: {where}: weight granularity must be channel or group, got {weight.granularity!r}")
    if weight.bits == 8 and weight.granularity != "channel":
        raise QuantConfigError(f"ascend export: {where}: W8A8_DYNAMIC weights are per channel, got {weight.granularity!r}")
    return W8A8 if weight.bits == 8 else W4A8


def _profile() -> SimpleNamespace:
    """The facts the registered vllm-ascend profile quotes (the model supplies them, with their
    source lines); without a registered profile only the format's own checks apply."""
    prof = engine.profile_for("ascend")
    facts = dict(prof.facts) if prof is not None else {}
    return SimpleNamespace(ENGINE=facts.get("ENGINE", "vllm-ascend"),
                           W4A8_PER_CHANNEL_ONLY=facts.get("W4A8_PER_CHANNEL_ONLY", "its W4A8 method"),
                           DESCRIPTION_NEEDS=tuple(facts.get("DESCRIPTION_NEEDS", ())),
                           CACHE_SOURCE=facts.get("CACHE_SOURCE", "its attention"),
                           INT32_TENSORS=tuple(facts.get("INT32_TENSORS", ())))


def stores_int32(key: str) -> bool:
    """Whether the layout holds the released tensor ``key`` as int32: its name ends with one of
    the profile's ``INT32_TENSORS`` (integer tables msModelSlim writes int32; V4: the hash
    router's table). Such a tensor is never copied file to file."""
    return key.endswith(_profile().INT32_TENSORS)


def check_scheme(scheme: QuantScheme, targets: list[str]) -> None:
    """Scheme-level checks (no tensor data): every target's specs have a ModelSlim type that
    vllm-ascend runs somewhere. Which module may carry which type is the engine profile's
    (models/deepseek_v4/serving_ascend.py), checked leaf by leaf before anything is written
    (``ExportConfig.check`` -> ``serving.check_export``)."""
    from ..quant.schemes import spec_targets

    prof = _profile()
    for t in spec_targets(targets):
        if t not in LINEAR_TARGETS:
            continue
        ts = scheme.target(t)
        if ts.weight is None:
            raise QuantConfigError(f"ascend export: scheme {scheme.name!r} target {t} has no weight spec")
        typ = weight_type(ts.weight, ts.input, f"scheme {scheme.name!r} target {t}")
        if typ == W4A8 and ts.weight.granularity != "channel":
            raise QuantConfigError(
                f"ascend export: scheme {scheme.name!r} target {t}: {prof.ENGINE} runs W4A8_DYNAMIC "
                f"per channel only (group_size > 0 is refused, {prof.W4A8_PER_CHANNEL_ONLY}); "
                f"use an int4 per-channel weight spec (granularity: channel) for {t}")
        if typ == W4A8 and t == "attn-linear":
            raise QuantConfigError(
                f"ascend export: scheme {scheme.name!r} target attn-linear: {prof.ENGINE} has no "
                "W4A8_DYNAMIC method for a linear (quantization/methods/registry.py: 'moe' only); "
                "use int8 weights for attn-linear")
    if "attn-cache" in targets and scheme.cache is not None:
        raise QuantConfigError(
            f"ascend export: attn-cache: {prof.ENGINE} keeps DeepSeek-V4's attention caches in bf16 and has "
            f"no int8 q/k/p/v path for it ({prof.CACHE_SOURCE}); drop attn-cache from --quant-target")


def encode_weight(base: str, spec: TensorSpec, act: TensorSpec | None, d: dict[str, torch.Tensor],
                  shape: tuple[int, int], fake_quant: torch.Tensor,
                  down_projection: bool = False) -> tuple[dict[str, torch.Tensor], str]:
    """Checkpoint tensors of module ``base`` and their description type. ``down_projection``:
    ``base`` is a gated MLP's down projection (the model's role ``down``), whose input dim the
    engine splits over tensor-parallel ranks: an expert's ``scale_bias`` then holds one row sum
    per slice."""
    out_f, _ = shape
    typ = weight_type(spec, act, base)
    scale = d["scale"].float().reshape(out_f, -1).contiguous()
    q = d["qweight"]
    t = {f"{base}.weight": q.contiguous() if typ == W8A8 else pack_int4_rows(q),
         f"{base}.weight_scale": scale,
         f"{base}.weight_offset": torch.zeros_like(scale)}
    if typ == W4A8 and ".experts." in base:
        w = fake_quant.float()
        if down_projection:
            if w.shape[1] % SCALE_BIAS_TP:
                raise QuantConfigError(f"{base}: in_features {w.shape[1]} is not divisible by {SCALE_BIAS_TP} (scale_bias slices)")
            bias = 8.0 * w.reshape(out_f, SCALE_BIAS_TP, -1).sum(-1)
        else:
            bias = 8.0 * w.sum(-1, keepdim=True)
        t[f"{base}.scale_bias"] = bias.contiguous()
    return t, typ


def description(types: dict[str, str], scheme: QuantScheme, targets: list[str]) -> dict[str, Any]:
    """quant_model_description.json: the header keys first (as msModelSlim orders them after the
    tensors, order is irrelevant to readers), then one type per tensor."""
    used = set(types.values()) - {FLOAT}
    model_type = W8A8 if W8A8 in used or not used else W4A8
    groups = {s.group_size for t in LINEAR_TARGETS if t in targets
              for s in [scheme.target(t).weight] if s is not None and s.granularity == "group"}
    desc: dict[str, Any] = dict(types)
    desc.update({"version": VERSION, "model_quant_type": model_type, "metadata": {},
                 "group_size": groups.pop() if len(groups) == 1 else 0})
    missing = [k for k in _profile().DESCRIPTION_NEEDS if k not in types]
    if missing:   # vllm-ascend would look every module up under names the description lacks
        raise QuantConfigError(f"ascend export: the checkpoint has no tensor {missing[0]!r}, which "
                               f"{_profile().ENGINE} needs in {DESCRIPTION_NAME} to map its names")
    return desc


def activation_targets(desc: dict[str, Any]) -> tuple[dict[str, TensorSpec], TensorSpec | None]:
    """Read-back: the dynamic int8 per-token input spec of each linear target that has a
    W*A8_DYNAMIC tensor, and the cache spec when the cache is quantized."""
    spec = TensorSpec("int", 8, True, "token", dynamic=True)
    found: dict[str, TensorSpec] = {}
    for key, typ in desc.items():
        if typ in (W8A8, W4A8) and key.endswith(".weight"):
            found[_target_of(key)] = spec
    return found, (spec if desc.get("kv_cache_type") == "C8" else None)


def _target_of(key: str) -> str:
    return "moe" if ".ffn." in key else "attn-linear"
