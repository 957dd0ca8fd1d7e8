"""DeepSeek-V4 adapter: binds the blockwise framework (amct_ext.base.BaseModel) to this model.

What is V4-specific here
- The hidden state is 4-D ``[B, S, hc, D]`` (hyper-connections) from the embedding to the head;
  the head collapses the hc copies (``hc_head_*``) before the final norm.
- ``Block.forward(x, start_pos=0, input_ids=None)``: hash-routed MoE layers need each sample's
  ``input_ids``. They travel through the per-sample state channel (``self.sample_state``), which
  ``do_embedding_forward`` fills from what the Catcher records.
- Children are ``attn`` / ``ffn`` (not ``self_attn`` / ``mlp``), so units and wrappers come
  from ``quant_module`` rather than generic name matching; the 'mlp' target is refused.

Memory model: the whole model is a meta skeleton; only the stem (embed, norm, head, hc_head_*)
is loaded for real, and layer ``i`` is built on demand and released after use.

Two build paths for a layer
- CPU staging (``block(i)``): every tensor in host memory; the PTQ solver moves one unit at a
  time to the compute device.
- Sharded (``block(i, sharded=True)``): the layer's device map comes from
  ``dispatch.build_layer_device_map`` over ``shard_devices()``; tensors are read from the
  checkpoint DIRECTLY onto their device (one ``reader.load_prefix`` per device group, FP8 / FP4
  decoded there), then ``dispatch.dispatch_layer`` adds the accelerate hooks that move
  activations between devices. Nothing of the layer passes through host memory as a whole.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections import defaultdict
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from amct_ext.base import BaseModel, RunConfig
from amct_ext.pipeline.capture import Catcher, run_until_caught
from amct_ext.io.checkpoint import CheckpointReader
from amct_ext.runtime.dispatch import (LayerPlacement, build_layer_device_map, dispatch_layer, resolve_device_for,
                                       undispatch_layer)
from amct_ext.runtime.empty import assert_materialized
from amct_ext.errors import CheckpointError, ConfigError
from amct_ext.pipeline.ptq_units import PtqUnit
from amct_ext.quant.schemes import parse_targets

from . import mtp, quant_module
from amct_ext.export.readback import exported_quant

from .loading import apply_exported_activations, build_skeleton, empty_block, load_block, load_config, load_stem
from .modeling import Block, RotaryTable

log = logging.getLogger(__name__)

#: config.json fields without which the defaults would silently describe another model
#: (official name, runtime name(s)); any spelling is accepted. Every field the computation reads
#: whose default is V4-Flash's value is here: a missing one is refused (issue 25.1), never filled
#: from another model (a missing sliding_window moved tiny-trained's RTN PPL 274.23 -> 290.63; a
#: Pro config without routed_scaling_factor would have got Flash's 1.5 instead of 2.5).
REQUIRED_CONFIG_FIELDS = (
    ("vocab_size", "vocab_size"),
    ("hidden_size", "dim"),
    ("num_hidden_layers", "n_layers"),
    ("num_attention_heads", "n_heads"),
    ("moe_intermediate_size", "moe_inter_dim"),
    ("n_routed_experts", "n_routed_experts"),
    ("num_experts_per_tok", "n_activated_experts"),
    ("compress_ratios", "compress_ratios"),
    ("sliding_window", "window_size"),
    ("rope_scaling", "rope_parameters", "rope_factor"),
    ("routed_scaling_factor", "route_scale"),
    ("rope_theta", "rope_theta"),
    ("compress_rope_theta", "compress_rope_theta"),
    ("qk_rope_head_dim", "rope_head_dim"),
    ("head_dim", "head_dim"),
    ("q_lora_rank", "q_lora_rank"),
    ("o_lora_rank", "o_lora_rank"),
    ("o_groups", "o_groups"),
    ("index_n_heads", "index_n_heads"),
    ("index_head_dim", "index_head_dim"),
    ("index_topk", "index_topk"),
    ("hc_mult", "hc_mult"),
    ("hc_sinkhorn_iters", "hc_sinkhorn_iters"),
    ("hc_eps", "hc_eps"),
    ("n_shared_experts", "n_shared_experts"),
    ("scoring_func", "score_func"),
    ("num_hash_layers", "n_hash_layers"),
    ("swiglu_limit", "swiglu_limit"),
    ("rms_norm_eps", "norm_eps"),
    ("max_position_embeddings", "max_seq_len"),
)

# attribute set on a sharded block: the devices its map was built over (for re-dispatch)
_SHARD_ATTR = "_amct_shard_devices"


#: how a V4 layer is spread over devices (runtime/dispatch.py): attention, its indexer (the
#: ratio-4 layers), routed experts one unit each; the rest (norms, hc, gate, shared expert) is the stem
V4_PLACEMENT = LayerPlacement(attn="attn", attn_side="attn.indexer", experts_prefix="ffn.experts.")


def check_config_fields(model_path) -> None:
    """One clear error naming config.json and the first missing required field."""
    from pathlib import Path

    from .config_types import check_config_types

    cfg = Path(model_path) / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"{cfg}: config.json not found (is {model_path} a DeepSeek-V4 checkpoint folder?)")
    try:
        raw = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(f"{cfg}: cannot read JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{cfg}: expected a JSON object at the top level")
    check_config_types(raw, cfg)   # a string where a number belongs: named by its config.json field
    for names in REQUIRED_CONFIG_FIELDS:
        if not any(n in raw for n in names):
            alts = [n for n in dict.fromkeys(names[1:]) if n != names[0]]
            alt = f" (or {' / '.join(map(repr, alts))})" if alts else ""
            raise ConfigError(f"{cfg}: required field {names[0]!r}{alt} is missing (its default would be "
                              "another model's value)")


class _DropPartialLoadWarnings(logging.Filter):
    """The sharded path reads a layer with one ``load_prefix`` per device; each call sees the
    other devices' keys as "not expected". Those are accounted for across all calls by
    ``_load_sharded`` (which reports keys no device took), so the per-call warning is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("checkpoint keys under")


