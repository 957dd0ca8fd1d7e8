"""tiny-serve: the built-in tiny V4 of vLLM's kernel geometry (models/deepseek_v4/tiny_serve.py).

Each vLLM rule (VLLM_CONSTRAINTS, with the vLLM file it comes from) is checked on the config the
model is built from and on the config.json that `--model tiny-serve` writes; the plain `tiny`
model, which vLLM cannot run, must break the rules the issue names.
"""
import json

import pytest
import torch

from models.deepseek_v4.tiny import TINY_CONFIG, random_tiny_model
from models.deepseek_v4.tiny_serve import (
    TINY_SERVE_OVERRIDES,
    VLLM_CONSTRAINTS,
    tiny_serve_config_dict,
    violated_vllm_constraints,
)


def test_tiny_serve_config_meets_every_vllm_rule():
    cfg = tiny_serve_config_dict()
    assert violated_vllm_constraints(cfg) == []
    for rule in VLLM_CONSTRAINTS:  # every rule names the vLLM file it comes from
        assert rule.source.startswith(("vllm/", "csrc/")), rule.name


def test_plain_tiny_breaks_the_rules_vllm_enforces():
    broken = set(violated_vllm_constraints(dict(TINY_CONFIG)))
    assert {"compressor head_dim in (512, 128)", "rope dim 64", "n_routed_experts in (64, 128, 256, 384)",
            "num_experts_per_tok in (6, 8)", "index_topk 512"} <= broken


@pytest.mark.parametrize("key,value", [("head_dim", 256), ("qk_rope_head_dim", 32), ("n_routed_experts", 32),
                                       ("num_experts_per_tok", 4), ("index_topk", 256), ("index_head_dim", 64),
                                       ("hidden_act", "gelu"), ("compress_ratios", [0, 4, 16, 4, 0])])
def test_each_rule_can_fail(key, value):
    assert violated_vllm_constraints({**tiny_serve_config_dict(), key: value}), key


def test_tiny_serve_model_runs_and_keeps_every_layer_kind(one_thread):
    model = random_tiny_model(seed=0, **TINY_SERVE_OVERRIDES)
    cfg = model.config
    ratios = cfg.compress_ratios[: cfg.n_layers]
    assert {0, 4, 128} <= set(ratios) and 0 < cfg.n_hash_layers < cfg.n_layers
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params < 8_000_000, n_params  # CI-sized: a few MB in bf16
    ids = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (1, 16, cfg.vocab_size) and torch.isfinite(logits).all()


def test_model_flag_builds_cached_checkpoint(tmp_path, monkeypatch):
    """`--model tiny-serve` resolves to a cached checkpoint (built once) whose config.json has vLLM's geometry."""
    from amct_ext.base import named_model_binding
    from tools import run_ptq

    monkeypatch.setenv("AMCT_CACHE", str(tmp_path))
    binding = named_model_binding("tiny-serve")      # what the library's plan_job asks
    path = binding.resolve_checkpoint("tiny-serve", None, False, None)
    assert path.parent == tmp_path and path.name.startswith("tiny-serve-")
    cfg = json.loads((path / "config.json").read_text())
    assert violated_vllm_constraints(cfg) == []
    assert cfg["head_dim"] == 512 and cfg["n_routed_experts"] == 64
    stamp = (path / "config.json").stat().st_mtime_ns
    assert binding.resolve_checkpoint("tiny-serve", None, False, None) == path and (path / "config.json").stat().st_mtime_ns == stamp
    assert run_ptq.build_parser().parse_args(["--model", "tiny-serve", "--output-dir", str(tmp_path / "o")]).model \
        == "tiny-serve"
