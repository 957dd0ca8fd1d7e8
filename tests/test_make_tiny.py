"""tools/make_tiny_checkpoint.py writes the released layout, deterministically."""
import json
import subprocess
import sys

import torch
from transformers import AutoTokenizer

from tests.conftest import REPO


def run_tool(out, *extra):
    cmd = [sys.executable, "-W", "ignore", str(REPO / "tools" / "make_tiny_checkpoint.py"), "--out", str(out), *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]


def test_layout(tiny_ckpt):
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV4ForCausalLM"] and "hidden_size" in cfg and "dim" not in cfg
    ratios = cfg["compress_ratios"][: cfg["num_hidden_layers"]]
    assert {0, 4, 128} <= set(ratios)
    assert 0 < cfg["num_hash_layers"] < cfg["num_hidden_layers"]  # hash and score layers
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 2
    assert any(k.startswith("mtp.0.") for k in index)
    assert "layers.1.attn.indexer.compressor.wkv.weight" in index and "hc_head_fn" in index
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)  # offline (HF_HUB_OFFLINE=1 in conftest)
    assert len(tok) <= cfg["vocab_size"] and tok.decode(tok("Hello world").input_ids, skip_special_tokens=True) == "Hello world"


def test_cli_fp8_and_determinism(tmp_path):
    run_tool(tmp_path / "a", "--format", "fp8", "--seed", "3")
    run_tool(tmp_path / "b", "--format", "fp8", "--seed", "3")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8" and cfg["expert_dtype"] == "fp4"
    for f in sorted(p.name for p in (tmp_path / "a").iterdir()):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    from safetensors import safe_open

    index = json.loads((tmp_path / "a" / "model.safetensors.index.json").read_text())["weight_map"]
    key = "layers.2.ffn.experts.0.w1.weight"
    with safe_open(tmp_path / "a" / index[key], framework="pt") as f:
        assert f.get_tensor(key).dtype == torch.int8
    key = "layers.0.attn.wq_a.weight"
    with safe_open(tmp_path / "a" / index[key], framework="pt") as f:
        assert f.get_tensor(key).dtype == torch.float8_e4m3fn
