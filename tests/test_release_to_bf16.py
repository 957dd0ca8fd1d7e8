"""benchmarks/scripts/release_to_bf16.py: the bf16 copy transformers' V4 loads (issue 24 item 4;
casebook/peer-llm-compressor.md P14)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from amct_ext.io.storage_formats import decode_fp4, decode_fp8_block

from tests.conftest import load_script
INDEX = "model.safetensors.index.json"


def _tool():
    return load_script("benchmarks/scripts/release_to_bf16.py")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / INDEX).read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(folder / shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_copy_decodes_every_scaled_weight_and_keeps_the_rest(tiny_ckpt_fp8, tiny_ckpt, tmp_path):
    dst = tmp_path / "bf16"
    assert _tool().main([str(tiny_ckpt_fp8), str(dst)]) == 0
    src, got, orig = _tensors(tiny_ckpt_fp8), _tensors(dst), _tensors(tiny_ckpt)
    assert not [k for k in got if k.endswith(".scale")]
    assert set(got) == {k for k in src if not (k.endswith(".scale") and k[:-5] + "weight" in src)}
    n_fp8 = n_fp4 = 0
    for k, t in src.items():
        if k.endswith(".scale"):
            continue
        s = src.get(k[: -len("weight")] + "scale") if k.endswith(".weight") else None
        if s is None:
            assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
            continue
        if t.dtype == torch.float8_e4m3fn:
            want, n_fp8 = decode_fp8_block(t, s), n_fp8 + 1
        else:
            want, n_fp4 = decode_fp4(t, s), n_fp4 + 1
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], want), k
        # the same random weights in bf16: only the storage format's rounding apart
        rel = (got[k].float() - orig[k].float()).norm() / orig[k].float().norm()
        assert rel < (0.2 if t.dtype != torch.float8_e4m3fn else 0.05), (k, float(rel))
    assert n_fp8 > 0 and n_fp4 > 0
    cfg = json.loads((dst / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["expert_dtype"] is None
    assert (dst / "tokenizer.json").is_file()
    # a second run finds the index and does nothing
    assert _tool().main([str(tiny_ckpt_fp8), str(dst)]) == 0


def test_refuses_when_the_disk_is_too_small(tiny_ckpt_fp8, tmp_path, capsys):
    assert _tool().main([str(tiny_ckpt_fp8), str(tmp_path / "x"), "--reserve-gb", "1e9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "GiB free" in err[0]
    assert not (tmp_path / "x" / INDEX).exists()
