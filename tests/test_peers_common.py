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
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
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
    pc.resolve_data_paths(_ns(eval_data=tmp_path / "nope.raw"), _raise, check_files=False)
    monkeypatch.setattr(pc, "default_eval_path", lambda: None)
    with pytest.raises(ValueError, match="no shipped copy of the Wikitext-2 test split"):
        pc.resolve_data_paths(_ns(), _raise, check_files=False)


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
