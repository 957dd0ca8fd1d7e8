"""The job plan: every input of a PTQ run checked before any work (issue 25.1).

``build_job(options, spec, paths)`` turns a :class:`PtqOptions` (what the user asked for: the
flags of tools/run_ptq.py, by the same names, the model's defaults filled in) and the
:class:`ResolvedPaths` of its model and texts into a :class:`PtqJob` -- small explicit parts for
the model, checkpoint, evaluation, runtime, output and export, and the workflow's own resolved
``PtqSpec`` (scheme, targets, recipe, calibration as a ``base.PtqConfig``) -- or raises one
:class:`~amct_ext.errors.AmctError` naming the flag or file at fault.
``options.plan_job`` resolves the options and calls it; the options are the one "as asked"
config, the plan the one checked config.
No tensor data is read: the checkpoint is checked through its index, shapes through
meta-device skeletons, the export through the exporter's own check. On V4-Flash-sized inputs
the whole plan takes seconds (benchmarks/RESULTS.md, "time to error").

The model-specific questions (which config fields are required, which keys a layer has,
which weights a target covers, which smoothing pairs no export can write) are answered by the
model's plan spec (``models/deepseek_v4/plan.py``); this module only asks them.

A recipe file may hold the whole job spec, as an llm-compressor recipe does::

    {"recipe": [{"algo": "clip"}, {"algo": "gptq"}],
     "propagate": "quant", "holdout": 0.25, "guard": true, "targets": "attn-linear,moe"}

A flag given on the command line and a different value in the file is refused (never one of
them silently).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from ..base import DEFAULT_EPOCHS, DEFAULT_LR, EvalConfig, PtqConfig
from ..errors import AmctError, ConfigError, DataError, QuantConfigError
from ..io.output_space import probe_writable
from .size_caps import check_calibration_memory, check_recipe_sizes
from .text_files import check_utf8_text
from .tokenizer_files import check_tokenizer

if TYPE_CHECKING:
    from .ptq_spec import PtqSpec

DTYPES = ("bf16", "fp32")
PPL_MODES = ("float", "rtn")
PROPAGATE = ("float", "quant")
#: job-spec keys a recipe file may carry beside its algorithm list
JOB_KEYS = ("propagate", "holdout", "guard", "targets")


class ModelPlanSpec(Protocol):
    """What the plan asks the model (implemented by ``models.deepseek_v4.plan.DeepseekV4PlanSpec``)."""

    name: str

    def read_config(self, model_path: Path) -> Any: ...
    def n_layers(self, config: Any) -> int: ...
    def check_checkpoint(self, model_path: Path, config: Any) -> dict[str, Any]: ...
    def check_scheme(self, config: Any, scheme, targets: Sequence[str], layers: Sequence[int]) -> dict[int, int]: ...
    def unit_stems(self, config: Any, scheme, targets: Sequence[str], layers: Sequence[int]) -> dict[int, list[str]]: ...
    def unexportable_smoothing(self, config: Any, targets: Sequence[str]) -> dict[str, str]: ...
    def adapter(self, run: Any) -> Any: ...
    def source_defaults(self, model_path: Path) -> tuple[str, dict[str, tuple[str, str]]]: ...


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
    device_memory_gb: float | None = None
    boundary: str = "recompute"
    # ---- output and export
    export: str | None = None
    dequantize_rest: bool = False
    quiet: bool = False



@dataclass(frozen=True)
class ResolvedPaths:
    """Where the options' model and texts were found (``options.plan_job`` resolves them: the
    model's checkpoint folder, the calibration text, the evaluation text)."""

    model: Path
    calib: Path | None = None
    eval: Path | None = None


# ----------------------------------------------------------------------------- the plan's parts
@dataclass
class ModelPart:
    name: str
    path: Path
    config: Any = field(repr=False)
    n_layers: int
    spec: Any = field(default=None, repr=False)   # the model's plan spec (ModelPlanSpec): also makes the adapter
    label: str | None = None                      # the --model name the job was asked for


@dataclass
class CheckpointPart:
    keys: int
    shards: int


