"""The export follows the serving engine's profile (amct_ext/export/engine.py,
models/deepseek_v4/serving.py; casebook/export.md "vLLM's V4 loader"):

- modules vLLM builds with quant_config=None (compressors, the indexer's weights_proj) and a
  wo_a it cannot run in the scheme's format are written as the exact fake-quant weight in float
  and listed in quantization_config.ignore; the modules it quantizes are written quantized and
  not ignored;
- wo_a is FP8 e4m3 128x128 blocks (what fp8_einsum runs) or a float weight;
- what vLLM cannot represent is refused before anything is written, in one line naming the
  module, the engine and the flag that avoids it.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from amct_ext.errors import AmctError
from tests.export_helpers import TINY

pytestmark = pytest.mark.usefixtures("one_thread")

VLLM_FLOAT = ("attn.compressor.wkv", "attn.compressor.wgate", "attn.indexer.weights_proj",
              "attn.indexer.compressor.wkv", "attn.indexer.compressor.wgate")
VLLM_QUANT = ("attn.wq_a", "attn.wkv", "attn.wq_b", "attn.wo_b", "attn.indexer.wq_b")
FP8_BLOCK = {"name": "fp8-block128", "weight": {"format": "fp8", "granularity": "block", "block_size": [128, 128]},
             "input": {"format": "fp8", "granularity": "group", "group_size": 128, "dynamic": True}}


def _cfg(out: Path, scheme, targets, model=TINY, **kw):
    from amct_ext.export.exporter import ExportConfig
    from amct_ext.quant.schemes import load_scheme

    return ExportConfig(model_path=model, out_dir=out, format=kw.pop("format", "compressed-tensors"),
                        scheme=load_scheme(scheme), targets=list(targets), device="cpu", **kw)


def _ignored(ignore: list[str], name: str) -> bool:
    """compressed-tensors' matching: an exact name or a 're:' regex (fullmatch)."""
    return any(re.fullmatch(p[3:], name) if p.startswith("re:") else p == name for p in ignore)


def _fake_quant_of_release(layer: int, leaf: str, scheme) -> torch.Tensor:
    """Independent oracle: the RTN fake-quant weight of the released weight, computed with the
    quantizer math directly (formats.fake_quant), in the weight's own dtype."""
    from amct_ext.io.checkpoint import CheckpointReader
    from amct_ext.quant import formats

    with CheckpointReader(TINY) as r:
        w = r.get_raw(f"layers.{layer}.{leaf}.weight")
    return formats.fake_quant(w, scheme.target("attn-linear").weight)


# ----------------------------------------------------------------------------- unit level
def test_profile_decisions_and_refusal_lines():
    from amct_ext.export.engine import FLOAT, QUANTIZED, EngineRefusal
    from amct_ext.quant.schemes import load_scheme
    from models.deepseek_v4.serving import vllm_profile

    p = vllm_profile()
    w8, w4, fp8b = (load_scheme(s).target("attn-linear") for s in ("w8a8", "w4a16-g128", FP8_BLOCK))
    for leaf in VLLM_QUANT + ("ffn.experts.3.w1", "ffn.shared_experts.w2"):
        assert p.plan_leaf(leaf, w8.weight, w8.input).action == QUANTIZED, leaf
    for leaf in VLLM_FLOAT + ("attn.wo_a",):
        assert p.plan_leaf(leaf, w4.weight, None).action == FLOAT, leaf      # weight-only: float
    assert p.plan_leaf("attn.wo_a", fp8b.weight, fp8b.input).action == QUANTIZED   # fp8_einsum
    assert p.plan_leaf("attn.wo_a", fp8b.weight, None).action == FLOAT             # kernel would add FP8 inputs
    for leaf in VLLM_FLOAT + ("attn.wo_a",):
        with pytest.raises(EngineRefusal) as e:
            p.plan_leaf(leaf, w8.weight, w8.input, where=f"layers.1.{leaf}")
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"layers.1.{leaf}: vLLM") and "--quant-target attn-linear" in msg
    with pytest.raises(EngineRefusal, match="no rule"):
        p.plan_leaf("attn.something_new", w8.weight, None)
    with pytest.raises(EngineRefusal, match=r"x\.pt: parameter 'up_limit': vLLM .*scalar swiglu_limit.*pairs="):
        p.check_params(["w1.weight_quantizer.scale", "up_limit"], where=lambda k: f"x.pt: parameter {k!r}")


# ----------------------------------------------------------------------------- tiny exports
@pytest.fixture(scope="module")
def wide_w4_export(tmp_path_factory):
    """w4a16-g128 on AMCT's wide attention set + moe, RTN, of the trained tiny asset."""
    from amct_ext.export.exporter import export_checkpoint

    out = tmp_path_factory.mktemp("wide") / "out"
    export_checkpoint(_cfg(out, "w4a16-g128", ["attn-linear-all", "moe"]))
    return out


