"""The job plan (amct_ext/pipeline/job.py, issue 25.1 / 25.2 / 25.5): every bad input refused in
one `error:` line with exit 2 before any perplexity or output; recipe files as job specs; the
default recipe by scheme content; the typed smoothing pair syntax; the per-layer summary; help
groups; plain progress lines; no import circle between the tools."""
import ast
import io
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import run_ptq  # noqa: E402

FAST = ["--calib-samples", "2", "--seq-len", "32", "--eval-windows", "2", "--quiet"]


def refused(capsys, argv, match, out: Path):
    code = run_ptq.main(argv)
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert code == 2, (code, cap.err[-500:])
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err
    assert "ppl[" not in cap.out            # refused before any perplexity
    assert not (out / "report.json").exists() and not (out / "ptq_params").exists()
    return err[0]


@pytest.fixture(scope="module")
def broken(tiny_ckpt, tmp_path_factory):
    """Copies of the tiny checkpoint, each with one defect in its config or index."""
    root = tmp_path_factory.mktemp("broken")
    made = {}
    for field in ("sliding_window", "rope_scaling", "routed_scaling_factor"):
        d = root / f"no-{field}"
        shutil.copytree(tiny_ckpt, d)
        cfg = json.loads((d / "config.json").read_text())
        cfg.pop(field)
        (d / "config.json").write_text(json.dumps(cfg))
        made[field] = d
    d = root / "nokey"
    shutil.copytree(tiny_ckpt, d)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"].pop("layers.3.attn.attn_sink")
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    made["nokey"] = d
    d = root / "noshard"
    shutil.copytree(tiny_ckpt, d)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    shard = idx["weight_map"]["layers.3.attn.attn_sink"]
    (d / shard).unlink()
    made["noshard"] = (d, shard)
    g48 = root / "w4-g48.json"
    g48.write_text(json.dumps({"name": "w4-g48", "weight": {"format": "int", "bits": 4, "granularity": "group",
                                                            "group_size": 48}}))
    made["g48"] = g48
    return made


def test_every_refusal_is_one_line_before_any_ppl(tiny_ckpt, broken, tmp_path, capsys):
    out = tmp_path / "out"
    tiny = ["--model", "tiny", "--model-path", str(tiny_ckpt), "--output-dir", str(out), *FAST]
    for field in ("sliding_window", "rope_scaling", "routed_scaling_factor"):
        refused(capsys, ["--model", "tiny", "--model-path", str(broken[field]), "--output-dir", str(out), *FAST],
                f"required field {field!r}", out)
    refused(capsys, ["--model", "tiny", "--model-path", str(broken["nokey"]), "--output-dir", str(out), *FAST],
            "layer 3 lacks key 'layers.3.attn.attn_sink'", out)
    d, shard = broken["noshard"]
    refused(capsys, ["--model", "tiny", "--model-path", str(d), "--output-dir", str(out), *FAST],
            f"shard file {shard!r}", out)
    refused(capsys, [*tiny, "--scheme", str(broken["g48"])], "does not fit layers.0.attn.wq_a.weight [32, 64]", out)
    refused(capsys, [*tiny, "--scheme", "w4a16", "--export", "ascend"], "--export ascend: ascend export", out)
    line = refused(capsys, [*tiny, "--algo", "awq", "--export", "compressed-tensors"], "'up_limit'", out)
    assert "leave smoothing pair 'w3' out" in line and "awq:pairs=attn_norm+q_norm+wo_a" in line
    refused(capsys, [*tiny, "--holdout", "1.5"], "--holdout 1.5", out)
    refused(capsys, [*tiny, "--ppl-modes", "float,bogus"], "--ppl-modes: 'bogus'", out)
    refused(capsys, [*tiny, "--calib-samples", "0"], "--calib-samples 0", out)
    refused(capsys, [*tiny, "--capture-memory-gb", "-1"], "--capture-memory-gb -1", out)
    refused(capsys, [*tiny, "--algo", "awq:pairs=attn_norm,q_norm"], "unknown algorithm 'q_norm'", out)
    refused(capsys, [*tiny, "--algo", "awq:pairs=attn_norm+bogus"], "pairs='attn_norm+bogus'", out)
    afile = tmp_path / "a-file"
    afile.write_text("x")
    line = refused(capsys, ["--model", "tiny", "--model-path", str(tiny_ckpt), "--output-dir", str(afile), *FAST],
                   "--output-dir", out)
    assert "not a folder" in line and afile.read_text() == "x"
    # internals are not named
    for bad in ("PtqConfig", "bytes"):
        assert bad not in line


