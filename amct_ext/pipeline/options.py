"""The library entry point (issue 37): a PTQ job as a caller asks for it, planned and run.

    import models.deepseek_v4                      # registers the model (its ModelBinding)
    from amct_ext.pipeline.options import PtqOptions, plan_job
    from amct_ext.pipeline.job_runner import run_job

    job = plan_job(PtqOptions(output_dir="runs/w4", model="tiny-trained", scheme="w4a16-g128"))
    report = run_job(job)                          # what OUTPUT/report.json holds

:class:`PtqOptions` holds what was asked, by the names of tools/run_ptq.py's flags (``calib_samples``
is ``--calib-samples``; the CLI builds it with ``PtqOptions(**vars(args))``), None where the
model's default applies. :func:`plan_job` resolves the rest -- the calibration and evaluation
text, the model's defaults and checkpoint folder -- and returns the checked plan
(``job.PtqJob``, the run's one config) or raises one ``AmctError`` naming the option at fault.

The model is found through the ``ModelBinding`` registry (``amct_ext.base``): by built-in name
(``model``, the binding's ``model_names``), or by the ``model_type`` of the checkpoint folder
(``model=None`` with ``model_path``). Its binding gives the defaults, the checkpoint folder and
the plan spec; nothing here names a model.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..base import DEFAULT_EPOCHS, DEFAULT_LR, ModelBinding, model_binding, named_model_binding
from ..errors import ConfigError, DataError
from .job import JobRequest, PtqJob, build_job, check_request

DTYPES = ("bf16", "fp32")


@dataclass
class PtqOptions:
    """One PTQ job as asked. Field names and defaults are those of tools/run_ptq.py's flags
    (tests/test_job_plan.py holds the two together); None: the model's default (its binding's
    ``model_defaults``), or, for the data paths, the shipped WikiText-2 splits."""

    output_dir: str
    # ---- model and data
    model: str | None = "tiny"            # a built-in name; None: the model is ``model_path``'s model_type
    model_path: str | None = None
    download: bool = False
    calib_data: str | None = None
    calib_dataset: str | None = None      # PATH[:CONFIG[:SPLIT]] fetched with `datasets`
    calib_samples: int | None = None
    seq_len: int | None = None
    eval_data: str | None = None
    eval_windows: int | None = None
    eval_first_window: int = 0
    eval_ppl: bool | None = None
    ppl_modes: str = "float,rtn"
    # ---- scheme and recipe
    scheme: str = "w8a8"
    quant_target: str | None = None
    algo: str | None = None
    recipe: str | None = None
    propagate: str | None = None
    holdout: float | None = None
    no_guard: bool = False
    legacy_solver: bool = False
    epochs: int = DEFAULT_EPOCHS
    lr: float = DEFAULT_LR
    seed: int = 0
    start_layer: int | None = None
    end_layer: int | None = None
    no_ptq: bool = False
    allow_fewer_layers: bool = False
    # ---- runtime and memory
    device: str = "auto"
    dtype: str | None = None
    threads: int | None = None
    batch_size: int | None = None
    eval_batch_size: int | None = None
    sharded_eval: bool = False
    sharded_ptq: bool = False
    capture_memory_gb: float | None = None
    hessian_memory_gb: float | None = None
    boundary: str = "recompute"
    # ---- output and export
    export: str | None = None
    dequantize_rest: bool = False
    quiet: bool = False


def model_of(options: PtqOptions) -> ModelBinding:
    """The binding that answers for ``options``' model: by built-in name, else by the
    checkpoint folder's config.json ``model_type``."""
    if options.model is not None:
        return named_model_binding(options.model)
    if not options.model_path:
        raise ConfigError("give the model: a built-in name (model) or its checkpoint folder (model_path)")
    return model_binding(options.model_path)


def with_model_defaults(options: PtqOptions, binding: ModelBinding) -> PtqOptions:
    """``options`` with every field left None that the model has a default for filled in."""
    defaults = binding.model_defaults(options.model)
    names = {f.name for f in fields(PtqOptions)}
    unknown = sorted(set(defaults) - names)
    if unknown:   # a binding's typo would otherwise be a default silently never applied
        raise ConfigError(f"model {options.model!r}: its defaults name no option: {', '.join(unknown)}")
    return replace(options, **{k: v for k, v in defaults.items() if getattr(options, k) is None})


def data_paths(options: PtqOptions) -> tuple[Path, Path]:
    """(calibration text, evaluation text): the files given, a fetched dataset, or the shipped splits."""
    from ..data import EVAL_DEFAULT, cache_root, dataset_calibration_file
    from .calibration import DEFAULT_CALIBRATION_PATH

    if options.calib_data and options.calib_dataset:
        raise ConfigError("pass either --calib-data FILE or --calib-dataset NAME, not both")
    eval_path = Path(options.eval_data) if options.eval_data else EVAL_DEFAULT
    if options.calib_dataset:
        calib_path = dataset_calibration_file(options.calib_dataset, cache_root())
    else:
        calib_path = Path(options.calib_data) if options.calib_data else DEFAULT_CALIBRATION_PATH
    if not calib_path.is_file():
        raise DataError(f"calibration text not found: {calib_path} (pass --calib-data FILE)")
    return calib_path, eval_path


