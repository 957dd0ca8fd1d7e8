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
from .capture import CALL_METER, CallSink, CaptureStore, SpilledCalls, call_nbytes, capture_unit_io
from ..errors import AmctError, ConfigError, DataError
from ..io.io_utils import atomic_save, atomic_write_json, safe_torch_load
from .perplexity import NllAccumulator, load_eval_text, tokenize_windows
from .phases import NO_PHASES
from ..quant.quantizers import ActivationQuantizer
from ..quant.schemes import QuantScheme
from .ptq_spec import PtqSpec
from .ptq_units import UnitResult

log = logging.getLogger(__name__)

PARAMS_DIR = "ptq_params"
META_NAME = "meta.json"
# 2: the full fingerprint (dtype, device type, calibration hashes, checkpoint identity)
META_VERSION = 2
MODES = ("float", "rtn", "ptq")


class ParamsMismatchError(AmctError):
    """An output folder holds PTQ parameters of another scheme / targets / model / settings."""


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
    limit = getattr(adapter, "max_seq_len", None)
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


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def call_bytes(calls) -> int:
    """Bytes of a unit's captured calls; a spilled sequence counts its bytes on disk."""
    if isinstance(calls, SpilledCalls):
        return sum(call_nbytes(c) for c in calls.head) + calls.spilled_nbytes
    return sum(call_nbytes(c) for c in calls)


def _module_bytes(module: nn.Module) -> int:
    return _tensor_bytes(list(module.parameters()) + [b for b in module.buffers() if b is not None])


@dataclass
class Stream:
    """Hidden states of a set of samples between layers, with their per-sample state."""

    hidden: list[torch.Tensor]
    state: list[dict[str, Any]]

    @property
    def nbytes(self) -> int:
        return _tensor_bytes(self.hidden)


def embed_stream(adapter: BaseModel, windows: torch.Tensor, batch_size: int) -> Stream:
    hidden = adapter.do_embedding_forward(batches(windows, batch_size))
    return Stream(hidden, list(adapter.sample_state or [{}] * len(hidden)))


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


# ----------------------------------------------------------------------------- static calibration
def _static_quantizers(module: nn.Module) -> list[ActivationQuantizer]:
    return [m for m in module.modules() if isinstance(m, ActivationQuantizer) and m.is_static]


def scheme_has_static(scheme: QuantScheme, targets: Sequence[str]) -> bool:
    """Whether any activation / cache spec used by ``targets`` is static (needs calibration)."""
    for t in targets:
        spec = scheme.cache if t == "attn-cache" else scheme.target(t).input
        if spec is not None and not spec.dynamic:
            return True
    return False


def observe_static(adapter: BaseModel, block: nn.Module, calib: Stream | None, layer_idx: int) -> int:
    """Record the ranges of static activation quantizers over the layer's calibration inputs
    (RTN weights), then switch them to 'quant' (unobserved ones to 'off'). Returns the number
    left unobserved. No-op (0) for dynamic-only schemes."""
    static = _static_quantizers(block)
    if not static:
        return 0
    if calib is None:
        raise ConfigError("the scheme has static activation specs (dynamic: false): they need calibration data")
    for q in static:
        q.reset_stats()
        q.mode = "observe"
    adapter.set_quant_enabled(block, True)
    adapter.do_block_forward(block, calib.hidden, calib.state)
    return finish_static(block, layer_idx)


def finish_static(block: nn.Module, layer_idx: int) -> int:
    """Static quantizers with a range -> 'quant', without one -> 'off'; returns how many are off."""
    unobserved = 0
    for q in _static_quantizers(block):
        if q.observed:
            q.mode = "quant"
        else:
            q.mode = "off"
            unobserved += 1
    if unobserved:
        log.warning("layer %d: %d static activation quantizer(s) saw no calibration data "
                    "(e.g. experts no calibration token was routed to); they stay in float",
                    layer_idx, unobserved)
    return unobserved


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
    model_id = adapter.model_id() if hasattr(adapter, "model_id") else {"name": str(adapter.model_path)}
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