@dataclass
class RecipePart:
    """The recipe as :func:`check_request` chose it, before the model is opened: what the resume
    pre-check compares (``options.resume_check``) and what :func:`build_job` resolves into the
    plan's ``PtqSpec``. ``recipe`` None: the legacy learned-clip solver."""

    recipe: Any
    propagate: str
    holdout: float
    guard: bool
    source: str                       # "--algo", a file, or "default|best for <scheme>"

    def algorithms(self, cfg: PtqConfig) -> Any:
        """The recipe the run executes: ``recipe``, or (None) the pre-recipe solver, an
        algorithm of the recipe now (learned_clip with ``cfg``'s --epochs / --lr)."""
        if self.recipe is not None:
            return self.recipe
        from ..algorithms.recipe import parse_algo

        return parse_algo(f"learned_clip:epochs={cfg.epochs}:lr={cfg.lr!r}", "--legacy-solver")


@dataclass
class EvaluationPart:
    enabled: bool
    modes: list[str]
    config: EvalConfig    # the workflow's own settings (text, windows, batch, sharding), held as built


@dataclass
class RuntimePart:
    device: str
    dtype: str
    threads: int | None
    capture_memory_gb: float | None
    hessian_memory_gb: float | None
    sharded_ptq: bool
    boundary: str = "recompute"       # under torchrun: how a rank gets its first layer's inputs
    quiet: bool = False               # no progress display
    #: the accelerator memory the run may use (GiB): every budget is planned against it and the
    #: allocator refuses more (None: the whole device)
    device_memory_gb: float | None = None


@dataclass
class OutputPart:
    dir: Path
    layers: range
    resume: bool                      # OUTPUT/ptq_params already holds this run's parameters


@dataclass
class ExportPart:
    format: str
    out_dir: Path
    allow_partial: bool
    dequantize_rest: bool = False
    scheme: str = ""                  # the --scheme value (a name or a file) the export reloads


@dataclass
class PtqJob:
    model: ModelPart
    checkpoint: CheckpointPart
    # what the run computes, the workflow's own PtqSpec resolved once in build_job: scheme, targets,
    # the recipe (the legacy solver's learned_clip included), propagate, holdout, guard, and its
    # calibration, a base.PtqConfig: the windows (text, samples x seq_len, batch, seed) and
    # --epochs / --lr (the legacy solver's, and meta.json's "solver" entries), in that one place
    spec: PtqSpec
    recipe_source: str                # "--algo", a file, "default|best for <scheme>'s content", "legacy"
    legacy_solver: bool               # the recipe is --legacy-solver's learned_clip
    units_per_layer: dict[int, int]   # the targeted units of each layer of the range
    evaluation: EvaluationPart
    runtime: RuntimePart
    output: OutputPart
    export: ExportPart | None
    ptq: bool = True
    seconds: float = 0.0

    @property
    def n_units(self) -> int:
        return sum(self.units_per_layer.values())

    def describe(self) -> str:
        """Two lines for the log: what will run."""
        s, c = self.spec, self.spec.calibration
        how = "legacy learned clip" if self.legacy_solver else f"{s.recipe} ({self.recipe_source})"
        lines = [f"plan: {self.model.name} {self.model.path} ({self.model.n_layers} layers), scheme "
                 f"{s.scheme.name} on {','.join(s.targets)}, layers "
                 f"[{self.output.layers.start}, {self.output.layers.stop}) = {self.n_units} units",
                 f"plan: recipe {how}, propagate {s.propagate}, holdout {s.holdout:g}, guard "
                 f"{'on' if s.guard else 'off'}; calibration {c.n_samples} x {c.seq_len}"
                 + (f"; ppl {','.join(self.evaluation.modes) or '-'}+ptq" if self.evaluation.enabled else "")
                 + (f"; export {self.export.format}" if self.export else "")
                 + (" (resumed)" if self.output.resume else "")
                 + f"  [checked in {self.seconds:.1f} s]"]
        return "\n".join(lines)

    # ---- what the run takes: the plan's own configs, checked, as copies (and the PtqRuntime made here)
    @property
    def torch_dtype(self) -> Any:
        import torch

        return {"bf16": torch.bfloat16, "fp32": torch.float32}[self.runtime.dtype]

    def ptq_config(self) -> PtqConfig:
        """``base.PtqConfig``: calibration windows and the legacy solver's settings, checked
        here (where the run takes them) and a copy, so that the run's changes never reach the plan."""
        cfg = replace(self.spec.calibration)
        cfg.check()
        return cfg

    def ptq_spec(self, calibration: PtqConfig) -> PtqSpec:
        """``ptq_spec.PtqSpec``: what the run computes, the plan's with ``calibration`` (the run's
        copy, :meth:`ptq_config`), checked again where the run takes it."""
        return replace(self.spec, calibration=calibration).resolved()

    def eval_config(self) -> EvalConfig:
        """``base.EvalConfig``: the perplexity windows, checked here (where the run takes them) and
        a copy, so that the run's changes never reach the plan."""
        cfg = replace(self.evaluation.config)
        cfg.check()
        return cfg

    def ptq_runtime(self) -> Any:
        """``workflow.PtqRuntime``: how the PTQ loop executes (memory budgets, sharding)."""
        from .workflow import PtqRuntime

        rt = self.runtime
        runtime = PtqRuntime(capture_memory_bytes=None if rt.capture_memory_gb is None
                             else int(rt.capture_memory_gb * 2 ** 30),
                             sharded=rt.sharded_ptq,
                             hessian_memory_bytes=None if rt.hessian_memory_gb is None
                             else int(rt.hessian_memory_gb * 2 ** 30))
        runtime.check()
        return runtime


