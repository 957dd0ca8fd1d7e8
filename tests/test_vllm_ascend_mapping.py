"""Issue 23.5: every tensor of the Ascend export maps to a parameter and quant method vllm-ascend's
DeepSeek-V4 would create for it, and no parameter is left unset (tests/vllm_ascend_loader.py
replays its loader from its source, independently of the exporter's profile)."""
from __future__ import annotations

import json
import re

import pytest
import torch

from tests.export_helpers import TINY, tensor_layout, with_complete_mtp
from tests.vllm_ascend_loader import load_draft, load_target

pytestmark = pytest.mark.usefixtures("one_thread")

W4A8_CHANNEL = {
    "name": "w4a8-channel", "description": "int8 attention, int4 per-channel experts, int8 per-token inputs",
    "weight": {"format": "int", "bits": 8, "symmetric": True, "granularity": "channel"},
    "input": {"format": "int", "bits": 8, "symmetric": True, "granularity": "token", "dynamic": True},
    "targets": {"moe": {"weight": {"format": "int", "bits": 4, "symmetric": True, "granularity": "channel"}}},
}


@pytest.fixture(scope="module")
def complete_src(tmp_path_factory):
    # like the release: the MTP block complete, its head shared (no mtp.0.head.weight)
    return with_complete_mtp(TINY, tmp_path_factory.mktemp("mtp-src"), own_head=False)


def _export(src, out, scheme, **kw):
    from amct_ext.export.exporter import ExportConfig, export_checkpoint
    from amct_ext.quant.schemes import load_scheme

    cfg = ExportConfig(model_path=src, out_dir=out, format="ascend", scheme=load_scheme(scheme),
                       targets=kw.pop("targets", ["attn-linear", "moe"]), device="cpu", dtype=torch.float32, **kw)
    export_checkpoint(cfg)
    from amct_ext.export import ascend

    return (json.loads((out / "config.json").read_text()), tensor_layout(out, ascend.INDEX_NAME),
            json.loads((out / ascend.DESCRIPTION_NAME).read_text()),
            tensor_layout(src, "model.safetensors.index.json"))


@pytest.fixture(scope="module")
def w8a8_mtp(complete_src, tmp_path_factory):
    return _export(complete_src, tmp_path_factory.mktemp("w8a8") / "e", "w8a8")


def test_w8a8_export_loads_completely_in_target_and_mtp_draft(w8a8_mtp):
    cfg, layout, desc, src = w8a8_mtp
    target = load_target(cfg, layout, desc, src)
    assert not target.errors, target.errors[:5]
    assert not target.unset(), target.unset()[:5]
    # what vllm-ascend runs quantized: the attention projections (not wo_a), the indexer's wq_b,
    # the shared and routed experts; the rest float
    quant = {re.sub(r"layers\.\d+", "layers.L", k) for k, v in target.methods.items() if v == "W8A8_DYNAMIC"}
    assert quant == {f"model.layers.L.self_attn.{m}" for m in ("wq_a", "wq_b", "wkv", "wo_b", "indexer.wq_b")} | \
        {"model.layers.L.mlp.shared_experts.gate_up_proj", "model.layers.L.mlp.shared_experts.down_proj",
         "model.layers.L.mlp.experts"}, sorted(quant)
    draft = load_draft(cfg, layout, desc, src)
    assert not draft.errors, draft.errors[:5]
    assert not draft.unset(), draft.unset()[:5]
    assert draft.methods["model.layers.0.mtp_block.self_attn.wq_a"] == "W8A8_DYNAMIC"
    assert draft.methods["model.layers.0.mtp_block.mlp.experts"] == "W8A8_DYNAMIC"
    assert draft.methods["model.layers.0.e_proj"] == "FLOAT"
    # vllm-ascend's draft loads its own head: the export wrote a copy of head.weight there
    assert "mtp.0.head.weight" not in src and layout["mtp.0.head.weight"] == layout["head.weight"]


def test_int4_routed_experts_load_completely(tmp_path):
    """int4 per-channel routed experts: W4A8_DYNAMIC with scale_bias, every expert slot set. The
    scheme also makes the shared expert int4, which the served export refuses; written anyway
    (serve_check=False), the replay rejects exactly that and nothing else."""
    cfg, layout, desc, src = _export(TINY, tmp_path / "e", W4A8_CHANNEL, serve_check=False)
    target = load_target(cfg, layout, desc, src)
    assert target.methods["model.layers.1.mlp.experts"] == "W4A8_DYNAMIC"
    assert [e for e in target.errors if "shared_experts" not in e] == []
    for i in range(cfg["num_hidden_layers"]):
        assert f"model.layers.{i}.mlp.shared_experts.gate_up_proj: no vllm-ascend method for (W4A8_DYNAMIC, linear) " \
               "(modelslim_config.py:531-541)" in target.errors
    assert [u for u in target.unset() if "shared_experts" not in u] == []
    # the asset's MTP layer has e_proj / h_proj / norms only: a draft would leave its block unset
    draft = load_draft(cfg, layout, desc, src)
    assert any("mtp block" in e for e in draft.errors), draft.errors[:3]


@pytest.mark.parametrize("scheme,targets,needle", [
    ("w4a8", ["moe"], "per channel only"),                        # group 128
    ("w8a8", ["attn-linear", "attn-cache"], "attn-cache"),
    ({**W4A8_CHANNEL, "weight": W4A8_CHANNEL["targets"]["moe"]["weight"], "targets": {}}, ["attn-linear"],
     "no W4A8_DYNAMIC method for a linear"),
])
def test_schemes_vllm_ascend_cannot_run_are_refused(tmp_path, scheme, targets, needle):
    from amct_ext.errors import QuantConfigError

    with pytest.raises(QuantConfigError, match=needle):
        _export(TINY, tmp_path / "e", scheme, targets=targets)
    assert not (tmp_path / "e").exists() or not any((tmp_path / "e").iterdir())