def test_export_with_the_w3_pair_left_out_is_planned(tiny_ckpt, tmp_path):
    from amct_ext.data import CALIB_DEFAULT, EVAL_DEFAULT
    from amct_ext.pipeline.job import PtqOptions, ResolvedPaths, build_job
    from models.deepseek_v4.plan import DeepseekV4PlanSpec

    opts = PtqOptions(output_dir=str(tmp_path / "o"), scheme="w8a8", algo="awq:pairs=attn_norm+q_norm+wo_a",
                      calib_samples=2, seq_len=32, batch_size=1, eval_batch_size=1, dtype="bf16",
                      export="compressed-tensors")
    job = build_job(opts, DeepseekV4PlanSpec(), ResolvedPaths(tiny_ckpt, CALIB_DEFAULT, EVAL_DEFAULT))
    assert job.spec.recipe.algorithms[0].pairs == "attn_norm+q_norm+wo_a"
    assert job.export.format == "compressed-tensors" and job.n_units == 40
    assert not (tmp_path / "o").exists()          # the plan writes nothing


def test_typed_pair_syntax_selects_those_pairs():
    from amct_ext.algorithms.recipe import parse_algo
    from amct_ext.algorithms.smoothing import _pairs, pair_names

    algo = parse_algo("awq:pairs=attn_norm+q_norm").algorithms[0]
    assert pair_names(algo.pairs) == ["attn_norm", "q_norm"]
    assert pair_names("all") == ["attn_norm", "q_norm", "wo_a", "w3"]
    unit = SimpleNamespace(smoothing_subgraphs=lambda: [SimpleNamespace(name=n) for n in ("attn_norm", "q_norm",
                                                                                          "wo_a", "w3")])
    assert [p.name for p in _pairs(unit, algo.pairs)] == ["attn_norm", "q_norm"]
    assert [p.name for p in _pairs(unit, "w3")] == ["w3"]


def test_recipe_file_holds_the_job_spec(tiny_ckpt, tmp_path):
    from amct_ext.data import CALIB_DEFAULT, EVAL_DEFAULT
    from amct_ext.errors import ConfigError
    from amct_ext.pipeline.job import PtqOptions, ResolvedPaths, build_job
    from models.deepseek_v4.plan import DeepseekV4PlanSpec

    f = tmp_path / "job.json"
    f.write_text(json.dumps({"recipe": [{"algo": "clip"}, {"algo": "gptq"}], "propagate": "quant", "holdout": 0.4,
                             "guard": False, "targets": "attn-linear"}))

    paths = ResolvedPaths(tiny_ckpt, CALIB_DEFAULT, EVAL_DEFAULT)

    def req(**kw):
        return PtqOptions(output_dir=str(tmp_path / "o"), scheme="w8a8", recipe=str(f), calib_samples=2, seq_len=32,
                          batch_size=1, eval_batch_size=1, dtype="bf16", **kw)

    job = build_job(req(), DeepseekV4PlanSpec(), paths)
    r = job.spec
    assert (r.recipe.names, r.propagate, r.holdout, r.guard) == (["clip", "gptq"], "quant", 0.4, False)
    assert list(job.spec.targets) == ["attn-linear"] and job.n_units == 4
    # the same value on the command line is fine; a different one is refused, never one silently
    assert build_job(req(holdout=0.4), DeepseekV4PlanSpec(), paths).spec.holdout == 0.4
    with pytest.raises(ConfigError, match=r"--holdout 0.3 conflicts with holdout=0.4"):
        build_job(req(holdout=0.3), DeepseekV4PlanSpec(), paths)
    with pytest.raises(ConfigError, match=r"--quant-target attn-linear,moe conflicts"):
        build_job(req(quant_target="attn-linear,moe"), DeepseekV4PlanSpec(), paths)
    f.write_text(json.dumps({"recipe": ["rtn"], "holdup": 1}))
    with pytest.raises(ConfigError, match="unknown top-level key"):
        build_job(req(), DeepseekV4PlanSpec(), paths)


