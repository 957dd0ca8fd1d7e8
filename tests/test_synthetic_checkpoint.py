"""tools/make_synthetic_checkpoint.py: the folder is a release-layout checkpoint that our reader and
loader accept, with the keys / dtypes / shapes the real config implies."""
import json

import pytest
import torch

from tests.conftest import REPO


@pytest.fixture(scope="module")
def synthetic_tiny(tmp_path_factory, one_thread):
    from tools.make_synthetic_checkpoint import main

    out = tmp_path_factory.mktemp("syn") / "ckpt"
    assert main(["--like", "tiny", "--layers", "4", "--out", str(out), "--seed", "3"]) == 0
    return out


def test_config_cut_to_n_layers_keeps_the_flash_layer_pattern(synthetic_tiny):
    cfg = json.loads((synthetic_tiny / "config.json").read_text())
    flash = json.loads((REPO / "models/deepseek_v4/configs/deepseek-v4-flash.config.json").read_text())
    assert cfg["num_hidden_layers"] == 4
    # layers 0-3 of V4-Flash are ratio 0, 0, 4, 128; the trailing entry is the MTP module's
    assert cfg["compress_ratios"] == [0, 0, 4, 128, 0] == flash["compress_ratios"][:4] + flash["compress_ratios"][43:]
    assert cfg["num_hash_layers"] == 3          # layers 0-2 hash-routed, layer 3 score-routed
    assert cfg["quantization_config"]["scale_fmt"] == "ue8m0" and cfg["expert_dtype"] == "fp4"


def test_stored_dtypes_and_shapes(synthetic_tiny):
    from amct_ext.io.checkpoint import CheckpointReader

    with CheckpointReader(synthetic_tiny) as r:
        keys = set(r.keys())
        raw = {k: r.get_raw(k) for k in ("layers.2.attn.wq_a.weight", "layers.2.attn.wq_a.scale",
                                         "layers.2.ffn.experts.5.w1.weight", "layers.2.ffn.experts.5.w1.scale",
                                         "layers.0.ffn.gate.tid2eid", "layers.3.attn.attn_sink")}
    # tiny dims: hidden 64, q_lora 32, expert width 32 (independent of the writer's own layout code)
    assert raw["layers.2.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert tuple(raw["layers.2.attn.wq_a.weight"].shape) == (32, 64)
    assert raw["layers.2.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert tuple(raw["layers.2.attn.wq_a.scale"].shape) == (1, 1)
    assert raw["layers.2.ffn.experts.5.w1.weight"].dtype == torch.int8
    assert tuple(raw["layers.2.ffn.experts.5.w1.weight"].shape) == (32, 32)      # [inter, dim / 2]
    assert tuple(raw["layers.2.ffn.experts.5.w1.scale"].shape) == (32, 2)        # [inter, dim / 32]
    assert raw["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert raw["layers.3.attn.attn_sink"].dtype == torch.float32
    assert "layers.2.attn.indexer.wq_b.scale" in keys and "layers.3.attn.indexer.wq_b.weight" not in keys
    assert "layers.3.ffn.gate.tid2eid" not in keys            # score routing
    assert {"mtp.0.e_proj.weight", "mtp.0.attn.wq_a.weight", "mtp.0.ffn.experts.0.w2.scale"} <= keys
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn"} <= keys


def test_loads_with_our_loader_and_runs(synthetic_tiny):
    from models.deepseek_v4.loading import load_checkpoint_model

    model, account = load_checkpoint_model(synthetic_tiny, dtype=torch.float32, return_account=True)
    assert account.unexpected == []
    assert account.skipped and all(k.startswith("mtp.0.") for k in account.skipped)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(synthetic_tiny))("a synthetic checkpoint", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids)
    assert logits.shape == (1, ids.shape[1], 512) and torch.isfinite(logits).all()


def test_real_flash_and_pro_layouts_match_the_config():
    """The layout the writer checks every layer against, at the real sizes (no weights drawn)."""
    from models.deepseek_v4.configuration import DeepseekV4Config
    from models.deepseek_v4.synthetic import expected_release_layout, synthetic_config_dict

    flash = DeepseekV4Config(**synthetic_config_dict("v4-flash", 4))
    lay = expected_release_layout(flash, 2)
    assert lay["layers.2.attn.wq_a.weight"] == ((1024, 4096), torch.float8_e4m3fn)
    assert lay["layers.2.attn.wq_a.scale"] == ((8, 32), torch.float8_e8m0fnu)
    assert lay["layers.2.ffn.experts.255.w1.weight"] == ((2048, 2048), torch.int8)
    assert lay["layers.2.ffn.experts.255.w1.scale"] == ((2048, 128), torch.float8_e8m0fnu)
    assert lay["layers.2.ffn.experts.0.w2.weight"] == ((4096, 1024), torch.int8)
    assert lay["layers.2.ffn.gate.tid2eid"] == ((129280, 6), torch.int64)
    assert "layers.2.ffn.experts.256.w1.weight" not in lay
    pro = DeepseekV4Config(**synthetic_config_dict("v4-pro", 3))
    assert pro.compress_ratios == [128, 128, 4, 0]
    lay = expected_release_layout(pro, 2)
    assert lay["layers.2.ffn.experts.383.w1.weight"] == ((3072, 3584), torch.int8)     # [3072, 7168 / 2]
    assert lay["layers.2.attn.wq_a.weight"] == ((1536, 7168), torch.float8_e4m3fn)


def test_bad_input_is_one_error_line(tmp_path, capsys):
    from tools.make_synthetic_checkpoint import main

    assert main(["--like", "v4-flash", "--layers", "44", "--out", str(tmp_path / "x")]) == 2
    assert "--layers 44" in capsys.readouterr().err
    assert main(["--like", "tiny", "--layers", "1", "--out", str(tmp_path / "y"), "--override", "oops"]) == 2
