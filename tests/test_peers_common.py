"""benchmarks/peers_common.py: the venv, command-line and record helpers the three peer scripts share.

The peers themselves run in venvs of their own (not here); these pin the shared logic they rely on:
which environment a peer process gets, how the re-run into the venv is marked, when the venv is
(re)installed, how the data-path defaults and their errors go, and that the scripts' flags are the
shared ones."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_script

pc = load_script("benchmarks/peers_common.py", "peers_common")


def test_peer_env_keep_set_decides_who_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "0")
    rerun = pc.peer_env(2, keep_set=True)      # the whole script again: the caller's settings win
    assert (rerun["OMP_NUM_THREADS"], rerun["HF_HUB_OFFLINE"], rerun["TRANSFORMERS_OFFLINE"]) == ("7", "1", "0")
    step = pc.peer_env(2, keep_set=False)      # one recorded step: these win
    assert (step["OMP_NUM_THREADS"], step["HF_HUB_OFFLINE"], step["TRANSFORMERS_OFFLINE"]) == ("2", "1", "1")
    assert rerun["PATH"] == step["PATH"] == os.environ["PATH"]


def test_with_pythonpath_puts_the_repo_first():
    assert pc.with_pythonpath({}, "/r") == {"PYTHONPATH": "/r"}
    assert pc.with_pythonpath({"PYTHONPATH": "/a"}, "/r")["PYTHONPATH"] == "/r" + os.pathsep + "/a"
    assert pc.with_pythonpath({"PYTHONPATH": ""}, "/r")["PYTHONPATH"] == "/r"


def test_rerun_in_peer_venv_marks_the_child_and_returns_its_status(tmp_path, monkeypatch):
    script = tmp_path / "child.py"
    script.write_text("import json, os, sys\n"
                      "keys = ('MARK', 'OMP_NUM_THREADS', 'HF_HUB_OFFLINE', 'PYTHONPATH')\n"
                      "print(json.dumps({'argv': sys.argv[1:], **{k: os.environ.get(k) for k in keys}}))\n"
                      "sys.exit(3)\n")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("PYTHONPATH", "/old")
    out = tmp_path / "out.txt"
    with open(out, "w") as fh:   # the child's stdout, to read what it saw
        real_run = subprocess.run
        monkeypatch.setattr(pc.subprocess, "run", lambda *a, **k: real_run(*a, stdout=fh, **k))
        rc = pc.rerun_in_peer_venv(Path(sys.executable), str(script), ["--x", "1"], "MARK", 4, pythonpath="/repo")
    got = json.loads(out.read_text().strip().splitlines()[-1])
    assert rc == 3
    assert got == {"argv": ["--x", "1"], "MARK": "1", "OMP_NUM_THREADS": "4", "HF_HUB_OFFLINE": "1",
                   "PYTHONPATH": "/repo" + os.pathsep + "/old"}


def test_peer_or_rerun_runs_the_peer_only_inside_its_venv(monkeypatch):
    args = argparse.Namespace(venv=Path("/v"), threads=2)
    calls = []
    monkeypatch.setattr(pc, "rerun_in_peer_venv", lambda *a: calls.append(("rerun",) + a) or 5)

    def ensure(venv):
        calls.append(("ensure", venv))
        return venv / "bin" / "python"

    def run(kw):
        return pc.peer_or_rerun(lambda a: calls.append(("peer", a)) or 0, args, ["--x"], script="s.py",
                                inside_env="MARK", ensure_venv=ensure, **kw)

    monkeypatch.delenv("MARK", raising=False)
    assert run({"pythonpath": "/repo"}) == 5
    assert calls == [("ensure", Path("/v")), ("rerun", Path("/v/bin/python"), "s.py", ["--x"], "MARK", 2, "/repo")]
    calls.clear()
    monkeypatch.setenv("MARK", "1")   # the re-run itself: no venv work, the peer runs
    assert run({}) == 0 and calls == [("peer", args)]


def _fake_venv(tmp_path) -> Path:
    """A venv folder whose python runs this interpreter. A wrapper, not a symlink: a symlink to a
    venv's python (itself a symlink to the base interpreter, as ``python -m venv`` makes it from
    /usr/bin/python3) has no pyvenv.cfg beside it, so Python resolves it to the base interpreter,
    without this venv's packages (casebook fresh-clone-and-reliability, F-peer-probe)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    return venv


