"""The device scripts return what they finished when the device tool cuts the call (casebook i34-16).

``benchmarks/scripts/h200_block_rounding.sh`` ran its stages and packed the results into $OUT only
at its end; a call cut by its time limit (rc 124) came back with no file, although earlier runs in
it had finished. It now publishes after every run. Checked with a stand-in for python: the first
run finishes, the second hangs and the whole script is killed."""
from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

STUB = """#!/bin/bash
# stand-in for python3: a checkpoint index for --out, a JSON for --json; the run tagged HANG never ends
prev=
for a in "$@"; do
  case $prev in
    --out) mkdir -p "$a"; echo '{}' > "$a/model.safetensors.index.json";;
    --json) echo '{}' > "$a";;
  esac
  prev=$a
done
case "$*" in *run_HANG*) exec sleep 60;; esac
echo "[solve] blockround layer 2: 1 steps, 0.1 s a step"
"""


def test_a_call_cut_after_its_first_run_still_returns_that_run(tmp_path):
    stub = tmp_path / "py"
    stub.write_text(STUB)
    stub.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "BR_PY": str(stub), "BR_WORK": str(tmp_path / "work"), "OUT": str(out)}
    proc = subprocess.Popen(["bash", str(REPO / "benchmarks/scripts/h200_block_rounding.sh"),
                             "run@DONE@w4a16@rtn@30", "run@HANG@w4a16@rtn@30"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        proc.wait(timeout=4)
        raise AssertionError("the hanging run ended on its own")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)            # what the device tool's limit does to the call
        proc.wait()
    with tarfile.open(out / "results.tgz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"DONE.json", "DONE.log", "summary.txt"} <= names
    assert "run DONE: rc=0" in (out / "summary.txt").read_text()


SLOW_STUB = STUB.replace("exec sleep 60;;", "exec sleep 60;;\n  *run_SLOW*) sleep 3;;")


def test_a_started_run_outlives_its_call_and_a_later_call_waits_for_it(tmp_path):
    """casebook i34-25: the default recipe on a V4-Pro layer (~8 min, plus the benchmark's minute)
    passes one call's 600 s. ``start@`` runs it in a session of its own, so killing the call's
    process group (what the tool does when a command returns) leaves it running; ``wait@`` in the
    next call returns once it has ended, with its files."""
    stub = tmp_path / "py"
    stub.write_text(SLOW_STUB)
    stub.chmod(0o755)
    env = {**os.environ, "BR_PY": str(stub), "BR_WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out1")}
    script = str(REPO / "benchmarks/scripts/h200_block_rounding.sh")
    first = subprocess.Popen(["bash", script, "start@SLOW@w4a16@rtn@30"], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    first.wait(timeout=10)
    os.killpg(first.pid, 9) if _group_alive(first.pid) else None     # the tool ends the call's processes
    summary = tmp_path / "work" / "res" / "summary.txt"
    assert "run SLOW: rc=" not in summary.read_text()                # returned before the run ended
    out2 = tmp_path / "out2"
    done = subprocess.run(["bash", script, "wait@SLOW@30"], cwd=REPO, env={**env, "OUT": str(out2)},
                          capture_output=True, text=True, timeout=40)
    assert done.returncode == 0 and "run SLOW: rc=0" in (out2 / "summary.txt").read_text()
    with tarfile.open(out2 / "results.tgz") as tar:
        assert {"SLOW.json", "SLOW.log"} <= {Path(n).name for n in tar.getnames()}
    assert "still running" not in done.stdout


def test_a_wait_that_runs_out_says_so(tmp_path):
    env = {**os.environ, "BR_WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(REPO / "benchmarks/scripts/h200_block_rounding.sh"), "wait@NONE@2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=30)
    assert "run NONE: still running after 2 s" in done.stdout


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
