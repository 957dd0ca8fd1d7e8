"""DeepseekV4Config: both naming schemes, nested dicts, arch_dtype, round trips, validation."""
import json

import pytest
import torch
import transformers
from transformers import AutoConfig

from amct_ext.errors import ConfigError
from models.deepseek_v4 import DeepseekV4Config
from models.deepseek_v4.tiny import TINY_CONFIG, tiny_config
from tests.conftest import CONFIGS


@pytest.fixture(scope="module")
def flash():
    return DeepseekV4Config.from_pretrained(CONFIGS / "deepseek-v4-flash.config.json")


@pytest.fixture(scope="module")
def pro():
    return DeepseekV4Config.from_pretrained(CONFIGS / "deepseek-v4-pro.config.json")


def test_flash_values(flash):
    c = flash
    assert (c.dim, c.n_layers, c.n_heads, c.head_dim, c.q_lora_rank) == (4096, 43, 64, 512, 1024)
    assert (c.o_groups, c.o_lora_rank, c.n_routed_experts, c.moe_inter_dim) == (8, 1024, 256, 2048)
    assert (c.n_activated_experts, c.index_topk, c.index_n_heads, c.index_head_dim) == (6, 512, 64, 128)
    assert c.rope_factor == 16 and c.original_seq_len == 65536 and c.beta_fast == 32 and c.beta_slow == 1
    assert c.route_scale == 1.5 and c.score_func == "sqrtsoftplus" and c.n_hash_layers == 3
    assert len(c.compress_ratios) == 44 == c.n_layers + c.n_mtp_layers
    assert c.compress_ratios[:3] == [0, 0, 4] and c.compress_ratios[3] == 128
    assert c.arch_dtype == "fp8" and c.scale_fmt == "ue8m0" and c.expert_dtype == "fp4"
    assert c.dtype == torch.bfloat16
    assert c.window_size == 128 and c.rope_head_dim == 64 and c.max_seq_len == 1048576


def test_pro_values(pro):
    c = pro
    assert (c.dim, c.n_layers, c.n_heads, c.q_lora_rank, c.o_groups) == (7168, 61, 128, 1536, 16)
    assert (c.n_routed_experts, c.moe_inter_dim, c.index_topk) == (384, 3072, 1024)
    assert c.rope_factor == 16 and c.original_seq_len == 65536 and c.route_scale == 2.5
    assert len(c.compress_ratios) == 62 and c.compress_ratios[:2] == [128, 128]
    assert c.arch_dtype == "fp8" and c.dtype == torch.bfloat16 and c.expert_dtype == "fp4"


def test_hf_names_stay_readable(flash):
    assert flash.hidden_size == 4096 and flash.num_hidden_layers == 43
    assert flash.max_position_embeddings == 1048576 and flash.rms_norm_eps == 1e-6
    assert flash.sliding_window == 128 and flash.scoring_func == "sqrtsoftplus"
    assert flash.routed_scaling_factor == 1.5 and flash.num_hash_layers == 3
    assert flash.rope_scaling["factor"] == 16
    assert flash.quantization_config["quant_method"] == "fp8"


def test_runtime_names_accepted_and_hf_wins():
    base = {k: v for k, v in TINY_CONFIG.items() if k not in ("hidden_size", "num_hidden_layers")}
    c = DeepseekV4Config(**base, dim=96, n_layers=3)
    assert c.dim == 96 and c.hidden_size == 96 and c.n_layers == 3 and c.num_hidden_layers == 3
    c = DeepseekV4Config(**base, dim=96, hidden_size=128, n_layers=3)
    assert c.dim == 128 and c.hidden_size == 128
    # the reference's ModelArgs name `dtype="fp8"` means storage format, not torch dtype
    c = DeepseekV4Config(**base, n_layers=3, dtype="fp8")
    assert c.arch_dtype == "fp8"


@pytest.mark.parametrize("name", ["flash", "pro"])
def test_round_trips(name, request, tmp_path):
    c = request.getfixturevalue(name)
    d = c.to_dict()
    assert DeepseekV4Config.from_dict(d).to_dict() == d
    c.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_scaling" in saved and "quantization_config" in saved and "hidden_size" in saved
    assert "dim" not in saved  # the file stays official-style
    again = DeepseekV4Config.from_pretrained(tmp_path)
    assert again.to_dict() == d and again.arch_dtype == "fp8" and again.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "override, field",
    [
        ({"compress_ratios": [0, 4]}, "compress_ratios"),
        ({"o_groups": 3}, "o_groups"),
        ({"qk_rope_head_dim": 32}, "rope_head_dim"),
        ({"scoring_func": "relu"}, "score_func"),
        ({"num_experts_per_tok": 9}, "n_activated_experts"),
        ({"compress_ratios": [0, 4, 64, 4, 0]}, "compress_ratios"),
        ({"hidden_size": 0}, "dim"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quant_method"),
    ],
)
def test_rejects_impossible(override, field):
    with pytest.raises(ConfigError, match=field):
        tiny_config(**override)


