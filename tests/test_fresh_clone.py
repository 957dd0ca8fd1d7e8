"""A fresh clone stands on its own: the repository's files alone, copied into an empty folder
with nothing beside it, run the README's command 1 offline (issue 17, item 1).

This is also the end-to-end test of tools/run_ptq.py with the tiny defaults (it replaced the
shorter run in test_run_ptq.py, so the suite pays for one full tiny run, not two)."""
import json
import os
import shlex
import shutil
import subprocess
import sys

from tests.conftest import REPO

# what a checkout carries besides the tracked files, never part of a clone
_NOT_SHIPPED = {".git", "runs", ".cache", ".pytest_cache", "__pycache__", ".whl", ".out", "build", "dist"}


def readme_job_command() -> list[str]:
    """The job part of the README's command 1 (`pip install ... && python tools/run_ptq.py ...`)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    line = next(ln for ln in block.splitlines() if "tools/run_ptq.py" in ln)
    job = next(part.strip() for part in line.split("&&") if "tools/run_ptq.py" in part)
    return shlex.split(job)


def repository_files() -> list[str]:
    """Tracked files plus new, not ignored ones (a working tree under review); without git (an
    unpacked sdist) every file but caches and outputs."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                             capture_output=True, check=True, timeout=60).stdout
        return [f for f in out.decode().split("\0") if f and (REPO / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [str(p.relative_to(REPO)) for p in REPO.rglob("*")
                if p.is_file() and not _NOT_SHIPPED & set(p.relative_to(REPO).parts)]


def test_readme_command_1_in_a_bare_copy(tmp_path_factory):
    cmd = readme_job_command()
    assert cmd == ["python", "tools/run_ptq.py", "--model", "tiny", "--output-dir", "runs/tiny"], cmd
    root = tmp_path_factory.mktemp("fresh-clone")
    proj = root / "proj"
    for rel in repository_files():
        dst = proj / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dst)
    assert [p.name for p in root.iterdir()] == ["proj"]        # nothing beside it
    cache = tmp_path_factory.mktemp("amct-cache")               # not beside the clone either
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AMCT_CACHE")}
    env.update(AMCT_CACHE=str(cache), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    proc = subprocess.run([sys.executable, *cmd[1:], "--quiet"], cwd=proj, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((proj / "runs" / "tiny" / "report.json").read_text())
    # it ran the clone's own code and data, not this checkout's
    assert report["calibration"]["path"].startswith(str(proj)), report["calibration"]["path"]
    assert report["eval"]["path"].startswith(str(proj)), report["eval"]["path"]
    # the tiny defaults (tools/run_ptq.py DEFAULTS['tiny'])
    assert report["model"] == "tiny" and report["scheme"] == "w8a8" and report["dtype"] == "fp32"
    assert report["quant_target"] == ["attn-linear", "moe"] and report["layers"] == [0, 4]
    assert report["calibration"]["samples"] == 8 and report["calibration"]["seq_len"] == 128
    assert report["eval"]["windows"] == 32 and report["eval"]["seq_len"] == 128
    assert set(report["ppl"]) == {"float", "rtn", "quant"}
    assert all(isinstance(v, float) and v > 1 for v in report["ppl"].values())
    assert len(report["units"]) == 4 * 10 and not any(u["resumed"] for u in report["units"])
    for u in report["units"]:
        assert set(u) >= {"name", "kind", "layer", "loss_before", "loss_after", "seconds"}
    assert report["unobserved_static_quantizers"] == {"rtn": 0, "ptq_calibration": 0, "ptq": 0}
    assert report["wall_s"] > 0 and report["peak_memory_bytes"] > 0
    assert (proj / "runs" / "tiny" / "ptq_params" / "layer_1_ffn_shared_experts.pt").is_file()
    assert "loss vs RTN" in proc.stdout and "ppl float" in proc.stdout   # the summary per layer and unit kind
    from models.deepseek_v4.tiny import tiny_cache_key

    assert [p.name for p in cache.iterdir()] == [f"tiny-v4-{tiny_cache_key()}"]


def test_installed_package_carries_the_data(monkeypatch):
    """setup.py's package_data covers every shipped data file (a wheel install has them)."""
    import fnmatch

    import setuptools

    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kw: seen.update(kw))
    monkeypatch.chdir(REPO)
    exec(compile((REPO / "setup.py").read_text(), "setup.py", "exec"), {"__name__": "__main__"})
    pkg_data = seen["package_data"]
    assert "datasets" in seen["extras_require"]          # --calib-dataset's optional extra
    needed = ["amct_ext/data/wikitext-2/wiki.valid.tokens", "amct_ext/data/wikitext-2-raw/wiki.test.raw",
              "amct_ext/data/LICENSE", "amct_ext/data/README.md", "amct_ext/quant/schemes/w8a8.json",
              "models/deepseek_v4/SPEC.md",
              "models/deepseek_v4/configs/deepseek-v4-flash.config.json",
              "models/deepseek_v4/configs/deepseek-v4-pro.config.json"]
    for rel in needed:
        assert (REPO / rel).is_file(), rel
        covered = any(rel.startswith(pkg.replace(".", "/") + "/")
                      and any(fnmatch.fnmatch(rel[len(pkg) + 1:], g) for g in globs)
                      for pkg, globs in pkg_data.items())
        assert covered, rel


def test_tiny_trained_runs_with_the_shipped_defaults(tmp_path, capsys):
    """--model tiny-trained needed --calib-data and --eval-data before the data shipped (the
    library's entry point fills in the shipped splits, for the CLI too)."""
    from tests.conftest import library_job

    out = tmp_path / "o"
    assert library_job(out, model="tiny-trained", no_ptq=True, quiet=True, calib_samples=1, seq_len=16,
                       eval_windows=1) is not None, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["calibration"]["path"] == str(REPO / "amct_ext" / "data" / "wikitext-2" / "wiki.valid.tokens")
    assert report["eval"]["path"] == str(REPO / "amct_ext" / "data" / "wikitext-2-raw" / "wiki.test.raw")
    assert report["ppl"]["float"] > 1 and report["ppl"]["rtn"] > 1


def test_library_default_eval_text_is_the_shipped_test_split(tiny_adapter):
    import torch

    from amct_ext.base import EvalConfig
    from amct_ext.pipeline.workflow import load_eval_windows
    from tests.conftest import WIKI_TEST_RAW

    default = load_eval_windows(tiny_adapter, EvalConfig(seq_len=64, max_windows=3))
    explicit = load_eval_windows(tiny_adapter, EvalConfig(seq_len=64, max_windows=3, data_path=WIKI_TEST_RAW))
    assert torch.equal(default, explicit)
