"""Tiny DeepSeek-V4 configs and deterministic random weights, for tests and the smoke run.

Every layer kind is present: ratio 0 (window only), ratio 4 (overlapping compressor + indexer),
ratio 128; hash-routed and score-routed MoE layers; hc_mult 4.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .configuration import DeepseekV4Config
from .modeling import Block, DeepseekV4ForCausalLM, Gate

# official (HF) names, like a released config.json
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "num_hash_layers": 2,
    "num_nextn_predict_layers": 1,
    "compress_ratios": [0, 4, 128, 4, 0],  # 4 main layers + 1 MTP entry
    "sliding_window": 8,
    "index_n_heads": 4,
    "index_head_dim": 16,
    "index_topk": 8,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 128,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 512,  # = factor * original: keeps transformers' YaRN check quiet
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def tiny_config(**overrides: Any) -> DeepseekV4Config:
    """The tiny config; overrides use official names (e.g. hidden_size=128) or runtime names."""
    values = {**TINY_CONFIG, **overrides}
    return DeepseekV4Config(**values)


@torch.no_grad()
def init_block_weights(block: Block, config: DeepseekV4Config, generator: torch.Generator) -> None:
    """Draw a block's weights so activations stay O(1) and routing spreads over the experts."""
    def normal(p: torch.Tensor, std: float, mean: float = 0.0) -> None:
        p.copy_((torch.randn(p.shape, generator=generator) * std + mean).to(p.dtype))

    for name, p in block.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "weight" and p.dim() == 2:  # linears and the router: unit-variance outputs
            normal(p, 1.0 / math.sqrt(p.shape[1]))
        elif leaf == "weight":  # RMSNorm
            normal(p, 0.1, 1.0)
        elif leaf in ("hc_attn_fn", "hc_ffn_fn"):
            normal(p, 0.02)
        elif leaf in ("hc_attn_base", "hc_ffn_base"):
            normal(p, 0.5)
        elif leaf in ("hc_attn_scale", "hc_ffn_scale"):
            normal(p, 0.1, 1.0)
        elif leaf == "attn_sink":
            normal(p, 1.0)
        elif leaf == "ape":
            normal(p, 0.5)
        elif leaf == "bias":
            normal(p, 0.1)
        else:
            raise AssertionError(f"no init rule for {name}")
    for module in block.modules():
        if isinstance(module, Gate) and module.hash:
            # each token id gets `topk` distinct experts
            ranks = torch.rand(config.vocab_size, config.n_routed_experts, generator=generator).argsort(dim=-1)
            module.tid2eid.copy_(ranks[:, : module.topk])


@torch.no_grad()
def init_random_weights(model: DeepseekV4ForCausalLM, seed: int = 0) -> DeepseekV4ForCausalLM:
    """Deterministic random weights for a whole model (independent of the compute dtype)."""
    gen = torch.Generator().manual_seed(seed)
    config = model.config
    model.embed.weight.copy_(torch.randn(model.embed.weight.shape, generator=gen).to(model.embed.weight.dtype))
    for block in model.layers:
        init_block_weights(block, config, gen)
    model.norm.weight.copy_(1.0 + 0.1 * torch.randn(model.norm.weight.shape, generator=gen))
    model.head.weight.copy_(torch.randn(model.head.weight.shape, generator=gen) / math.sqrt(config.dim))
    model.hc_head_fn.copy_(0.02 * torch.randn(model.hc_head_fn.shape, generator=gen))
    model.hc_head_base.copy_(0.5 * torch.randn(model.hc_head_base.shape, generator=gen))
    model.hc_head_scale.copy_(1.0 + 0.1 * torch.randn(model.hc_head_scale.shape, generator=gen))
    return model


def random_mtp_tensors(config: DeepseekV4Config, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A few ``mtp.0.*`` tensors like the release carries (not part of the main forward)."""
    d = config.dim
    return {
        "mtp.0.enorm.weight": torch.ones(d, dtype=torch.float32),
        "mtp.0.hnorm.weight": torch.ones(d, dtype=torch.float32),
        "mtp.0.e_proj.weight": (torch.randn(d, d, generator=generator) / math.sqrt(d)).to(torch.bfloat16),
        "mtp.0.h_proj.weight": (torch.randn(d, d, generator=generator) / math.sqrt(d)).to(torch.bfloat16),
    }


def random_tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> DeepseekV4ForCausalLM:
    config = tiny_config(**overrides)
    model = DeepseekV4ForCausalLM(config, dtype=dtype)
    return init_random_weights(model, seed).eval()


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# Bump when make_tiny_checkpoint writes something else for the same config and seed (new init
# rule, new tensor order, new config.json keys): cached checkpoints are keyed by it and by the
# config (tiny_cache_key). 2: config.json carries the released config's behaviour keys
# (hidden_act, norm_topk_prob, topk_method, ...; weights unchanged).
GENERATOR_VERSION = 2


def tiny_cache_key(text_path=None, fmt: str = "bf16", seed: int = 0, **overrides: Any) -> str:
    """A short hash of everything that makes a tiny checkpoint: config, generator version, format,
    seed and the tokenizer's training text (its bytes). A cache folder named by it is never stale."""
    import hashlib
    import json
    from pathlib import Path

    h = hashlib.sha256()
    h.update(json.dumps({**TINY_CONFIG, **overrides}, sort_keys=True).encode())
    h.update(f"\0gen{GENERATOR_VERSION}\0{fmt}\0{seed}\0".encode())
    h.update(Path(text_path or default_text_path()).read_bytes())
    return h.hexdigest()[:16]


def default_text_path():
    from amct_ext.pipeline.calibration import DEFAULT_CALIBRATION_PATH

    return DEFAULT_CALIBRATION_PATH


def make_tiny_checkpoint(out_dir, fmt: str = "bf16", seed: int = 0, text_path=None, n_shards: int = 2, **overrides):
    """Random tiny checkpoint (config.json, shards + index, mtp.0.*, tokenizer) in ``out_dir``."""
    from pathlib import Path

    from amct_ext.pipeline.tokenizer import tokenizer_vocab_size, train_bpe_tokenizer

    from .release_format import write_release_checkpoint

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_config(**overrides)
    train_bpe_tokenizer(text_path or default_text_path(), config.vocab_size, out_dir)
    actual = tokenizer_vocab_size(out_dir)
    if actual > config.vocab_size:
        raise ValueError(f"tokenizer has {actual} entries but the model vocab is {config.vocab_size}")
    model = DeepseekV4ForCausalLM(config, dtype=torch.float32)
    init_random_weights(model, seed)
    mtp = random_mtp_tensors(config, torch.Generator().manual_seed(seed + 1))
    return write_release_checkpoint(model.state_dict(), config, out_dir, fmt=fmt, n_shards=n_shards, extra=mtp)