def test_default_recipe_follows_the_scheme_content(tmp_path):
    from amct_ext.algorithms.recipe import DEFAULT_FALLBACK, DEFAULT_RECIPES, default_recipe
    from amct_ext.quant.schemes import load_scheme

    three = load_scheme("w3a16-g128").to_dict()
    lying = tmp_path / "w8a8.json"
    lying.write_text(json.dumps({**three, "name": "w8a8"}))
    s = load_scheme(str(lying))
    assert s.name == "w8a8"
    assert default_recipe(s) == DEFAULT_RECIPES["w3a16-g128"] != DEFAULT_RECIPES["w8a8"]
    user = tmp_path / "mine.json"
    user.write_text(json.dumps({"name": "mine", "weight": {"format": "int", "bits": 5, "granularity": "channel"}}))
    assert default_recipe(load_scheme(str(user))) == DEFAULT_FALLBACK
    assert default_recipe("w8a8") == DEFAULT_RECIPES["w8a8"]


def _unit(layer, kind, i, before, after, reverted=False, resumed=False):
    from amct_ext.pipeline.ptq_units import UnitResult

    return UnitResult(name=f"layers.{layer}.{kind}.{i}", kind=kind, layer=layer, loss_before=before,
                      loss_after=after, seconds=0.5, n_calls=4, n_params=0, best_epoch=0, resumed=resumed,
                      stats={"reverted_to_rtn": reverted})