def test_vllm_float_modules_are_fake_quant_floats_and_ignored(wide_w4_export):
    from amct_ext.io.checkpoint import CheckpointReader
    from amct_ext.quant.schemes import load_scheme

    scheme = load_scheme("w4a16-g128")
    cfg = json.loads((wide_w4_export / "config.json").read_text())
    ignore = cfg["quantization_config"]["ignore"]
    with CheckpointReader(wide_w4_export) as r, CheckpointReader(TINY) as src:
        for leaf in VLLM_FLOAT + ("attn.wo_a",):
            key = f"layers.1.{leaf}.weight"                         # layer 1: ratio 4, all of them
            assert not r.has(f"layers.1.{leaf}.weight_scale") and not r.has(f"layers.1.{leaf}.weight_packed"), leaf
            got = r.get_raw(key)
            assert got.dtype == src.get_raw(key).dtype                  # fp32 compressors stay fp32
            assert torch.equal(got, _fake_quant_of_release(1, leaf, scheme)), leaf   # the run's function
            assert not torch.equal(got, src.get_raw(key)), leaf         # and really quantized
            for name in (f"model.layers.1.{leaf}", f"layers.1.{leaf}"):   # vLLM's and the flat name
                assert _ignored(ignore, name), (name, ignore)
        for leaf in VLLM_QUANT:
            assert r.has(f"layers.1.{leaf}.weight_packed"), leaf
            assert not _ignored(ignore, f"model.layers.1.{leaf}"), leaf
        assert r.has("layers.1.ffn.experts.0.w1.weight_packed")
        assert not _ignored(ignore, "model.layers.1.ffn.experts.0.w1")
        assert r.get_raw("layers.1.attn.wo_a.weight").dtype == torch.bfloat16     # bf16 bmm
    assert cfg["amct_export"]["engine"].startswith("vLLM")


