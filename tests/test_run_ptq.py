"""tools/run_ptq.py: the bad-input contract
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


# The end-to-end run with the tiny defaults is tests/test_fresh_clone.py (README command 1 in a
# bare copy of the repository); the cases below are the bad-input contract and small options.


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
    # --threads 0 / negative: refused (torch would silently keep its default)
    expect_error(capsys, [*tiny, "--threads", "0"], "--threads 0: must be >= 1", out)
    expect_error(capsys, [*tiny, "--threads", "-2"], "--threads -2: must be >= 1", out)
    # a tiny model with a missing --model-path: no --download hint (tiny is never downloaded)
    for model in ("tiny", "tiny-serve", "tiny-trained"):
        code = run_ptq.main(["--model", model, "--model-path", str(tmp_path / "missing"), *base])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert code == 2 and "does not exist" in err and "--download" not in err, err
    # calibration text that is the evaluation text under another name
    leak = tmp_path / "my-calibration.txt"
    shutil.copy(REPO / "amct_ext" / "data" / "wikitext-2-raw" / "wiki.test.raw", leak)
    expect_error(capsys, [*tiny, "--calib-data", str(leak)], "shares a 64-word run with the evaluation text", out)
    expect_error(capsys, [*tiny, "--calib-data", str(leak), "--calib-dataset", "x"], "not both", out)
    assert not out.exists()   # nothing half-written by any of the above


def test_cli_and_ptqconfig_share_solver_defaults():
    from amct_ext.base import PtqConfig

    args = run_ptq.build_parser().parse_args(["--output-dir", "x"])
    assert args.lr == PtqConfig().lr and args.epochs == PtqConfig().epochs


def test_calib_dataset_errors_are_one_line(tmp_path, capsys, monkeypatch):
    import importlib.util

    from amct_ext import data

    monkeypatch.setenv("AMCT_CACHE", str(tmp_path / "cache"))
    base = ["--output-dir", str(tmp_path / "o"), "--quiet"]
    # offline (conftest sets HF_HUB_OFFLINE=1) -- or datasets missing: either way one clear line
    expect_error(capsys, [*base, "--calib-dataset", "wikitext:wikitext-2-raw-v1:validation"], "--calib-dataset")
    real = importlib.util.find_spec
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda n, *a: None if n == "datasets" else real(n, *a))
    expect_error(capsys, [*base, "--calib-dataset", "wikitext:wikitext-2-raw-v1:validation"],
                 "pip install -e '.[datasets]'")
    expect_error(capsys, [*base, "--calib-dataset", "wikitext:wikitext-2-raw-v1:test"], "evaluation split")
    expect_error(capsys, [*base, "--calib-dataset", "a:b:c:d"], "PATH[:CONFIG[:SPLIT]]")
    # datasets present (pretended) but offline: the offline line, not an import error
    monkeypatch.setattr(data.importlib.util, "find_spec", lambda n, *a: object() if n == "datasets" else real(n, *a))
    monkeypatch.setattr(data, "_offline", lambda: True)
    expect_error(capsys, [*base, "--calib-dataset", "wikitext:wikitext-2-raw-v1:validation"], "offline mode")


def test_tiny_tokenizer_is_trained_on_calib_data(tmp_path, capsys, monkeypatch):
    """--model tiny with --calib-data: the generated checkpoint's tokenizer is trained on that text
    (issue 17: tokenizer training ignored --calib-data), cached under its own key."""
    from amct_ext.pipeline.tokenizer import train_bpe_tokenizer
    from models.deepseek_v4.tiny import TINY_CONFIG, tiny_cache_key

    text = tmp_path / "calib.txt"
    valid = (REPO / "amct_ext" / "data" / "wikitext-2" / "wiki.valid.tokens").read_text(encoding="utf-8")
    text.write_text("".join(valid.splitlines(True)[3000:3400]), encoding="utf-8")
    monkeypatch.setenv("AMCT_CACHE", str(tmp_path / "cache"))
    old = torch.get_num_threads()
    try:
        code = run_ptq.main(["--model", "tiny", "--calib-data", str(text), "--output-dir", str(tmp_path / "o"),
                             "--no-ptq", "--no-eval-ppl", "--quiet", "--seq-len", "32", "--calib-samples", "1"])
    finally:
        torch.set_num_threads(old)
    assert code == 0, capsys.readouterr().err
    ckpt = tmp_path / "cache" / f"tiny-v4-{tiny_cache_key(text)}"
    assert ckpt.is_dir() and tiny_cache_key(text) != tiny_cache_key()
    ref = train_bpe_tokenizer(text, TINY_CONFIG["vocab_size"], tmp_path / "ref")
    assert (ckpt / "tokenizer.json").read_bytes() == (ref / "tokenizer.json").read_bytes()


def test_refuses_output_dir_of_another_scheme(tiny_ckpt, tmp_path, capsys):
    from amct_ext.base import PtqConfig, RunConfig
    from amct_ext.quant.schemes import load_scheme
    from amct_ext.pipeline.ptq_spec import PtqSpec
    from amct_ext.pipeline.workflow import prepare_params_dir
    from models.deepseek_v4.adapter import DeepseekV4Adapter

    out = tmp_path / "out"
    with DeepseekV4Adapter(RunConfig(tiny_ckpt, device="cpu")) as a:
        prepare_params_dir(a, out, PtqSpec(load_scheme("w8a8"), ["attn-linear", "moe"], PtqConfig()))
    meta = (out / "ptq_params" / "meta.json").read_text()
    expect_error(capsys, ["--model", "tiny", "--model-path", str(tiny_ckpt), "--output-dir", str(out),
                          "--scheme", "fp8", "--quiet"], "fresh --output-dir", out)
    assert (out / "ptq_params" / "meta.json").read_text() == meta
    assert sorted(p.name for p in (out / "ptq_params").iterdir()) == ["meta.json"]


def test_subprocess_error_is_one_line(tmp_path):
    proc = run_cli(["--model", "v4-flash", "--output-dir", str(tmp_path / "o")])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