@pytest.mark.parametrize("prefix, installs", [(pytest.__version__.split(".")[0] + ".", False), ("0.0.0-none", True)])
def test_ensure_peer_venv_installs_only_when_the_peer_is_missing(tmp_path, monkeypatch, prefix, installs):
    venv = _fake_venv(tmp_path)
    calls = []
    real_run = subprocess.run

    def run(cmd, **kw):
        if cmd[1:3] == ["-m", "pip"]:
            calls.append(cmd[4:])
            return subprocess.CompletedProcess(cmd, 0)
        return real_run(cmd, **kw)

    monkeypatch.setattr(pc.subprocess, "run", run)
    # the probe imports module, transformers and torch (all in this venv) and reads dist's version
    py = pc.ensure_peer_venv(venv, quiet=True, module="pytest", dist="pytest", version_prefix=prefix,
                             requirements=("torch==9", "peer==1"))
    assert py == venv / "bin" / "python"
    # torch alone first (keeps pip on the CPU wheel), then everything
    assert calls == ([["-q", "torch==9"], ["-q", "torch==9", "peer==1"]] if installs else [])


def _ns(**kw):
    return argparse.Namespace(**{"eval_data": None, "calib_data": None, **kw})


def _raise(msg):
    raise ValueError(msg)


def test_resolve_data_paths_defaults_and_errors(tmp_path, monkeypatch):
    ev, cal = tmp_path / "test.raw", tmp_path / "calib.txt"
    ev.write_text("x")
    cal.write_text("y")
    monkeypatch.setattr(pc, "default_eval_path", lambda: ev)
    monkeypatch.setattr(pc, "default_calib_path", lambda: cal)
    args = _ns()
    pc.resolve_data_paths(args, _raise)
    assert (args.eval_data, args.calib_data) == (ev, cal)
    with pytest.raises(ValueError, match="config.json: no such file"):
        pc.resolve_data_paths(_ns(), _raise, also=(tmp_path / "config.json",))
    with pytest.raises(ValueError, match="nope.raw: no such file"):
        pc.resolve_data_paths(_ns(eval_data=tmp_path / "nope.raw"), _raise)
    with pytest.raises(ValueError, match=f"{tmp_path}: a folder, not a file"):
        pc.resolve_data_paths(_ns(calib_data=tmp_path), _raise)
    monkeypatch.setattr(pc, "default_eval_path", lambda: None)
    with pytest.raises(ValueError, match="no shipped copy of the Wikitext-2 test split"):
        pc.resolve_data_paths(_ns(), _raise)


def test_records(tmp_path, capsys):
    assert pc.command_line("/a/b/peer_x.py", ["--model", "M"]) == "peer_x.py --model M"
    assert pc.rel_to_repo(pc.REPO / "assets" / "tiny-v4") == "assets/tiny-v4"
    assert pc.rel_to_repo("/elsewhere/deq") == "/elsewhere/deq"
    path = tmp_path / "r.json"
    assert pc.load_results(path) == {"cells": {}}
    pc.save(path, {"cells": {"a": {"ppl": 1.0}}, "float": {}})
    assert pc.load_results(path)["cells"] == {"a": {"ppl": 1.0}}
    assert pc.load_results(path, fresh=True) == {"cells": {}}
    assert pc.smoke_report(None, {}, {"windows_equal": True, "shape": [1, 2]}) == 0
    assert pc.smoke_report(path, {"seed": 0}, {"windows_equal": False}) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "smoke FAILED"
    assert json.loads(path.read_text()) == {"smoke": True, "protocol": {"seed": 0}, "checks": {"windows_equal": False}}