def test_the_profile_keeps_what_vllm_ascend_runs_float():
    from amct_ext.export import engine
    from amct_ext.quant.schemes import load_scheme
    from models.deepseek_v4.serving_ascend import vllm_ascend_profile

    prof, ts = vllm_ascend_profile(), load_scheme("w8a8").target("attn-linear")
    with pytest.raises(engine.EngineRefusal, match=r"layers\.1\.attn\.wo_a: vllm-ascend .*--quant-target attn-linear"):
        prof.plan_leaf("attn.wo_a", ts.weight, ts.input, where="layers.1.attn.wo_a")
    for leaf in ("attn.compressor.wkv", "attn.indexer.compressor.wgate", "attn.indexer.weights_proj"):
        with pytest.raises(engine.EngineRefusal):
            prof.plan_leaf(leaf, ts.weight, ts.input)
    for leaf in ("attn.wq_a", "attn.wkv", "attn.wq_b", "attn.wo_b", "attn.indexer.wq_b", "ffn.experts.3.w2",
                 "ffn.shared_experts.w1"):
        assert prof.plan_leaf(leaf, ts.weight, ts.input).action == engine.QUANTIZED, leaf
    assert engine.profile_for("ascend") is prof


@pytest.mark.parametrize("scheme,targets,needle", [
    ("w8a8", ["attn-linear-all", "moe"], r"layers\.0\.attn\.wo_a: vllm-ascend .*--quant-target attn-linear"),
    (W4A8_CHANNEL, ["attn-linear", "moe"], r"layers\.0\.ffn\.shared_experts\.w1: vllm-ascend.*W8A8_DYNAMIC"),
])
@pytest.mark.parametrize("from_run", [False, True])
def test_what_the_engine_cannot_serve_is_refused_before_writing(tmp_path, scheme, targets, needle, from_run):
    """RTN or a run's parameters alike, before any layer is written: one line naming module,
    engine and flag."""
    from amct_ext.export.engine import EngineRefusal
    from amct_ext.export.exporter import ExportConfig, export_checkpoint
    from amct_ext.quant.schemes import load_scheme

    cfg = ExportConfig(model_path=TINY, out_dir=tmp_path / "e", format="ascend", scheme=load_scheme(scheme),
                       targets=targets, params_dir=(tmp_path / "run") if from_run else None, device="cpu")
    with pytest.raises(EngineRefusal, match=needle) as e:
        export_checkpoint(cfg)
    assert "\n" not in str(e.value) and "--quant-target" in str(e.value)
    assert not (tmp_path / "e").exists()


def test_the_replay_rejects_the_wider_target_written_as_asked(tmp_path):
    """serve_check=False writes wo_a / the compressors W8A8_DYNAMIC and weights_proj with scales:
    the loader replay fails on each, as the profile predicted."""
    cfg, layout, desc, src = _export(TINY, tmp_path / "e", "w8a8", targets=["attn-linear-all", "moe"],
                                     serve_check=False)
    errs = load_target(cfg, layout, desc, src).errors
    assert any("layers.1.self_attn.wo_a: W8A8_DYNAMIC, but" in e for e in errs)
    assert any("layers.1.self_attn.compressor.wkv: W8A8_DYNAMIC, but" in e for e in errs)
    assert any("layers.1.attn.indexer.weights_proj.weight_scale: no parameter" in e for e in errs)


def test_the_replay_catches_what_vllm_ascend_would_reject(w8a8_mtp):
    """The replay itself can fail: each edit below is an export vllm-ascend would not load."""
    cfg, layout, desc, src = w8a8_mtp

    def errors(lay, des):
        t = load_target(cfg, lay, des, src)
        return t.errors + [f"unset {u}" for u in t.unset()]

    w = "layers.1.attn.wo_a"
    bad = dict(layout, **{f"{w}.weight": {"dtype": "I8", "shape": layout[f"{w}.weight"]["shape"]},
                          f"{w}.weight_scale": {"dtype": "F32", "shape": [layout[f"{w}.weight"]["shape"][0], 1]},
                          f"{w}.weight_offset": {"dtype": "F32", "shape": [layout[f"{w}.weight"]["shape"][0], 1]}})
    bad_desc = dict(desc, **{f"{w}.weight": "W8A8_DYNAMIC"})
    assert any("raw int8 weight" in e for e in errors(bad, bad_desc))
    p = "layers.1.attn.indexer.weights_proj"
    assert any("no parameter" in e for e in errors(dict(layout, **{f"{p}.weight_scale": {"dtype": "F32", "shape": [1, 1]}}), desc))
    gone = {k: v for k, v in layout.items() if k != "layers.2.ffn.experts.3.w2.weight_scale"}
    assert any("unset model.layers.2.mlp.experts.w2_weight_scale" in e for e in errors(gone, desc))
    assert any("KeyError" in e for e in errors(layout, {k: v for k, v in desc.items() if k != "layers.1.attn.wq_b.weight"}))
    assert any("no description entry" in e for e in errors(layout, {k: v for k, v in desc.items() if k != "hc_head_fn"}))
    # the MTP draft needs its own head
    d = load_draft(cfg, {k: v for k, v in layout.items() if k != "mtp.0.head.weight"}, desc, src)
    assert "model.layers.0.shared_head.head.weight" in d.unset()
