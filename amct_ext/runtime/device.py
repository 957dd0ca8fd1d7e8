"""Accelerator abstraction: the ONLY module of the project that touches ``torch.npu`` / ``torch.cuda``.

Everything else asks this module which backend to use and calls the helpers below, so the
toolkit runs unchanged on Ascend NPUs (``torch_npu``), NVIDIA GPUs and plain CPU.

Backend priority: npu > cuda > cpu. ``torch_npu`` is imported lazily (inside a ``try``) because
importing it on a machine without the CANN runtime fails, and importing it has side effects
(it patches torch), so we only do it when somebody asks for the backend.
"""
from __future__ import annotations

import contextlib
import functools
import os
import resource
import sys
import time
from typing import Any, Callable

import torch

from . import device_checks
from ..errors import AmctError, ConfigError

BACKENDS = ("npu", "cuda", "cpu")


@functools.lru_cache(maxsize=1)
def _npu_available() -> bool:
    """True when ``torch_npu`` imports and reports at least one device.

    Cached: the import is expensive and its outcome cannot change within a process.
    """
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception:  # ImportError, or a broken CANN install raising anything else
        return False
    try:
        return bool(torch.npu.is_available())
    except Exception:
        return False


def _cuda_available() -> bool:
    return bool(torch.cuda.is_available())


def backend_available(backend: str) -> bool:
    if backend == "npu":
        return _npu_available()
    if backend == "cuda":
        return _cuda_available()
    if backend == "cpu":
        return True
    raise AmctError(f"unknown device backend {backend!r}; expected one of {BACKENDS}")


def detect_backend() -> str:
    """'npu' when torch_npu works, else 'cuda' when a GPU is visible, else 'cpu'."""
    if _npu_available():
        return "npu"
    if _cuda_available():
        return "cuda"
    return "cpu"


def _accel_module(backend: str) -> Any:
    """``torch.npu`` or ``torch.cuda`` (the two expose the same memory / sync / event API)."""
    if backend == "npu":
        if not _npu_available():
            raise AmctError("device backend 'npu' requested but torch_npu is not usable here")
        return torch.npu
    if backend == "cuda":
        return torch.cuda
    raise AmctError(f"backend {backend!r} has no accelerator module")


def device_count(backend: str | None = None) -> int:
    """Number of devices of ``backend`` (default: the detected one); cpu counts as 1."""
    backend = backend or detect_backend()
    if backend == "cpu":
        return 1
    if not backend_available(backend):
        return 0
    return int(_accel_module(backend).device_count())


def resolve_device(pref: str | torch.device = "auto", index: int = 0) -> torch.device:
    """Turn a user preference into a concrete ``torch.device``.

    ``pref``: 'auto' (best available backend), 'npu', 'cuda', 'cpu', or an explicit
    'cuda:1' / 'npu:3' (the explicit index wins over ``index``). Asking for a backend that is not
    available, or for an index past the device count, raises AmctError naming the backend.
    """
    if isinstance(pref, torch.device):
        pref = str(pref)
    pref = (pref or "auto").strip().lower()
    if ":" in pref:
        backend, _, idx = pref.partition(":")
        try:
            index = int(idx)
        except ValueError:
            raise AmctError(f"bad device string {pref!r}: index {idx!r} is not an integer") from None
    else:
        backend = pref
    if backend == "auto":
        backend = detect_backend()
    if backend not in BACKENDS:
        raise AmctError(f"unknown device {pref!r}; expected auto, npu, cuda, cpu or e.g. 'cuda:1'")
    if backend == "cpu":
        return torch.device("cpu")
    if not backend_available(backend):
        why = "torch_npu is not installed or has no device" if backend == "npu" else \
            "torch.cuda.is_available() is False"
        raise AmctError(f"device backend {backend!r} requested but not available ({why})")
    n = device_count(backend)
    if index < 0 or index >= n:
        raise AmctError(f"device {backend}:{index} requested but only {n} {backend} device(s) exist")
    return torch.device(backend, index)


def device_list(backend: str | None = None) -> list[torch.device]:
    """Every device of ``backend`` (default: detected); ``[cpu]`` for cpu."""
    backend = backend or detect_backend()
    if backend == "cpu":
        return [torch.device("cpu")]
    return [torch.device(backend, i) for i in range(device_count(backend))]


