"""The fast tier (tests/tiers.py) stays what README / ARCHITECTURE say it is: >= 100 unit-level
tests, none of which reaches a checkpoint-building fixture or names a whole job, another process
or a checkpoint writer; and `-m fast` selects exactly the declared files' tests."""
import json
import os
import re
import subprocess
import sys

from tests.conftest import REPO
from tests.tiers import CHECKPOINT_FIXTURES, FAST_FILES, HEAVY_NAMES

TESTS = REPO / "tests"


def test_fast_files_exist_and_name_no_heavy_entry_point():
    assert len(FAST_FILES) >= 10
    for name in sorted(FAST_FILES):
        path = TESTS / name
        assert path.is_file(), f"tests/tiers.py names {name}, which does not exist"
        text = path.read_text(encoding="utf-8")
        used = [h for h in HEAVY_NAMES if re.search(rf"(?<![\w-]){re.escape(h)}(?![\w-])", text)]
        assert not used, f"{name} is in the fast tier but uses {used}"


def test_fast_tier_collects_at_least_100_tests_and_no_checkpoint_fixture(tmp_path):
    report = tmp_path / "fast.json"
    env = {**os.environ, "AMCT_FAST_TIER_REPORT": str(report), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", "fast", "tests"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    fast = json.loads(report.read_text())
    selected = [ln for ln in done.stdout.splitlines() if "::" in ln]
    assert sorted(selected) == sorted(fast), "`-m fast` selects other tests than the declared files'"
    # the other files were not even imported (nothing to deselect): their collection would cost ~30 s
    assert "deselected" not in done.stdout.splitlines()[-1], done.stdout.splitlines()[-1]
    assert len(fast) >= 100, f"the fast tier has {len(fast)} tests (< 100)"
    assert {nodeid.split("::")[0].split("/")[-1] for nodeid in fast} == set(FAST_FILES)
    heavy = {nodeid: sorted(set(fx) & CHECKPOINT_FIXTURES) for nodeid, fx in fast.items() if set(fx) & CHECKPOINT_FIXTURES}
    assert not heavy, f"fast tests that build a checkpoint: {heavy}"


def test_ci_runs_the_readme_test_command_on_two_workers():
    """The whole suite runs on two pytest-xdist workers: one process took 13.5 min on a slow 2-core
    host, over the ten the suite must keep (casebook F-suite-time). CI's command is the README's."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = readme.split("```bash", 1)[1].split("```", 1)[0]
    command = [ln.strip() for ln in block.splitlines() if ln.strip().startswith("python -m pytest")]
    assert command == ["python -m pytest -q -n 2 tests"]
    ci = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines() if "pytest" in ln]
    assert ci == command
    assert '"pytest-xdist>=3"' in (REPO / "setup.py").read_text()