# names shown in messages but not compared: a moved or renamed folder is the same run
_DISPLAY_ONLY = {"scheme", "model.name"}
_FIELD_NAMES = {"version": "format version", "scheme_fingerprint": "scheme"}


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(_flatten(v, key) if isinstance(v, dict) and v else {key: v})
    return out


def _mismatch(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """The first field that differs, as ``field: OLD in the folder, NEW now``; or None."""
    if old.get("version") != new["version"]:
        return f"format version: {old.get('version')!r} in the folder, {new['version']!r} now"
    flat_old, flat_new = _flatten(old), _flatten(new)
    for key in [*flat_new, *(k for k in flat_old if k not in flat_new)]:
        if key in _DISPLAY_ONLY:
            continue
        a, b = flat_old.get(key, "<absent>"), flat_new.get(key, "<absent>")
        if a != b:
            if key == "scheme_fingerprint":  # the names say more than two hashes
                return f"scheme: {old.get('scheme')!r} in the folder, {new.get('scheme')!r} now (different fingerprint)"
            return f"{_FIELD_NAMES.get(key, key)}: {a!r} in the folder, {b!r} now"
    return None


def check_params_dir(params_dir: Path, meta: dict[str, Any]) -> bool:
    """True when ``params_dir`` already holds parameters of this exact run (resume); False when
    it is absent or empty. Raises ParamsMismatchError for anything else (never mix)."""
    meta_path = params_dir / META_NAME
    hint = "pass a fresh --output-dir or delete that folder"
    if meta_path.is_file():
        try:
            old = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ParamsMismatchError(f"{meta_path}: unreadable ({e}); {hint}") from None
        why = _mismatch(old if isinstance(old, dict) else {}, meta)
        if why:
            raise ParamsMismatchError(f"{params_dir} holds PTQ parameters of another run: {why}; {hint}")
        return True
    if params_dir.is_dir() and any(p.suffix == ".pt" for p in params_dir.iterdir()):
        raise ParamsMismatchError(f"{params_dir} holds .pt files but no {META_NAME} (unknown scheme); {hint}")
    return False


def _read_meta(params_dir: Path) -> dict[str, Any]:
    meta_path = params_dir / META_NAME
    if not meta_path.is_file():
        raise DataError(f"{meta_path} not found: no PTQ parameters in {params_dir} (run PTQ first)")
    try:
        return json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{meta_path}: unreadable ({e})") from None


def load_unit_params(unit, params_dir: Path) -> None:
    path = params_dir / f"{unit.file_stem}.pt"
    if not path.is_file():
        raise DataError(f"{path}: missing PTQ parameters of unit {unit.name} (run PTQ for this layer first)")
    try:
        params = safe_torch_load(path)
    except Exception as e:  # truncated / foreign file: one line naming it
        raise DataError(f"{path}: cannot load ({type(e).__name__}: {e})") from None
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
        meta = _read_meta(pdir)
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
            mem.max_layer_bytes = max(mem.max_layer_bytes, _module_bytes(block))
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
            mem.max_layer_bytes = max(mem.max_layer_bytes, _module_bytes(block))
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
    exists = check_params_dir(pdir, meta)
    if create and not exists:
        atomic_write_json(meta, pdir / META_NAME)
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


def run_blockwise_ptq(adapter: BaseModel, spec: PtqSpec, output_dir: str | Path, *,
                      layers: range | None = None, calib_windows: torch.Tensor | None = None,
                      runtime: PtqRuntime | None = None, part: LayerSlice | None = None,
                      mtp: bool = True) -> PtqResult:
    """Quantize every unit of ``layers`` with ``spec``'s recipe and save its parameters under
    OUTPUT/ptq_params.

    Per layer i (built on the compute device, or spread over the devices with
    ``runtime.sharded``): build it, ``quantize_block``, run it once with quantizers OFF over
    the calibration inputs X_i while capturing what the recipe declares it needs
    (``Recipe.needs()``: every unit's calls, or per-leaf statistics in as many passes as the
    device budget allows; this is the float layer, bit for bit: the targets are float
    outputs); observe static activation ranges; then run the recipe on the layer's units
    (``algorithms.runner.run_recipe_on_units``: the kinds an algorithm groups solved jointly,
    the RTN guard, the held-out share), each unit where it is.

    ``spec`` (``PtqSpec``): scheme, targets, calibration, recipe (None: the scheme's default,
    as on the command line), propagation ('float': X_{i+1} is the float layer's output, see
    the module doc; 'quant': the quantized layer's output after solving), holdout and guard.
    ``runtime`` (``PtqRuntime``): memory budgets, sharded layers, phase timer, progress hook.
    ``part`` (``LayerSlice``): this call is a layer range of a larger (torchrun) run.

    ``mtp``: when the range ends at the model's last layer and the adapter has an MTP layer
    (``adapter.mtp_layer_ids()``), that layer is quantized next like a decoder layer, on inputs
    the adapter builds from the last layer's outputs (``adapter.mtp_block_inputs``).
    """
    spec = spec.resolved()
    cfg, scheme, targets, recipe = spec.calibration, spec.scheme, spec.targets, spec.recipe
    propagate, holdout, guard = spec.propagate, spec.holdout, spec.guard
    runtime = runtime or PtqRuntime()
    runtime.check()
    part = part or LayerSlice()
    float_like, start = part.float_like, part.start
    ph = runtime.phases if runtime.phases is not None else NO_PHASES
    on_unit_done = runtime.on_unit_done
    sharded = runtime.sharded
    # a block-level algorithm (the recipe's last entry) runs after the unit algorithms, on the
    # whole layer against its output; the units get the rest of the recipe
    block_algo = recipe.block_algorithm
    unit_recipe = recipe.unit_recipe() if block_algo is not None else recipe
    needs = unit_recipe.needs()
    # its targets may be the float MODEL's outputs: a float stream carried beside the quantized one
    float_stream = block_algo is not None and block_algo.float_model_targets(propagate)
    if block_algo is not None and sharded:
        raise ConfigError(f"recipe {recipe}: the block-level {block_algo.name!r} needs the whole layer on "
                          "one device; it cannot run on a sharded layer (drop --shard, or the algorithm)")
    if float_stream and start is not None:
        raise ConfigError(f"recipe {recipe} with propagate=quant: {block_algo.name!r} (target=float_model) "
                          "needs the float model's stream, which a torchrun rank's hand-off does not carry; "
                          f"use {block_algo.name}:target=float_layer, or propagate=float")
    layers = layers if layers is not None else layer_range(adapter)
    if calib_windows is None:
        calib_windows = load_calib_windows(adapter, cfg)
    pdir = prepare_params_dir(adapter, output_dir, spec, calib_windows=calib_windows)
    dev = adapter.device
    devmod.reset_peak_memory(dev)
    t0 = time.perf_counter()
    result = PtqResult(params_dir=str(pdir))

    if start is not None and not 0 <= start[0] <= layers.start:
        raise ConfigError(f"run_blockwise_ptq: the given stream enters layer {start[0]}, after the first "
                          f"layer to quantize ({layers.start})")
    if start is not None:
        first, calib = start
    else:
        first = 0
        with ph.phase("embed"):
            calib = embed_stream(adapter, calib_windows, cfg.batch_size)
    mem = MemoryStats(device=str(dev), peak_memory_bytes=0, hidden_bytes=calib.nbytes)
    fcalib = calib if float_stream else None   # the float model's stream (same as calib until layer 1)
    last = layers.stop
    mtp_ids = _mtp_layers(adapter, layers) if mtp else []
    # The layer is built where it runs (decoded there, never staged in host memory): the float
    # capture needs the whole layer on the device anyway, and a host-staged V4-Flash layer cost
    # ~3x its 13 GB in host RSS (build, .to(device), .to('cpu') after; benchmarks/RESULTS.md §7b).
    for i in _tqdm([*range(first, last), *mtp_ids], desc="ptq layers", disable=not adapter.run.progress):
        if i in mtp_ids:   # the MTP layer: h_i of the last layer with embed(t_{i+1}) (issue 23.6)
            if fcalib is not None:
                fcalib = (calib if fcalib is calib
                          else Stream(*adapter.mtp_block_inputs(i, fcalib.hidden, fcalib.state)))
            calib = Stream(*adapter.mtp_block_inputs(i, calib.hidden, calib.state))
        with ph.phase("build", layer=i):
            block = adapter.block(i, sharded=True) if sharded and i not in mtp_ids else adapter.block(i, device=dev)
        mem.max_layer_bytes = max(mem.max_layer_bytes, _module_bytes(block))
        if i not in layers and i not in mtp_ids:  # a float predecessor: only its output is needed
            with ph.phase("float_forward", layer=i):
                calib = float_layer_output(adapter, block, calib, float_like is not None and i in float_like,
                                           scheme, targets)
            fcalib = calib if fcalib is not None else None   # float predecessors: one stream
            adapter.release_block(block)
            continue
        with ph.phase("build", layer=i):
            adapter.quantize_block(block, scheme, targets)
        units = list(adapter.iter_ptq_units(block, i, targets))
        todo = {u.name for u in units if not (pdir / f"{u.file_stem}.pt").is_file()}
        if block_algo is not None and todo:
            # the block stage tunes every unit of the layer together: a layer an interrupted run
            # left half written is solved again as a whole (its units are written after the block)
            todo = {u.name for u in units}
        # a recipe that replays no calls (rtn, hclip, gptq) gets per-leaf Hessians
        # accumulated during the float forward instead of stored calls (algorithms/hessians.py);
        # the layer then keeps its fast paths (the MoE's grouped GEMMs report their rows)
        stats_mode = not needs.calls and not sharded and runtime.statistics
        hessians = collector = None
        if not stats_mode:
            adapter.prepare_capture(block)        # every unit called as a module: hooks see it
        store = CaptureStore(runtime.capture_memory_bytes,
                             None if runtime.capture_memory_bytes is None
                             else Path(output_dir) / SCRATCH_DIR / f"layer_{i}",
                             chunk_bytes=runtime.capture_buffer_bytes)
        CALL_METER.reset_peak()
        calls_before = CALL_METER.live      # call data alive before this layer (none in a run)
        sinks = {}
        for u in (units if not stats_mode else ()):
            if u.name in todo:
                made = runtime.make_sink(u) if runtime.make_sink is not None else None
                sinks[u.name] = made if made is not None else store.sink(u.file_stem)
        try:
            passes: list[list] = []
            with ph.phase("capture", layer=i):
                adapter.set_quant_enabled(block, False)   # float math, bit for bit
                if todo and stats_mode:
                    from ..algorithms.hessians import plan_hessian_passes

                    # more than one pass only when the layer's Hessians exceed the budget
                    todo_units = [u for u in units if u.name in todo]
                    passes = plan_hessian_passes(todo_units, runtime.hessian_budget(dev))
                    if len(passes) > 1 and not needs.statistics:
                        # RTN: the Hessians would only measure its loss; not worth extra passes
                        passes = [todo_units]
                        hessians = {u.name: {} for u in todo_units}
                        next_hidden = adapter.do_block_forward(block, calib.hidden, calib.state)
                    else:
                        collector, hessians, next_hidden = _collect_hessians(adapter, block, calib, passes[0])
                    calls = {}
                    result.unobserved_static += observe_static(adapter, block, calib, i)
                elif todo:
                    calls, next_hidden = capture_unit_io(
                        [u for u in units if u.name in todo],
                        lambda: adapter.do_block_forward(block, calib.hidden, calib.state), sinks=sinks)
                    result.unobserved_static += observe_static(adapter, block, calib, i)
                else:  # the whole layer was done by an earlier run: only its float output is needed
                    calls, next_hidden = {}, adapter.do_block_forward(block, calib.hidden, calib.state)
            # the float model's output of this layer (the float stream's next inputs): computed
            # here, while the layer is still float (GPTQ writes its fake-quant weights into the
            # float ones); layer 0, whose two streams are one, has it from the capture
            float_next = None
            if fcalib is not None:
                if fcalib is calib:
                    float_next = next_hidden
                else:
                    with ph.phase("capture", layer=i):
                        float_next = adapter.do_block_forward(block, fcalib.hidden, fcalib.state)
            block_targets = None
            if block_algo is not None and todo:
                block_targets = float_next if float_stream else next_hidden
            if collector is not None:
                ph.note(hessian_bytes=_tensor_bytes({id(ls.H): ls.H for st in hessians.values()
                                                     for ls in st.values() if ls.H is not None}.values()),
                        host_count_reads=collector.host_reads, hessian_passes=len(passes))
            mem.capture_memory_peak_bytes = max(mem.capture_memory_peak_bytes,
                                                store.peak_in_memory if store.memory_bytes is not None
                                                else sum(s.nbytes for s in sinks.values()))
            mem.capture_spilled_bytes += store.spilled_bytes
            ph.note(capture_bytes=sum(call_bytes(c) for c in calls.values() if isinstance(c, Sequence)),
                    spilled_bytes=store.spilled_bytes, in_memory_peak_bytes=store.peak_in_memory)
            adapter.set_quant_enabled(block, True)
            if propagate == "quant":
                finish_static(block, i)   # counted once, by the observe pass above
            from ..algorithms.runner import run_recipe_on_units

            todo_units = [u for u in units if u.name in todo]
            solved: dict[str, UnitResult] = {}
            done: dict[str, UnitResult] = {}
            if stats_mode and todo_units:
                # pass by pass: each pass's Hessians are solved and freed before the next
                # pass collects its own (passes[0]'s were collected by the capture above)
                for k, pass_units in enumerate(passes):
                    if k > 0:
                        with ph.phase("capture", layer=i):
                            adapter.set_quant_enabled(block, False)
                            # the output is pass 0's again: not kept (a host copy of the layer's)
                            collector, hessians, _ = _collect_hessians(adapter, block, calib, pass_units,
                                                                       keep_output=False)
                            adapter.set_quant_enabled(block, True)
                    with ph.phase("solve:recipe", layer=i, device=str(dev)):
                        rerun = LayerRerun(adapter, block, calib)
                        rs = run_recipe_on_units(pass_units, {}, unit_recipe, device=dev, seed=cfg.seed,
                                                 dtype=adapter.run.dtype, holdout=holdout, guard=guard,
                                                 hessians=hessians, recollect=rerun)
                    if rerun.forwards:   # a note goes to the phase just finished: solve:recipe
                        ph.note(recollect_forwards=rerun.forwards, recollect_seconds=round(rerun.seconds, 3),
                                recollect_runs=rerun.runs)
                    done.update({u.name: r for u, r in zip(pass_units, rs)})
                    # written pass by pass: an interrupted layer resumes at its next pass (with a
                    # block stage: after it, below)
                    for unit in (pass_units if block_algo is None else ()):
                        with ph.phase("write", layer=i):
                            _save_unit(pdir, unit, done[unit.name])
                        solved[unit.name] = done[unit.name]
                        if on_unit_done is not None:
                            on_unit_done(done[unit.name])
                    hessians = None
                    if collector is not None:
                        collector.free()
                        collector = None
                    devmod.empty_cache(dev)
            # one recipe run per device holding units (a sharded layer): the grouped
            # algorithms stack a group's experts, which must share a device
            by_dev: dict[torch.device, list] = {}
            for u in (todo_units if not stats_mode else ()):
                by_dev.setdefault(adapter.unit_device(block, u) if sharded else dev, []).append(u)
            for udev, group in by_dev.items():
                with ph.phase("solve:recipe", layer=i, device=str(udev)):
                    rs = run_recipe_on_units(group, calls, unit_recipe, device=udev, seed=cfg.seed,
                                             dtype=adapter.run.dtype, holdout=holdout, guard=guard,
                                             hessians=hessians)
                done.update({u.name: r for u, r in zip(group, rs)})
            calls = {}      # the unit captures are not read again: freed before the block stage
            if block_algo is not None and todo_units:
                from ..algorithms.source_grid import is_kept

                with ph.phase("solve:block", layer=i, device=str(dev)):
                    run_block_stage(adapter, block, block_algo, [u for u in units if not is_kept(done[u.name])],
                                    calib, block_targets, done,
                                    seed=cfg.seed, layer_idx=i)
                block_targets = None
            if todo_units:
                for unit, r in [(u, done[u.name]) for u in todo_units if u.name not in solved]:
                    with ph.phase("write", layer=i):
                        _save_unit(pdir, unit, r)
                    solved[unit.name] = r
                    if on_unit_done is not None:
                        on_unit_done(r)
            calls = {}
            result.units += [solved[u.name] if u.name in solved else _resumed_result(pdir, u) for u in units]
        finally:
            for s in sinks.values():
                s.discard()
            store.cleanup()
            hessians = None                   # frees the layer's Hessians (GBs on the device)
            if collector is not None:
                collector.free()
                collector = None
        layer_calls_peak = CALL_METER.peak - calls_before
        mem.call_memory_peak_bytes = max(mem.call_memory_peak_bytes, layer_calls_peak)
        ph.note(call_memory_peak_bytes=layer_calls_peak)
        if fcalib is not None:
            fcalib = Stream(float_next, fcalib.state)
        if propagate == "quant":
            # the next layer's inputs go through the units an earlier run finished too: loaded
            # only now, after this run's solve -- loaded before it, their in-place weights would
            # feed a re-run of the layer (sequential GPTQ) a non-float input (casebook i24-sq4)
            for unit in units:
                if unit.name not in todo:
                    load_unit_params(unit, pdir)
            adapter.end_capture(block)   # propagated as it will be evaluated (fused paths on)
            with ph.phase("propagate", layer=i):
                next_hidden = adapter.do_block_forward(block, calib.hidden, calib.state)
        calib = Stream(next_hidden, calib.state)
        with ph.phase("release", layer=i):
            adapter.release_block(block)
    devmod.synchronize(dev)
    mem.peak_memory_bytes = max(devmod.peak_memory_bytes(dev), getattr(ph, "max_device_peak", lambda: 0)())
    result.memory = mem
    result.seconds = time.perf_counter() - t0
    return result


def run_block_stage(adapter: BaseModel, block: nn.Module, algo, units: Sequence, calib: Stream,
                    targets: Sequence[torch.Tensor], results: dict[str, UnitResult], *, seed: int,
                    layer_idx: int) -> None:
    """The recipe's block-level algorithm on one layer (after its unit algorithms): every unit's
    leaves tuned together against the layer's output ``targets`` on the run's inputs ``calib``.
    Its statistics go into each unit's result; the unit's own loss after the unit algorithms no
    longer describes the unit, so ``loss_after`` becomes None (the layer's MSE is in the stats)."""
    from ..algorithms.base import BlockData
    from .replay import unit_seed

    dev = adapter.block_device(block)
    # every unit called as its own module (no fused path holding detached weights)
    adapter.prepare_capture(block)
    adapter.set_quant_enabled(block, True)
    t0 = time.perf_counter()
    data = BlockData(units=list(units), inputs=calib.hidden, states=calib.state or [{}] * len(calib.hidden),
                     targets=targets, forward=lambda x, st: adapter.block_forward_sample(block, x, st),
                     device=dev, seed=unit_seed(seed, f"layers.{layer_idx}"), layer_idx=layer_idx,
                     concat=adapter.concat_samples, block=block)
    stats = algo.apply_block(data)
    devmod.synchronize(dev)
    dt = time.perf_counter() - t0
    for u in units:
        r = results[u.name]
        r.stats = dict(r.stats or {})
        r.stats[algo.name] = {**stats.get(u.name, {}), "layer_seconds": round(dt, 3)}
        if "skipped" not in stats.get(u.name, {}):
            r.loss_after = None
        r.seconds += dt / max(len(units), 1)


def _mtp_layers(adapter: BaseModel, layers: range) -> list[int]:
    """The MTP layer quantized after the run's layers: the adapter's first one (its input is
    the last main layer's output), when the run ends at the model's last layer."""
    hook = getattr(adapter, "mtp_layer_ids", None)
    if hook is None or layers.stop != adapter.num_layers:
        return []
    return hook()[:1]


def _collect_hessians(adapter: BaseModel, block: nn.Module, calib: Stream, units: Sequence,
                      keep_output: bool = True, only: dict[str, set[str]] | None = None,
                      stop_after_units: bool = False):
    """One forward of ``block`` over ``calib`` with a HessianCollector on ``units`` (``only``:
    those leaves): (collector, {unit name: its statistics}, the layer's output, or [] without
    ``keep_output``). ``stop_after_units``: each sample's forward ends once every unit's module
    has returned (nothing after them feeds their leaves). The collector lets go of its stacks:
    the statistics own them."""
    from ..algorithms.hessians import HessianCollector

    collector = HessianCollector(units, only=only)
    collector.attach(block)
    stop_after = [u.module for u in units] if stop_after_units else ()
    try:
        out = adapter.do_block_forward(block, calib.hidden, calib.state, keep_outputs=keep_output,
                                       stop_after=stop_after)
    finally:
        collector.detach()
    collector.release()
    return collector, {u.name: collector.stats(u.name) for u in units}, out


class LayerRerun:
    """``SolveContext.recollect`` of the statistics path: the layer's calibration forward once
    more, with quantization on in the given units only (every other unit and the rest of the
    layer float, as in the capture), collecting the given leaves' statistics. Each sample's
    forward ends once the given units' modules have returned: a re-run for the attention's
    later stages does not run the MoE after it (the routed experts on the MoE's grouped path
    are never called as modules, so their re-run goes to the layer's end). Counts its forwards
    and their time for the report (``runs``: [unit kinds, leaves collected, seconds] each)."""

    def __init__(self, adapter: BaseModel, block: nn.Module, calib: Stream):
        self.adapter, self.block, self.calib = adapter, block, calib
        self.forwards = 0
        self.seconds = 0.0
        self.runs: list[list] = []

    def __call__(self, units: Sequence, leaves: dict[str, set[str]]) -> dict[str, dict]:
        t0 = time.perf_counter()
        self.adapter.set_quant_enabled(self.block, False)
        try:
            for u in units:
                self.adapter.set_quant_enabled(u.module, True)
            _, stats, _ = _collect_hessians(self.adapter, self.block, self.calib, units, keep_output=False,
                                            only=leaves, stop_after_units=True)
        finally:
            # the recipe runs with the whole layer's quantization on (run_blockwise_ptq): back to it
            self.adapter.set_quant_enabled(self.block, True)
        devmod.synchronize(self.adapter.block_device(self.block))   # the time is the forward's
        dt = time.perf_counter() - t0
        self.forwards += 1
        self.seconds += dt
        self.runs.append(["+".join(sorted({u.kind for u in units})), sum(len(v) for v in leaves.values()),
                          round(dt, 3)])
        return stats


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