# ----------------------------------------------------------------------------- recipe file = job spec
def load_job_spec(path: str | Path) -> tuple[Any, dict[str, Any]]:
    """(Recipe, job keys) from a recipe file; the job keys are those of :data:`JOB_KEYS` it holds."""
    from ..algorithms.recipe import RecipeError, load_recipe_file, recipe_from_data

    p = Path(path)
    if p.suffix.lower() in (".yaml", ".yml"):
        return load_recipe_file(p), {}   # YAML: the algorithm list only (load_recipe_file's rules)
    if not p.is_file():
        raise RecipeError(f"--recipe {p}: file not found")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:   # RecursionError: nested too deep
        raise RecipeError(f"--recipe {p}: invalid JSON ({e})") from None
    job = {}
    if isinstance(data, dict):
        job = {k: data[k] for k in JOB_KEYS if k in data}
        data = {k: v for k, v in data.items() if k not in JOB_KEYS}
    return recipe_from_data(data, str(p)), job


def _merge(flag: str, given: Any, key: str, spec: dict[str, Any], source: str, default: Any) -> Any:
    if key not in spec:
        return default if given is None else given
    value = spec[key]
    if given is not None and given != value:
        raise ConfigError(f"{flag} {given} conflicts with {key}={value!r} in recipe file {source}; "
                          "give it in one place")
    return value


