"""DeepSeek-V4's ``ModelBinding``: what the export, the job plan (its built-in model names, their
defaults and checkpoints: cli.py) and the torchrun cost model need to know about V4 without a
running adapter (``amct_ext/`` never imports ``models``; it looks the
binding up by config.json ``model_type``, ``amct_ext.base.model_binding``). Registered when
``models.deepseek_v4`` is imported."""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch
from torch import nn

from amct_ext.base import ModelBinding, register_model_binding
from amct_ext.pipeline.ptq_units import PtqUnit

from . import cli


class V4Binding(ModelBinding):
    model_type = "deepseek_v4"
    #: the pairs of QuantV4Attention / QuantV4Expert.smoothing_subgraphs (quant_module.py)
    smoothing_pairs = ("attn_norm", "q_norm", "wo_a", "w3")
    #: AMCT's every attention linear (also wo_a, the compressors, the indexer's weights_proj;
    #: quant_module.py), with attn-linear's specs
    wider_targets = {"attn-linear-all": "attn-linear"}
    #: the MTP layers ``mtp.{j}.*`` (mtp.py)
    extra_layers = "mtp"
    #: QuantV4Expert.PROJECTIONS (quant_module.py)
    gated_projections = {"gate": "w1", "up": "w3", "down": "w2"}
    #: the regexes match the module names of the three loaders: the release's flat names
    #: (``layers.0.attn.wq_a``), vLLM's after its WeightsMapper (``model.layers.0.attn.fused_wqa_wkv``,
    #: ``...attn.mla_attn.compressor...``, the FusedMoE ``...ffn.experts``) and transformers' renames
    #: (``model.layers.0.self_attn.q_a_proj``, ``...mlp.experts``, ``...mlp.shared_experts.down_proj``)
    module_patterns = {"attn-linear": (r"re:.*\.(attn|self_attn)\..*",),
                       "moe": (r"re:.*\.(ffn|mlp)\.(experts|shared_experts)(\..*)?$",)}
    #: never quantized by this tool (heads, router, the MTP layer's projections)
    unquantized_modules = ("head", "lm_head", r"re:.*\.(ffn|mlp)\.gate$", r"re:.*mtp\.\d+\.(e_proj|h_proj|head)$")

    def check_config(self, model_path) -> None:
        from .adapter import check_config_fields

        check_config_fields(model_path)

    def load_config(self, model_path) -> Any:
        from .loading import load_config

        return load_config(model_path)

    def build_layer(self, reader, config, layer_idx: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        from .loading import load_block

        # no expert packing: the export never runs the layer, and packing holds two copies
        block, _ = load_block(reader, config, layer_idx, dtype, device, pack_experts=False)
        return block

    def build_extra_layer(self, reader, config, j: int, dtype: torch.dtype, device: torch.device) -> nn.Module | None:
        from .mtp import load_complete_mtp_block

        return load_complete_mtp_block(reader, config, j, dtype, device)

    def quantize_block(self, block: nn.Module, scheme, targets: Sequence[str]) -> nn.Module:
        from . import quant_module

        return quant_module.quantize_block(block, scheme, targets)

    def iter_ptq_units(self, block: nn.Module, layer_idx: int, targets: Sequence[str]) -> Iterator[PtqUnit]:
        from . import quant_module

        return quant_module.iter_block_ptq_units(block, layer_idx, targets)

    def quantized_weights(self, block: nn.Module) -> dict[str, nn.Module]:
        """QuantLinear leaves by their own weight; a WoAQuant (the grouped output projection's
        quantizer, a child of the attention) holds the checkpoint's ``attn.wo_a.weight``."""
        from amct_ext.quant.quant_linear import QuantLinear

        from .quant_module import WoAQuant

        leaves: dict[str, nn.Module] = {}
        for name, mod in block.named_modules():
            if isinstance(mod, QuantLinear) and not mod.weight_quantizer.is_identity:
                leaves[f"{name}.weight"] = mod
            elif isinstance(mod, WoAQuant) and not mod.weight_quantizer.is_identity:
                leaves[f"{name.rpartition('.')[0]}.wo_a.weight"] = mod
        return leaves

    #: the built-in models (cli.py): the tinies (generated or shipped) and the two releases
    model_names = cli.MODELS

    def model_defaults(self, name):
        return cli.model_defaults(name)

    def resolve_checkpoint(self, name, model_path, download, calib_path):
        path = cli.resolve_checkpoint(name, model_path, download, calib_path)
        cli.check_weights_present(path, name)
        return path

    def plan_spec(self):
        from .plan import DeepseekV4PlanSpec

        return DeepseekV4PlanSpec()

    def check_export(self, export_cfg, profile, planned_params: Sequence[str] = ()) -> None:
        from .serving import check_export

        check_export(export_cfg, profile, planned_params)

    def served_tp_sizes(self, export_cfg, profile) -> list[int]:
        from .serving import servable_tp_sizes

        return servable_tp_sizes(export_cfg, profile)

    def released_config_keys(self, config) -> dict[str, Any]:
        from .configuration import behaviour_keys

        return behaviour_keys(config)

    def layer_cost(self, config, layer_idx: int, targets: Sequence[str], n_tokens: int, epochs: int):
        from .cost import v4_layer_cost

        return v4_layer_cost(config, layer_idx, targets, n_tokens, epochs)


V4_BINDING = register_model_binding(V4Binding())

# the engine profiles (vLLM, vllm-ascend) register themselves with amct_ext.export.engine on import
from . import serving, serving_ascend  # noqa: E402,F401
