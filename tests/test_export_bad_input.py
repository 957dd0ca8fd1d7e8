"""Bad input to the export: parameters of another scheme / model / checkpoint, a non-empty --out,
an interrupted export (no index; the rerun resumes and gives the same files)."""
from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch

from tests.export_helpers import REPO, TINY

sys.path.insert(0, str(REPO / "tools"))
pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(out, scheme="w8a8", **kw):
    from amct_ext.export.exporter import ExportConfig
    from amct_ext.quant.schemes import load_scheme

    kw.setdefault("model_path", TINY)
    return ExportConfig(out_dir=out, format=kw.pop("format", "compressed-tensors"), scheme=load_scheme(scheme),
                        targets=["attn-linear", "moe"], device="cpu", **kw)


@pytest.fixture(scope="module")
def fake_run(tmp_path_factory):
    """A run_ptq output folder with a real meta.json (w8a8 on the tiny asset) and no units."""
    from amct_ext.base import PtqConfig, RunConfig
    from amct_ext.quant.schemes import load_scheme
    from amct_ext.pipeline.ptq_spec import PtqSpec
    from amct_ext.pipeline.workflow import prepare_params_dir
    from models.deepseek_v4.adapter import DeepseekV4Adapter

    run = tmp_path_factory.mktemp("run")
    with DeepseekV4Adapter(RunConfig(TINY, device="cpu", progress=False)) as a:
        prepare_params_dir(a, run, PtqSpec(load_scheme("w8a8"), ["attn-linear", "moe"], PtqConfig()))
    return run


def _run_copy(fake_run, tmp_path, edit=None):
    run = tmp_path / "run"
    shutil.copytree(fake_run, run)
    if edit:
        meta_path = run / "ptq_params" / "meta.json"
        meta = json.loads(meta_path.read_text())
        edit(meta)
        meta_path.write_text(json.dumps(meta))
    return run


def _export_cli(argv, capsys):
    import export as export_tool

    code = export_tool.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, (err[-1] if err else "")