def test_summary_is_per_layer_and_kind(tmp_path):
    from amct_ext.pipeline.summary import format_summary, summarize_units, write_error_plot

    units = [_unit(0, "attn", 0, 2.0, 1.0)]
    units += [_unit(0, "expert", i, 1.0, 0.5 + 0.1 * i) for i in range(5)]       # expert 4: 0.9 / 1.0
    units += [_unit(0, "expert", 5, 1.0, 1.0, reverted=True)]                    # worst: ratio 1.0
    units += [_unit(1, "expert", i, 4.0, 3.0, resumed=i == 0) for i in range(3)]
    groups = summarize_units(reversed(units))          # order does not matter
    assert [(g.layer, g.kind, g.units) for g in groups] == [(0, "attn", 1), (0, "expert", 6), (1, "expert", 3)]
    e0 = groups[1]
    assert e0.kept_rtn == 1 and e0.worst == "layers.0.expert.5" and e0.worst_ratio == 1.0
    assert e0.vs_rtn == pytest.approx((0.5 + 0.6 + 0.7 + 0.8 + 0.9 + 1.0) / 6.0 - 1)
    assert groups[2].resumed == 1 and groups[2].vs_rtn == pytest.approx(-0.25)
    text = format_summary(groups, {"float": 100.0, "rtn": 110.0, "quant": 105.0})
    assert len(text.splitlines()) == 2 + 3 + 2                       # head, rule, 3 groups, total, ppl
    assert "total: 10 units in 3 groups, 1 kept at RTN" in text
    assert "rtn 110.0000 (+10.00%)" in text and "ptq 105.0000 (+5.00%, -4.55% vs rtn)" in text
    pytest.importorskip("matplotlib")
    png = write_error_plot(groups, tmp_path / "layer_errors.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_help_is_grouped_and_lists_the_schemes():
    from amct_ext.quant.schemes import builtin_schemes

    text = run_ptq.build_parser().format_help()
    for title in ("model and data:", "scheme and recipe:", "runtime and memory:", "output and export:"):
        assert title in text
    section = text[text.index("scheme and recipe:"):text.index("runtime and memory:")]
    assert "--scheme SCHEME" in section and "--algo ALGO" in section
    for name in builtin_schemes():
        assert name in section


def test_progress_lines_are_plain():
    from amct_ext.pipeline.progress import PtqProgress

    buf, done = io.StringIO(), []
    p = PtqProgress({0: 2, 1: 2}, done_before={1: 1}, on_layer_done=done.append, out=buf)
    for layer in (0, 1, 0):
        p.unit_done(SimpleNamespace(layer=layer))
    assert done == [1, 0]
    lines = buf.getvalue().splitlines()
    assert lines[0].startswith("ptq: layer 1 done (1/2 layers, 3/4 units")
    assert lines[1].startswith("ptq: layer 0 done (2/2 layers, 4/4 units")
    assert "\x1b" not in buf.getvalue() and "\r" not in buf.getvalue()


def test_the_tools_do_not_import_each_other():
    for tool, other in (("run_ptq.py", "export"), ("export.py", "run_ptq")):
        tree = ast.parse((REPO / "tools" / tool).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                assert node.module not in (f"tools.{other}", other), (tool, node.module)
            if isinstance(node, ast.Import):
                assert all(a.name not in (f"tools.{other}", other) for a in node.names), tool
    assert "parse_args([" not in (REPO / "tools" / "run_ptq.py").read_text()


def test_every_flag_is_an_option_of_the_library_by_name_and_default():
    """tools/run_ptq.py parses its flags into ``PtqOptions(**vars(args))``: one field per flag,
    the same defaults, so a library call with a field left out is the command without that flag."""
    import dataclasses

    from amct_ext.errors import ConfigError
    from amct_ext.pipeline.options import PtqOptions, command_flags

    args = run_ptq.build_parser().parse_args(["--output-dir", "o"])
    assert set(vars(args)) == {f.name for f in dataclasses.fields(PtqOptions)}
    assert run_ptq.options_from_args(args) == PtqOptions(output_dir="o")
    flagged = run_ptq.build_parser().parse_args(["--output-dir", "o", "--model", "tiny-trained", "--no-guard",
                                                 "--eval-windows", "3", "--no-eval-ppl"])
    assert run_ptq.options_from_args(flagged) == PtqOptions(output_dir="o", model="tiny-trained", no_guard=True,
                                                            eval_windows=3, eval_ppl=False)
    # and back: the flags a record quotes for a library call parse into that call's options
    asked = dict(model="tiny-trained", scheme="w4a16-g128", recipe="best", eval_windows=3, ppl_modes="", no_guard=True,
                 eval_ppl=False, holdout=0.5, threads=1, quiet=True)
    assert command_flags(**asked)[:4] == ["--model", "tiny-trained", "--scheme", "w4a16-g128"]
    assert run_ptq.options_from_args(run_ptq.build_parser().parse_args([*command_flags(**asked), "--output-dir", "o"])) \
        == PtqOptions(output_dir="o", **asked)
    with pytest.raises(ConfigError, match="'eval_window' is no option of the job"):
        command_flags(eval_window=3)


def test_the_library_plan_fills_the_models_defaults_and_refuses_unknown_names(tmp_path):
    """plan_job asks the model's binding (amct_ext.base registry) for the name's checkpoint and
    defaults; the plan equals the CLI's for the same command."""
    from amct_ext.errors import ConfigError
    from amct_ext.pipeline.options import PtqOptions, plan_job
    from models.deepseek_v4.cli import TRAINED_TINY

    job = plan_job(PtqOptions(output_dir=str(tmp_path / "o"), model="tiny-trained", eval_windows=3, quiet=True))
    assert job.model.path == TRAINED_TINY and job.model.label == "tiny-trained"
    calibration = job.spec.calibration
    assert (calibration.n_samples, calibration.seq_len, job.runtime.dtype, job.runtime.threads) == \
        (16, 256, "fp32", 1)
    # the plan holds the workflow's PtqConfig itself; the run takes a checked copy
    from amct_ext.base import DEFAULT_EPOCHS, DEFAULT_LR, PtqConfig

    assert type(calibration) is PtqConfig and (calibration.epochs, calibration.lr) == (DEFAULT_EPOCHS, DEFAULT_LR)
    assert job.ptq_config() == calibration and job.ptq_config() is not calibration
    assert job.ptq_spec(job.ptq_config()) == job.spec and job.ptq_spec(job.ptq_config()) is not job.spec
    ev = job.evaluation
    assert ev.enabled and ev.config.max_windows == 3 and ev.config.batch_size == 8
    cli = plan_job(run_ptq.options_from_args(run_ptq.build_parser().parse_args(
        ["--model", "tiny-trained", "--eval-windows", "3", "--quiet", "--output-dir", str(tmp_path / "o")])))
    assert (cli.spec.calibration, cli.evaluation, cli.runtime, cli.output, cli.recipe_source) == \
        (job.spec.calibration, job.evaluation, job.runtime, job.output, job.recipe_source)
    with pytest.raises(ConfigError, match="model 'tiny-x': no registered model binding names it"):
        plan_job(PtqOptions(output_dir=str(tmp_path / "o"), model="tiny-x"))
    with pytest.raises(ConfigError, match="--dtype fp16: must be one of bf16, fp32"):
        plan_job(PtqOptions(output_dir=str(tmp_path / "o"), model="tiny-trained", dtype="fp16"))
    # the PtqConfig could not hold None (a TypeError in its check): refused by the flag's name
    with pytest.raises(ConfigError, match="--epochs None: must be an integer >= 0"):
        plan_job(PtqOptions(output_dir=str(tmp_path / "o"), model="tiny-trained", epochs=None))
    with pytest.raises(ConfigError, match="--lr None: must be a positive number"):
        plan_job(PtqOptions(output_dir=str(tmp_path / "o"), model="tiny-trained", lr=None))
    # a folder alone names the model by its config.json model_type (V4's defaults for unnamed folders)
    by_path = plan_job(PtqOptions(output_dir=str(tmp_path / "o"), model=None, model_path=str(TRAINED_TINY),
                                  calib_samples=2, seq_len=32))
    assert by_path.model.path == TRAINED_TINY and by_path.runtime.dtype == "bf16" and not by_path.evaluation.enabled
    assert not (tmp_path / "o").exists()          # the plan writes nothing


def test_a_models_default_must_name_an_option():
    """A binding's default under a misspelt name would never apply (the run silently takes
    another value): refused, naming it (casebook i37l-1)."""
    from amct_ext.errors import ConfigError
    from amct_ext.pipeline.options import PtqOptions, with_model_defaults

    class Typo:
        def model_defaults(self, name):
            return {"calib_sample": 4, "seq_len": 32}

    with pytest.raises(ConfigError, match="its defaults name no option: calib_sample"):
        with_model_defaults(PtqOptions(output_dir="o"), Typo())
    given = with_model_defaults(PtqOptions(output_dir="o", seq_len=64), SimpleNamespace(
        model_defaults=lambda name: {"seq_len": 32, "calib_samples": 4}))
    assert (given.seq_len, given.calib_samples) == (64, 4)     # a given option is never replaced


def test_the_plan_takes_the_options_themselves_and_refuses_a_dtype_left_to_the_model(tmp_path):
    """build_job / check_request take PtqOptions (no second request type, casebook i37l-2); an
    options object whose model defaults were never filled in (dtype None) is refused by name,
    before the output folder is looked at, never planned at fp32's sizes."""
    from amct_ext.errors import ConfigError
    from amct_ext.pipeline import job as jobmod
    from amct_ext.pipeline.job import PtqOptions, check_request
    from amct_ext.pipeline.options import PtqOptions as exported

    assert exported is PtqOptions and not hasattr(jobmod, "JobRequest")
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"^--dtype None: must be one of bf16, fp32$"):
        check_request(PtqOptions(output_dir=str(blocker), calib_samples=2, seq_len=32, batch_size=1,
                                 eval_batch_size=1))
    with pytest.raises(ConfigError, match="exists and is not a folder"):   # the dtype given: the next check
        check_request(PtqOptions(output_dir=str(blocker), calib_samples=2, seq_len=32, batch_size=1,
                                 eval_batch_size=1, dtype="bf16"))


def test_resume_precheck_names_the_field(tmp_path):
    """The fingerprint fields settled before the model is opened are compared at plan time."""
    from amct_ext.algorithms.recipe import parse_algo
    from amct_ext.errors import AmctError
    from amct_ext.pipeline.job import RecipePart
    from amct_ext.pipeline.options import resume_check
    from amct_ext.base import PtqConfig
    from amct_ext.pipeline.ptq_spec import PtqSpec
    from amct_ext.quant.schemes import load_scheme

    w8, targets = load_scheme("w8a8"), ["attn-linear", "moe"]
    part = RecipePart(parse_algo("rtn"), "float", 0.25, True, "--algo")
    pdir = tmp_path / "ptq_params"
    pdir.mkdir()
    (pdir / "meta.json").write_text(json.dumps({"version": 2, "scheme": "w8a8", "scheme_fingerprint": w8.fingerprint(),
                                                "targets": targets, "dtype": "fp32",
                                                # the "solver" entry a run writes (PtqSpec.solver_meta)
                                                "solver": PtqSpec(w8, targets, PtqConfig(), recipe=part.recipe,
                                                                  propagate="float").solver_meta()}))
    assert not resume_check(tmp_path / "fresh", w8, targets, part, "fp32")
    assert resume_check(tmp_path, w8, targets, part, "fp32")
    with pytest.raises(AmctError, match=r"scheme: 'w8a8' in the folder, 'fp8' now"):
        resume_check(tmp_path, load_scheme("fp8"), targets, part, "fp32")
    with pytest.raises(AmctError, match=r"dtype: 'fp32' in the folder, 'bf16' now"):
        resume_check(tmp_path, w8, targets, part, "bf16")
    with pytest.raises(AmctError, match=r"solver.holdout: 0.25 in the folder, 0.5 now"):
        resume_check(tmp_path, w8, targets, RecipePart(part.recipe, "float", 0.5, True, "--algo"), "fp32")


def test_library_spec_takes_the_default_recipe_by_content_too(tmp_path):
    """The library path (PtqSpec.resolved, what run_blockwise_ptq calls) must pick the same default
    as the plan: by the scheme's content, not its name (a 3-bit file named "w8a8" is not RTN's)."""
    from amct_ext.algorithms.recipe import DEFAULT_RECIPES, parse_algo
    from amct_ext.pipeline.ptq_spec import PtqSpec
    from amct_ext.quant.schemes import load_scheme

    lying = tmp_path / "w8a8.json"
    lying.write_text(json.dumps({**load_scheme("w3a16-g128").to_dict(), "name": "w8a8"}))
    spec = PtqSpec(load_scheme(str(lying)), ["attn-linear", "moe"]).resolved()
    algo, propagate = DEFAULT_RECIPES["w3a16-g128"]
    assert spec.recipe.settings() == parse_algo(algo, "default recipe").settings()
    assert spec.propagate == propagate


def test_named_recipes_best_and_default(tiny_ckpt, tmp_path, monkeypatch):
    """--recipe best takes the scheme's BEST_RECIPES entry (by content) with its propagation, and
    the default where the scheme has none; --recipe default is the default; a file named 'best'
    is read only as ./best; --algo with a name is refused."""
    from amct_ext.algorithms import recipe as rmod
    from amct_ext.data import CALIB_DEFAULT, EVAL_DEFAULT
    from amct_ext.errors import ConfigError
    from amct_ext.pipeline.job import PtqOptions, ResolvedPaths, build_job
    from amct_ext.pipeline.ptq_spec import resolve_spec
    from amct_ext.base import PtqConfig
    from amct_ext.quant.schemes import load_scheme
    from models.deepseek_v4.plan import DeepseekV4PlanSpec

    monkeypatch.setitem(rmod.BEST_RECIPES, "w4a16", ("clip,gptq", "quant"))

    def plan(scheme, **kw):
        return build_job(PtqOptions(output_dir=str(tmp_path / "o"), scheme=scheme, calib_samples=2, seq_len=32,
                                    batch_size=1, eval_batch_size=1, dtype="bf16", **kw), DeepseekV4PlanSpec(),
                         ResolvedPaths(tiny_ckpt, CALIB_DEFAULT, EVAL_DEFAULT))

    job = plan("w4a16", recipe="best")
    best = job.spec
    assert (best.recipe.names, best.propagate) == (["clip", "gptq"], "quant") and job.recipe_source.startswith("best")
    d_algo, d_prop = rmod.DEFAULT_RECIPES["w4a16"]
    default = plan("w4a16", recipe="default").spec
    assert (default.recipe.settings(), default.propagate) == (rmod.parse_algo(d_algo).settings(), d_prop)
    assert plan("w4a16").spec.recipe.settings() == default.recipe.settings()
    # no best entry: best is the default
    assert plan("w8a8", recipe="best").spec.recipe.settings() == rmod.parse_algo(rmod.DEFAULT_RECIPES["w8a8"][0]).settings()
    # the library spec takes the same names
    spec = resolve_spec(load_scheme("w4a16"), "attn-linear,moe", PtqConfig(), recipe_file="best")
    assert spec.recipe.names == ["clip", "gptq"] and spec.propagate == "quant"
    # a file that happens to be called best: ./best
    f = tmp_path / "best"
    f.write_text(json.dumps(["rtn"]))
    monkeypatch.chdir(tmp_path)
    assert plan("w4a16", recipe="./best").spec.recipe.names == ["rtn"]
    with pytest.raises(ConfigError, match="not both"):
        plan("w4a16", recipe="best", algo="rtn")
    with pytest.raises(ConfigError, match="not a named recipe"):
        rmod.named_recipe("w8a8", "fastest")
