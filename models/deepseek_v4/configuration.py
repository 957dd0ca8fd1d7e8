"""DeepseekV4Config: one config object that speaks both the official HF names and the runtime names.

The released ``config.json`` uses HF-standard names (``hidden_size``, ``num_hidden_layers``, nested
``rope_scaling`` / ``quantization_config``); the reference model code reads runtime names (``dim``,
``n_layers``, ``rope_factor``...). This class accepts either, lets the HF name win when both are
given, stores BOTH on the object (HF tooling reads the HF names), and validates the result.

Two traps handled here (casebook/deepseek-v4.md):
- ``PreTrainedConfig`` owns ``dtype`` (alias of ``torch_dtype``). The checkpoint's storage format
  ("fp8"/"bf16") therefore lives in ``arch_dtype``; ``dtype`` stays the runtime torch dtype.
- transformers >= 5.10 registers its own ``deepseek_v4`` config. This class is NOT registered with
  ``AutoConfig`` so importing the project leaves transformers' registry untouched; use
  ``DeepseekV4Config.from_pretrained`` (or ``load_checkpoint_model``) to get this class.
"""
from __future__ import annotations

import copy
from typing import Any

from transformers import PretrainedConfig

from amct_ext.errors import ConfigError

# official config.json name -> runtime name (spec §1)
HF_TO_RUNTIME: dict[str, str] = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "moe_intermediate_size": "moe_inter_dim",
    "num_experts_per_tok": "n_activated_experts",
    "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps",
    "sliding_window": "window_size",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "num_hash_layers": "n_hash_layers",
    "num_nextn_predict_layers": "n_mtp_layers",
    "max_position_embeddings": "max_seq_len",
}
# rope_scaling key -> runtime name
ROPE_SCALING_TO_RUNTIME: dict[str, str] = {
    "factor": "rope_factor",
    "original_max_position_embeddings": "original_seq_len",
    "beta_fast": "beta_fast",
    "beta_slow": "beta_slow",
}

# Runtime defaults: V4-Flash values (the shared Flash config.json).
RUNTIME_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "dim": 4096,
    "n_layers": 43,
    "n_heads": 64,
    "moe_inter_dim": 2048,
    "n_activated_experts": 6,
    "rope_head_dim": 64,
    "norm_eps": 1e-6,
    "window_size": 128,
    "score_func": "sqrtsoftplus",
    "route_scale": 1.5,
    "n_hash_layers": 3,
    "n_mtp_layers": 1,
    "max_seq_len": 1048576,
    "q_lora_rank": 1024,
    "head_dim": 512,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "compress_ratios": None,  # default: [0]*n_layers + [0]*n_mtp_layers
    "compress_rope_theta": 160000.0,
    "rope_theta": 10000.0,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "swiglu_limit": 10.0,
    "expert_dtype": None,
    "rope_factor": 1.0,
    "original_seq_len": 0,
    "beta_fast": 32,
    "beta_slow": 1,
    "arch_dtype": "bf16",
    "scale_fmt": None,
}

# Keys of the released config.json that describe what the model computes rather than its sizes.
# The model code has one answer for each (below), so a config that says otherwise describes
# another model and is refused; every config.json the project writes carries them, because
# serving engines read them without defaults (vLLM's DeepseekV4MoE reads ``norm_topk_prob``
# and ``hidden_act``, and creates ``ffn.gate.e_score_correction_bias`` only for
# ``topk_method: noaux_tc``; casebook/export.md).
#   hidden_act          Expert: silu(clamp(w1 x)) * clamp(w3 x)           -> "silu"
#   norm_topk_prob      Gate: top-k weights renormalised unless softmax    -> score_func != "softmax"
#   topk_method         Gate: topk(score + bias), bias only for selection  -> "noaux_tc"
#   attention_bias      every attention Linear has no bias                -> False
#   attention_dropout   inference only, no dropout anywhere               -> 0.0
#   initializer_range   not used by the model's math (tiny.py draws its own init); the release's
#   use_cache           generation-time flag of HF / engines; the release's
FIXED_BEHAVIOUR: dict[str, Any] = {
    "hidden_act": "silu",
    "topk_method": "noaux_tc",
    "attention_bias": False,
    "attention_dropout": 0.0,
}
RELEASE_FLAGS: dict[str, Any] = {"initializer_range": 0.02, "use_cache": True}


def behaviour_keys(config: "DeepseekV4Config") -> dict[str, Any]:
    """The released config's behaviour keys with this config's values (for writers that copy
    a config.json which may predate them: every file the project writes carries them)."""
    return {k: getattr(config, k) for k in (*FIXED_BEHAVIOUR, "norm_topk_prob", *RELEASE_FLAGS)}


def derived_norm_topk_prob(score_func: str) -> bool:
    """Whether the Gate renormalises its top-k weights (modeling.Gate: all but softmax do)."""
    return score_func != "softmax"


SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
ARCH_DTYPES = ("bf16", "fp8")
COMPRESS_RATIOS = (0, 4, 128)


class DeepseekV4Config(PretrainedConfig):
    model_type = "deepseek_v4"

    def __init__(self, **kwargs: Any) -> None:
        kw = dict(kwargs)
        values: dict[str, Any] = {}

        # 1. plain runtime names, then HF names on top (HF wins when both are given)
        for name, default in RUNTIME_DEFAULTS.items():
            values[name] = kw.pop(name, default)
        for hf_name, rt_name in HF_TO_RUNTIME.items():
            if hf_name in kw:
                values[rt_name] = kw.pop(hf_name)

        # 2. nested dicts
        rope_scaling = kw.pop("rope_scaling", None)
        # transformers >= 5 renames rope_scaling to rope_parameters (and adds rope_type / rope_theta)
        rope_parameters = kw.pop("rope_parameters", None)
        if rope_scaling is None and isinstance(rope_parameters, dict) and "factor" in rope_parameters:
            rope_scaling = {k: v for k, v in rope_parameters.items() if k not in ("rope_type", "rope_theta")}
        if rope_scaling:
            for key, rt_name in ROPE_SCALING_TO_RUNTIME.items():
                if key in rope_scaling:
                    values[rt_name] = rope_scaling[key]
        quantization_config = kw.pop("quantization_config", None)
        if quantization_config:
            method = quantization_config.get("quant_method")
            # 'compressed-tensors': an export of this tool (amct_ext.export); its tensors describe
            # their own storage, the reader decodes them
            if method not in (None, "fp8", "compressed-tensors"):
                raise ConfigError(f"quantization_config.quant_method: unsupported value {method!r} "
                                  "(expected 'fp8' or 'compressed-tensors')")
            values["arch_dtype"] = "fp8" if method == "fp8" else values["arch_dtype"]
            values["scale_fmt"] = quantization_config.get("scale_fmt", values["scale_fmt"])

        behaviour: dict[str, Any] = {}
        for key, value in FIXED_BEHAVIOUR.items():
            given = kw.pop(key, value)
            if given != value:
                raise ConfigError(f"config key {key!r} is {given!r}, but this model computes {value!r} "
                                  "(models/deepseek_v4/modeling.py)")
            behaviour[key] = value
        norm_topk = derived_norm_topk_prob(str(values["score_func"]))
        given = kw.pop("norm_topk_prob", norm_topk)
        if given != norm_topk:
            raise ConfigError(f"config key 'norm_topk_prob' is {given!r}, but with scoring_func "
                              f"{values['score_func']!r} this model's Gate {'renormalises' if norm_topk else 'does not renormalise'} "
                              "its top-k weights")
        behaviour["norm_topk_prob"] = norm_topk
        for key, default in RELEASE_FLAGS.items():
            behaviour[key] = kw.pop(key, default)

        # The reference's ModelArgs calls the storage format `dtype`; a string "fp8"/"bf16" there is the
        # storage format, a torch dtype is HF's runtime dtype (trap: the two meanings share one name).
        if isinstance(kw.get("dtype"), str) and kw["dtype"] in ARCH_DTYPES:
            values["arch_dtype"] = kw.pop("dtype")

        if values["compress_ratios"] is None:
            values["compress_ratios"] = [0] * (int(values["n_layers"]) + int(values["n_mtp_layers"]))
        values["compress_ratios"] = [int(r) for r in values["compress_ratios"]]
        if rope_scaling is None and values["rope_factor"] != 1.0 and values["original_seq_len"] > 0:
            rope_scaling = {
                "type": "yarn",
                "factor": values["rope_factor"],
                "original_max_position_embeddings": values["original_seq_len"],
                "beta_fast": values["beta_fast"],
                "beta_slow": values["beta_slow"],
            }
        if quantization_config is None and values["arch_dtype"] == "fp8":
            quantization_config = {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "scale_fmt": values["scale_fmt"] or "ue8m0",
                "weight_block_size": [128, 128],
            }

        # torch_dtype (runtime) defaults to bf16 as in the release
        if "torch_dtype" not in kw and "dtype" not in kw:
            kw["torch_dtype"] = "bfloat16"
        for key in ("bos_token_id", "eos_token_id"):
            kw.setdefault(key, {"bos_token_id": 0, "eos_token_id": 1}[key])
        kw.setdefault("tie_word_embeddings", False)
        kw.setdefault("architectures", ["DeepseekV4ForCausalLM"])

        # HF names go through the parent's init so its validators (rope, generation) can read them.
        for hf_name, rt_name in HF_TO_RUNTIME.items():
            kw[hf_name] = values[rt_name]
        super().__init__(**kw)

        for name, value in values.items():
            setattr(self, name, value)
        # Mirror every HF name (HF tooling reads config.max_position_embeddings etc.).
        for hf_name, rt_name in HF_TO_RUNTIME.items():
            setattr(self, hf_name, values[rt_name])
        for key, value in behaviour.items():
            setattr(self, key, value)
        self.rope_scaling = copy.deepcopy(rope_scaling)
        self.quantization_config = copy.deepcopy(quantization_config)
        self.num_key_value_heads = 1
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        file_name = {rt: hf for hf, rt in HF_TO_RUNTIME.items()}
        file_name.update({rt: f"rope_scaling.{k}" for k, rt in ROPE_SCALING_TO_RUNTIME.items()})

        def bad(field: str, why: str) -> ConfigError:
            # the config.json field the user wrote (hidden_size), not the runtime name (dim)
            shown = file_name.get(field, field)
            return ConfigError(f"field {shown!r}" + (f" (DeepseekV4Config.{field})" if shown != field else "")
                               + f": {why}")

        for field in ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "q_lora_rank", "o_groups",
                      "o_lora_rank", "moe_inter_dim", "n_routed_experts", "n_activated_experts", "hc_mult",
                      "window_size", "index_n_heads", "index_head_dim", "index_topk", "hc_sinkhorn_iters"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise bad(field, f"must be a positive integer, got {value!r} ({type(value).__name__})")
        if len(self.compress_ratios) < self.n_layers:
            raise bad("compress_ratios", f"has {len(self.compress_ratios)} entries, fewer than num_hidden_layers={self.n_layers}")
        for i, r in enumerate(self.compress_ratios):
            if r not in COMPRESS_RATIOS:
                raise bad("compress_ratios", f"entry {i} is {r}; supported ratios are {COMPRESS_RATIOS}")
        if self.n_heads % self.o_groups:
            raise bad("o_groups", f"n_heads={self.n_heads} is not divisible by o_groups={self.o_groups}")
        if not 0 < self.rope_head_dim < self.head_dim or self.rope_head_dim % 2:
            raise bad("rope_head_dim", f"must be even and 0 < rope_head_dim < head_dim={self.head_dim}, "
                                       f"got {self.rope_head_dim}")
        if self.rope_head_dim >= self.index_head_dim and any(r == 4 for r in self.compress_ratios[: self.n_layers]):
            raise bad("index_head_dim", f"must exceed rope_head_dim={self.rope_head_dim}, got {self.index_head_dim}")
        if self.score_func not in SCORE_FUNCS:
            raise bad("score_func", f"unknown scoring function {self.score_func!r}; expected one of {SCORE_FUNCS}")
        if self.n_activated_experts > self.n_routed_experts:
            raise bad("n_activated_experts", f"topk={self.n_activated_experts} exceeds n_routed_experts="
                                             f"{self.n_routed_experts}")
        if not 0 <= self.n_hash_layers <= self.n_layers:
            raise bad("n_hash_layers", f"must be within [0, n_layers={self.n_layers}], got {self.n_hash_layers}")
        if self.n_shared_experts not in (0, 1):
            raise bad("n_shared_experts", f"only 0 or 1 shared expert is supported, got {self.n_shared_experts}")
        if self.arch_dtype not in ARCH_DTYPES:
            raise bad("arch_dtype", f"storage format must be one of {ARCH_DTYPES}, got {self.arch_dtype!r}")
        if self.expert_dtype not in (None, "fp4", "fp8", "bf16"):
            raise bad("expert_dtype", f"unsupported expert storage {self.expert_dtype!r}")
        if self.norm_eps <= 0:
            raise bad("norm_eps", f"must be positive, got {self.norm_eps}")
        if self.original_seq_len < 0 or self.rope_factor <= 0:
            raise bad("rope_scaling", f"factor must be > 0 and original_max_position_embeddings >= 0, got "
                                      f"{self.rope_factor} / {self.original_seq_len}")

    # ------------------------------------------------------------------ conveniences
    def layer_ratio(self, i: int) -> int:
        return self.compress_ratios[i]

    def layer_kind(self, i: int) -> str:
        """Short label used in reports: 'r0', 'r4', 'r128' plus routing ('hash'/'score')."""
        route = "hash" if i < self.n_hash_layers else "score"
        return f"r{self.compress_ratios[i]}-{route}"

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        # Runtime mirrors are derived from the HF names on load; keep the file official-style.
        for rt_name in HF_TO_RUNTIME.values():
            out.pop(rt_name, None)
        for rt_name in ROPE_SCALING_TO_RUNTIME.values():
            out.pop(rt_name, None)
        out.pop("scale_fmt", None)
        out.pop("rope_parameters", None)
        if self.original_seq_len > 0:
            out["rope_scaling"] = {
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
                "factor": self.rope_factor,
                "original_max_position_embeddings": self.original_seq_len,
                "type": "yarn",
            }
        if out.get("quantization_config") is None:
            out.pop("quantization_config", None)
        if out.get("rope_scaling") is None:
            out.pop("rope_scaling", None)
        # arch_dtype is carried by quantization_config when fp8; keep it explicit for bf16 too
        return out
