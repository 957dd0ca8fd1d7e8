"""compressed-tensors layout: per-module tensors and the ``quantization_config`` of config.json.

Conventions (read from the compressed-tensors 0.20 source, compressors/*; see casebook/export.md):

=================  =======================  ==================================================
our weight spec    format                   tensors of module ``M``
=================  =======================  ==================================================
int8 (symmetric)   int-quantized (with A8)  ``M.weight`` int8 [out, in], ``M.weight_scale``
                   / pack-quantized (A16)   fp32 [out, 1] (channel) or [out, in/g] (group)
int2..7 (+ int8    pack-quantized           ``M.weight_packed`` int32 [out, ceil(in*b/32)],
 weight-only)                               ``M.weight_scale``, ``M.weight_shape`` int64 [2],
                                            ``M.weight_zero_point`` int32 packed along dim 0
                                            (asymmetric only)
fp8 e4m3           float-quantized          ``M.weight`` float8_e4m3fn, ``M.weight_scale``
                                            fp32 [out, 1] / [ceil(out/128), ceil(in/128)]
mxfp8              mxfp8-quantized          ``M.weight`` float8_e4m3fn, ``M.weight_scale``
                                            uint8 (e8m0 exponent) [out, in/32]
mxfp4              mxfp4-pack-quantized     ``M.weight_packed`` uint8 [out, in/2] (even
                                            column in the low nibble), ``M.weight_scale``
                                            uint8 [out, in/32]
=================  =======================  ==================================================

compressed-tensors' integer grid is signed ``[-2^(b-1), 2^(b-1)-1]`` also for asymmetric
weights, while ours is ``[0, 2^b - 1]``: asymmetric codes and zero points are shifted by
``2^(b-1)`` on export, which leaves ``(q - zp) * scale`` -- the dequantized value -- unchanged.
Scales are stored in fp32 (the precision the fake-quant weight was computed with), so the
library's own ``dequantize`` reproduces our fake-quant weight exactly.
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import torch

from ..errors import QuantConfigError
from ..quant.schemes import LINEAR_TARGETS, QuantScheme, TensorSpec, spec_targets
from ..quant.packing import pack_int32, pack_int32_dim0

QUANT_METHOD = "compressed-tensors"
#: config_groups keys: our linear target names, so the read-back knows which target a group is;
#: each group's ``targets`` and the fixed ``ignore`` entries are the model's module names
#: (``ModelBinding.module_patterns`` / ``unquantized_modules``): the regexes must match the names
#: of every loader (the release's flat names, vLLM's after its WeightsMapper, transformers' renames).
IGNORE_HEAD = ["lm_head"]


def _strategy(spec: TensorSpec, role: str) -> dict[str, Any]:
    g = spec.granularity
    if g == "group":
        return {"strategy": "group", "group_size": spec.group_size}
    if g == "block":
        return {"strategy": "block", "block_structure": list(spec.block_size)}
    if g in ("channel", "token", "tensor"):
        return {"strategy": g}
    raise QuantConfigError(f"compressed-tensors: granularity {g!r} of the {role} spec has no equivalent")


def quant_args(spec: TensorSpec, role: str) -> dict[str, Any]:
    """A TensorSpec as compressed-tensors ``QuantizationArgs`` (JSON form)."""
    d: dict[str, Any] = {"num_bits": spec.bits, "symmetric": spec.symmetric,
                         "dynamic": bool(spec.dynamic) if role == "input" else False}
    if spec.format == "int":
        d["type"] = "int"
        d.update(_strategy(spec, role))
    elif spec.format == "fp8":
        d["type"] = "float"
        d.update(_strategy(spec, role))
    else:  # MX: groups of 32 with e8m0 (uint8) scales
        d.update({"type": "float", "strategy": "group", "group_size": 32, "scale_dtype": "torch.uint8"})
    if role == "input" and not spec.dynamic:
        raise QuantConfigError("export supports dynamic activation specs only (static input scales are not exported)")
    return d


def module_format(weight: TensorSpec, act: TensorSpec | None) -> str:
    if weight.format == "int":
        return "int-quantized" if weight.bits == 8 and act is not None else "pack-quantized"
    if weight.format == "fp8":
        return "float-quantized"
    return {"mxfp8": "mxfp8-quantized", "mxfp4": "mxfp4-pack-quantized"}[weight.format]


def encode_weight(base: str, spec: TensorSpec, act: TensorSpec | None, d: dict[str, torch.Tensor],
                  shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    """``d``: ``WeightQuantizer.export`` of the weight of module ``base`` -> checkpoint tensors."""
    out_f, in_f = shape
    fmt = module_format(spec, act)
    t: dict[str, torch.Tensor] = {}
    if spec.format == "int":
        scale = d["scale"].float()
        if spec.granularity == "channel":
            scale = scale.reshape(out_f, 1)
        elif spec.granularity != "group":
            raise QuantConfigError(f"{base}: compressed-tensors export of int weights needs granularity channel or group, got {spec.granularity!r}")
        q = d["qweight"].to(torch.int16)
        zp = d.get("zero_point")
        if not spec.symmetric:  # our [0, 2^b-1] grid -> the library's signed grid
            shift = 1 << (spec.bits - 1)
            q = q - shift
            zp = (zp.to(torch.int16) - shift).reshape(scale.shape)
        if fmt == "int-quantized":
            t[f"{base}.weight"] = q.to(torch.int8)
            if zp is not None:
                t[f"{base}.weight_zero_point"] = zp.to(torch.int8)
        else:
            t[f"{base}.weight_packed"] = pack_int32(q.to(torch.int8), spec.bits)
            t[f"{base}.weight_shape"] = torch.tensor([out_f, in_f], dtype=torch.int64)
            if zp is not None:
                t[f"{base}.weight_zero_point"] = pack_int32_dim0(zp.to(torch.int8), spec.bits)
        t[f"{base}.weight_scale"] = scale.contiguous()
    elif spec.format == "fp8":
        scale = d["scale"].float()
        if spec.granularity == "channel":
            scale = scale.reshape(out_f, 1)
        t[f"{base}.weight"] = d["qweight"].contiguous()
        t[f"{base}.weight_scale"] = scale.contiguous()
    elif spec.format == "mxfp8":
        t[f"{base}.weight"] = d["qweight"].contiguous()
        t[f"{base}.weight_scale"] = d["scale_e8m0"].to(torch.uint8).contiguous()
    else:  # mxfp4: e2m1 codes, two per byte, even column low
        codes = d["qweight"].to(torch.uint8)
        t[f"{base}.weight_packed"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
        t[f"{base}.weight_scale"] = d["scale_e8m0"].to(torch.uint8).contiguous()
    return t


def quantization_config(scheme: QuantScheme, targets: list[str], float_layers: list[int] = (),
                        module_patterns: Mapping[str, Sequence[str]] | None = None,
                        unquantized: Sequence[str] = IGNORE_HEAD) -> dict[str, Any]:
    """``quantization_config`` for config.json: one config group per quantized linear target.

    ``module_patterns``: per linear target, the module names / ``re:`` patterns of the group's
    ``targets`` (``ModelBinding.module_patterns``; None: left empty, for a check of the scheme
    alone); ``unquantized``: the fixed ``ignore`` entries (``ModelBinding.unquantized_modules``).
    ``float_layers``: decoder-layer ids left in float (a run over a layer range, an MTP layer
    copied as released, which vLLM's MTP loader renumbers ``mtp.{j}`` -> ``layers.{n + j}``);
    they go to ``ignore`` so a loader does not expect quantized tensors there."""
    groups: dict[str, Any] = {}
    formats = set()
    spec_keys = spec_targets(targets)   # attn-linear-all writes the attn-linear group
    for target in LINEAR_TARGETS:
        if target not in spec_keys:
            continue
        ts = scheme.target(target)
        if ts.weight is None:
            raise QuantConfigError(f"scheme {scheme.name!r}: target {target} has no weight spec; "
                                   "activation-only linear schemes cannot be exported")
        fmt = module_format(ts.weight, ts.input)
        formats.add(fmt)
        if module_patterns is not None and not module_patterns.get(target):
            raise QuantConfigError(f"compressed-tensors: the model declares no module names for target {target} "
                                   "(ModelBinding.module_patterns)")
        patterns = [] if module_patterns is None else list(module_patterns[target])
        groups[target] = {"targets": patterns, "weights": quant_args(ts.weight, "weight"),
                          "input_activations": None if ts.input is None else quant_args(ts.input, "input"),
                          "output_activations": None, "format": fmt}
    kv = None
    if "attn-cache" in targets and scheme.cache is not None:
        kv = quant_args(scheme.cache, "input")
    return {"quant_method": QUANT_METHOD, "format": formats.pop() if len(formats) == 1 else "mixed-precision",
            "quantization_status": "compressed", "config_groups": groups,
            "ignore": list(unquantized) + [rf"re:.*layers\.{i}\..*" for i in float_layers],
            "kv_cache_scheme": kv}


MX_FORMATS = ("mxfp8-quantized", "mxfp4-pack-quantized")


def drop_mx_inputs(qc: dict[str, Any]) -> list[str]:
    """Describe the MX config groups of ``qc`` as weight-only (``input_activations`` None), in
    place; returns their names. For an engine that serves MX weights weight-only whatever the
    config says (vLLM's CUDA build below SM100): the export then says what is served."""
    dropped = []
    for name, group in qc["config_groups"].items():
        if group.get("format") in MX_FORMATS and group.get("input_activations") is not None:
            group["input_activations"] = None
            dropped.append(name)
    return dropped


def leaf_ignore_patterns(leaves) -> list[str]:
    r"""``ignore`` entries for modules written as float weights, from their names relative to a
    decoder layer (``attn.wo_a``, ``ffn.experts.3.w1``): one regex per name with the indices
    generalised, matching the flat, vLLM and transformers prefixes alike
    (``re:.*\.attn\.wo_a$`` matches ``model.layers.3.attn.wo_a``)."""
    out = []
    for leaf in leaves:
        pat = "re:.*\\." + "\\.".join(r"\d+" if part.isdigit() else re.escape(part) for part in leaf.split(".")) + "$"
        if pat not in out:
            out.append(pat)
    return out


def spec_from_args(args: dict[str, Any] | None, where: str) -> TensorSpec | None:
    """Inverse of :func:`quant_args` for activation specs (the read-back's dynamic quantization)."""
    if not args:
        return None
    try:
        typ, bits = args["type"], int(args["num_bits"])
        strategy = args.get("strategy")
        if not args.get("dynamic", False):
            raise QuantConfigError(f"{where}: static activation scales are not supported (dynamic: false)")
        if typ == "float" and args.get("group_size") == 32 and strategy == "group":
            return TensorSpec({8: "mxfp8", 4: "mxfp4"}[bits])
        fmt = "int" if typ == "int" else "fp8"
        kw: dict[str, Any] = {"granularity": strategy, "dynamic": True}
        if strategy == "group":
            kw["group_size"] = int(args["group_size"])
        return TensorSpec(fmt, bits if fmt == "int" else None, bool(args.get("symmetric", True)), **kw)
    except (KeyError, TypeError, ValueError) as e:
        raise QuantConfigError(f"{where}: cannot read activation args {args} ({e})") from None