def test_transformers_registration_untouched(tmp_path):
    """Importing the project leaves transformers' own deepseek_v4 classes in the Auto registry."""
    import models.deepseek_v4  # noqa: F401

    tiny_config().save_pretrained(tmp_path)
    auto = AutoConfig.from_pretrained(tmp_path)
    assert type(auto) is transformers.DeepseekV4Config
    assert type(DeepseekV4Config.from_pretrained(tmp_path)) is DeepseekV4Config


# ----------------------------------------------------------------------- the released key set
#: keys of the released config.json a written config may lack, and why:
#: - transformers_version: the version of the writer; writing ours would make the bytes (and the
#:   run fingerprints that hash config.json) depend on the installed transformers; no engine reads it
#: - quantization_config (bf16 checkpoints only): the release's value describes FP8 block
#:   tensors; on a bf16 checkpoint vLLM would build FP8 parameters and fail to load it
ALWAYS_EXEMPT = {"transformers_version"}
BF16_EXEMPT = ALWAYS_EXEMPT | {"quantization_config"}
BEHAVIOUR = {"hidden_act": "silu", "norm_topk_prob": True, "topk_method": "noaux_tc", "attention_bias": False,
             "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True}


def released_keys() -> set[str]:
    keys = [set(json.loads((CONFIGS / f"deepseek-v4-{n}.config.json").read_text())) for n in ("flash", "pro")]
    assert keys[0] == keys[1]
    return keys[0]


def assert_released_keys(d: dict, where: str, exempt: set[str]) -> None:
    missing = released_keys() - exempt - set(d)
    assert not missing, f"{where}: lacks released keys {sorted(missing)}"
    for k, v in BEHAVIOUR.items():
        assert d[k] == v, (where, k, d[k])


def test_every_written_config_has_the_released_keys(tiny_ckpt, tiny_ckpt_fp8):
    from models.deepseek_v4.release_format import official_config_dict
    from models.deepseek_v4.synthetic import synthetic_config_dict
    from tests.export_helpers import TINY

    assert_released_keys(official_config_dict(tiny_config(), "bf16"), "official_config_dict bf16", BF16_EXEMPT)
    assert_released_keys(official_config_dict(tiny_config(), "fp8"), "official_config_dict fp8", ALWAYS_EXEMPT)
    assert_released_keys(json.loads((tiny_ckpt / "config.json").read_text()), "make_tiny_checkpoint", BF16_EXEMPT)
    assert_released_keys(json.loads((tiny_ckpt_fp8 / "config.json").read_text()), "make_tiny_checkpoint fp8",
                         ALWAYS_EXEMPT)
    assert_released_keys(json.loads((TINY / "config.json").read_text()), "assets/tiny-v4", BF16_EXEMPT)
    for like in ("tiny", "v4-flash"):
        assert_released_keys(synthetic_config_dict(like, 2), f"synthetic {like}", ALWAYS_EXEMPT)
    # transformers' machinery: the config object itself gives them (transformers >= 5 calls
    # torch_dtype 'dtype' there; official_config_dict writes the released name)
    assert_released_keys(tiny_config().to_dict(), "DeepseekV4Config.to_dict", BF16_EXEMPT | {"torch_dtype"})


def test_behaviour_keys_are_what_the_model_computes():
    """Independent of the table: the Gate renormalises its top-k weights exactly when
    norm_topk_prob says so, score layers carry the selection-only bias of noaux_tc, and the
    expert's activation is silu."""
    from models.deepseek_v4.modeling import Expert, Gate

    torch.manual_seed(0)
    x = torch.randn(5, 64)
    for func in ("sqrtsoftplus", "sigmoid", "softmax"):
        c = tiny_config(scoring_func=func)
        g = Gate(c, layer_id=3, dtype=torch.float32)          # a score layer (num_hash_layers 2)
        torch.nn.init.normal_(g.weight)
        w, _ = g(x, None)
        renormalised = torch.allclose(w.sum(-1), torch.full((5,), c.route_scale))
        assert c.norm_topk_prob is renormalised, func
        assert c.topk_method == "noaux_tc" and isinstance(g.bias, torch.nn.Parameter)
    e = Expert(64, 32, 0.0, torch.float32)
    for lin in (e.w1, e.w2, e.w3):
        torch.nn.init.normal_(lin.weight)
    ref = e.w2(torch.nn.functional.silu(e.w1(x)) * e.w3(x))
    assert tiny_config().hidden_act == "silu" and torch.allclose(e(x), ref, atol=1e-5)
    assert not any(m.bias is not None for m in e.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("override, key", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"scoring_func": "softmax", "norm_topk_prob": True}, "norm_topk_prob"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_behaviour_keys_that_describe_another_model_refused(override, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        tiny_config(**override)
