"""Blockwise orchestration, generic over a BaseModel adapter: perplexity and PTQ.

Blockwise means the model is never whole in memory: the hidden states of every sample flow
through layer i, layer i is released, then layer i+1 is built. Peak memory is about one layer
plus the hidden states (kept on the host between layers). Both ``evaluate_blockwise`` and
``run_blockwise_ptq`` follow that loop.

Design choice: float predecessors
---------------------------------
During PTQ, layer i+1 is calibrated on FLOAT inputs: X_{i+1} = float_block_i(X_i), not the
output of the quantized layer i. Reasons: (1) the solver's target is the float unit output, so
float inputs make input and target consistent; (2) each layer's data depends only on the float
model and the calibration windows, so a resumed run recomputes exactly the same data and
produces bit-identical parameters; (3) one forward per layer gives both the captured unit I/O
and the next layer's input. (Quantized predecessors would let later layers compensate earlier
errors, at the cost of a second pass per layer and of resume determinism.)
``PtqSpec(propagate='quant')`` (``--propagate quant``) does exactly that: after a
layer's units are solved, the quantized layer's output is the next layer's input (a resumed
run reloads the finished units first, so it stays bit-identical). Which is better is measured
per scheme on the quality table (benchmarks/RESULTS.md §8; algorithms/recipe.py defaults).

Static activation specs (``dynamic: false``) need observed ranges: after ``quantize_block`` an
'observe' pass over the calibration inputs of the layer (float inputs, RTN weights) records
them, then they switch to 'quant'. A static quantizer that saw no data (an expert no
calibration token was routed to) has no range to quantize with: it is left 'off' (float
activations), and COUNTED -- ``EvalResult.unobserved_static`` / ``PtqResult.unobserved_static``,
which tools/run_ptq.py writes into report.json and its summary. Not an error: with a few
calibration windows and many experts some experts receive no token, and refusing would make
small calibration sets unusable; inventing a range (e.g. from another expert) would be a
silent guess. A count in the report makes the float fraction visible (casebook/fresh-clone-and-reliability.md).

Parameter files: OUTPUT/ptq_params/meta.json (the run's fingerprint: scheme, targets, solver /
recipe settings, dtype, device type, calibration text and window hashes with samples, seq-len,
seed, batch size, the model config hash, the checkpoint identity, a format version) is written
before any unit; each unit then writes ``{file_stem}.pt`` (its ``export_ptq_params()``) and
``{file_stem}.json`` (its losses) atomically. A unit whose ``.pt`` exists is skipped, so an
interrupted run resumes where it stopped. A folder whose meta.json differs in any field is
refused with one line naming the field and both values (never mixed).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..runtime import device as devmod
from ..base import BaseModel, EvalConfig, PtqConfig, batches
from .calibration import load_calibration_windows
from ..data import EVAL_DEFAULT
from .block_stage import BlockStage, run_block_stage  # noqa: F401  (run_block_stage: its old home)
from .capture import CallSink, capture_unit_io  # noqa: F401  (capture_unit_io: its old home)
from .capture_modes import LayerRerun, LayerWork, SolveSettings, _collect_hessians, call_bytes, capture_mode  # noqa: F401
from ..errors import AmctError, ConfigError, DataError
from ..io.io_utils import atomic_save, atomic_write_json, load_error_line, safe_torch_load
from .perplexity import NllAccumulator, load_eval_text, tokenize_windows
from .phases import NO_PHASES
from ..quant.schemes import QuantScheme
from .ptq_spec import PtqSpec
from .ptq_units import UnitResult
from .resume_guard import ResumeGuard
from .static_ranges import finish_static, observe_static, scheme_has_static  # noqa: F401
from .stream import Stream, embed_stream, module_bytes, mtp_layers, mtp_stream  # noqa: F401

log = logging.getLogger(__name__)

# the output folder's layout, meta.json and its checks live in run_folder (one owner)
from .run_folder import META_NAME, META_VERSION, PARAMS_DIR, ParamsMismatchError, RunFolder  # noqa: E402,F401

MODES = ("float", "rtn", "ptq")


# ----------------------------------------------------------------------------- small helpers
def _tqdm(iterable, **kw):
    from tqdm.auto import tqdm

    return tqdm(iterable, **kw)


def layer_range(adapter: BaseModel, start: int | None = None, end: int | None = None) -> range:
    """Layers ``[start, end)``; None = from the first / to the last. Out of range: ConfigError."""
    n = adapter.num_layers
    s = 0 if start is None else start
    e = n if end is None else end
    if not (0 <= s < e <= n):
        raise ConfigError(f"layer range [{s}, {e}) is invalid: the model has {n} layers (0..{n - 1}); "
                          f"need 0 <= start-layer < end-layer <= {n}")
    return range(s, e)


def check_seq_len(adapter: BaseModel, seq_len: int, what: str = "seq_len") -> None:
    """A window must predict at least one token and fit the model's positions."""
    limit = adapter.max_seq_len
    if seq_len < 2:
        raise ConfigError(f"{what}={seq_len}: must be >= 2 (a window predicts tokens 1..S-1)")
    if limit is not None and seq_len > limit:
        raise ConfigError(f"{what}={seq_len} exceeds the model's max_position_embeddings={limit}")


