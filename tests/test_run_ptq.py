"""tools/run_ptq.py: an end-to-end tiny run (subprocess) and the bad-input contract
(one `error: ...` line on stderr, exit code 2, nothing written)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "run_ptq.py"
sys.path.insert(0, str(REPO / "tools"))

import run_ptq  # noqa: E402

# small settings so each case stays fast; the defaults are exercised by the e2e run's shape
FAST = ["--calib-samples", "2", "--seq-len", "64", "--eval-windows", "4", "--epochs", "1", "--quiet"]


@pytest.fixture(autouse=True, scope="module")
def restore_threads():
    old = torch.get_num_threads()   # run_ptq.main sets 1 thread for tiny
    yield
    torch.set_num_threads(old)


def run_cli(args, env_extra=None):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)


def test_end_to_end_tiny(tmp_path, wiki_test_raw):
    out = tmp_path / "out"
    # no --model-path: the tiny checkpoint is generated into $AMCT_CACHE and reused
    proc = run_cli(["--model", "tiny", "--output-dir", str(out), "--end-layer", "2", *FAST],
                   {"AMCT_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "cache" / "tiny-v4" / "config.json").is_file()
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "tiny" and report["scheme"] == "w8a8"
    assert report["quant_target"] == ["attn-linear", "moe"]
    assert set(report["ppl"]) == {"float", "rtn", "quant"}
    assert all(isinstance(v, float) and v > 1 for v in report["ppl"].values())
    assert report["eval"]["windows"] == 4 and report["eval"]["seq_len"] == 64
    assert len(report["units"]) == 2 * 10
    for u in report["units"]:
        assert set(u) >= {"name", "kind", "layer", "loss_before", "loss_after", "seconds"}
        assert u["loss_after"] <= u["loss_before"]
    assert report["wall_s"] > 0 and report["peak_memory_bytes"] > 0
    assert (out / "ptq_params" / "layer_1_ffn_shared_experts.pt").is_file()
    assert "loss_before" in proc.stdout   # the summary table


def expect_error(capsys, argv, match, out=None):
    code = run_ptq.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err and err[-1].startswith("error: ") and match in err[-1], err
    assert not any("Traceback" in line for line in err)
    if out is not None:
        assert not (Path(out) / "report.json").exists()


def test_bad_inputs(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    base = ["--output-dir", str(out), *FAST]
    # missing checkpoint / absent weights
    expect_error(capsys, ["--model", "v4-flash", *base], "needs --model-path", out)
    expect_error(capsys, ["--model", "v4-pro", "--model-path", str(tmp_path / "nowhere"), *base], "does not exist", out)
    empty = tmp_path / "noweights"
    empty.mkdir()
    shutil.copy(tiny_ckpt / "config.json", empty / "config.json")
    expect_error(capsys, ["--model", "v4-flash", "--model-path", str(empty), *base], "no weights", out)
    # config without a required field
    bad = tmp_path / "badcfg"
    shutil.copytree(tiny_ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["num_hidden_layers"]
    (bad / "config.json").write_text(json.dumps(cfg))
    expect_error(capsys, ["--model", "v4-flash", "--model-path", str(bad), *base], "'num_hidden_layers'", out)
    tiny = ["--model", "tiny", "--model-path", str(tiny_ckpt), "--output-dir", str(out), "--quiet"]
    # sequence lengths the model cannot take
    expect_error(capsys, [*tiny, "--seq-len", "1"], "must be >= 2", out)
    expect_error(capsys, [*tiny, "--seq-len", "1024"], "max_position_embeddings=512", out)
    # unknown scheme / targets
    expect_error(capsys, [*tiny, "--scheme", "w3a3"], "unknown scheme 'w3a3'", out)
    expect_error(capsys, [*tiny, "--quant-target", "mlp"], "MoE", out)
    expect_error(capsys, [*tiny, "--quant-target", "attn,moe"], "unknown quant target 'attn'", out)
    expect_error(capsys, [*tiny, "--start-layer", "3", "--end-layer", "9"], "layer range", out)
    assert not out.exists()   # nothing half-written by any of the above


def test_refuses_output_dir_of_another_scheme(tiny_ckpt, tmp_path, capsys):
    from amct_ext.base import PtqConfig, RunConfig
    from amct_ext.schemes import load_scheme
    from amct_ext.workflow import prepare_params_dir
    from models.deepseek_v4.adapter import DeepseekV4Adapter

    out = tmp_path / "out"
    with DeepseekV4Adapter(RunConfig(tiny_ckpt, device="cpu")) as a:
        prepare_params_dir(a, out, load_scheme("w8a8"), ["attn-linear", "moe"], PtqConfig())
    meta = (out / "ptq_params" / "meta.json").read_text()
    expect_error(capsys, ["--model", "tiny", "--model-path", str(tiny_ckpt), "--output-dir", str(out),
                          "--scheme", "w4a8", "--quiet"], "fresh --output-dir", out)
    assert (out / "ptq_params" / "meta.json").read_text() == meta
    assert sorted(p.name for p in (out / "ptq_params").iterdir()) == ["meta.json"]


def test_subprocess_error_is_one_line(tmp_path):
    proc = run_cli(["--model", "v4-flash", "--output-dir", str(tmp_path / "o")])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