# ----------------------------------------------------------------------------- checks
def _positive_int(flag: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{flag} {value}: must be a positive integer")
    return value


def _memory_gb(flag: str, value: float | None) -> float | None:
    if value is not None and (not math.isfinite(value) or value < 0):
        raise ConfigError(f"{flag} {value:g}: must be a number of GiB >= 0")
    return value


def _check_output_dir(out: Path) -> None:
    """--output-dir: a folder (or nothing yet) whose parent is a folder we can write into."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output-dir {out}: exists and is not a folder")
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"--output-dir {out}: {probe} is a file, not a folder")


@dataclass
class _Inputs:
    """What :func:`check_request` settles without opening the model."""

    scheme: Any
    targets: list[str]
    recipe: RecipePart
    samples: int
    batch: int
    eval_batch: int
    modes: list[str]
    cap: float | None
    hes: float | None


def check_request(opts: PtqOptions) -> _Inputs:
    """Every check of the options (the model's defaults filled in) that needs neither the model
    nor the data: flags, output folder, scheme, recipe (and the job spec of a recipe file),
    targets. Cheap: run it before anything else."""
    from ..algorithms.recipe import choose_recipe
    from ..quant.schemes import load_scheme, parse_targets

    if opts.dtype not in DTYPES:
        raise ConfigError(f"--dtype {opts.dtype}: must be one of {', '.join(DTYPES)}")
    out = Path(opts.output_dir)
    _check_output_dir(out)
    probe_writable(out, "--output-dir")   # a read-only folder refused now, not after the perplexities
    # ---- runtime and sizes (flags by name, never a dataclass field)
    threads = opts.threads
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads {threads}: must be >= 1 (omit it for torch's default)")
    samples = _positive_int("--calib-samples", opts.calib_samples)
    seq_len = opts.seq_len
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ConfigError(f"--seq-len {seq_len}: must be >= 2 (a window needs a token and its successor)")
    batch = _positive_int("--batch-size", opts.batch_size)
    eval_batch = _positive_int("--eval-batch-size", opts.eval_batch_size)
    if opts.eval_windows is not None:
        _positive_int("--eval-windows", opts.eval_windows)
    # --epochs 0 is meaningful (learned_clip keeps its grid start: PtqConfig allows it); None is
    # refused here, by name, as the plan's PtqConfig could not hold it (a TypeError in its check)
    if not isinstance(opts.epochs, int) or isinstance(opts.epochs, bool) or opts.epochs < 0:
        raise ConfigError(f"--epochs {opts.epochs}: must be an integer >= 0")
    if opts.lr is None:
        raise ConfigError("--lr None: must be a positive number")
    if not (math.isfinite(opts.lr) and opts.lr > 0):
        raise ConfigError(f"--lr {opts.lr:g}: must be a positive number")
    cap = _memory_gb("--capture-memory-gb", opts.capture_memory_gb)
    hes = _memory_gb("--hessian-memory-gb", opts.hessian_memory_gb)
    if opts.hessian_memory_gb is not None and opts.hessian_memory_gb == 0:
        raise ConfigError("--hessian-memory-gb 0: must be > 0 (omit it for 35% of the accelerator's memory)")
    if _memory_gb("--device-memory-gb", opts.device_memory_gb) == 0:
        raise ConfigError("--device-memory-gb 0: must be > 0 (omit it for the whole device)")
    modes = [m.strip() for m in (opts.ppl_modes or "").split(",") if m.strip()]
    for m in modes:
        if m not in PPL_MODES:
            raise ConfigError(f"--ppl-modes: {m!r} is not one of {', '.join(PPL_MODES)}")
    if opts.export and opts.no_ptq:
        raise ConfigError("--export needs learned parameters: drop --no-ptq (or use tools/export.py --scheme for RTN)")

    # ---- scheme and recipe (the recipe file may hold the job spec)
    scheme = load_scheme(opts.scheme)
    # the recipe, resolved in one place (algorithms.recipe.choose_recipe); a JSON file may hold the job spec
    choice = choose_recipe(scheme, opts.algo, opts.recipe, legacy=opts.legacy_solver, read_file=load_job_spec)
    recipe, source, job_spec = choice.recipe, choice.source, choice.job_spec
    where = source
    propagate = _merge("--propagate", opts.propagate, "propagate", job_spec, where,
                       choice.propagate if recipe is not None and choice.propagate is not None else "float")
    if propagate not in PROPAGATE:
        raise ConfigError(f"propagate={propagate!r} ({where}): must be one of {', '.join(PROPAGATE)}")
    holdout = _merge("--holdout", opts.holdout, "holdout", job_spec, where, 0.25)
    if isinstance(holdout, bool) or not isinstance(holdout, (int, float)) or not 0 <= holdout < 1:
        # name where the value came from, and its type: a string "0.5" in a recipe file is not 0.5
        shown = (f"holdout={holdout!r} ({type(holdout).__name__}) in recipe file {where}" if "holdout" in job_spec
                 else f"--holdout {holdout}")
        raise ConfigError(f"{shown}: the held-out share of each unit's calls must be a number in [0, 1)")
    guard = _merge("--no-guard", False if opts.no_guard else None, "guard", job_spec, where, True)
    if opts.no_guard and job_spec.get("guard") is True:
        raise ConfigError(f"--no-guard conflicts with guard=true in recipe file {where}; give it in one place")
    if not isinstance(guard, bool):
        raise ConfigError(f"guard={guard!r} in recipe file {where}: must be true or false")
    targets_text = _merge("--quant-target", opts.quant_target, "targets", job_spec, where, "attn-linear,moe")
    targets = scheme.check_targets(parse_targets(targets_text))
    if recipe is not None:   # a search grid of 10^12 candidates: refused before any work
        check_recipe_sizes(recipe.algorithms, where)

    return _Inputs(scheme, list(targets), RecipePart(recipe, propagate, float(holdout), guard, source),
                   samples, batch, eval_batch, modes, cap, hes)


def _check_output_room(opts: PtqOptions, model_path: Path, spec: ModelPlanSpec, config: Any, inp: _Inputs,
                       layers: range, export: ExportPart | None, n_units: int) -> None:
    """Free space on --output-dir's disk for the unit files and the export (io/output_space.py)."""
    from ..io import output_space as room

    count = getattr(spec, "quantized_weight_numel", None)
    numel = count(config, inp.scheme, inp.targets, list(layers)) if count is not None else {}
    need, what = 0, []
    if not opts.no_ptq:
        names = [a.name for a in inp.recipe.recipe.algorithms] if inp.recipe.recipe is not None else []
        need += room.ptq_params_bytes(numel, names, 2 if opts.dtype == "bf16" else 4, n_units)
        what.append("the run")
    if export is not None:
        need += room.export_bytes(room.checkpoint_bytes(model_path),
                                  export.dequantize_rest or export.format == "ascend")
        what.append(f"its {export.format} export")
    out = Path(opts.output_dir)
    room.check_output_room(out, "--output-dir", need, " and ".join(what) or "the run",
                           already=[out / "ptq_params", *([export.out_dir] if export else [])],
                           probe=False)   # check_request probed it, before the model was opened


def build_job(opts: PtqOptions, spec: ModelPlanSpec, paths: ResolvedPaths, *, check_resume=None,
              checked: _Inputs | None = None) -> PtqJob:
    """The checked plan of ``opts`` (see the module docstring), its model and texts at ``paths``.
    ``check_resume(out_dir, scheme, targets, recipe_part, dtype) -> bool``: the caller's
    fingerprint check of OUTPUT/ptq_params (True: a resume), run before the model is opened; it
    must read no tensor data. ``checked``: what
    :func:`check_request` returned for these options when the caller ran it first (it is then
    not run again: the options are checked once)."""
    import time

    t0 = time.perf_counter()
    out = Path(opts.output_dir)
    inp = checked if checked is not None else check_request(opts)
    scheme, targets, recipe, seq_len = inp.scheme, inp.targets, inp.recipe.recipe, opts.seq_len
    # the resume fingerprint's settled fields first: a mismatched folder costs no checkpoint scan
    resume = bool(check_resume(out, scheme, targets, inp.recipe, opts.dtype)) \
        if check_resume is not None and not opts.no_ptq else False

    # ---- data
    calib_path = Path(paths.calib) if paths.calib else None
    if calib_path is None or not calib_path.is_file():
        raise DataError(f"calibration text not found: {calib_path} (pass --calib-data FILE)")
    eval_path = Path(paths.eval) if paths.eval else None
    if opts.eval_ppl and (eval_path is None or not eval_path.is_file()):
        raise DataError(f"evaluation text not found: {eval_path} (pass --eval-data wiki.test.raw)")
    check_utf8_text(calib_path, "--calib-data")   # binary / UTF-16 text: one line now, not a traceback later
    if opts.eval_ppl:
        check_utf8_text(eval_path, "--eval-data")

    # ---- model: links, config, checkpoint index, layers, scheme x shapes
    from .plan_checks import check_checkpoint_links, check_layer_count

    model_path = Path(paths.model)
    check_checkpoint_links(model_path)
    config = spec.read_config(model_path)
    n_layers = spec.n_layers(config)
    check_tokenizer(model_path, getattr(config, "vocab_size", None))   # named file, both sizes
    max_len = getattr(config, "max_seq_len", None)
    if isinstance(max_len, int) and seq_len > max_len:
        raise ConfigError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings={max_len}")
    start = 0 if opts.start_layer is None else opts.start_layer
    stop = n_layers if opts.end_layer is None else opts.end_layer
    if not 0 <= start < stop <= n_layers:
        raise ConfigError(f"--start-layer {start} / --end-layer {stop}: the layer range must satisfy "
                          f"0 <= start < end <= {n_layers}")
    layers = range(start, stop)
    values = getattr(spec, "hidden_values_per_token", None)
    if not opts.no_ptq and values is not None:   # --calib-samples 10^9: refused now, not after minutes
        check_calibration_memory(inp.samples, seq_len, values(config), 2 if opts.dtype == "bf16" else 4)
    # ---- export: format x scheme x targets x engine (the exporter's own check), with the unit
    # parameters the recipe will save that the engine may not represent (the w3 pair's up_limit)
    export = None
    if opts.export:
        from ..export.exporter import ExportConfig

        ecfg = ExportConfig(model_path=model_path, out_dir=out / f"export-{opts.export}",
                            format=opts.export, scheme=scheme, targets=list(targets),
                            params_dir=out / "ptq_params", dequantize_rest=opts.dequantize_rest)
        planned = spec.planned_params(config, targets, recipe) if hasattr(spec, "planned_params") else ()
        try:
            ecfg.check(planned_params=planned)
        except AmctError as e:
            raise type(e)(f"--export {opts.export}: {e}") from None
        export = ExportPart(format=opts.export, out_dir=ecfg.out_dir, allow_partial=False,
                            dequantize_rest=opts.dequantize_rest, scheme=opts.scheme)

    # ---- the index (every layer's keys, every shard) and the scheme against every targeted shape
    ck = spec.check_checkpoint(model_path, config)
    if "checkpoint_layers" in ck:
        check_layer_count(n_layers, ck["checkpoint_layers"], str(model_path), opts.allow_fewer_layers)
    units = spec.check_scheme(config, scheme, targets, list(layers))
    _check_output_room(opts, model_path, spec, config, inp, layers, export, sum(units.values()))

    from .ptq_spec import PtqSpec

    calibration = PtqConfig(epochs=opts.epochs, lr=opts.lr, n_samples=inp.samples, seq_len=seq_len,
                            batch_size=inp.batch, seed=opts.seed, calib_path=calib_path,
                            eval_paths=(str(eval_path),))
    r = inp.recipe
    # resolved() checks the calibration, targets, propagate and holdout again: check_request refused
    # every value it would (by flag name), so this is a guard, never the first error
    ptq = PtqSpec(scheme, targets, calibration, recipe=r.algorithms(calibration), propagate=r.propagate,
                  holdout=r.holdout, guard=r.guard).resolved()
    job = PtqJob(
        model=ModelPart(spec.name, model_path, config, n_layers, spec=spec, label=opts.model),
        checkpoint=CheckpointPart(keys=ck.get("keys", 0), shards=ck.get("shards", 0)),
        spec=ptq, recipe_source=r.source, legacy_solver=r.recipe is None, units_per_layer=units,
        evaluation=EvaluationPart(bool(opts.eval_ppl), inp.modes, EvalConfig(
            seq_len=seq_len, max_windows=opts.eval_windows, first_window=opts.eval_first_window,
            batch_size=inp.eval_batch, data_path=eval_path, sharded=opts.sharded_eval)),
        runtime=RuntimePart(opts.device, opts.dtype, opts.threads, inp.cap, inp.hes, opts.sharded_ptq,
                            boundary=opts.boundary, quiet=opts.quiet, device_memory_gb=opts.device_memory_gb),
        output=OutputPart(out, layers, resume=False),
        export=export, ptq=not opts.no_ptq)
    job.output.resume = resume
    job.seconds = time.perf_counter() - t0
    return job


__all__ = ["PtqOptions", "ResolvedPaths", "PtqJob", "ModelPlanSpec", "build_job", "check_request", "load_job_spec",
           "JOB_KEYS", "PPL_MODES", "DTYPES"]