def load_eval_windows(adapter: BaseModel, cfg: EvalConfig) -> torch.Tensor:
    """The Wikitext protocol: rows joined with '\\n\\n', tokenized once, non-overlapping windows."""
    cfg.check()
    check_seq_len(adapter, cfg.seq_len, "eval seq_len")
    # no path: the shipped wikitext-2-raw-v1 test split (offline), not a download
    text = load_eval_text(cfg.data_path if cfg.data_path is not None else EVAL_DEFAULT)
    return tokenize_windows(text, adapter.tokenizer(), cfg.seq_len, cfg.max_windows, first_window=cfg.first_window)


def load_calib_windows(adapter: BaseModel, cfg: PtqConfig) -> torch.Tensor:
    cfg.check()
    check_seq_len(adapter, cfg.seq_len, "calibration seq_len")
    return load_calibration_windows(cfg.calib_path, adapter.tokenizer(), cfg.seq_len, cfg.n_samples, cfg.seed,
                                    eval_paths=cfg.eval_paths)


@dataclass
class MemoryStats:
    """Peak memory of a blockwise loop: the device statistic and our own accounting."""

    device: str
    peak_memory_bytes: int           # device allocator peak; on cpu the PROCESS peak RSS
    max_layer_bytes: int = 0         # largest layer's parameters + buffers
    hidden_bytes: int = 0            # hidden states of all samples between layers
    capture_memory_peak_bytes: int = 0   # PTQ: captured unit calls held in host memory at once (max)
    capture_spilled_bytes: int = 0       # PTQ: captured unit calls written to the scratch folder (sum)
    #: PTQ: call data in host memory at once over a layer's capture AND solve (max over layers):
    #: kept, waiting to be spilled, read back, stacked by an algorithm (capture.CALL_METER)
    call_memory_peak_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ----------------------------------------------------------------------------- parameter folder
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def windows_sha256(windows: torch.Tensor) -> str:
    """Hash of the calibration token windows (shape and ids): what the units are fitted on."""
    w = windows.detach().to("cpu", torch.int64).contiguous()
    return hashlib.sha256(repr(tuple(w.shape)).encode() + w.numpy().tobytes()).hexdigest()