def _as_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return resolve_device("auto")
    return device if isinstance(device, torch.device) else torch.device(device)


# ----------------------------------------------------------------------------- torch.distributed
#: the collective backend of each device type (HCCL is registered by importing torch_npu)
DIST_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def dist_backend(device_type: str) -> str:
    """The ``torch.distributed`` backend for ranks computing on ``device_type``: gloo on cpu,
    nccl on cuda, hccl on npu."""
    try:
        return DIST_BACKENDS[device_type]
    except KeyError:
        raise AmctError(f"no torch.distributed backend for device type {device_type!r}; "
                        f"expected one of {tuple(DIST_BACKENDS)}") from None


def local_rank_device(pref: str | torch.device, local_rank: int) -> torch.device:
    """The device of the rank with ``local_rank`` on its host: cpu stays cpu; 'auto' / 'cuda' /
    'npu' become device ``local_rank`` of that backend, made the current device (NCCL / HCCL
    use the current device for their communicators). An explicit index ('cuda:1') is refused:
    under torchrun each rank owns the device of its local rank."""
    text = str(pref).strip().lower()
    if ":" in text:
        raise AmctError(f"--device {text!r}: under torchrun each rank uses the device of its LOCAL_RANK; "
                        f"pass the backend only (auto, cuda, npu, cpu)")
    dev = resolve_device(text, index=local_rank)
    if dev.type in ("cuda", "npu"):
        _accel_module(dev.type).set_device(dev)
    return dev


# ----------------------------------------------------------------------------- fast paths
# AMCT_FAST_PATHS=0 makes every model run its plain torch paths (e.g. to compare the two)
FAST_PATHS_ENV = "AMCT_FAST_PATHS"


def _fast_paths_allowed() -> bool:
    return os.environ.get(FAST_PATHS_ENV, "1") != "0"


@functools.lru_cache(maxsize=1)
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def fast_paths_enabled(device: str | torch.device) -> bool:
    """Whether models may take their fast paths (fused kernels from torch, fp32-output GEMMs)
    on ``device``: CUDA, unless switched off."""
    return _as_device(device).type == "cuda" and _fast_paths_allowed()


def fused_kernels_enabled(device: str | torch.device) -> bool:
    """Whether the project's Triton kernels may run on ``device``: CUDA with Triton installed.
    NPUs and CPUs use the torch paths."""
    return fast_paths_enabled(device) and _triton_importable()


# AMCT_FP32_ISLANDS=strict keeps the fp32 islands on true fp32 GEMMs while the other fast paths run
FP32_ISLANDS_ENV = "AMCT_FP32_ISLANDS"


def fp32_out_gemm_supported(device: str | torch.device) -> bool:
    """Whether the fp32 islands may use bf16 GEMMs with fp32 output (``torch.mm(a, b,
    out_dtype=torch.float32)``) on ``device``: seen on CUDA with torch 2.11, absent on CPU
    (amct_ext/runtime/exact_gemm.py; their accuracy is in benchmarks/RESULTS.md)."""
    return fast_paths_enabled(device) and os.environ.get(FP32_ISLANDS_ENV, "") != "strict"