def test_params_of_another_scheme_model_checkpoint_refused(fake_run, tmp_path, capsys):
    base = ["--model", "tiny-trained", "--format", "compressed-tensors", "--quiet"]
    run = _run_copy(fake_run, tmp_path)
    code, err = _export_cli([*base, "--from", str(run), "--scheme", "w4a8", "--out", str(tmp_path / "o1")], capsys)
    assert code == 2 and err.startswith("error: ") and "'scheme_fingerprint'" in err, err
    code, err = _export_cli([*base, "--from", str(run), "--quant-target", "moe", "--out", str(tmp_path / "o2")], capsys)
    assert code == 2 and "'targets'" in err, err
    # another model: the config.json the parameters were learned on differs
    other = tmp_path / "other"
    shutil.copytree(TINY, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (other / "config.json").write_text(json.dumps(cfg))
    code, err = _export_cli([*base, "--model-path", str(other), "--from", str(run), "--out", str(tmp_path / "o3")], capsys)
    assert code == 2 and "'model.config_sha256'" in err, err
    # another checkpoint (newer runs record the index hash)
    run2 = _run_copy(fake_run, tmp_path / "b", lambda m: m["model"].update(index_sha256="0" * 64))
    code, err = _export_cli([*base, "--from", str(run2), "--out", str(tmp_path / "o4")], capsys)
    assert code == 2 and "'index_sha256'" in err, err
    for o in ("o1", "o2", "o3", "o4"):
        assert not (tmp_path / o).exists()          # refused before anything is written


def test_unit_params_of_another_shape_refused(fake_run, tmp_path):
    from amct_ext.errors import AmctError
    from amct_ext.export.exporter import export_checkpoint, resolve_run
    from amct_ext.io.io_utils import atomic_save

    run = _run_copy(fake_run, tmp_path)
    # a clip for a 64-row weight where wq_a has 128 rows (e.g. saved from another model)
    atomic_save({"wq_a.weight_quantizer.clip": torch.full((64,), 0.9)}, run / "ptq_params" / "layer_0_attn.pt")
    scheme, targets, pdir = resolve_run(run, TINY, None, None)
    cfg = _cfg(tmp_path / "out")
    cfg.params_dir = pdir
    with pytest.raises(AmctError, match=r"layer_0_attn\.pt.*clip shape"):
        export_checkpoint(cfg)
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()


def test_non_empty_out_refused_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    argv = ["--model", "tiny-trained", "--format", "ascend", "--out", str(out), "--quiet"]
    code, err = _export_cli(argv, capsys)
    assert code == 2 and "is not empty" in err and "--overwrite" in err, err
    assert (out / "keep.txt").is_file() and len(list(out.iterdir())) == 1
    code, err = _export_cli([*argv, "--overwrite"], capsys)
    assert code == 0 and not (out / "keep.txt").exists()
    assert (out / "quant_model_weights.safetensors.index.json").is_file()
    # a finished export is a non-empty folder too
    code, err = _export_cli(argv, capsys)
    assert code == 2 and "is not empty" in err
    # an export is not a source
    code, err = _export_cli(["--model", "tiny-trained", "--model-path", str(out), "--format", "ascend",
                             "--out", str(tmp_path / "again")], capsys)
    assert code == 2 and "itself an exported quantized checkpoint" in err, err
    # --out must never be (or contain) the source checkpoint
    code, err = _export_cli(["--model", "tiny-trained", "--format", "ascend", "--out", str(TINY), "--overwrite"], capsys)
    assert code == 2 and "source checkpoint" in err and (TINY / "config.json").is_file()


def test_interrupted_export_has_no_index_and_resumes(tmp_path, monkeypatch):
    from amct_ext.export import writer as writer_mod
    from amct_ext.export.exporter import export_checkpoint
    from amct_ext.export.writer import STATE_NAME, ExportOutputError

    clean = export_checkpoint(_cfg(tmp_path / "clean"))
    real = writer_mod.ShardedWriter.close_group
    calls = {"n": 0}

    def flaky(self, group, stream, extra=None):
        if calls["n"] == 3:
            raise KeyboardInterrupt            # the user's Ctrl-C while the fourth shard is written
        calls["n"] += 1
        return real(self, group, stream, extra)

    monkeypatch.setattr(writer_mod.ShardedWriter, "close_group", flaky)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        export_checkpoint(_cfg(out))
    assert not (out / "model.safetensors.index.json").exists() and (out / STATE_NAME).is_file()
    assert not (out / "config.json").exists()
    assert not list(out.glob(".*.partial"))   # the interrupted shard left nothing behind
    assert len(list(out.glob("model-*.safetensors"))) == 3
    monkeypatch.setattr(writer_mod.ShardedWriter, "close_group", real)
    # a rerun of another kind into the partial folder is refused, naming the field
    with pytest.raises(ExportOutputError, match="'scheme_fingerprint'"):
        export_checkpoint(_cfg(out, scheme="w4a16-g128"))
    resumed = export_checkpoint(_cfg(out))
    assert resumed.groups_resumed == ["stem", "layers.0", "layers.1"]
    assert resumed.groups_written == [g for g in clean.groups_written if g not in resumed.groups_resumed]
    assert not (out / STATE_NAME).exists()
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    assert idx == json.loads((tmp_path / "clean" / "model.safetensors.index.json").read_text())
    for shard in set(idx["weight_map"].values()):
        assert (out / shard).read_bytes() == (tmp_path / "clean" / shard).read_bytes(), shard
    assert json.loads((out / "config.json").read_text()) == json.loads((tmp_path / "clean" / "config.json").read_text())


def test_schemes_a_format_cannot_hold_refused(tmp_path):
    from amct_ext.errors import QuantConfigError
    from amct_ext.export.exporter import export_checkpoint

    with pytest.raises(QuantConfigError, match="ascend export.*mxfp4"):
        export_checkpoint(_cfg(tmp_path / "a", scheme="mxfp4", format="ascend"))
    with pytest.raises(QuantConfigError, match="ascend export.*symmetric"):
        export_checkpoint(_cfg(tmp_path / "b", scheme="w4a16-g128", format="ascend"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_fp8_release_rest_stays_fp8_unless_dequantized(tiny_ckpt_fp8, tmp_path):
    """Only the experts quantized: the FP8 attention linears keep their bytes and .scale (a
    storage-only export, serve_check=False: vLLM would not load them, test_export_engine); with
    dequantize_rest they become bf16. Both read back to the same weights as the release."""
    from amct_ext.io.checkpoint import CheckpointReader
    from amct_ext.export.exporter import ExportConfig, export_checkpoint
    from amct_ext.quant.schemes import load_scheme

    def export(out, rest):
        cfg = ExportConfig(model_path=tiny_ckpt_fp8, out_dir=out, format="compressed-tensors",
                           scheme=load_scheme("w8a8"), targets=["moe"], device="cpu", dequantize_rest=rest,
                           serve_check=rest)
        return export_checkpoint(cfg)

    export(tmp_path / "keep", False)
    export(tmp_path / "deq", True)
    key = "layers.1.attn.wq_a.weight"
    with CheckpointReader(tiny_ckpt_fp8) as src, CheckpointReader(tmp_path / "keep") as keep, \
            CheckpointReader(tmp_path / "deq") as deq:
        assert src.stored_dtype(key) == "F8_E4M3" and keep.stored_dtype(key) == "F8_E4M3"
        assert torch.equal(keep.get_raw(key).view(torch.uint8), src.get_raw(key).view(torch.uint8))
        assert torch.equal(keep.get_raw(key[:-6] + "scale").view(torch.uint8),
                           src.get_raw(key[:-6] + "scale").view(torch.uint8))
        assert deq.stored_dtype(key) == "BF16" and not deq.has(key[:-6] + "scale")
        ref = src.load_prefix("layers.1.", dtype=torch.float32).tensors["attn.wq_a.weight"]
        for r in (keep, deq):
            assert torch.equal(r.load_prefix("layers.1.", dtype=torch.float32).tensors["attn.wq_a.weight"], ref)
        # the experts are int8 now, the released FP4 expert storage is gone
        e = "layers.1.ffn.experts.0.w1"
        assert keep.stored_dtype(e + ".weight") == "I8" and keep.has(e + ".weight_scale") and not keep.has(e + ".scale")
    cfg = json.loads((tmp_path / "keep" / "config.json").read_text())
    assert cfg["amct_export"]["released_quantization_config"]["quant_method"] == "fp8"
    assert cfg["expert_dtype"] is None and cfg["quantization_config"]["quant_method"] == "compressed-tensors"
