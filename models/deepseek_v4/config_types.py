"""The JSON types of config.json's fields, checked before the config object is built (issue 36.3).

``DeepseekV4Config`` converts and combines fields as it builds itself (``int(r)`` over
``compress_ratios``, ``rope_scaling.get(...)``, transformers' own rope validators), so a string
where a number belongs used to surface as a ``ValueError`` about an ``int()`` literal, an
``AttributeError`` traceback, or a message naming the runtime attribute (``dim``) instead of the
file's field (``hidden_size``) (casebook i36t-6). Here every field present is checked against
its JSON type first; the error names config.json, the field, the value and its type.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from amct_ext.errors import ConfigError

INT_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size",
              "num_experts_per_tok", "qk_rope_head_dim", "sliding_window", "num_hash_layers",
              "num_nextn_predict_layers", "max_position_embeddings", "q_lora_rank", "head_dim", "o_groups",
              "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters",
              "n_routed_experts", "n_shared_experts", "num_key_value_heads", "bos_token_id", "eos_token_id")
NUMBER_FIELDS = ("rms_norm_eps", "routed_scaling_factor", "compress_rope_theta", "rope_theta", "hc_eps",
                 "swiglu_limit")
STRING_FIELDS = ("scoring_func", "model_type")
ROPE_NUMBERS = ("factor", "beta_fast", "beta_slow")
ROPE_INTS = ("original_max_position_embeddings",)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _bad(cfg: Path, field: str, want: str, value: Any) -> ConfigError:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return ConfigError(f"{cfg}: field {field!r} must be {want}, got {shown} ({type(value).__name__})")


def check_config_types(raw: dict[str, Any], cfg: Path) -> None:
    """Raise one ConfigError for the first field of ``raw`` (config.json at ``cfg``) whose JSON
    type is wrong."""
    for f in INT_FIELDS:
        if f in raw and raw[f] is not None and not _is_int(raw[f]):
            raise _bad(cfg, f, "an integer", raw[f])
    for f in NUMBER_FIELDS:
        if f in raw and raw[f] is not None and not _is_number(raw[f]):
            raise _bad(cfg, f, "a finite number", raw[f])
    for f in STRING_FIELDS:
        if f in raw and not isinstance(raw[f], str):
            raise _bad(cfg, f, "a string", raw[f])
    ratios = raw.get("compress_ratios")
    if ratios is not None:
        if not isinstance(ratios, list):
            raise _bad(cfg, "compress_ratios", "a list of integers (one per layer)", ratios)
        for i, r in enumerate(ratios):
            if not _is_int(r):
                raise _bad(cfg, f"compress_ratios[{i}]", "an integer", r)
    for name in ("rope_scaling", "quantization_config"):
        if raw.get(name) is not None and not isinstance(raw[name], dict):
            raise _bad(cfg, name, "an object (or null)", raw[name])
    rope = raw.get("rope_scaling") or {}
    for f in ROPE_NUMBERS:
        if f in rope and not _is_number(rope[f]):
            raise _bad(cfg, f"rope_scaling.{f}", "a finite number", rope[f])
    for f in ROPE_INTS:
        if f in rope and not _is_int(rope[f]):
            raise _bad(cfg, f"rope_scaling.{f}", "an integer", rope[f])


__all__ = ["check_config_types"]