def job_request(o: PtqOptions, model_path: Path, calib_path: Path, eval_path: Path) -> JobRequest:
    """The request ``build_job`` checks: the options with the model's defaults already filled in."""
    return JobRequest(
        model_path=model_path, output_dir=o.output_dir, scheme=o.scheme, quant_target=o.quant_target,
        algo=o.algo, recipe=o.recipe, propagate=o.propagate, holdout=o.holdout, no_guard=o.no_guard,
        legacy_solver=o.legacy_solver, calib_path=calib_path, calib_samples=o.calib_samples, seq_len=o.seq_len,
        batch_size=o.batch_size, seed=o.seed, epochs=o.epochs, lr=o.lr, eval_path=eval_path,
        eval_ppl=bool(o.eval_ppl), eval_windows=o.eval_windows, eval_batch_size=o.eval_batch_size,
        ppl_modes=o.ppl_modes, no_ptq=o.no_ptq, device=o.device, dtype=o.dtype, threads=o.threads,
        capture_memory_gb=o.capture_memory_gb, hessian_memory_gb=o.hessian_memory_gb, sharded_ptq=o.sharded_ptq,
        sharded_eval=o.sharded_eval, start_layer=o.start_layer, end_layer=o.end_layer, export=o.export,
        dequantize_rest=o.dequantize_rest, allow_partial=False, model=o.model,
        eval_first_window=o.eval_first_window, boundary=o.boundary, quiet=o.quiet,
        allow_fewer_layers=o.allow_fewer_layers)


def resume_check(out_dir: Path, scheme: Any, targets: Any, r: Any, dtype: str) -> bool:
    """The fingerprint fields known before the model is opened (scheme, targets, recipe, dtype)
    against OUTPUT/ptq_params/meta.json (True: this run's folder, a resume); the full check
    (calibration windows, checkpoint) follows once the tokenizer ran, still before any perplexity."""
    from .run_folder import RunFolder

    now = {"scheme_fingerprint": scheme.fingerprint(), "targets": list(targets), "dtype": dtype}
    # the recipe part of meta.json's "solver" entry (PtqSpec.solver_meta); --legacy-solver's
    # learned_clip settings are compared by the full check (prepare_params_dir) that follows
    if r.recipe is not None:
        now.update({"solver.recipe": r.recipe.settings(), "solver.propagate": r.propagate,
                    "solver.holdout": r.holdout, "solver.guard": r.guard})
    return RunFolder(out_dir).check_settled(now, scheme_name=scheme.name)


def plan_job(options: PtqOptions) -> PtqJob:
    """The checked job plan of ``options``: every input checked before anything is computed or
    written (the cheap checks first, the request checked once), the model's checkpoint resolved
    last (a built-in tiny one is generated on first use)."""
    from .calibration import refuse_test_split

    calib_path, eval_path = data_paths(options)
    binding = model_of(options)
    o = with_model_defaults(options, binding)
    if o.dtype not in DTYPES:
        raise ConfigError(f"--dtype {o.dtype}: must be one of {', '.join(DTYPES)}")
    # flags, scheme, recipe, targets, output folder first: they need neither the model nor the text
    req = job_request(o, Path(o.model_path or "."), calib_path, eval_path)
    checked = check_request(req)
    # by content, before anything is trained or computed on it (also guards tokenizer training)
    refuse_test_split(calib_path, "calibration", [eval_path])
    model_path = binding.resolve_checkpoint(o.model, o.model_path, o.download, calib_path)
    return build_job(replace(req, model_path=model_path), binding.plan_spec(), check_resume=resume_check,
                     checked=checked)


def command_flags(**options: Any) -> list[str]:
    """tools/run_ptq.py's flags for these options, in the order given (``--name-with-dashes VALUE``;
    a True switch as the bare flag, ``eval_ppl=False`` as ``--no-eval-ppl``; False / None left
    out): the command a record quotes for a library call. An unknown name is refused."""
    names = {f.name for f in fields(PtqOptions)}
    argv: list[str] = []
    for name, value in options.items():
        if name not in names:
            raise ConfigError(f"{name!r} is no option of the job (PtqOptions)")
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False and name == "eval_ppl":
            argv.append("--no-eval-ppl")
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return argv


def quantize(output_dir: str, **options: Any) -> dict[str, Any] | None:
    """``run_job(plan_job(PtqOptions(output_dir, **options)))``: the whole job in one call; its
    report (None on a torchrun rank other than the first)."""
    from .job_runner import run_job

    return run_job(plan_job(PtqOptions(output_dir=output_dir, **options)))


__all__ = ["PtqOptions", "plan_job", "quantize", "command_flags", "resume_check", "model_of", "with_model_defaults", "data_paths"]
