"""Building DeepSeek-V4 from a released checkpoint: the meta skeleton, one layer at a time, or whole.

A layer is built on the meta device (no allocation, no init cost), its tensors are read from the
checkpoint straight onto the target device (FP8 / FP4 dequantized there), assigned into the module
with their dtypes taken from the skeleton (so the fp32 islands stay fp32 -- never a blanket
``.bfloat16()``), and only the derived buffers (rope tables) are recomputed on that device.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from amct_ext.io.checkpoint import CheckpointReader
from amct_ext.runtime.empty import assert_materialized, empty_weights, paused_gc
from amct_ext.errors import CheckpointError, ConfigError
from amct_ext.export.readback import PART_SUFFIXES, exported_quant

from .configuration import DeepseekV4Config
from .modeling import Block, DeepseekV4ForCausalLM, RotaryTable

log = logging.getLogger(__name__)

# top-level (non-layer) tensors of the release, each loaded with the stem
TOP_LEVEL_PREFIXES = ("embed.", "norm.", "head.", "hc_head_")


@dataclass
class KeyAccount:
    """Every checkpoint key ends up in exactly one list."""

    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)      # mtp.* (not part of the main forward)
    unexpected: list[str] = field(default_factory=list)   # present in the checkpoint, unknown to the model

    def summary(self) -> str:
        return f"{len(self.loaded)} loaded, {len(self.skipped)} skipped (mtp), {len(self.unexpected)} unexpected"


def load_config(path: str | os.PathLike) -> DeepseekV4Config:
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise CheckpointError(f"{cfg}: config.json not found (is {path} a DeepSeek-V4 checkpoint folder?)")
    try:
        return DeepseekV4Config.from_pretrained(path)
    except ConfigError as e:
        raise ConfigError(f"{cfg}: {e}") from None
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"{cfg}: invalid config ({e})") from None


def build_skeleton(config: DeepseekV4Config, dtype: torch.dtype = torch.bfloat16) -> DeepseekV4ForCausalLM:
    """The whole model with every parameter and buffer on the meta device."""
    with empty_weights(), paused_gc():
        return DeepseekV4ForCausalLM(config, dtype=dtype)


def empty_block(config: DeepseekV4Config, layer_id: int, dtype: torch.dtype = torch.bfloat16) -> Block:
    with empty_weights():
        return Block(layer_id, config, dtype)


def materialize_derived_buffers(module: nn.Module, device: torch.device | str) -> None:
    """Recompute non-persistent derived buffers (rope tables) on ``device`` after a meta build."""
    for sub in module.modules():
        if isinstance(sub, RotaryTable):
            sub.materialize(device)


def _assign(module: nn.Module, tensors: dict[str, torch.Tensor], what: str, partial: bool = False,
            filled: Collection[str] = ()) -> None:
    """``tensors`` become ``module``'s parameters and buffers; ``filled``: names already loaded
    into the module's own tensors (``load_prefix(into=...)``), not missing."""
    result = module.load_state_dict(tensors, strict=False, assign=True)
    missing = [] if partial else [k for k in result.missing_keys if k not in filled]
    if missing or result.unexpected_keys:  # the reader already accounted; this is a bug guard
        raise CheckpointError(f"{what}: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}")


def load_block(reader: CheckpointReader, config: DeepseekV4Config, layer_id: int,
               dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
               check_finite: bool = True, pack_experts: bool = True) -> tuple[Block, list[str]]:
    """Build decoder layer ``layer_id`` from the checkpoint on ``device``; returns (block, loaded keys).

    ``check_finite``: NaN / Inf in a decoded tensor is an error naming it and its shard
    (``CheckpointReader.load_prefix``); False only for benchmarks measuring that check.
    ``pack_experts``: the routed experts are decoded straight into the grouped-GEMM stacks
    (``MoE.packed_slots``), one copy of them at the build's peak; False leaves them as separate
    tensors (for callers that never run the layer's forward: the export)."""
    block = empty_block(config, layer_id, dtype)
    prefix = f"layers.{layer_id}."
    expected = block.state_dict()
    into = {f"ffn.{k}": v for k, v in block.ffn.packed_slots(device).items()} if pack_experts else {}
    result = reader.load_prefix(prefix, expected, device=device, dtype=dtype, check_finite=check_finite, into=into)
    _assign(block, result.tensors, f"layer {layer_id}", filled=into)
    materialize_derived_buffers(block, device)
    assert_materialized(block, f"layer {layer_id}")
    return block.eval(), [prefix + k for k in result.loaded] + [prefix + k for k in result.unexpected]


