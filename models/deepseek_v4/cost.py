"""The cost of a DeepSeek-V4 layer from its shapes: what the torchrun layer split balances
(``amct_ext.pipeline.distributed.partition_layers``), stated by the adapter
(``DeepseekV4Adapter.layer_cost``) and the export binding (``binding.V4Binding.layer_cost``)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from amct_ext.pipeline.layer_cost import LayerCost
from amct_ext.quant.schemes import parse_targets

from .loading import empty_block


@dataclass(frozen=True)
class CostRates:
    """Stated rates of the cost model (defaults: the H200 figures of benchmarks/RESULTS.md).

    ``unit_overhead_s``: fixed cost per solved unit (issue 15: a routed expert took 0.2-0.3 s
    for 8 calls, launch-bound). ``solve_flop_rate``: effective FLOP/s of the solver's replays
    (forward + backward ~ 6 FLOPs per weight per token per epoch). ``load_bytes_per_s``: build
    and load of a layer (RESULTS §5: 3.36 GiB on disk in 1.14 s). ``forward_flop_rate``: float
    forward, with the per-kind factors measured in RESULTS §4.0 (replay, S = 4096)."""

    unit_overhead_s: float = 0.25
    solve_flop_rate: float = 1.0e14
    load_bytes_per_s: float = 3.0e9
    forward_flop_rate: float = 2.0e14
    kind_factor: tuple[tuple[int, float], ...] = ((0, 1.0), (4, 10.02 / 6.84), (128, 7.89 / 6.84))


def _param_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


_COUNTS: dict[tuple, tuple[int, int, int, int]] = {}


def _v4_param_counts(config: Any, layer_idx: int) -> tuple[int, int, int, int]:
    """(attention, one routed expert, shared experts, whole layer) weights of a layer, from a
    meta build; cached per layer kind (a meta build of 256 experts takes ~0.5 s)."""
    ratio = int(config.compress_ratios[layer_idx])
    key = (json.dumps(vars(config), sort_keys=True, default=str), ratio, layer_idx < int(config.n_hash_layers))
    if key not in _COUNTS:
        block = empty_block(config, layer_idx)
        shared = block.ffn.shared_experts
        _COUNTS[key] = (_param_count(block.attn), _param_count(block.ffn.experts[0]),
                        _param_count(shared) if shared is not None else 0, _param_count(block))
    return _COUNTS[key]


def v4_target_weight_count(config: Any, layer_idx: int, target: str) -> int:
    """At least how many weights of layer ``layer_idx`` ``target`` quantizes: 'moe' counts the
    routed and shared experts' projections (a V4-Pro layer: 25.4 G routed; every V4 layer has the
    same experts, so one meta-built expert of each width, not the layer); the attention's targets
    count 0 (a lower bound: its projections are a few percent of a layer)."""
    if target != "moe":
        return 0
    from .modeling import Expert

    with torch.device("meta"):
        def width(inter: int) -> int:
            return _param_count(Expert(config.dim, inter, config.swiglu_limit, torch.bfloat16))

        shared = width(config.n_shared_experts * config.moe_inter_dim) if config.n_shared_experts else 0
        return int(config.n_routed_experts) * width(config.moe_inter_dim) + shared


def v4_layer_cost(config: Any, layer_idx: int, targets: Sequence[str], n_tokens: int, epochs: int,
                  rates: CostRates = CostRates()) -> LayerCost:
    """The cost of DeepSeek-V4 layer ``layer_idx`` from its shapes (a meta build, no memory):
    the attention's weights grow with the compress ratio (compressor at 4 and 128, indexer at
    4), the MoE's with the number and width of the experts; a routed expert sees topk / E of
    the tokens. ``n_tokens``: calibration tokens (samples x seq_len)."""
    targets = list(parse_targets(targets)) if targets else []
    attn, expert, shared, total = _v4_param_counts(config, layer_idx)
    n_exp = int(config.n_routed_experts)
    topk = int(config.n_activated_experts)
    ratio = int(config.compress_ratios[layer_idx])
    factor = dict(rates.kind_factor).get(ratio, 1.0)
    routed_tokens = n_tokens * topk / n_exp

    solve_s, n_units = 0.0, 0
    passes = 6.0 * max(1, epochs + 1)          # epochs of forward + backward, plus the loss evaluations
    if "attn-linear" in targets or "attn-linear-all" in targets:
        n_units += 1
        solve_s += passes * attn * n_tokens / rates.solve_flop_rate
    if "moe" in targets:
        n_units += n_exp + (1 if shared else 0)
        solve_s += passes * (n_exp * expert * routed_tokens + shared * n_tokens) / rates.solve_flop_rate
    solve_s += n_units * rates.unit_overhead_s
    # release layout: FP4 experts (~0.53 byte / weight with scales), FP8 elsewhere (~1.0)
    disk_bytes = 0.53 * n_exp * expert + 1.0 * (total - n_exp * expert)
    active = attn + topk * expert + shared
    forward_s = 2.0 * active * n_tokens * factor / rates.forward_flop_rate
    return LayerCost(float_s=disk_bytes / rates.load_bytes_per_s + forward_s, solve_s=solve_s)
