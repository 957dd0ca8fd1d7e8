"""compressed-tensors export checked by the compressed-tensors package itself: its compressors
decompress every exported weight exactly to our fake-quant weight, and its config model parses our
quantization_config. (compressed-tensors is part of the 'test' extra, so CI runs these.)"""
from __future__ import annotations

import pytest
import torch

from tests.export_helpers import TINY

pytestmark = pytest.mark.usefixtures("one_thread")
ct_lib = pytest.importorskip("compressed_tensors")

INT8_TOKEN = {"format": "int", "bits": 8, "symmetric": True, "granularity": "token", "dynamic": True}
SCHEMES = {
    "w8a8": "w8a8",
    "w4a16-g128": "w4a16-g128",   # asymmetric: packed zero points
    "w4a8": "w4a8",
    "fp8": "fp8",
    "mxfp8": "mxfp8",
    "mxfp4": "mxfp4",
    "w3a16-g128": {"name": "w3a16-g128", "weight": {"format": "int", "bits": 3, "symmetric": True,
                                                    "granularity": "group", "group_size": 128}},
    "w8a16-asym": {"name": "w8a16-asym", "weight": {"format": "int", "bits": 8, "symmetric": False,
                                                    "granularity": "channel"}},
    "fp8-block": {"name": "fp8-block", "weight": {"format": "fp8", "granularity": "block", "block_size": [128, 128]},
                  "input": {"format": "fp8", "granularity": "token", "dynamic": True}},
}


@pytest.fixture(scope="module")
def float_layer():
    from amct_ext.io.checkpoint import CheckpointReader
    from models.deepseek_v4.loading import load_block, load_config

    config = load_config(TINY)
    with CheckpointReader(TINY) as reader:
        # layer 1: ratio 4, so it has a compressor and an indexer besides the experts
        block, _ = load_block(reader, config, 1, torch.float32, "cpu")
    return block


def _ct_scheme(group: dict):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    ia = group.get("input_activations")
    return QuantizationScheme(targets=group["targets"], weights=QuantizationArgs(**group["weights"]),
                              input_activations=QuantizationArgs(**ia) if ia else None, format=group["format"])


@pytest.mark.parametrize("name", list(SCHEMES))
def test_library_decompresses_to_our_fake_quant(float_layer, name):
    import copy

    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    from amct_ext.export import compressed_tensors as ct
    from models.deepseek_v4.binding import V4_BINDING
    from amct_ext.export.readback import decode, group_parts
    from amct_ext.quant.schemes import load_scheme
    from models.deepseek_v4 import quant_module

    scheme = load_scheme(SCHEMES[name])
    targets = ["attn-linear", "moe"]
    qc = ct.quantization_config(scheme, targets, (), V4_BINDING.module_patterns, V4_BINDING.unquantized_modules)
    parsed = QuantizationConfig.model_validate(qc)            # the library's own config model
    assert set(parsed.config_groups) == set(targets) and parsed.quant_method == "compressed-tensors"
    block = copy.deepcopy(float_layer)
    quant_module.quantize_block(block, scheme, targets)
    leaves = V4_BINDING.quantized_weights(block)   # what the exporter encodes
    assert len(leaves) >= 30                                   # every linear of the layer
    checked = 0
    for wname, leaf in leaves.items():
        target = "moe" if ".ffn." in wname else "attn-linear"
        group = qc["config_groups"][target]
        fake = leaf.weight_quantizer(leaf.weight).float()
        d = leaf.weight_quantizer.export(leaf.weight)
        tensors = ct.encode_weight("m", leaf.weight_quantizer.spec, leaf.input_quantizer.spec, d, tuple(leaf.weight.shape))
        local = {k[2:]: v for k, v in tensors.items()}
        compressor = BaseCompressor.get_value_from_registry(group["format"])
        out = compressor.decompress(dict(local), _ct_scheme(group))
        assert torch.equal(out["weight"].float(), fake), (name, wname)
        # and the library's packing / dtype conventions, as a second opinion on the layout
        if "weight_packed" in local and local["weight_packed"].dtype == torch.int32:
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
            from amct_ext.quant.packing import unpack_int32

            bits = leaf.weight_quantizer.spec.bits
            codes = unpack_int32(local["weight_packed"], bits, leaf.weight.shape[1])
            assert torch.equal(pack_to_int32(codes, bits), local["weight_packed"])
        # our own reader decodes the same tensors to the same weight
        parts = group_parts(list(tensors))["m.weight"]
        mine = decode(lambda k: tensors[k], parts, tuple(leaf.weight.shape), None, "m.weight")
        assert torch.equal(mine, fake)
        checked += 1
    assert checked == len(leaves)