def load_stem(reader: CheckpointReader, model: DeepseekV4ForCausalLM, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Load embed / norm / head / hc_head_* into ``model`` (a skeleton); returns the keys consumed."""
    expected = {k: v for k, v in model.state_dict().items() if not k.startswith("layers.")}
    consumed = []
    for prefix in TOP_LEVEL_PREFIXES:
        want = {k: v for k, v in expected.items() if k.startswith(prefix)}
        result = reader.load_prefix(prefix, want, device=device, dtype=dtype, strip_prefix=False)
        _assign(model, result.tensors, f"top-level {prefix}*", partial=True)
        consumed += result.loaded + result.unexpected
    return consumed


def account_keys(reader: CheckpointReader, consumed: set[str]) -> KeyAccount:
    """Split every checkpoint key into loaded / skipped (mtp) / unexpected; scales count with their weight."""
    account = KeyAccount()
    for key in reader.keys():
        base = None
        for suffix in (".scale",) + PART_SUFFIXES:   # companions count with their weight
            if key.endswith(suffix):
                base = key[: -len(suffix)] + ".weight"
                break
        if key in consumed or (base is not None and base in consumed):
            account.loaded.append(key)
        elif key.startswith("mtp."):
            account.skipped.append(key)
        else:
            account.unexpected.append(key)
    if account.unexpected:
        log.warning("checkpoint %s: %d keys the model does not use: %s", reader.root, len(account.unexpected),
                    ", ".join(account.unexpected[:10]))
    return account


def apply_exported_activations(block: Block, exported, layer_id: int) -> Block:
    """An exported checkpoint's weights are already on the grid; what it still declares is the
    dynamic activation (and cache) quantization: wrap the block with those specs only."""
    if exported is None or not exported.targets or layer_id not in exported.layers:
        return block
    from . import quant_module

    quant_module.quantize_block(block, exported.scheme, exported.targets)
    quant_module.set_quant_enabled(block, True)
    _float_leaves_unquantized(block, exported.float_weights, layer_id)
    return block


def _float_leaves_unquantized(block: Block, float_weights, layer_id: int) -> None:
    """A leaf inside a quantized target whose weight the export left FLOAT (msModelSlim's ``wo_b``)
    runs float in the engine, input included: its input quantizer becomes the identity (an
    identity quantizer, not mode 'off', so no later ``set_activation_mode`` turns it back on)."""
    if not float_weights:
        return
    from amct_ext.quant.quant_linear import QuantLinear
    from amct_ext.quant.quantizers import ActivationQuantizer

    for name, leaf in block.named_modules():
        if isinstance(leaf, QuantLinear) and f"layers.{layer_id}.{name}.weight" in float_weights:
            leaf.input_quantizer = ActivationQuantizer(None)


def load_checkpoint_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                          device: torch.device | str = "cpu", return_account: bool = False):
    """The whole float model with weights loaded (BF16 or FP8/FP4 checkpoints alike), eval mode."""
    config = load_config(path)
    model = build_skeleton(config, dtype)
    with CheckpointReader(path) as reader:
        consumed = set(load_stem(reader, model, device, dtype))
        exported = exported_quant(path)
        for i in range(config.n_layers):
            block, keys = load_block(reader, config, i, dtype, device)
            apply_exported_activations(block, exported, i)
            model.layers[i] = block
            consumed.update(keys)
        account = account_keys(reader, consumed)
    model.config = config
    assert_materialized(model, "model")
    model.eval()
    return (model, account) if return_account else model
