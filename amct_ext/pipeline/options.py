"""The library entry point (issue 37): a PTQ job as a caller asks for it, planned and run.

    import models.deepseek_v4                      # registers the model (its ModelBinding)
    from amct_ext.pipeline.options import PtqOptions, plan_job
    from amct_ext.pipeline.job_runner import run_job

    job = plan_job(PtqOptions(output_dir="runs/w4", model="tiny-trained", scheme="w4a16-g128"))
    report = run_job(job)                          # what OUTPUT/report.json holds

:class:`PtqOptions` (defined in job.py beside the plan it becomes, re-exported here) holds what
was asked, by the names of tools/run_ptq.py's flags (``calib_samples`` is ``--calib-samples``;
the CLI builds it with ``PtqOptions(**vars(args))``), None where the model's default applies.
:func:`plan_job` resolves the rest -- the model's defaults, the calibration and evaluation text
and the checkpoint folder (``job.ResolvedPaths``) -- and hands them to ``job.build_job``, which
returns the checked plan (``job.PtqJob``, the run's one config) or raises one ``AmctError``
naming the option at fault.

The model is found through the ``ModelBinding`` registry (``amct_ext.base``): by built-in name
(``model``, the binding's ``model_names``), or by the ``model_type`` of the checkpoint folder
(``model=None`` with ``model_path``). Its binding gives the defaults, the checkpoint folder and
the plan spec; nothing here names a model.
"""
from __future__ import annotations

from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from ..base import ModelBinding, model_binding, named_model_binding
from ..errors import ConfigError, DataError
from .job import PtqJob, PtqOptions, ResolvedPaths, build_job, check_request


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
    written (the cheap checks first, the options checked once), the model's checkpoint resolved
    last (a built-in tiny one is generated on first use)."""
    from .calibration import refuse_test_split

    calib_path, eval_path = data_paths(options)
    binding = model_of(options)
    o = with_model_defaults(options, binding)
    # dtype, flags, scheme, recipe, targets, output folder first: they need neither the model nor the text
    checked = check_request(o)
    # by content, before anything is trained or computed on it (also guards tokenizer training)
    refuse_test_split(calib_path, "calibration", [eval_path])
    model_path = binding.resolve_checkpoint(o.model, o.model_path, o.download, calib_path)
    spec = binding.plan_spec()
    checked = with_source_defaults(checked, o, *spec.source_defaults(model_path))
    return build_job(o, spec, ResolvedPaths(model_path, calib_path, eval_path),
                     check_resume=resume_check, checked=checked)


def with_source_defaults(checked: Any, o: PtqOptions, label: str, source_defaults: dict) -> Any:
    """``checked`` (``job.check_request``'s result) with the named recipe the checkpoint's weights
    call for (the model's ``source_defaults``: a release already on a low-precision grid may have
    another default). Only a named recipe changes; --algo, a recipe file, --legacy-solver and a
    given --propagate are the user's and stay."""
    from ..algorithms.recipe import NAMED_RECIPES, choose_recipe
    from .size_caps import check_recipe_sizes

    if not source_defaults or o.algo or o.legacy_solver or (o.recipe and o.recipe not in NAMED_RECIPES):
        return checked
    choice = choose_recipe(checked.scheme, None, o.recipe, source_defaults=source_defaults, source_label=label)
    if choice.source == checked.recipe.source:      # this scheme's named recipe is the same from this source
        return checked
    check_recipe_sizes(choice.recipe.algorithms, choice.source)
    part = replace(checked.recipe, recipe=choice.recipe, source=choice.source,
                   propagate=o.propagate if o.propagate is not None else choice.propagate)
    return replace(checked, recipe=part)


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


__all__ = ["PtqOptions", "plan_job", "quantize", "command_flags", "resume_check", "model_of", "with_model_defaults",
           "data_paths"]
