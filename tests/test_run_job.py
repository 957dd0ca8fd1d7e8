"""The library entry point (issue 37): ``amct_ext.pipeline.job_runner.run_job(job)`` runs a
checked plan built without tools/run_ptq.py, and its results are those of the workflow called
by hand with the settings the plan states (an independent path: no PtqJob, no run_job)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from amct_ext.base import EvalConfig, PtqConfig, RunConfig
from amct_ext.pipeline.job import PtqOptions, ResolvedPaths, build_job
from amct_ext.pipeline.job_runner import run_job
from amct_ext.pipeline.ptq_spec import PtqSpec
from amct_ext.pipeline.workflow import (PARAMS_DIR, evaluate_blockwise, load_calib_windows, load_eval_windows,
                                        run_blockwise_ptq)
from amct_ext.quant.schemes import load_scheme
from models.deepseek_v4.adapter import DeepseekV4Adapter
from models.deepseek_v4.plan import DeepseekV4PlanSpec

from tests.conftest import WIKI_TEST_RAW, WIKI_VALID

TARGETS = ["attn-linear", "moe"]


def _plan(model_path: Path, out: Path, **kw):
    """The plan of these options (the model's defaults given in full) on ``model_path``."""
    base = dict(output_dir=str(out), scheme="w8a8", algo="gptq:sequential=false", calib_samples=3, seq_len=32,
                batch_size=2, seed=5, epochs=2, lr=5e-3, eval_ppl=True, eval_windows=3, eval_batch_size=2, ppl_modes="",
                device="cpu", dtype="fp32", threads=1, start_layer=1, end_layer=3, eval_first_window=4, quiet=True,
                model="tiny")
    base.update(kw)
    return build_job(PtqOptions(**base), DeepseekV4PlanSpec(), ResolvedPaths(model_path, WIKI_VALID, WIKI_TEST_RAW))


def _params(pdir: Path) -> dict[str, dict]:
    return {p.name: torch.load(p, weights_only=True) for p in sorted(pdir.glob("*.pt"))}


def test_run_job_runs_the_plan_as_the_workflow_does(tiny_ckpt, tmp_path, one_thread, capsys):
    job = _plan(tiny_ckpt, tmp_path / "lib")
    report = run_job(job)
    saved = json.loads((tmp_path / "lib" / "report.json").read_text())
    assert saved["ppl"] == report["ppl"] and report["model"] == "tiny" and report["layers"] == [1, 3]
    assert report["eval"]["first_window"] == 4 and report["calibration"]["seed"] == 5

    # the same settings by hand: adapter, calibration, spec, loop, perplexity
    scheme = load_scheme("w8a8")
    ptq = PtqConfig(n_samples=3, seq_len=32, batch_size=2, seed=5, calib_path=WIKI_VALID,
                    eval_paths=(str(WIKI_TEST_RAW),))
    with DeepseekV4Adapter(RunConfig(tiny_ckpt, device="cpu", dtype=torch.float32, progress=False)) as adapter:
        calib = load_calib_windows(adapter, ptq)
        run_blockwise_ptq(adapter, PtqSpec(scheme, TARGETS, ptq, recipe="gptq:sequential=false", propagate="float"),
                          tmp_path / "hand", layers=range(1, 3), calib_windows=calib)
        cfg = EvalConfig(seq_len=32, max_windows=3, first_window=4, batch_size=2, data_path=WIKI_TEST_RAW)
        ppl = evaluate_blockwise(adapter, load_eval_windows(adapter, cfg), cfg, "ptq", scheme=scheme,
                                 targets=TARGETS, layers=range(1, 3), params_dir=tmp_path / "hand" / PARAMS_DIR).ppl
    lib, hand = _params(tmp_path / "lib" / PARAMS_DIR), _params(tmp_path / "hand" / PARAMS_DIR)
    assert sorted(lib) == sorted(hand) and len(lib) == 2 * 10
    for name in lib:
        assert lib[name].keys() == hand[name].keys(), name
        for k in lib[name]:
            assert torch.equal(lib[name][k], hand[name][k]), (name, k)
    assert report["ppl"] == {"float": None, "rtn": None, "quant": ppl}
    assert (tmp_path / "lib" / PARAMS_DIR / "meta.json").read_text() == \
        (tmp_path / "hand" / PARAMS_DIR / "meta.json").read_text()


def test_the_plan_derives_the_legacy_solver_and_the_runtime(tiny_ckpt, tmp_path):
    """--legacy-solver: the plan marks it (the resume check skips its recipe), the run's
    recipe is learned_clip with the plan's epochs / lr; the memory budgets in bytes."""
    job = _plan(tiny_ckpt, tmp_path / "o", algo=None, legacy_solver=True, epochs=3, lr=0.01,
                capture_memory_gb=0.5, hessian_memory_gb=2.0)
    assert job.legacy_solver and job.recipe_source == "legacy"
    spec = job.ptq_spec(job.ptq_config())
    assert spec.recipe.names == ["learned_clip"]
    assert (spec.recipe.settings()[0]["epochs"], spec.recipe.settings()[0]["lr"]) == (3, 0.01)
    assert spec.solver_meta()["epochs"] == 3 and spec.solver_meta()["lr"] == 0.01
    rt = job.ptq_runtime()
    assert rt.capture_memory_bytes == 2 ** 29 and rt.hessian_memory_bytes == 2 * 2 ** 30
    ev = job.eval_config()
    assert (ev.seq_len, ev.max_windows, ev.first_window, ev.batch_size) == (32, 3, 4, 2)


def test_the_cli_only_parses_flags_into_the_plan():
    """tools/run_ptq.py's run: the flags as the library's options, its plan_job, then run_job; no
    plan or workflow call of its own (the plan, its defaults and the model's resolution live in the
    library: amct_ext/pipeline/options.py and the model's binding)."""
    import ast

    src = (Path(__file__).resolve().parents[1] / "tools" / "run_ptq.py").read_text()
    run = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.FunctionDef) and n.name == "run")
    called = {n.func.id if isinstance(n.func, ast.Name) else n.func.attr
              for n in ast.walk(run) if isinstance(n, ast.Call)}
    assert {"plan_job", "run_job"} <= called and len(run.body) <= 6
    assert "run_blockwise_ptq" not in src and "evaluate_blockwise" not in src
    assert "def plan_job" not in src and "build_job" not in src and "check_request" not in src
    assert "DEFAULTS = " not in src and "resolve_checkpoint" not in src and "PlanSpec" not in src


def test_quantize_is_plan_job_then_run_job(tiny_ckpt, tmp_path, one_thread):
    """The one-call convenience (models.deepseek_v4.quantize, registering V4 on import) runs the
    job of its options: the report it returns is the one written, for the options it was given."""
    from models.deepseek_v4 import quantize

    report = quantize(str(tmp_path / "q"), model="tiny", model_path=str(tiny_ckpt), no_ptq=True, eval_ppl=False,
                      calib_samples=1, seq_len=16, quiet=True)
    saved = json.loads((tmp_path / "q" / "report.json").read_text())
    assert report["ppl"] == saved["ppl"] == {"float": None, "rtn": None, "quant": None}
    assert report["model_path"] == str(tiny_ckpt) and report["calibration"]["samples"] == 1