def test_fail_is_one_line_and_status_2(capsys):
    with pytest.raises(SystemExit) as e:
        pc.fail("bad input")
    assert e.value.code == 2 and capsys.readouterr().err == "error: bad input\n"


@pytest.mark.parametrize("script", ["peer_llmcompressor", "peer_autoround", "peer_msmodelslim"])
def test_every_peer_takes_the_shared_protocol_flags(script, tmp_path):
    mod = load_script(f"benchmarks/{script}.py", f"{script}_flags")
    ev, cal = tmp_path / "t.raw", tmp_path / "c.txt"
    ev.write_text("x")
    cal.write_text("y")
    args = mod.parse_args(["--model", str(pc.REPO / "assets" / "tiny-v4"), "--eval-data", str(ev),
                           "--calib-data", str(cal), "--seq-len", "32", "--eval-windows", "3",
                           "--calib-samples", "2", "--seed", "5", "--threads", "1", "--smoke"])
    assert (args.eval_data, args.calib_data, args.seq_len, args.eval_windows, args.calib_samples, args.seed) \
        == (ev, cal, 32, 3, 2, 5)


# =========================================================================== bad input, per script
# Each case must end in one `error: ...` line and exit status 2 from parse_args (or main before any
# work): only --smoke runs or parse_args alone, so a missing check can never reach a venv install.
PEERS = ["peer_llmcompressor", "peer_autoround", "peer_msmodelslim"]
TINY = pc.REPO / "assets" / "tiny-v4"


@pytest.fixture(scope="module")
def peers():
    return {s: load_script(f"benchmarks/{s}.py", f"{s}_errors") for s in PEERS}


@pytest.fixture
def texts(tmp_path):
    ev, cal = tmp_path / "t.raw", tmp_path / "c.txt"
    ev.write_text("x")
    cal.write_text("y")
    return ["--eval-data", str(ev), "--calib-data", str(cal)]


def _refused(call, capsys, want: str) -> None:
    with pytest.raises(SystemExit) as e:
        call()
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err and "error: " in err.strip().splitlines()[-1], err
    assert want in err.strip().splitlines()[-1], err


@pytest.mark.parametrize("script", PEERS)
@pytest.mark.parametrize("flag", ["--eval-data", "--calib-data"])
def test_missing_data_file_refused_at_parse_time(peers, script, flag, texts, tmp_path, capsys):
    """msModelSlim's run reads both texts only after its venv install: parse time must refuse them."""
    argv = ["--model", str(TINY), *texts, flag, str(tmp_path / "nope.txt")]
    _refused(lambda: peers[script].parse_args(argv), capsys, f"{tmp_path / 'nope.txt'}: no such file")


@pytest.mark.parametrize("script", PEERS)
@pytest.mark.parametrize("model, want", [("missing", "no such folder"), ("file", "not a folder"),
                                         ("no-config", "config.json: no such file"),
                                         ("bad-config", "config.json: not readable JSON"),
                                         ("list-config", "config.json: a JSON list, not an object")])
def test_bad_model_folder_is_one_error_line(peers, script, model, want, texts, tmp_path, capsys):
    """``--smoke --model /nonexistent`` was a transformers OSError traceback (llm-compressor, msModelSlim)."""
    path = tmp_path / model
    if model == "file":
        path.write_text("{}")
    elif model != "missing":
        path.mkdir()
        if model != "no-config":
            (path / "config.json").write_text("{oops" if model == "bad-config" else "[1]")
    _refused(lambda: peers[script].main(["--smoke", "--model", str(path), *texts]), capsys, want)