def device_guard(device: str | torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` the current device while code that launches on the *current* device runs
    (Triton kernels do). Needed when a layer is spread over several GPUs: the current device
    stays cuda:0 while the tensors of some modules live on cuda:1 (casebook S11)."""
    dev = _as_device(device)
    if dev.type in ("cuda", "npu") and dev.index is not None:
        return _accel_module(dev.type).device(dev)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- memory / sync
def empty_cache(device: str | torch.device | None = None) -> None:
    """Return cached allocator blocks to the driver; a no-op on cpu."""
    dev = _as_device(device)
    if dev.type in ("npu", "cuda"):
        _accel_module(dev.type).empty_cache()


def synchronize(device: str | torch.device | None = None) -> None:
    """Wait for queued kernels on ``device``; a no-op on cpu (ops there are synchronous)."""
    dev = _as_device(device)
    if dev.type in ("npu", "cuda"):
        _accel_module(dev.type).synchronize(dev)


def profiler_activities(device: str | torch.device | None = None) -> list:
    """torch.profiler activities that see ``device``'s kernels (CPU always; CUDA; NPUs profile
    through torch_npu's own profiler, so only their host side here)."""
    from torch.profiler import ProfilerActivity

    acts = [ProfilerActivity.CPU]
    if _as_device(device).type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    return acts


def reset_peak_memory(device: str | torch.device | None = None) -> None:
    """Reset the allocator's peak counter. On cpu this is a no-op: the kernel's peak RSS
    (``ru_maxrss``) cannot be reset, so cpu peaks are always "since process start"."""
    dev = _as_device(device)
    if dev.type in ("npu", "cuda"):
        # the allocator of a device the process has not used yet refuses the reset ("Invalid
        # device argument", seen on CUDA): touch it first
        torch.empty(1, device=dev)
        _accel_module(dev.type).reset_peak_memory_stats(dev)


def _pinned_host_allowed() -> bool:
    return os.environ.get("AMCT_PINNED_HOST", "1") != "0"


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of accelerator tensor ``t`` that goes back to the device at full speed: into
    page-locked (pinned) memory. A layer's hidden states cross the host link once per pass (the
    capture, every re-run, evaluation): 8.6 GB for one V4-Flash layer at 128 x 2048, which a
    pageable copy moves at 6-9 GB/s on the H200's host and a pinned one at ~55 GB/s
    (RESULTS §5). A cpu tensor is returned as it is. Pinned only on CUDA, where
    ``pinned_host_bytes`` counts it for the host-memory bound (NPU: pageable, uncounted
    otherwise); where pinned memory is refused, or with ``AMCT_PINNED_HOST=0``, the copy is an
    ordinary pageable one. The copy is complete on return (the host may read it).

    Cost: torch's caching host allocator rounds each block up to a power of two (a V4-Flash
    window of 2048 x 4 x 4096 bf16 is exactly 64 MiB; a V4-Pro one, 112 MiB, takes 128 MiB) and
    keeps freed blocks for reuse, so the pinned pool stays at its high-water mark."""
    if t.device.type == "cpu":
        return t
    if t.device.type == "cuda" and _pinned_host_allowed():
        try:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        except RuntimeError:
            out = None
        if out is not None:
            return out.copy_(t)
    return t.to("cpu")


class CopiesAhead:
    """Host -> device copies issued now on a side stream, to be used later on the current one.

    Block-wise rounding draws a step's samples from (pinned) host memory: a V4-Flash batch of 8
    windows is 1 GiB of inputs and targets, ~19 ms a step on an H200 when copied on the stream
    that computes (the copy waits for the previous step and the step waits for the copy). Issued
    one step ahead on a side stream, the copy engine moves them while the previous step computes.

    ``CopiesAhead(tensors, device).get()`` returns the device copies (the same values as
    ``t.to(device)``) after making the current stream wait for them; each copy is marked as used
    by that stream, so the caching allocator does not hand its memory out again before the
    stream's work on it is done. On cpu (no streams) ``get`` returns ``t.to(device)``."""

    _side: dict = {}

    def __init__(self, tensors, device: str | torch.device):
        dev = _as_device(device)
        self._dev, self._event = dev, None
        if dev.type not in ("cuda", "npu"):
            self._tensors = list(tensors)
            return
        mod = _accel_module(dev.type)
        side = CopiesAhead._side.get(dev)
        if side is None:
            side = CopiesAhead._side[dev] = mod.Stream(dev)
        # allocated on the side stream, the copies take memory from that stream's own pool: no
        # block still in use by kernels queued on the current stream (get() records that use)
        with mod.stream(side):
            self._tensors = [t.to(dev, non_blocking=True) for t in tensors]
            self._event = side.record_event()

    def get(self) -> list[torch.Tensor]:
        if self._event is None:
            return [t.to(self._dev) for t in self._tensors]
        current = _accel_module(self._dev.type).current_stream(self._dev)
        current.wait_event(self._event)
        for t in self._tensors:
            t.record_stream(current)
        self._event = None
        return self._tensors


def pinned_host_bytes() -> int:
    """Page-locked host memory held by the accelerator's caching host allocator (blocks in use
    and cached), in bytes: what ``to_host`` keeps there. The driver maps it outside the
    process's ``RssAnon``, so a memory bound read from /proc alone would miss it (casebook
    i24-pin-1). 0 on cpu, before CUDA is initialized, and on NPU (``to_host`` pins only on CUDA).
    With ``PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True`` the pinned blocks are
    ordinary malloc memory registered with the driver, already in ``RssAnon``: counted twice."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return 0
    stats = getattr(torch.cuda, "host_memory_stats", None)
    try:
        return int(stats().get("allocated_bytes.current", 0)) if stats is not None else 0
    except RuntimeError:
        return 0


def _rss_scale() -> int:
    # ru_maxrss is KiB on Linux but bytes on macOS.
    return 1 if sys.platform == "darwin" else 1024


def peak_memory_bytes(device: str | torch.device | None = None) -> int:
    """Peak allocated bytes on ``device`` since the last ``reset_peak_memory``.

    On cpu: the PROCESS-WIDE peak resident set size in bytes (``own_peak_rss_bytes``), i.e. all
    memory of this process (Python, libraries, every tensor) since it started -- not only tensors,
    and not resettable. Use it as an upper bound, not as an allocator statistic.
    """
    dev = _as_device(device)
    if dev.type in ("npu", "cuda"):
        return int(_accel_module(dev.type).max_memory_allocated(dev))
    return own_peak_rss_bytes()


def own_peak_rss_bytes() -> int:
    """This process's peak resident set since it started, in bytes.

    Linux: ``VmHWM`` of /proc/self/status, the high-water mark of the process's own address space.
    Not ``ru_maxrss``: on Linux that keeps the parent's peak across fork + exec, so a small job
    started by a large process (pytest, a benchmark driver) reported the parent's memory (casebook
    F-maxrss). Elsewhere (no /proc): ``ru_maxrss``."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024          # kB
    except (OSError, ValueError, IndexError):
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * _rss_scale()


def memory_allocated(device: str | torch.device | None = None) -> int:
    """Bytes currently allocated by tensors on ``device``.

    On cpu: the process-wide CURRENT resident set size in bytes (from /proc/self/statm where it
    exists, else the peak RSS as an upper bound) -- same caveats as ``peak_memory_bytes``.
    """
    dev = _as_device(device)
    if dev.type in ("npu", "cuda"):
        return int(_accel_module(dev.type).memory_allocated(dev))
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_memory_bytes(dev)


def total_memory_bytes(device: str | torch.device | None = None) -> int | None:
    """The accelerator's total memory in bytes (what a memory budget is a fraction of), or the
    cap :func:`cap_memory` set on it; None on cpu, where the host's memory is shared with
    everything else and no budget is implied."""
    dev = _as_device(device)
    if dev.type in ("npu", "cuda"):
        index = dev.index if dev.index is not None else _accel_module(dev.type).current_device()
        total = int(_accel_module(dev.type).get_device_properties(index).total_memory)
        return min(total, _MEMORY_CAPS.get((dev.type, index), total))
    return None


#: (device type, index) -> the bytes the run may use there (``cap_memory``)
_MEMORY_CAPS: dict[tuple[str, int], int] = {}


def cap_memory(device: str | torch.device, nbytes: int, flag: str = "the memory cap") -> None:
    """Use at most ``nbytes`` of the accelerator ``device``: :func:`total_memory_bytes` reports
    the cap (every budget is a share of it) and the caching allocator refuses to grow past it, so
    a run planned for a smaller card (a 64-GB Ascend 910B) is held to it on a larger one. A cap
    over the device's memory, or on the CPU (no accelerator to cap), is refused naming ``flag``."""
    dev = _as_device(device)
    if dev.type not in ("npu", "cuda"):
        raise ConfigError(f"{flag}: the run is on {dev}, which has no accelerator memory to cap")
    index = dev.index if dev.index is not None else _accel_module(dev.type).current_device()
    total = int(_accel_module(dev.type).get_device_properties(index).total_memory)
    if not 0 < nbytes <= total:
        raise ConfigError(f"{flag} {nbytes / 2 ** 30:g} GiB: {dev} has {total / 2 ** 30:.1f} GiB; give a value "
                          "in (0, that]")
    _accel_module(dev.type).set_per_process_memory_fraction(nbytes / total, index)
    _MEMORY_CAPS[(dev.type, index)] = nbytes


# ----------------------------------------------------------------------------- timing
def elapsed_ms(fn: Callable[[], Any], device: str | torch.device | None = None,
               repeats: int = 10, warmup: int = 2) -> list[float]:
    """Run ``fn()`` ``warmup`` times untimed, then ``repeats`` times timed; per-repeat ms.

    On npu/cuda, device events bracket each call (so the time is kernel time, not launch
    time); on cpu ``time.perf_counter`` is used. Benchmarks should report the median.
    """
    if repeats < 1:
        raise AmctError(f"elapsed_ms: repeats must be >= 1, got {repeats}")
    dev = _as_device(device)
    for _ in range(max(0, warmup)):
        fn()
    times: list[float] = []
    if dev.type in ("npu", "cuda"):
        mod = _accel_module(dev.type)
        synchronize(dev)
        for _ in range(repeats):
            start, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(float(start.elapsed_time(end)))
        return times
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


class Timer:
    """Context manager timing one region: ``with Timer(dev) as t: ...; t.ms``.

    Synchronizes the device before and after so asynchronous kernels are included.
    """

    def __init__(self, device: str | torch.device | None = None):
        self.device = _as_device(device)
        self.ms: float = float("nan")

    def __enter__(self) -> "Timer":
        synchronize(self.device)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        synchronize(self.device)
        self.ms = (time.perf_counter() - self._t0) * 1e3


# ------------------------------------------------------------------------------- graph replay
GRAPHS_ENV = "AMCT_GRAPHS"  # AMCT_GRAPHS=0: never replay captured graphs


def has_python_hooks(module: torch.nn.Module) -> bool:
    """Forward hooks or accelerate dispatch hooks anywhere in ``module``: Python code that a graph
    replay would skip."""
    for m in module.modules():
        if m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook"):
            return True
    return False


class GraphedForward:
    """``module(x, **kwargs)`` replayed from a captured CUDA graph, one graph per input signature.

    The forward of one V4-Flash layer launches ~300 kernels; at S = 4096 on an H200 issuing them
    takes about as long as running them, so the device waits on the host (RESULTS.md §4.3). A
    replay issues the whole layer at once. The graph reads the module's parameters and writes
    into its own memory, so it is only valid while the module stays as it was: use one instance
    for a loop over samples of a fixed layer (``BaseModel.do_block_forward(..., graphed=True)``)
    and drop it afterwards.

    A signature is captured the second time it is seen (the first call runs eagerly: it builds the
    module's lazy caches and skips shapes seen only once, e.g. a short last batch). The replay
    computes with the same kernels as the eager call: bit-identical (benchmarks/bench_layer.py
    checks it). The checks of the forward (the fake quantizers' NaN / Inf refusals,
    ``device_checks``) are captured too and read after each replay.

    Eager instead when the device is not CUDA (Ascend graph mode is not wired up), with
    AMCT_GRAPHS=0 or AMCT_FAST_PATHS=0, when the module has Python hooks, under autograd, or when
    capture fails (e.g. a forward that syncs with the host)."""

    def __init__(self, module: torch.nn.Module, device: str | torch.device):
        dev = _as_device(device)
        self.module = module
        self.enabled = (dev.type == "cuda" and _fast_paths_allowed() and os.environ.get(GRAPHS_ENV, "1") != "0"
                        and not has_python_hooks(module))
        self.device = dev
        self.seen: set = set()
        self.graphs: dict = {}
        self.capture_error: str | None = None

    @staticmethod
    def _signature(x: torch.Tensor, kwargs: dict) -> tuple:
        parts = [(tuple(x.shape), x.dtype, x.device)]
        for k in sorted(kwargs):
            v = kwargs[k]
            parts.append((k, tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else (k, v))
        return tuple(parts)

    def __call__(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if not self.enabled or torch.is_grad_enabled():
            return self.module(x, **kwargs)
        key = self._signature(x, kwargs)
        if key not in self.graphs:
            if key not in self.seen:
                self.seen.add(key)
                return self.module(x, **kwargs)
            if not self._capture(key, x, kwargs):
                return self.module(x, **kwargs)
        graph, static_x, static_kw, static_out, checks = self.graphs[key]
        static_x.copy_(x)
        for k, v in static_kw.items():
            if isinstance(v, torch.Tensor):
                v.copy_(kwargs[k])
        graph.replay()
        if checks:
            # the captured flags now hold this replay's answers; torch.cat copies them, so the
            # answer read at the end of the caller's device_checks scope is this replay's
            device_checks.refuse_if(torch.cat([flags for flags, _ in checks]),
                                    [err for _, errors in checks for err in errors])
        return static_out.clone()  # the next replay overwrites static_out

    def _capture(self, key: tuple, x: torch.Tensor, kwargs: dict) -> bool:
        static_x = x.clone()
        static_kw = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        try:
            with device_guard(self.device):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.module(static_x, **static_kw)          # warm-up off the default stream
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # the checks (device_checks) cannot read their flags inside a capture: collect them
                with torch.cuda.graph(graph), device_checks.collecting_checks() as checks:
                    static_out = self.module(static_x, **static_kw)
        except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly from now on
            self.enabled = False
            import traceback
            where = "".join(traceback.format_tb(e.__traceback__)[-3:])  # the forward's line that failed
            self.capture_error = f"{type(e).__name__}: {str(e)[:200]}\n{where[-900:]}"
            return False
        self.graphs[key] = (graph, static_x, static_kw, static_out, checks)
        return True


class GraphedCall:
    """``fn(*tensors)`` -> tuple of tensors, replayed from a captured CUDA graph per input
    signature (shapes / dtypes / devices; ``None`` allowed in place of a tensor).

    For a loop of many small, host-sync-free launches called again and again with inputs of one
    shape (GPTQ's column sweep of a lazy block: ~10 kernels a column, 128 columns, a few thousand
    blocks per layer), where issuing the kernels costs far more than running them. As in
    :class:`GraphedForward`: a signature is captured the second time it is seen (the first call
    runs eagerly), a replay runs the same kernels as the eager call (bit-identical), and anything
    that is not CUDA, AMCT_GRAPHS=0 / AMCT_FAST_PATHS=0, autograd, or a capture failure runs
    ``fn`` eagerly. ``fn`` must not modify its inputs and must not read the host.

    The returned tensors of a replay are the graph's own outputs: valid until the next call (copy
    what you keep)."""

    def __init__(self, fn: Callable[..., tuple], device: str | torch.device):
        dev = _as_device(device)
        self.fn = fn
        self.device = dev
        self.enabled = dev.type == "cuda" and _fast_paths_allowed() and os.environ.get(GRAPHS_ENV, "1") != "0"
        self.seen: set = set()
        self.graphs: dict = {}
        self.capture_error: str | None = None
        self.replays = 0

    @staticmethod
    def _signature(args: tuple) -> tuple:
        return tuple(None if a is None else (tuple(a.shape), a.dtype, a.device) for a in args)

    def __call__(self, *args: torch.Tensor | None) -> tuple:
        if not self.enabled or torch.is_grad_enabled():
            return self.fn(*args)
        key = self._signature(args)
        if key not in self.graphs:
            if key not in self.seen:
                self.seen.add(key)
                return self.fn(*args)
            if not self._capture(key, args):
                return self.fn(*args)
        graph, static_in, static_out = self.graphs[key]
        for s, a in zip(static_in, args):
            if s is not None:
                s.copy_(a)
        graph.replay()
        self.replays += 1
        return static_out

    def _capture(self, key: tuple, args: tuple) -> bool:
        static_in = tuple(None if a is None else a.clone() for a in args)
        try:
            with device_guard(self.device):
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self.fn(*static_in)                       # warm-up off the default stream
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = self.fn(*static_in)
        except Exception as e:  # noqa: BLE001 - any capture failure: run eagerly from now on
            self.enabled = False
            self.capture_error = f"{type(e).__name__}: {str(e)[:300]}"
            return False
        self.graphs[key] = (graph, static_in, tuple(static_out))
        return True