def checkpoint_identity(model_path: Path) -> dict[str, Any]:
    """The checkpoint's identity without reading its weights: the hash of its shard index, or of
    a single file's safetensors header (tensor names, dtypes, shapes and offsets)."""
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        return {"index_sha256": _sha256_file(index)}
    single = model_path / "model.safetensors"
    if single.is_file():
        with open(single, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            return {"header_sha256": hashlib.sha256(head + f.read(min(n, 1 << 27))).hexdigest()}
    return {}


def params_meta(adapter: BaseModel, spec: PtqSpec, calib_windows: torch.Tensor | None = None) -> dict[str, Any]:
    """Everything that changes a unit's result (ptq_params/meta.json). A resumed run must agree
    on every field; display-only entries (names) are listed in ``_DISPLAY_ONLY``."""
    spec = spec.resolved()
    cfg = spec.calibration
    model_id = adapter.model_id()
    calib = cfg.calibration_settings()
    text = cfg.calibration_text()
    calib["text_sha256"] = _sha256_file(text) if text.is_file() else None
    if calib_windows is not None:
        calib["windows_sha256"] = windows_sha256(calib_windows)
    return {"version": META_VERSION, "scheme": spec.scheme.name,
            "scheme_fingerprint": spec.scheme.fingerprint(), "targets": list(spec.targets),
            "solver": spec.solver_meta(), "dtype": dtype_name(adapter.run.dtype),
            "device_type": adapter.device.type, "calibration": calib, "model": model_id,
            "checkpoint": checkpoint_identity(Path(adapter.model_path))}


def check_params_dir(params_dir: Path, meta: dict[str, Any]) -> bool:
    """True when ``params_dir`` already holds parameters of this exact run (resume); False when
    it is absent or empty. Raises ParamsMismatchError for anything else (``RunFolder.check_meta``)."""
    return RunFolder.of_params(params_dir).check_meta(meta)


def load_unit_params(unit, params_dir: Path) -> None:
    path = params_dir / f"{unit.file_stem}.pt"
    if not path.is_file():
        raise DataError(f"{path}: missing PTQ parameters of unit {unit.name} (run PTQ for this layer first)")
    try:
        params = safe_torch_load(path)
    except AmctError as e:   # already one line naming the file (a refused pickle)
        raise DataError(str(e)) from None
    except Exception as e:  # truncated / foreign file: one line naming it
        raise DataError(f"{path}: cannot load ({load_error_line(e)})") from None
    if not isinstance(params, dict):
        raise DataError(f"{path}: expected a dict of tensors, got {type(params).__name__}")
    try:
        unit.module.load_ptq_params(params)
    except AmctError as e:
        raise DataError(f"{path}: {e}") from None


# ----------------------------------------------------------------------------- evaluation
@dataclass
class EvalResult:
    mode: str
    ppl: float
    n_windows: int
    seq_len: int
    n_tokens: int
    seconds: float
    memory: MemoryStats
    # static activation quantizers left in float: no calibration data reached them
    unobserved_static: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["memory"] = self.memory.to_dict()
        return d


def check_eval_args(mode: str, cfg: EvalConfig, scheme: QuantScheme | None, targets: Sequence[str] | None,
                    params_dir: str | Path | None) -> tuple[Sequence[str] | None, Path | None]:
    """Validate an evaluation request before any work: (checked targets, the params folder)."""
    if mode not in MODES:
        raise ConfigError(f"evaluation mode {mode!r} is unknown; valid: {', '.join(MODES)}")
    cfg.check()
    if mode != "float":
        if scheme is None or targets is None:
            raise ConfigError(f"evaluation mode {mode!r} needs a scheme and quant targets")
        targets = scheme.check_targets(targets)
    pdir = None
    if mode == "ptq":
        if params_dir is None:
            raise ConfigError("evaluation mode 'ptq' needs params_dir (OUTPUT/ptq_params)")
        pdir = Path(params_dir)
        meta = RunFolder.of_params(pdir).require_meta()
        if meta.get("scheme_fingerprint") != scheme.fingerprint() or meta.get("targets") != list(targets):
            raise ParamsMismatchError(f"{pdir}: parameters were learned for scheme {meta.get('scheme')!r} "
                                      f"targets {meta.get('targets')}, not {scheme.name!r} {list(targets)}")
    return targets, pdir


def eval_needs_calibration(mode: str, scheme: QuantScheme | None, targets: Sequence[str] | None,
                           calib_windows: torch.Tensor | None) -> bool:
    """Whether evaluating ``mode`` must observe static activation ranges first (RTN of a scheme
    with ``dynamic: false`` specs); raises ConfigError when those windows are missing."""
    needs = mode == "rtn" and scheme_has_static(scheme, targets)
    if needs and calib_windows is None:
        raise ConfigError(f"scheme {scheme.name!r} has static activation specs (dynamic: false): "
                          "RTN evaluation needs calibration windows")
    return needs


def eval_block(adapter: BaseModel, i: int, mode: str, quant: bool, cfg: EvalConfig, *,
               scheme: QuantScheme | None, targets: Sequence[str] | None, calib: Stream | None,
               pdir: Path | None) -> tuple[nn.Module, Stream | None, int]:
    """Layer ``i`` ready for evaluation (float, RTN-observed or with its PTQ parameters loaded),
    the calibration stream advanced past it (None stays None), and the number of its static
    activation quantizers that saw no calibration data (left in float, counted)."""
    unobserved = 0
    # non-sharded: the layer is built on the compute device itself (not CPU-staged: the
    # forward passes of evaluation belong on the accelerator -- casebook S10)
    block = adapter.block(i, sharded=cfg.sharded, device=None if cfg.sharded else adapter.device)
    if quant:
        adapter.quantize_block(block, scheme, targets)
        if mode == "rtn":
            if calib is not None:
                # the next layer's calibration inputs come from the float layer (quantizers off);
                # the observe pass runs on the same float inputs
                adapter.set_quant_enabled(block, False)
                next_calib = adapter.do_block_forward(block, calib.hidden, calib.state)
                unobserved += observe_static(adapter, block, calib, i)
                calib = Stream(next_calib, calib.state)
        else:
            for unit in adapter.iter_ptq_units(block, i, targets):
                load_unit_params(unit, pdir)
            unobserved += finish_static(block, i)
        adapter.set_quant_enabled(block, True)
    elif calib is not None:
        calib = Stream(adapter.do_block_forward(block, calib.hidden, calib.state), calib.state)
    return block, calib, unobserved


@dataclass
class EvalStage:
    """Where this process sits in an evaluation. One process (the default): every layer, one
    at a time over every window batch (memory: one layer plus the hidden states). A pipeline
    rank (``distributed.evaluate``): its ``layers`` stay built (``resident``) and each window
    batch flows through all of them as it arrives; ``recv`` gives the previous rank's stream
    (None: this stage embeds), ``send`` passes a stream on (None: this stage computes the head
    NLL), ``reduce(acc, unobserved)`` shares the last stage's sums and returns the job's count
    of unobserved static quantizers."""

    layers: range
    resident: bool = False
    recv: Callable[[], Stream] | None = None
    send: Callable[[Stream], None] | None = None
    reduce: Callable[[NllAccumulator, int], int] | None = None


def evaluate_blockwise(adapter: BaseModel, windows: torch.Tensor, cfg: EvalConfig, mode: str = "float", *,
                       scheme: QuantScheme | None = None, targets: Sequence[str] | None = None,
                       layers: range | None = None, calib_windows: torch.Tensor | None = None,
                       calib_batch_size: int = 1, params_dir: str | Path | None = None,
                       stage: EvalStage | None = None) -> EvalResult:
    """Perplexity of ``windows`` ``[n, S]`` with the model run layer by layer.

    ``mode``: 'float'; 'rtn' (``quantize_block`` on ``layers``, no learning; static activation
    specs observed on ``calib_windows`` flowing through the FLOAT layers); 'ptq' (the same
    wrappers with the parameters saved in ``params_dir``, i.e. OUTPUT/ptq_params). Layers
    outside ``layers`` stay float. ``stage``: this process's part of a pipelined evaluation
    over torchrun ranks (``EvalStage``; ``distributed.evaluate`` builds it); None = the whole
    model here.
    """
    targets, pdir = check_eval_args(mode, cfg, scheme, targets, params_dir)
    layers = layers if layers is not None else layer_range(adapter)
    stage = stage if stage is not None else EvalStage(range(adapter.num_layers))
    dev = adapter.device
    devmod.reset_peak_memory(dev)
    t0 = time.perf_counter()

    needs_calib = eval_needs_calibration(mode, scheme, targets, calib_windows)

    def calibration_stream() -> Stream | None:
        """The calibration stream for static specs (it flows through the layers first)."""
        if not needs_calib:
            return None
        return stage.recv() if stage.recv is not None else embed_stream(adapter, calib_windows, calib_batch_size)

    mem = MemoryStats(device=str(dev), peak_memory_bytes=0)
    unobserved = 0
    acc = NllAccumulator()
    if not stage.resident:
        stream = embed_stream(adapter, windows, cfg.batch_size)
        calib = calibration_stream()
        mem.hidden_bytes = stream.nbytes + (calib.nbytes if calib else 0)
        for i in _tqdm(stage.layers, desc=f"ppl[{mode}] layers", disable=not adapter.run.progress):
            block, calib, n_unobserved = eval_block(adapter, i, mode, mode != "float" and i in layers, cfg,
                                                    scheme=scheme, targets=targets, calib=calib, pdir=pdir)
            unobserved += n_unobserved
            mem.max_layer_bytes = max(mem.max_layer_bytes, module_bytes(block))
            stream = Stream(adapter.do_block_forward(block, stream.hidden, stream.state, progress=f"layer {i}",
                                                     graphed=cfg.graphs and not cfg.sharded), stream.state)
            adapter.release_block(block)
        for h, ids in zip(stream.hidden, batches(windows, cfg.batch_size)):
            acc.update(adapter.do_head_forward(h), ids)
    else:
        calib = calibration_stream()
        blocks = []
        for i in stage.layers:
            block, calib, n_unobserved = eval_block(adapter, i, mode, mode != "float" and i in layers, cfg,
                                                    scheme=scheme, targets=targets, calib=calib, pdir=pdir)
            unobserved += n_unobserved
            mem.max_layer_bytes = max(mem.max_layer_bytes, module_bytes(block))
            blocks.append(block)
        if needs_calib and stage.send is not None:
            stage.send(calib)
        # window batches through the stage, in the one-process order
        for ids in batches(windows, cfg.batch_size):
            s = (stage.recv() if stage.recv is not None
                 else Stream(adapter.do_embedding_forward([ids]), list(adapter.sample_state)))
            for block in blocks:
                # graphed=False: a replay graph lives for one do_block_forward call, here one batch
                s = Stream(adapter.do_block_forward(block, s.hidden, s.state), s.state)
            if stage.send is None:
                acc.update(adapter.do_head_forward(s.hidden[0]), ids)
            else:
                stage.send(s)
        for block in blocks:
            adapter.release_block(block)
    if stage.reduce is not None:
        unobserved = stage.reduce(acc, unobserved)
    devmod.synchronize(dev)
    mem.peak_memory_bytes = devmod.peak_memory_bytes(dev)
    return EvalResult(mode=mode, ppl=acc.ppl, n_windows=int(windows.shape[0]), seq_len=int(windows.shape[1]),
                      n_tokens=acc.count, seconds=time.perf_counter() - t0, memory=mem,
                      unobserved_static=unobserved)


# ----------------------------------------------------------------------------- PTQ
@dataclass
class PtqResult:
    units: list[UnitResult] = field(default_factory=list)
    params_dir: str = ""
    seconds: float = 0.0
    memory: MemoryStats | None = None
    unobserved_static: int = 0       # static activation quantizers no calibration data reached


SCRATCH_DIR = ".scratch"


@dataclass
class PtqRuntime:
    """How a PTQ run executes -- never what it computes, so nothing here goes into meta.json.

    ``capture_memory_bytes``: host-memory budget of one layer's captured unit calls; calls
    beyond it spill to OUTPUT/.scratch/layer_{i}/ (removed once the unit / layer is solved).
    None = no budget (everything in memory); at most ``capture_buffer_bytes`` more wait to be
    written. ``sharded``: build each layer spread over
    ``adapter.shard_devices()`` (``dispatch.build_layer_device_map``, the ``--sharded-eval``
    placement) and solve every unit on the device that holds it, for layers that do not fit
    one device. ``make_sink(unit)``: a ``capture.CallSink`` for the unit (e.g. an algorithm's
    statistics sink), or None for the store's default. ``phases``: a ``phases.PhaseTimer``
    recording each step's time and peak memory (benchmarks). ``on_unit_done(result)``: called
    after each unit is saved (progress reporting; tests use it to interrupt)."""

    capture_memory_bytes: int | None = None
    #: the write buffer of calls on their way to the scratch folder, shared by a layer's units
    #: (``capture.CaptureStore``): host memory beyond the budget during the capture
    capture_buffer_bytes: int = 256 * 2 ** 20
    sharded: bool = False
    #: a recipe that replays no calls (``Recipe.needs().calls`` False) gets per-leaf Hessians
    #: accumulated during the capture instead of stored calls; False stores calls anyway
    statistics: bool = True
    make_sink: Callable[[Any], CallSink | None] | None = None
    #: device-memory budget of one capture pass's Hessians (statistics path); a layer whose
    #: units need more is captured in several passes (``hessians.plan_hessian_passes``).
    #: None = ``HESSIAN_MEMORY_FRACTION`` of the accelerator's memory, no limit on cpu.
    hessian_memory_bytes: int | None = None
    phases: Any = None
    on_unit_done: Callable[[UnitResult], None] | None = None

    def check(self) -> None:
        if self.capture_memory_bytes is not None and self.capture_memory_bytes < 0:
            raise ConfigError(f"capture memory budget must be >= 0 bytes, got {self.capture_memory_bytes}")
        if self.capture_buffer_bytes <= 0:
            raise ConfigError(f"capture write buffer must be > 0 bytes, got {self.capture_buffer_bytes}")
        if self.hessian_memory_bytes is not None and self.hessian_memory_bytes <= 0:
            raise ConfigError(f"Hessian memory budget must be > 0 bytes, got {self.hessian_memory_bytes}")

    def hessian_budget(self, device: torch.device) -> int | None:
        """The budget for the layer just built on ``device`` (call it after the build)."""
        if self.hessian_memory_bytes is not None:
            return self.hessian_memory_bytes
        total = devmod.total_memory_bytes(device)
        if total is None:
            return None
        return int(HESSIAN_MEMORY_FRACTION * max(total - devmod.memory_allocated(device), 0))


#: the default share of the device memory left free by the built layer for one pass's
#: Hessians; the rest is for the forward's transients and the solver's workspace (GPTQ's
#: Cholesky factors of a 16-expert chunk). On an H200 (140 GiB) a V4-Flash layer (13 GB of
#: weights, 21 GB of Hessians) takes one pass; a V4-Pro layer (53 GB built, 94 GB of expert
#: Hessians) three; 35 % of the whole memory left GPTQ out of memory on the V4-Pro layer
#: (casebook/real-size-ptq.md).
HESSIAN_MEMORY_FRACTION = 0.4


def _unit_stats_path(params_dir: Path, unit) -> Path:
    return params_dir / f"{unit.file_stem}.json"


def _resumed_result(params_dir: Path, unit) -> UnitResult:
    """The stats an earlier run saved for ``unit`` (its .pt exists)."""
    try:
        d = json.loads(_unit_stats_path(params_dir, unit).read_text(encoding="utf-8"))
        r = UnitResult(**d)
    except (OSError, ValueError, TypeError):
        r = UnitResult(name=unit.name, kind=unit.kind, layer=unit.layer_idx, loss_before=None, loss_after=None,
                       seconds=0.0, n_calls=0, n_params=0, best_epoch=0)
    r.resumed = True
    return r


def prepare_params_dir(adapter: BaseModel, output_dir: str | Path, spec: PtqSpec, create: bool = True,
                       calib_windows: torch.Tensor | None = None) -> Path:
    """Check (and, with ``create``, write) OUTPUT/ptq_params/meta.json; returns the folder.
    With ``create=False`` nothing is written: the caller validates before doing any work.
    ``calib_windows``: the windows the run calibrates on (default: drawn from
    ``spec.calibration``); their hash is part of the fingerprint."""
    pdir = Path(output_dir) / PARAMS_DIR
    if calib_windows is None:
        calib_windows = load_calib_windows(adapter, spec.calibration)
    meta = params_meta(adapter, spec, calib_windows)
    folder = RunFolder(output_dir)
    exists = folder.check_meta(meta)
    if create and not exists:
        folder.write_meta(meta)
    return pdir


@dataclass(frozen=True)
class LayerSlice:
    """A layer range of a larger run (``amct_ext.pipeline.distributed``). ``float_like``: that
    run's range; predecessors inside it run as its quantized layers did
    (``float_layer_output``), so the hidden states are bit for bit those of the larger run.
    ``start = (k, stream)``: the float inputs of layer k are given (received from another
    rank); layers < k are not run."""

    float_like: range | None = None
    start: tuple[int, Stream] | None = None


@dataclass
class _PtqRun:
    """What ``run_blockwise_ptq`` settles before its first layer (every check, the parameter
    folder, the embedded calibration stream) and carries from layer to layer."""

    adapter: BaseModel
    spec: PtqSpec
    runtime: PtqRuntime
    output_dir: Path
    pdir: Path
    layers: range
    float_like: range | None
    layer_ids: list[int]
    mtp_ids: list[int]
    needs: Any
    stage: BlockStage
    settings: SolveSettings
    phases: Any
    # the embedded stream until the loop takes it (``take_stream``): held here for the whole
    # run it would keep a V4-Flash calibration set (8 GiB of host memory) alive (casebook i34-8)
    calib: Stream | None
    memory: MemoryStats
    result: PtqResult
    t0: float
    resume: ResumeGuard

    @classmethod
    def start(cls, adapter: BaseModel, spec: PtqSpec, output_dir: str | Path, layers: range | None,
              calib_windows: torch.Tensor | None, runtime: PtqRuntime | None, part: "LayerSlice | None",
              extra_layers: bool) -> "_PtqRun":
        spec = spec.resolved()
        cfg, recipe = spec.calibration, spec.recipe
        runtime = runtime or PtqRuntime()
        runtime.check()
        part = part or LayerSlice()
        start = part.start
        ph = runtime.phases if runtime.phases is not None else NO_PHASES
        # a block-level algorithm (the recipe's last entry) runs after the unit algorithms, on the
        # whole layer against its output; the units get the rest of the recipe
        block_algo = recipe.block_algorithm
        unit_recipe = recipe.unit_recipe() if block_algo is not None else recipe
        stage = BlockStage(block_algo, spec.propagate, cfg.seed)
        stage.check(recipe, runtime.sharded, start is not None)
        layers = layers if layers is not None else layer_range(adapter)
        stage.check_device_memory(adapter, recipe, spec.scheme, spec.targets, layers)
        if calib_windows is None:
            calib_windows = load_calib_windows(adapter, cfg)
        pdir = prepare_params_dir(adapter, output_dir, spec, calib_windows=calib_windows)
        dev = adapter.device
        devmod.reset_peak_memory(dev)
        t0 = time.perf_counter()
        if start is not None and not 0 <= start[0] <= layers.start:
            raise ConfigError(f"run_blockwise_ptq: the given stream enters layer {start[0]}, after the first "
                              f"layer to quantize ({layers.start})")
        if start is not None:
            first, calib = start
        else:
            first = 0
            with ph.phase("embed"):
                calib = embed_stream(adapter, calib_windows, cfg.batch_size)
        stage.start(calib)
        mtp_ids = mtp_layers(adapter, layers) if extra_layers else []
        # finished units are taken only when whole and computed from these weights (resume_guard)
        resume = ResumeGuard(adapter, output_dir, [*range(layers.stop), *mtp_ids])
        settings = SolveSettings(unit_recipe, cfg.seed, adapter.run.dtype, spec.holdout, spec.guard, spec.propagate,
                                 write_as_solved=block_algo is None)
        return cls(adapter, spec, runtime, Path(output_dir), pdir, layers, part.float_like,
                   [*range(first, layers.stop), *mtp_ids], mtp_ids, unit_recipe.needs(), stage, settings, ph, calib,
                   MemoryStats(device=str(dev), peak_memory_bytes=0, hidden_bytes=calib.nbytes),
                   PtqResult(params_dir=str(pdir)), t0, resume)

    def take_stream(self) -> Stream:
        """The embedded calibration stream, handed to the loop once: the run keeps no reference,
        so each layer's inputs are freed as soon as the next layer's exist."""
        calib, self.calib = self.calib, None
        if calib is None:
            raise RuntimeError("_PtqRun.take_stream: the stream was already taken")
        return calib

    def build(self, i: int) -> nn.Module:
        """Layer ``i`` built where it runs (decoded there, never staged in host memory: the float
        capture needs the whole layer on the device anyway, and a host-staged V4-Flash layer cost
        ~3x its 13 GB in host RSS; benchmarks/RESULTS.md §7b)."""
        with self.phases.phase("build", layer=i):
            if self.runtime.sharded and i not in self.mtp_ids:
                block = self.adapter.block(i, sharded=True)
            else:
                block = self.adapter.block(i, device=self.adapter.device)
        self.memory.max_layer_bytes = max(self.memory.max_layer_bytes, module_bytes(block))
        return block

    def layer_work(self, i: int, block: nn.Module, calib: Stream) -> tuple[LayerWork, Any]:
        """The quantized layer's units, those left to solve, and its capture mode."""
        with self.phases.phase("build", layer=i):
            self.adapter.quantize_block(block, self.spec.scheme, self.spec.targets)
        units = list(self.adapter.iter_ptq_units(block, i, self.spec.targets))
        todo = self.resume.todo(i, units)
        if self.stage.algo is not None and todo:
            # the block stage tunes every unit of the layer together: a layer an interrupted run
            # left half written is solved again as a whole (its units are written after the block)
            todo = {u.name for u in units}
        work = LayerWork(i, block, units, todo, calib, self.adapter.device,
                         save=lambda unit, r: _save_unit(self.pdir, unit, r), on_saved=self.runtime.on_unit_done)
        scratch = (None if self.runtime.capture_memory_bytes is None
                   else self.output_dir / SCRATCH_DIR / f"layer_{i}")
        return work, capture_mode(self.adapter, self.runtime, work, self.needs, scratch)

    def propagate_quantized(self, work: LayerWork) -> None:
        """propagate=quant: the next layer's inputs are the solved layer's outputs. The units an
        earlier run finished are loaded only now, after this run's solve -- loaded before it,
        their in-place weights would feed a re-run of the layer (sequential GPTQ) a non-float
        input (casebook i24-sq4)."""
        for unit in work.units:
            if unit.name not in work.todo:
                load_unit_params(unit, self.pdir)
        self.adapter.end_capture(work.block)   # propagated as it will be evaluated (fused paths on)
        with self.phases.phase("propagate", layer=work.idx):
            work.next_hidden = self.adapter.do_block_forward(work.block, work.calib.hidden, work.calib.state)

    def finish(self) -> PtqResult:
        self.resume.close()
        dev = self.adapter.device
        devmod.synchronize(dev)
        self.memory.peak_memory_bytes = max(devmod.peak_memory_bytes(dev),
                                            getattr(self.phases, "max_device_peak", lambda: 0)())
        self.result.memory = self.memory
        self.result.seconds = time.perf_counter() - self.t0
        return self.result


def run_blockwise_ptq(adapter: BaseModel, spec: PtqSpec, output_dir: str | Path, *,
                      layers: range | None = None, calib_windows: torch.Tensor | None = None,
                      runtime: PtqRuntime | None = None, part: LayerSlice | None = None,
                      extra_layers: bool = True) -> PtqResult:
    """Quantize every unit of ``layers`` with ``spec``'s recipe (``PtqSpec``: scheme, targets,
    calibration, recipe, propagation, holdout, guard) and save its parameters under
    OUTPUT/ptq_params. ``runtime`` (``PtqRuntime``): memory budgets, sharded layers, phase timer,
    progress hook; ``part`` (``LayerSlice``): a layer range of a larger (torchrun) run; ``extra_layers``:
    a run ending at the model's last layer quantizes the adapter's MTP layer next, on inputs
    built from the last layer's outputs.

    Per layer: build it, ``quantize_block``; its capture mode (``capture_modes``: stored calls
    or statistics, as the recipe's ``needs()`` declare) runs the float layer once, capturing, and
    the unit recipe solves; the block stage (``block_stage``) tunes the layer as a whole when the
    recipe ends with a block-level algorithm; the units are written; the next layer's inputs are
    the float layer's output (propagate float) or the solved layer's (quant)."""
    run = _PtqRun.start(adapter, spec, output_dir, layers, calib_windows, runtime, part, extra_layers)
    ph, stage = run.phases, run.stage
    calib = run.take_stream()
    for i in _tqdm(run.layer_ids, desc="ptq layers", disable=not adapter.run.progress):
        if i in run.mtp_ids:   # the MTP layer: h_i of the last layer with embed(t_{i+1}) (issue 23.6)
            stage.enter_mtp(adapter, i, calib)
            calib = mtp_stream(adapter, i, calib)
        block = run.build(i)
        if i not in run.layers and i not in run.mtp_ids:  # a float predecessor: only its output is needed
            with ph.phase("float_forward", layer=i):
                calib = float_layer_output(adapter, block, calib, run.float_like is not None and i in run.float_like,
                                           run.spec.scheme, run.spec.targets)
            stage.after_predecessor(calib)
            adapter.release_block(block)
            continue
        work, mode = run.layer_work(i, block, calib)
        try:
            run.result.unobserved_static += mode.capture(ph)
            stage.capture_targets(adapter, work, ph)
            mode.account(ph, run.memory)
            mode.solve(ph, run.settings)
            stage.run(adapter, work, ph)
            work.write_rest(ph)
            run.result.units += [work.saved[u.name] if u.name in work.saved else _resumed_result(run.pdir, u)
                                 for u in work.units]
        finally:
            mode.close()
        mode.account_calls(ph, run.memory)
        stage.advance()
        if run.spec.propagate == "quant":
            run.propagate_quantized(work)
        calib = Stream(work.next_hidden, calib.state)
        del work, mode        # this layer's inputs (work.calib) go now, not after the next build
        with ph.phase("release", layer=i):
            adapter.release_block(block)
    return run.finish()


def float_layer_output(adapter: BaseModel, block: nn.Module, calib: Stream, like_quantized: bool,
                       scheme: QuantScheme, targets: Sequence[str]) -> Stream:
    """The float output of a layer (built on its device) over ``calib``. ``like_quantized``:
    computed as ``run_blockwise_ptq`` computes it for a layer it quantizes (wrapped, quantizers
    off, capture paths), so a rank recomputing another rank's layers gets the very same bits even
    where the plain and the capture paths round differently (grouped vs per-expert MoE on
    accelerators)."""
    if like_quantized:
        adapter.quantize_block(block, scheme, targets)
        adapter.prepare_capture(block)
        adapter.set_quant_enabled(block, False)
    return Stream(adapter.do_block_forward(block, calib.hidden, calib.state), calib.state)


def _save_unit(pdir: Path, unit, r: UnitResult) -> None:
    # stats first, then the .pt: the .pt's existence is what marks the unit done
    atomic_write_json(r.to_dict(), _unit_stats_path(pdir, unit))
    atomic_save(unit.module.export_ptq_params(), pdir / f"{unit.file_stem}.pt")


def summary_table(units: Sequence[UnitResult]) -> str:
    """A plain-text table: one row per unit with its losses."""
    def fmt(v: float | None) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4e}"

    head = f"{'unit':<32} {'kind':<13} {'calls':>5} {'loss_before':>12} {'loss_after':>12} {'gain':>7} {'s':>6}"
    rows = [head, "-" * len(head)]
    for u in units:
        gain = "-"
        if u.loss_before and u.loss_after is not None:
            gain = f"{100 * (1 - u.loss_after / u.loss_before):.1f}%"
        rows.append(f"{u.name:<32} {u.kind:<13} {u.n_calls:>5} {fmt(u.loss_before):>12} {fmt(u.loss_after):>12} "
                    f"{gain:>7} {u.seconds:>6.2f}" + ("  (resumed)" if u.resumed else ""))
    return "\n".join(rows)