@pytest.mark.parametrize("script", PEERS)
@pytest.mark.parametrize("flag, value", [("--eval-windows", "-3"), ("--eval-windows", "0"), ("--seq-len", "1"),
                                         ("--calib-samples", "0"), ("--threads", "0")])
def test_counts_refused_at_parse_time(peers, script, flag, value, texts, capsys):
    argv = ["--smoke", "--model", str(TINY), *texts, flag, value]
    _refused(lambda: peers[script].parse_args(argv), capsys, f"{flag} {value}: must be >= ")


def _venv_case(tmp_path, kind: str) -> Path:
    v = tmp_path / f"venv-{kind}"
    if kind == "file":
        v.write_text("")
    elif kind == "not-a-venv":
        (v / "src").mkdir(parents=True)   # a source tree or a prefix such as /usr
    elif kind == "empty":
        v.mkdir()
    elif kind == "venv":
        v.mkdir()
        (v / "pyvenv.cfg").write_text("home = /usr/bin\n")
        (v / "lib").mkdir()
    return v


@pytest.mark.parametrize("script", PEERS)
def test_venv_must_be_a_venv_or_new(peers, script, texts, tmp_path, capsys):
    """Only parse_args runs here: nothing creates or installs into any of these folders."""
    def parse(kind):
        return peers[script].parse_args(["--model", str(TINY), *texts, "--json", str(tmp_path / "r.json"),
                                         "--venv", str(_venv_case(tmp_path, kind))])

    _refused(lambda: parse("file"), capsys, "not a folder")
    _refused(lambda: parse("not-a-venv"), capsys, "not a virtual environment (no pyvenv.cfg)")
    for ok in ("missing", "empty", "venv"):
        assert parse(ok).venv == tmp_path / f"venv-{ok}"


@pytest.mark.parametrize("script", ["peer_llmcompressor", "peer_autoround"])
def test_result_json_that_a_run_resumes_must_be_an_object(peers, script, texts, tmp_path, capsys):
    bad, lst = tmp_path / "bad.json", tmp_path / "list.json"
    bad.write_text("{oops")
    lst.write_text("[]")
    base = ["--model", str(TINY), *texts, "--venv", str(tmp_path / "v")]
    _refused(lambda: peers[script].parse_args(base + ["--json", str(bad)]), capsys, "not readable JSON")
    _refused(lambda: peers[script].parse_args(base + ["--json", str(lst)]), capsys, "a JSON list, not an object")
    _refused(lambda: peers[script].parse_args(base + ["--json", str(tmp_path)]), capsys, "a folder, not a JSON file")
    assert peers[script].parse_args(base + ["--json", str(bad), "--fresh"]).fresh   # --fresh does not read it


def test_msmodelslim_json_workdir_and_inside(peers, texts, tmp_path, capsys):
    ms = peers["peer_msmodelslim"]
    base = ["--model", str(TINY), *texts, "--venv", str(tmp_path / "v")]
    _refused(lambda: ms.parse_args(base + ["--json", str(tmp_path)]), capsys, "a folder, not a JSON file")
    (tmp_path / "f").write_text("")
    _refused(lambda: ms.parse_args(base + ["--work-dir", str(tmp_path / "f")]), capsys, "--work-dir")
    _refused(lambda: ms.parse_args(base + ["--eval-jobs", "0"]), capsys, "--eval-jobs 0: must be >= 1")
    _refused(lambda: ms.main(["--inside", "quant", "--model_path"]), capsys, "--model_path PATH")


def test_llmcompressor_merge_parts_must_be_json_objects(peers, tmp_path, capsys):
    bad = tmp_path / "part.json"
    bad.write_text("{oops")
    plc = peers["peer_llmcompressor"]
    out = ["--json", str(tmp_path / "out.json")]
    _refused(lambda: plc.parse_args(["--merge", str(bad)] + out), capsys, "--merge")
    _refused(lambda: plc.parse_args(["--merge", str(tmp_path / "nope.json")] + out), capsys, "no such file")
