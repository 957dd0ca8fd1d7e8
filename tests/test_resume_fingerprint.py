"""ptq_params/meta.json records everything that changes a unit's result; a rerun that differs in
any field is refused with one line naming the field and both values (issue 17, item 2)."""
import json
import shutil

import pytest
import torch

from amct_ext.base import PtqConfig
from amct_ext.quant.schemes import load_scheme
from amct_ext.pipeline.ptq_spec import PtqSpec
from amct_ext.pipeline.workflow import (META_NAME, PARAMS_DIR, ParamsMismatchError, check_params_dir, load_calib_windows,
                               params_meta, prepare_params_dir)
from tests.conftest import WIKI_VALID

TARGETS = ["attn-linear", "moe"]


@pytest.fixture(scope="module")
def small_text(tmp_path_factory):
    p = tmp_path_factory.mktemp("calib") / "calib.txt"
    p.write_text("".join(WIKI_VALID.read_text(encoding="utf-8").splitlines(True)[:120]), encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def base_cfg(small_text):
    return PtqConfig(epochs=1, lr=5e-3, n_samples=2, seq_len=32, batch_size=1, seed=0, calib_path=small_text)


@pytest.fixture
def folder(tiny_adapter, base_cfg, tmp_path):
    """An output folder whose meta.json was written by the baseline run (fp32, cpu)."""
    prepare_params_dir(tiny_adapter, tmp_path, PtqSpec(load_scheme("w8a8"), TARGETS, base_cfg))
    return tmp_path / PARAMS_DIR


def meta_for(adapter, cfg, scheme="w8a8", targets=TARGETS):
    return params_meta(adapter, PtqSpec(load_scheme(scheme), targets, cfg), load_calib_windows(adapter, cfg))


def refusal(folder, meta) -> str:
    with pytest.raises(ParamsMismatchError) as e:
        check_params_dir(folder, meta)
    msg = str(e.value)
    assert "\n" not in msg and "fresh --output-dir" in msg
    return msg


def test_same_run_resumes_and_meta_has_every_field(tiny_adapter, base_cfg, folder):
    meta = json.loads((folder / META_NAME).read_text())
    assert set(meta) >= {"version", "scheme", "scheme_fingerprint", "targets", "solver", "dtype", "device_type",
                         "calibration", "model", "checkpoint"}
    assert meta["dtype"] == "fp32" and meta["device_type"] == "cpu"
    # no recipe given: w8a8's default recipe and propagation, as on the command line
    assert meta["solver"] == {"epochs": 1, "lr": 5e-3, "recipe": [{"name": "rtn"}], "propagate": "float",
                              "holdout": 0.25, "guard": True}
    assert set(meta["calibration"]) == {"samples", "seq_len", "seed", "batch_size", "text_sha256", "windows_sha256"}
    assert set(meta["checkpoint"]) == {"index_sha256"}
    assert check_params_dir(folder, meta_for(tiny_adapter, base_cfg)) is True


@pytest.mark.parametrize("field, change, old, new", [
    ("solver.epochs", dict(epochs=3), 1, 3),
    ("solver.lr", dict(lr=1e-2), 5e-3, 1e-2),
    ("calibration.samples", dict(n_samples=3), 2, 3),
    ("calibration.seq_len", dict(seq_len=48), 32, 48),
    ("calibration.seed", dict(seed=7), 0, 7),
    ("calibration.batch_size", dict(batch_size=2), 1, 2),
])
def test_changed_setting_is_named(tiny_adapter, base_cfg, folder, field, change, old, new):
    from dataclasses import replace

    msg = refusal(folder, meta_for(tiny_adapter, replace(base_cfg, **change)))
    assert f"{field}: {old!r} in the folder, {new!r} now" in msg, msg


def test_changed_scheme_targets_dtype_device(tiny_adapter, base_cfg, folder, monkeypatch):
    assert "scheme: 'w8a8' in the folder, 'w4a8' now" in refusal(folder, meta_for(tiny_adapter, base_cfg, "w4a8"))
    assert "targets: ['attn-linear', 'moe'] in the folder, ['moe'] now" in refusal(
        folder, meta_for(tiny_adapter, base_cfg, targets=["moe"]))
    monkeypatch.setattr(tiny_adapter.run, "dtype", torch.bfloat16)
    assert "dtype: 'fp32' in the folder, 'bf16' now" in refusal(folder, meta_for(tiny_adapter, base_cfg))
    monkeypatch.setattr(tiny_adapter.run, "dtype", torch.float32)
    monkeypatch.setattr(tiny_adapter, "device", torch.device("meta"))
    assert "device_type: 'cpu' in the folder, 'meta' now" in refusal(folder, meta_for(tiny_adapter, base_cfg))


def test_changed_calibration_text_is_named(tiny_adapter, base_cfg, folder, small_text, tmp_path):
    from dataclasses import replace

    other = tmp_path / "calib.txt"   # same name, one word changed
    other.write_text(small_text.read_text(encoding="utf-8").replace(" the ", " a ", 1), encoding="utf-8")
    msg = refusal(folder, meta_for(tiny_adapter, replace(base_cfg, calib_path=other)))
    assert msg.split("another run: ")[1].startswith("calibration.text_sha256: "), msg


def test_changed_model_config_checkpoint_and_version(tiny_adapter, tiny_ckpt, base_cfg, folder, tmp_path, monkeypatch):
    windows = load_calib_windows(tiny_adapter, base_cfg)
    scheme = load_scheme("w8a8")
    moved = tmp_path / "moved-ckpt"    # a moved, unchanged checkpoint is the same model: resumes
    shutil.copytree(tiny_ckpt, moved)
    monkeypatch.setattr(tiny_adapter, "model_path", moved)
    assert check_params_dir(folder, params_meta(tiny_adapter, PtqSpec(scheme, TARGETS, base_cfg), windows)) is True
    index = json.loads((moved / "model.safetensors.index.json").read_text())
    index["metadata"] = {"total_size": 1}     # another checkpoint with the same config
    (moved / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = refusal(folder, params_meta(tiny_adapter, PtqSpec(scheme, TARGETS, base_cfg), windows))
    assert "checkpoint.index_sha256: " in msg and "in the folder" in msg, msg
    cfg = json.loads((moved / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (moved / "config.json").write_text(json.dumps(cfg))
    assert "model.config_sha256: " in refusal(folder, params_meta(tiny_adapter, PtqSpec(scheme, TARGETS, base_cfg), windows))
    monkeypatch.setattr(tiny_adapter, "model_path", tiny_ckpt)
    old = json.loads((folder / META_NAME).read_text())
    old["version"] = 1
    (folder / META_NAME).write_text(json.dumps(old))
    assert "format version: 1 in the folder, 3 now" in refusal(
        folder, params_meta(tiny_adapter, PtqSpec(scheme, TARGETS, base_cfg), windows))


def test_fp32_then_bf16_is_refused_by_the_cli(tiny_ckpt, tmp_path, capsys):
    """The issue's case: a fp32 run, then --dtype bf16 into the same folder resumed every unit."""
    from tools import run_ptq

    out = tmp_path / "out"
    common = ["--model", "tiny", "--model-path", str(tiny_ckpt), "--output-dir", str(out), "--quiet",
              "--calib-samples", "2", "--seq-len", "32", "--epochs", "1", "--no-eval-ppl",
              "--start-layer", "0", "--end-layer", "1", "--quant-target", "attn-linear"]
    old = torch.get_num_threads()
    try:
        assert run_ptq.main([*common, "--dtype", "fp32"]) == 0
        before = sorted(p.name for p in (out / PARAMS_DIR).iterdir())
        capsys.readouterr()
        assert run_ptq.main([*common, "--dtype", "bf16"]) == 2
    finally:
        torch.set_num_threads(old)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dtype: 'fp32' in the folder, 'bf16' now" in err[0], err
    assert sorted(p.name for p in (out / PARAMS_DIR).iterdir()) == before


def test_single_file_checkpoint_identity_is_its_header(tmp_path):
    """Without an index, the identity is the safetensors header (names, dtypes, shapes, offsets):
    another tensor layout changes it; the same layout with other bytes does not (reading every
    weight to hash it would cost a full checkpoint read)."""
    from safetensors.torch import save_file

    from amct_ext.pipeline.workflow import checkpoint_identity

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b, c):
        d.mkdir()
    save_file({"w": torch.zeros(4, 4)}, str(a / "model.safetensors"))
    save_file({"w": torch.ones(4, 4)}, str(b / "model.safetensors"))
    save_file({"w": torch.zeros(4, 5)}, str(c / "model.safetensors"))
    ia, ib, ic = checkpoint_identity(a), checkpoint_identity(b), checkpoint_identity(c)
    assert set(ia) == {"header_sha256"}
    assert ia == ib and ia != ic
