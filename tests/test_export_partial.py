"""Export of a run whose layers are incomplete (issue 25.2): refused before anything is written
(a layer is done when every unit has its file, not when any has), unless --allow-partial, which
exports those layers float and says which."""
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def finished_run(tiny_ckpt, tmp_path_factory, one_thread):
    """An RTN recipe run over all 4 tiny layers, with the layer record tools/run_ptq.py writes."""
    from amct_ext.algorithms.recipe import parse_algo
    from amct_ext.base import PtqConfig, RunConfig
    from amct_ext.export.job import write_layers_record
    from amct_ext.pipeline.ptq_spec import PtqSpec
    from amct_ext.pipeline.workflow import PARAMS_DIR, run_blockwise_ptq
    from amct_ext.quant.schemes import load_scheme
    from models.deepseek_v4.adapter import DeepseekV4Adapter
    from models.deepseek_v4.plan import DeepseekV4PlanSpec

    run = tmp_path_factory.mktemp("run")
    scheme, targets = load_scheme("w8a8"), ["attn-linear", "moe"]
    with DeepseekV4Adapter(RunConfig(tiny_ckpt, device="cpu", dtype=torch.float32, progress=False)) as a:
        run_blockwise_ptq(a, PtqSpec(scheme, targets, PtqConfig(n_samples=1, seq_len=32), recipe=parse_algo("rtn")), run)
        stems = DeepseekV4PlanSpec().unit_stems(a.config, scheme, targets, range(4))
    write_layers_record(run / PARAMS_DIR, range(0, 4), stems)
    return run


def _copy_without(run: Path, tmp: Path, pattern: str) -> Path:
    dst = tmp / "run"
    shutil.copytree(run, dst)
    for p in (dst / "ptq_params").glob(pattern):
        p.unlink()
    return dst


def _request(tiny_ckpt, run, out, **kw):
    from amct_ext.export.job import ExportRequest

    return ExportRequest(model_path=tiny_ckpt, format="compressed-tensors", out_dir=out, from_dir=run, device="cpu",
                         **kw)


def test_complete_run_exports_every_layer(tiny_ckpt, finished_run, tmp_path):
    from amct_ext.export.job import export_config

    said = []
    assert export_config(_request(tiny_ckpt, finished_run, tmp_path / "E"), say=said.append).layers == [0, 1, 2, 3]
    assert said == []


def test_missing_layers_are_refused_unless_allow_partial(tiny_ckpt, finished_run, tmp_path, capsys):
    from amct_ext.errors import ConfigError
    from amct_ext.export.job import export_config, export_run

    run = _copy_without(finished_run, tmp_path, "layer_2_*.pt")          # layer 2 gone: an interrupted run
    out = tmp_path / "E"
    with pytest.raises(ConfigError, match=r"1 of the run's layers \[0, 4\).*layer 2: 0 of 10 units.*--allow-partial"):
        export_config(_request(tiny_ckpt, run, out))
    assert not out.exists()
    said = []
    cfg = export_config(_request(tiny_ckpt, run, out, allow_partial=True), say=said.append)
    assert cfg.layers == [0, 1, 3]
    assert said == ["export: --allow-partial: layers 2 are incomplete and stay float"]
    report = export_run(_request(tiny_ckpt, run, out, allow_partial=True), allow_distributed=False)
    assert report["quantized_layers"] == [0, 1, 3]
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert any("layers\\.2\\." in pat or "layers.2." in pat for pat in qc["ignore"]), qc["ignore"]


def test_a_half_done_layer_is_refused_without_the_record(tiny_ckpt, finished_run, tmp_path):
    """A library run (no layers.json): a layer with some but not all unit files is incomplete."""
    from amct_ext.errors import ConfigError
    from amct_ext.export.job import LAYERS_RECORD, export_config

    run = _copy_without(finished_run, tmp_path, "layer_1_ffn_experts_3.pt")
    (run / "ptq_params" / LAYERS_RECORD).unlink()
    with pytest.raises(ConfigError, match=r"layer 1: 9 of 10 units"):
        export_config(_request(tiny_ckpt, run, tmp_path / "E"))
    said = []                       # --allow-partial: the half-done layer is exported float, not quantized
    assert export_config(_request(tiny_ckpt, run, tmp_path / "E", allow_partial=True), say=said.append).layers == [0, 2, 3]
    assert said == ["export: --allow-partial: layers 1 are incomplete and stay float"]
    from amct_ext.export.job import export_run

    report = export_run(_request(tiny_ckpt, run, tmp_path / "E", allow_partial=True), allow_distributed=False)
    assert report["quantized_layers"] == [0, 2, 3]            # the exporter follows the checked layers
    # layers the run never began stay float, and it is said
    run2 = _copy_without(finished_run, tmp_path / "b", "layer_3_*.pt")
    (run2 / "ptq_params" / LAYERS_RECORD).unlink()
    said = []
    assert export_config(_request(tiny_ckpt, run2, tmp_path / "E2"), say=said.append).layers == [0, 1, 2]
    assert said == ["export: layers 3 were not part of the run and stay float"]


def test_cli_refusal_is_one_line(tiny_ckpt, finished_run, tmp_path, capsys):
    sys.path.insert(0, str(REPO / "tools"))
    import export as export_tool

    run = _copy_without(finished_run, tmp_path, "layer_0_attn.pt")
    out = tmp_path / "E"
    code = export_tool.main(["--model", "tiny", "--model-path", str(tiny_ckpt), "--from", str(run),
                             "--format", "compressed-tensors", "--out", str(out), "--device", "cpu", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --from") and "layer 0: 9 of 10" in err[0], err
    assert not out.exists()