def test_kv_cache_scheme_parses():
    from compressed_tensors.quantization import QuantizationConfig

    from amct_ext.export import compressed_tensors as ct
    from amct_ext.quant.schemes import load_scheme

    from models.deepseek_v4.binding import V4_BINDING

    qc = ct.quantization_config(load_scheme("w8a8"), ["attn-linear", "attn-cache", "moe"], (),
                                V4_BINDING.module_patterns, V4_BINDING.unquantized_modules)
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.kv_cache_scheme is not None and parsed.kv_cache_scheme.num_bits == 8
    assert parsed.kv_cache_scheme.strategy == "token" and parsed.kv_cache_scheme.dynamic is True
    assert "head" in parsed.ignore


def test_group_targets_match_the_loaders_module_names():
    """config_groups / ignore regexes select the same modules under the release's flat names,
    vLLM's mapped names and transformers' renamed modules (casebook/export.md, E6)."""
    import re

    from models.deepseek_v4.binding import V4_BINDING

    def hit(patterns, name):
        return any(re.match(p[3:], name) if p.startswith("re:") else p == name for p in patterns)

    attn = ["layers.1.attn.wq_a", "layers.1.attn.indexer.compressor.wkv",                # release
            "model.layers.1.attn.fused_wqa_wkv", "model.layers.1.attn.mla_attn.compressor.fused_wkv_wgate",  # vLLM
            "model.layers.1.self_attn.q_a_proj", "model.layers.1.self_attn.compressor.indexer.kv_proj"]    # transformers
    moe = ["layers.0.ffn.experts.7.w2", "layers.0.ffn.shared_experts.w1", "model.layers.0.ffn.experts",
           "model.layers.0.ffn.shared_experts.down_proj", "model.layers.0.mlp.experts", "model.layers.0.mlp.shared_experts.up_proj"]
    never = ["head", "lm_head", "layers.0.ffn.gate", "model.layers.0.mlp.gate", "mtp.0.e_proj", "mtp.0.h_proj"]
    g = V4_BINDING.module_patterns           # the model's names (amct_ext/ knows none)
    assert all(hit(g["attn-linear"], n) and not hit(g["moe"], n) for n in attn)
    assert all(hit(g["moe"], n) and not hit(g["attn-linear"], n) for n in moe)
    ignore = V4_BINDING.unquantized_modules
    assert all(hit(ignore, n) for n in never) and not any(hit(ignore, n) for n in attn + moe)


def test_a_target_without_module_names_is_refused():
    """A model binding that declares no module names for a target gets one line, not a config
    group that selects nothing."""
    import pytest

    from amct_ext.errors import QuantConfigError
    from amct_ext.export import compressed_tensors as ct
    from amct_ext.quant.schemes import load_scheme

    with pytest.raises(QuantConfigError, match="no module names for target moe"):
        ct.quantization_config(load_scheme("w8a8"), ["attn-linear", "moe"], (), {"attn-linear": ("re:.*attn.*",)})
    qc = ct.quantization_config(load_scheme("w8a8"), ["attn-linear"], [3], {"attn-linear": ("re:.*attn.*",)}, ("h",))
    assert qc["config_groups"]["attn-linear"]["targets"] == ["re:.*attn.*"]
    assert qc["ignore"] == ["h", r"re:.*layers\.3\..*"]