@contextlib.contextmanager
def _quiet_partial_loads() -> Iterator[None]:
    logger = logging.getLogger("amct_ext.io.checkpoint")
    f = _DropPartialLoadWarnings()
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


class DeepseekV4Adapter(BaseModel):
    """Blockwise access to a DeepSeek-V4 checkpoint folder (V4-Flash, V4-Pro, tiny)."""

    extra_layers = mtp.MTP_NAME

    def __init__(self, run: RunConfig):
        super().__init__(run)
        check_config_fields(self.model_path)
        self.config = load_config(self.model_path)
        self.reader = CheckpointReader(self.model_path)
        # an exported checkpoint (amct_ext.export): weights on the grid, activations quantized
        # dynamically as its config declares; None for a release
        self.exported = exported_quant(self.model_path)
        self.dtype = run.dtype
        self.model: nn.Module | None = None
        self._stem_loaded = False

    # ------------------------------------------------------------------ identity / limits
    @property
    def num_layers(self) -> int:
        return int(self.config.n_layers)

    @property
    def max_seq_len(self) -> int:
        return int(self.config.max_seq_len)

    def model_id(self) -> dict[str, Any]:
        """Identifies the checkpoint in ptq_params/meta.json: the hash of its config.json (a moved
        folder is the same model; a different architecture or size is not)."""
        blob = (self.model_path / "config.json").read_bytes()
        return {"name": self.model_path.name, "config_sha256": hashlib.sha256(blob).hexdigest()}

    # ------------------------------------------------------------------ skeleton and stem
    def empty_weights_model(self) -> nn.Module:
        if self.model is None:
            self.model = build_skeleton(self.config, self.dtype)
        return self.model

    def load_embed_state_dict(self) -> None:
        """embed / norm / head / hc_head_* onto the compute device (small next to one layer)."""
        if self._stem_loaded:
            return
        model = self.empty_weights_model()
        load_stem(self.reader, model, self.device, self.dtype)
        self._stem_loaded = True

    # ------------------------------------------------------------------ layers
    def block(self, layer_idx: int, sharded: bool = False, device: str | torch.device | None = None) -> Block:
        if layer_idx >= self.num_layers and layer_idx in self.mtp_layer_ids():
            # the MTP layer's decoder block (one device: it is one layer at the end of the run)
            with _quiet_partial_loads():
                return mtp.load_mtp_block(self.reader, self.config, layer_idx, self.dtype, device or self.device)
        if not 0 <= layer_idx < self.num_layers:
            raise ConfigError(f"layer index {layer_idx} is out of range: the model has {self.num_layers} layers")
        if not sharded:
            # read + dequantize where the layer will run: on an accelerator that is ~10x faster
            # than decoding on the host and copying (benchmarks/RESULTS.md §5)
            block, _ = load_block(self.reader, self.config, layer_idx, self.dtype, device or "cpu")
            return apply_exported_activations(block, self.exported, layer_idx)
        block = self._load_sharded(layer_idx, self.shard_devices())
        if self.exported is not None and self.exported.targets and layer_idx in self.exported.layers:
            self.quantize_block(block, self.exported.scheme, self.exported.targets)
            quant_module.set_quant_enabled(block, True)
        return block

    def _load_sharded(self, layer_idx: int, devices: Sequence[torch.device]) -> Block:
        """Direct placement: one ``load_prefix`` per device group, tensors decoded on the device."""
        block = empty_block(self.config, layer_idx, self.dtype)
        names = [n for n, _ in block.named_modules() if n]
        dmap = build_layer_device_map(names, devices, V4_PLACEMENT)
        groups: dict[torch.device, dict[str, torch.Tensor]] = defaultdict(dict)
        for key, meta in block.state_dict().items():
            owner = key.rpartition(".")[0]
            groups[resolve_device_for(owner, dmap)][key] = meta
        prefix = f"layers.{layer_idx}."
        tensors: dict[str, torch.Tensor] = {}
        not_taken: set[str] | None = None
        with _quiet_partial_loads():
            for dev, expected in groups.items():
                result = self.reader.load_prefix(prefix, expected, device=dev, dtype=self.dtype)
                tensors.update(result.tensors)
                unexpected = {k for k in result.unexpected if k not in block.state_dict()}
                not_taken = unexpected if not_taken is None else not_taken & unexpected
        if not_taken:
            log.warning("layer %d: checkpoint keys the model does not use: %s", layer_idx,
                        ", ".join(sorted(not_taken)[:10]))
        result = block.load_state_dict(tensors, strict=False, assign=True)
        if result.missing_keys or result.unexpected_keys:  # the reader already checked: a bug guard
            raise CheckpointError(f"layer {layer_idx}: missing {result.missing_keys[:5]}, "
                                  f"unexpected {result.unexpected_keys[:5]}")
        for name, sub in block.named_modules():
            if isinstance(sub, RotaryTable):  # derived buffers: recomputed where they are used
                sub.materialize(resolve_device_for(name, dmap))
        assert_materialized(block, f"layer {layer_idx}")
        dispatch_layer(block, dmap)
        setattr(block, _SHARD_ATTR, list(devices))
        return block.eval()

    def release_block(self, block: nn.Module) -> None:
        if hasattr(block, _SHARD_ATTR):
            delattr(block, _SHARD_ATTR)
        super().release_block(block)

    def unit_device(self, block: nn.Module, unit: PtqUnit) -> torch.device:
        """A sharded layer: the device its placement map gives the unit (the map is rebuilt from
        the block's module names, as ``quantize_block`` does); otherwise the base rule."""
        devices = getattr(block, _SHARD_ATTR, None)
        if devices is None:
            return super().unit_device(block, unit)
        names = [n for n, _ in block.named_modules() if n]
        local = unit.name[len(f"layers.{unit.layer_idx}."):]
        return resolve_device_for(local, build_layer_device_map(names, devices, V4_PLACEMENT))

    # ------------------------------------------------------------------ quantization hooks
    def quantize_block(self, block: Block, scheme, targets: Sequence[str]) -> Block:
        """``quant_module.quantize_block``; a sharded block is re-dispatched afterwards because
        the wrappers replace hooked modules (the new map equals the old one name for name)."""
        devices = getattr(block, _SHARD_ATTR, None)
        if devices is not None:
            undispatch_layer(block)
        quant_module.quantize_block(block, scheme, list(self.parse_targets(targets)))
        if devices is not None:
            names = [n for n, _ in block.named_modules() if n]
            dispatch_layer(block, build_layer_device_map(names, devices, V4_PLACEMENT))
        return block

    @staticmethod
    def parse_targets(targets: str | Sequence[str]) -> list[str]:
        """Validated targets; 'mlp' is refused (V4's feed-forward layers are MoE: use 'moe')."""
        return parse_targets(targets)

    def layer_cost(self, layer_idx: int, targets: Sequence[str], n_tokens: int, epochs: int):
        """V4's cost model from the layer's shapes (``cost.v4_layer_cost``)."""
        from .cost import v4_layer_cost

        return v4_layer_cost(self.config, layer_idx, targets, n_tokens, epochs)

    def target_weight_count(self, layer_idx: int, target: str) -> int:
        """The experts' weights for 'moe' (``cost.v4_target_weight_count``, a meta build)."""
        from .cost import v4_target_weight_count

        return v4_target_weight_count(self.config, layer_idx, target)

    def iter_ptq_units(self, block: Block, layer_idx: int, targets: Sequence[str]) -> Iterator[PtqUnit]:
        return quant_module.iter_block_ptq_units(block, layer_idx, list(self.parse_targets(targets)))

    def prepare_capture(self, block: Block) -> None:
        """The grouped-GEMM MoE path computes all routed experts from stacked weights without
        calling the expert modules, so their forward hooks would never fire: route this block
        through the per-expert loop (same numbers) while capturing."""
        ffn = getattr(block, "ffn", None)
        if ffn is not None:
            ffn.grouped = False

    def end_capture(self, block: Block) -> None:
        """The grouped-GEMM MoE path back on (bit for bit the per-expert loop's numbers on the
        CPU, tests/test_moe_paths.py; at real size the loop costs ~24 s a propagation)."""
        ffn = getattr(block, "ffn", None)
        if ffn is not None:
            ffn.grouped = True

    def set_quant_enabled(self, module: nn.Module, enabled: bool) -> None:
        quant_module.set_quant_enabled(module, enabled)

    def concat_samples(self, inputs, states):
        """V4's block takes ``(x [B, S, hc, D], start_pos, input_ids [B, S])``: samples of one
        shape and one ``start_pos`` concatenate along B (input_ids too: hash routing reads them
        per row); anything else (other keys, mixed shapes) is None, the samples then run one by one."""
        if not inputs or any(x.shape[1:] != inputs[0].shape[1:] for x in inputs):
            return None
        if any(set(st) - {"start_pos", "input_ids"} for st in states):
            return None
        if len({st.get("start_pos", 0) for st in states}) != 1:
            return None
        ids = [st.get("input_ids") for st in states]
        state = {"start_pos": states[0].get("start_pos", 0)}
        if any(i is not None for i in ids):
            if any(i is None or i.shape[0] != x.shape[0] for i, x in zip(ids, inputs)):
                return None
            state["input_ids"] = torch.cat([i.to(inputs[0].device) for i in ids])
        return torch.cat(list(inputs)), state

    # ------------------------------------------------------------------ MTP (mtp.{j}.*)
    def layer_name(self, layer_id: int) -> str:
        """``layers.{i}``, or ``mtp.{j}`` for the MTP layer ``n_layers + j``."""
        n = self.num_layers
        return f"layers.{layer_id}" if layer_id < n else f"mtp.{layer_id - n}"

    def mtp_layer_ids(self) -> list[int]:
        """Layer ids (n_layers + j) of the MTP layers whose block the checkpoint holds completely;
        ``block(id)`` builds them. [] for an exported checkpoint (its MTP is evaluated as exported)."""
        if getattr(self, "_mtp_ids", None) is None:
            self._mtp_ids = [] if self.exported is not None else mtp.complete_mtp_ids(self.reader, self.config)
        return list(self._mtp_ids)

    def _mtp_projections(self, layer_idx: int) -> "mtp.MtpProjections":
        cache = self.__dict__.setdefault("_mtp_proj", {})
        if layer_idx not in cache:
            with _quiet_partial_loads():
                cache[layer_idx] = mtp.load_mtp_projections(self.reader, self.config, layer_idx, self.dtype,
                                                            self.device)
        return cache[layer_idx]

    def mtp_block_inputs(self, layer_idx: int, hidden: Sequence[torch.Tensor],
                         states: Sequence[dict[str, Any]]) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        """The MTP block's inputs from the last main layer's outputs ``hidden`` (one per sample)
        and the samples' tokens: position i combines h_i with embed(t_{i+1}) (models/deepseek_v4/mtp.py)."""
        self.load_embed_state_dict()
        return mtp.block_inputs(self._mtp_projections(layer_idx), self.empty_weights_model().embed, hidden, states)

    @torch.no_grad()
    def mtp_logits(self, layer_idx: int, y: torch.Tensor) -> torch.Tensor:
        """The MTP block's output [B, S-1, hc, D] -> fp32 logits [B, S-1, V] predicting t_{i+2}."""
        self.load_embed_state_dict()
        return self._mtp_projections(layer_idx).logits(y.to(self.device), self.empty_weights_model().head)

    # ------------------------------------------------------------------ forward hooks
    @torch.no_grad()
    def do_embedding_forward(self, samples: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """embed -> [B, S, hc, D]; layer 0's inputs recorded by a Catcher in the model's own forward.

        The Catcher also records what the model passes to its layers (``start_pos``,
        ``input_ids``): that is each sample's state for ``do_block_forward``.
        """
        self.load_embed_state_dict()
        model = self.empty_weights_model()
        store = "cpu" if self.run.offload_hidden else None
        catcher = Catcher(model.layers[0], store_device=store)
        model.layers[0] = catcher
        try:
            for ids in samples:
                run_until_caught(lambda: model(ids.to(self.device)))
        finally:
            model.layers[0] = catcher.module
        self.sample_state = catcher.kwargs
        return catcher.inputs

    @torch.no_grad()
    def do_head_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """HC head (collapse hc copies) -> norm -> head: fp32 logits [B, S, V] for every position."""
        self.load_embed_state_dict()
        return self.empty_weights_model().head_logits(hidden.to(self.device))

    def close(self) -> None:
        self.reader.close()