def test_wo_a_is_fp8_block_when_the_scheme_is_what_fp8_einsum_runs(tmp_path):
    """Ratio-0 layers only (no compressor, whose FP8 inputs vLLM would not apply), every
    attention input width a multiple of 128: wo_a goes out as the FP8 blocks fp8_einsum runs,
    and the read-back applies the run's input quantizers on the wide set (wo_a included)."""
    from amct_ext.export.exporter import export_checkpoint
    from amct_ext.export.readback import exported_quant
    from amct_ext.io.checkpoint import CheckpointReader
    from models.deepseek_v4.tiny import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "m", hidden_size=128, head_dim=64, q_lora_rank=128, o_lora_rank=64,
                                 compress_ratios=[0, 0, 0, 0, 0])
    out = tmp_path / "fp8"
    export_checkpoint(_cfg(out, FP8_BLOCK, ["attn-linear-all"], model=model))
    assert exported_quant(out).targets == ["attn-linear-all"]
    cfg = json.loads((out / "config.json").read_text())
    with CheckpointReader(out) as r:
        w, s = r.get_raw("layers.1.attn.wo_a.weight"), r.get_raw("layers.1.attn.wo_a.weight_scale")
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert tuple(s.shape) == tuple(-(-d // 128) for d in w.shape)                 # 128x128 blocks
    group = cfg["quantization_config"]["config_groups"]["attn-linear"]
    assert group["weights"]["strategy"] == "block" and group["weights"]["block_structure"] == [128, 128]
    assert not _ignored(cfg["quantization_config"]["ignore"], "model.layers.1.attn.wo_a")


def test_attn_linear_leaves_wo_a_float_and_ignored(tmp_path):
    """The engine set: wo_a is not quantized at all, stays as released (bf16 here), and is
    ignored, since the attention config group's regex would otherwise cover it."""
    from amct_ext.export.exporter import export_checkpoint
    from amct_ext.io.checkpoint import CheckpointReader

    out = tmp_path / "w8"
    export_checkpoint(_cfg(out, "w8a8", ["attn-linear"]))
    cfg = json.loads((out / "config.json").read_text())
    with CheckpointReader(out) as r, CheckpointReader(TINY) as src:
        assert torch.equal(r.get_raw("layers.1.attn.wo_a.weight"), src.get_raw("layers.1.attn.wo_a.weight"))
        assert r.get_raw("layers.1.attn.wq_a.weight").dtype == torch.int8
    ignore = cfg["quantization_config"]["ignore"]
    assert _ignored(ignore, "model.layers.1.attn.wo_a") and not _ignored(ignore, "model.layers.1.attn.wq_a")


# ----------------------------------------------------------------------------- refusals
def _refused(cfg, match: str) -> str:
    """The refusal of ``cfg``: by check() (what the plan calls) and by the export, one line,
    and nothing written."""
    from amct_ext.export.exporter import export_checkpoint

    with pytest.raises(AmctError, match=match) as e:
        cfg.check()
    with pytest.raises(AmctError, match=match):
        export_checkpoint(cfg)
    assert not Path(cfg.out_dir).exists()
    msg = str(e.value)
    assert "\n" not in msg and "vLLM" in msg
    return msg


def test_input_quantization_on_modules_vllm_keeps_float_refused(tmp_path):
    msg = _refused(_cfg(tmp_path / "o", "w8a8", ["attn-linear-all", "moe"]),
                   r"^layers\.0\.attn\.wo_a: vLLM .*int8 token dynamic.*--quant-target attn-linear")
    assert "o_proj.py" in msg
    # with a wo_a fp8_einsum runs, the compressors' input quantization is refused next
    _refused(_cfg(tmp_path / "p", FP8_BLOCK, ["attn-linear-all"]),
             r"^layers\.1\.attn\.(indexer\.)?(compressor\.(wkv|wgate)|weights_proj): vLLM .*quant_config=None.*"
             r"fp8 group-128 dynamic.*--quant-target attn-linear")


def test_per_channel_up_limit_refused(tmp_path):
    params = tmp_path / "ptq_params"
    params.mkdir()
    torch.save({"w3.weight_quantizer.clip": torch.ones(3), "up_limit": torch.full((256,), 5.0)},
               params / "layer_1_ffn_experts_0.pt")
    torch.save({"wq_a.weight_quantizer.clip": torch.ones(3)}, params / "layer_0_attn.pt")
    msg = _refused(_cfg(tmp_path / "o", "w4a16-g128", ["attn-linear", "moe"], params_dir=params),
                   r"layer_1_ffn_experts_0\.pt: parameter 'up_limit': vLLM .*swiglu_limit")
    assert "pairs=attn_norm,q_norm,wo_a" in msg


def test_release_fp8_storage_left_behind_refused(tiny_ckpt_fp8, tmp_path):
    _refused(_cfg(tmp_path / "o", "w8a8", ["attn-linear", "moe"], model=tiny_ckpt_fp8),
             r"FP8 / FP4 storage.*--dequantize-rest")


def test_serve_check_off_writes_what_the_run_did(tmp_path):
    """Storage-only exports (this tool's read-back) keep the old behaviour, and say so."""
    from amct_ext.export.exporter import export_checkpoint
    from amct_ext.io.checkpoint import CheckpointReader

    out = tmp_path / "o"
    export_checkpoint(_cfg(out, "w8a8", ["attn-linear-all"], serve_check=False))
    with CheckpointReader(out) as r:
        assert r.get_raw("layers.1.attn.compressor.wkv.weight").dtype == torch.int8
    assert json.loads((out / "config.json").read_text())["amct_export"]["engine"] is None


def test_export_configs_carry_the_released_keys(wide_w4_export, tmp_path):
    """Both formats' config.json: every key of the released config (test_config's table), the
    behaviour keys filled in even from a source whose config predates them."""
    import shutil

    from amct_ext.export.exporter import export_checkpoint
    from tests.test_config import ALWAYS_EXEMPT, BF16_EXEMPT, assert_released_keys

    cfg = json.loads((wide_w4_export / "config.json").read_text())
    assert_released_keys(cfg, "compressed-tensors export", ALWAYS_EXEMPT)
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    # an old source config without the behaviour keys: the export still writes them
    old = tmp_path / "old"
    shutil.copytree(TINY, old, ignore=shutil.ignore_patterns("train*"))
    src = json.loads((old / "config.json").read_text())
    for k in ("hidden_act", "norm_topk_prob", "topk_method", "attention_bias", "attention_dropout",
              "initializer_range", "use_cache"):
        src.pop(k)
    (old / "config.json").write_text(json.dumps(src))
    export_checkpoint(_cfg(tmp_path / "asc", "w8a8", ["attn-linear", "moe"], model=old, format="ascend"))
    # ModelSlim describes the quantization in quant_model_description.json, not quantization_config
    assert_released_keys(json.loads((tmp_path / "asc" / "config.json").read_text()), "ascend export", BF16_EXEMPT)


def test_plan_says_what_the_export_does_with_the_wide_set(tmp_path):
    from models.deepseek_v4.serving import export_plan

    cfg = _cfg(tmp_path / "o", "w4a16-g128", ["attn-linear-all", "moe"])
    cfg.check()
    lines = dict(line.split(": ", 1) for line in export_plan(cfg))
    assert lines["attn.wq_a"] == "quantized" and lines["ffn.experts.*.w1"] == "quantized"
    for leaf in VLLM_FLOAT + ("attn.wo_a",):
        assert lines[leaf].startswith("written float") and "vLLM" in lines[leaf], leaf
    assert not (tmp_path / "o").exists()


def test_plan_time_check_refuses_a_recipe_that_will_save_up_limit(tmp_path):
    """Before the run: the plan passes the parameters its recipe will save."""
    from models.deepseek_v4.serving import PAIR_PARAMS

    cfg = _cfg(tmp_path / "o", "w4a16-g128", ["attn-linear", "moe"])
    cfg.check()                                     # no recipe parameters: fine
    with pytest.raises(AmctError, match=r"planned recipe's parameter 'up_limit': vLLM .*pairs="):
        cfg.check(planned_params=[PAIR_PARAMS["w3"]])

