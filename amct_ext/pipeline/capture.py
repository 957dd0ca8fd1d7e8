"""Capturing activations: a layer's inputs (Catcher) and the I/O of units inside a layer.

``Catcher`` replaces layer 0 of a model whose own forward is then run: the embedding and
whatever precedes layer 0 execute, the Catcher records the hidden state and the extra
arguments the model passes to its layers, then raises ``StopForward`` so nothing after it
runs (layers 1.. may still be on the meta device; they are never touched).

``capture_unit_io`` hooks sub-modules (PTQ units) while a block runs and hands every call's
positional args, kwargs and output to that unit's ``CallSink``: the solver's training data.

Sinks (bounded host memory)
---------------------------
A V4-Flash layer at the default calibration (128 x 2048 tokens) produces ~30 GB of unit inputs
and outputs; keeping them all on the host (the old behaviour) does not fit next to the layer.
What happens to a call is the sink's business:

- ``StoreCalls``: keep it in memory (on ``store_device``; the default, the old behaviour);
- ``SpillCalls``: append it to the unit's data file (raw tensor bytes, one chunk per flush; the
  layout stays in memory) under a scratch folder and read it back on iteration; ``discard()``
  removes the file once the unit is solved;
- ``CaptureStore``: one memory budget shared by every unit of a layer; a unit's calls stay in
  memory while the budget lasts, later ones spill (``--capture-memory-gb``) through one write
  buffer shared by the layer's units;
- a statistics sink (an algorithm that needs only e.g. a Hessian ``sum x^T x``): subclass
  ``CallSink``, fold each call into the statistic in ``add`` and return it from ``result``;
  nothing is stored.

``CallSink.result()`` is what the solver gets for the unit: for storing sinks a re-iterable
``Sequence[UnitCall]`` (``len``, iteration in capture order, indexing, slicing: a slice of
spilled calls is again lazy), so the solver needs no change whether the calls are in memory or
on disk.

Accounting (``CALL_METER``)
---------------------------
Every byte of call data held in host memory is counted in one process-wide
``CallMemoryMeter``: a call counts while its ``UnitCall`` lives -- kept by a sink, waiting in
the write buffer to be spilled, or read back from a chunk file -- and the host copies an
algorithm stacks count while they live (``algorithms.stacked.StackedCalls`` on a cpu device). Its ``peak`` is what the workflow
reports per layer (``MemoryStats.call_memory_peak_bytes``): with a budget B, a write buffer W
(``CaptureStore.buffer_bytes``) and an algorithm's working set S it stays <= B + W + S
(casebook/real-size-ptq.md, tests/test_capture_memory_bound.py).
"""
from __future__ import annotations

import abc
import inspect
import json
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..runtime import device as devmod


class StopForward(Exception):
    """Raised by Catcher after recording; private to this module and its callers."""


def detach_to(obj: Any, device: torch.device | str | None) -> Any:
    """Detach tensors in (nested) tuples / lists / dicts, optionally moving them to ``device``."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.to(device) if device is not None else t
    if isinstance(obj, tuple):
        return tuple(detach_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [detach_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: detach_to(v, device) for k, v in obj.items()}
    return obj


class Catcher(nn.Module):
    """Stands in for ``module`` (usually layer 0): records ``(inp, kwargs)`` and stops the forward.

    ``forward(inp, *args, **kwargs)``: extra positional arguments are bound to their parameter
    names with the wrapped module's forward signature, so the recorded kwargs are the same
    whether the model calls ``layer(x, 0, ids)`` or ``layer(x, start_pos=0, input_ids=ids)``;
    they can be replayed as ``module(inp, **kwargs)``. The wrapped module is kept as
    ``.module`` so the caller can put it back after the capture.
    """

    def __init__(self, module: nn.Module, store_device: torch.device | str | None = None):
        super().__init__()
        self.module = module
        self.store_device = store_device
        self.inputs: list[torch.Tensor] = []
        self.kwargs: list[dict[str, Any]] = []
        try:
            params = list(inspect.signature(module.forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        # names of the positional parameters after the hidden state
        self._pos_names = [p.name for p in params[1:]
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def forward(self, inp: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) > len(self._pos_names):
            raise TypeError(f"Catcher: {len(args)} extra positional arguments, but "
                            f"{type(self.module).__name__}.forward names only {self._pos_names}")
        bound = dict(zip(self._pos_names, args))
        bound.update(kwargs)
        if isinstance(inp, torch.Tensor) and self.store_device is not None and torch.device(self.store_device).type == "cpu":
            # the hidden state goes back to the device once per pass over the layer: pinned
            self.inputs.append(devmod.to_host(inp.detach()))
        else:
            self.inputs.append(detach_to(inp, self.store_device))
        self.kwargs.append(detach_to(bound, self.store_device))
        raise StopForward


def run_until_caught(model_forward: Callable[[], Any]) -> None:
    """Call ``model_forward()``; a ``StopForward`` from a Catcher ends it normally."""
    try:
        model_forward()
    except StopForward:
        return
    raise RuntimeError("the forward finished without reaching the Catcher "
                       "(is the Catcher installed in place of layer 0?)")


@dataclass
class UnitCall:
    """One call of a hooked module: replay with ``module(*args, **kwargs)``; target ``output``."""

    args: tuple
    kwargs: dict[str, Any]
    output: Any


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    return 0


def call_nbytes(call: UnitCall) -> int:
    """Bytes of the tensors of one call (args + kwargs + output)."""
    return _nbytes(call.args) + _nbytes(call.kwargs) + _nbytes(call.output)


class CallMemoryMeter:
    """Bytes of captured call data in host memory now (``live``) and at most (``peak``).

    ``hold(obj, n)``: ``n`` bytes that live as long as ``obj`` (a captured or read-back
    ``UnitCall``, an algorithm's stacked copy), counted until ``obj`` is garbage collected
    (CPython: when its last reference goes); ``add`` / ``sub`` for data released explicitly."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0

    def add(self, n: int) -> None:
        self.live += n
        if self.live > self.peak:
            self.peak = self.live

    def sub(self, n: int) -> None:
        self.live -= n

    def hold(self, obj: Any, n: int) -> None:
        if n:
            self.add(n)
            weakref.finalize(obj, self.sub, n)

    def reset_peak(self) -> None:
        self.peak = self.live


#: the process's one meter of host call bytes (see the module doc)
CALL_METER = CallMemoryMeter()


# ----------------------------------------------------------------------------- sinks
class CallSink(abc.ABC):
    """Receives the calls of ONE unit during the float forward, in call order.

    ``add(call)`` gets each call (tensors already detached and on the capture's
    ``store_device``); ``result()`` is called once after the forward and returns what the unit's
    solver receives; ``discard()`` frees whatever the sink still holds (files, memory) once the
    unit is done. ``nbytes``: bytes the sink holds in host memory now (for accounting)."""

    @abc.abstractmethod
    def add(self, call: UnitCall) -> None:
        """Take one call."""

    @abc.abstractmethod
    def result(self) -> Any:
        """What the unit's solver receives (after the forward)."""

    def discard(self) -> None:
        pass

    @property
    def nbytes(self) -> int:
        return 0


class StoreCalls(CallSink):
    """Keep every call in memory: ``result()`` is the list of calls."""

    def __init__(self) -> None:
        self.calls: list[UnitCall] = []
        self._bytes = 0

    def add(self, call: UnitCall) -> None:
        n = call_nbytes(call)
        self.calls.append(call)
        self._bytes += n
        CALL_METER.hold(call, n)

    def result(self) -> list[UnitCall]:
        return self.calls

    def discard(self) -> None:
        self.calls = []
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes


def _flatten(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """A JSON-able skeleton of ``obj`` with its tensors replaced by indices into ``tensors``."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"t": len(tensors) - 1}
    if isinstance(obj, tuple):
        return {"tuple": [_flatten(o, tensors) for o in obj]}
    if isinstance(obj, list):
        return {"list": [_flatten(o, tensors) for o in obj]}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError("SpillCalls: only str-keyed dicts can be spilled")
        return {"dict": {k: _flatten(v, tensors) for k, v in obj.items()}}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    raise TypeError(f"SpillCalls: cannot spill a {type(obj).__name__} (only tensors, containers, scalars)")


def _unflatten(skel: Any, tensors: Mapping[str, torch.Tensor], prefix: str) -> Any:
    (kind, val), = skel.items()
    if kind == "t":
        return tensors[f"{prefix}{val}"]
    if kind == "tuple":
        return tuple(_unflatten(o, tensors, prefix) for o in val)
    if kind == "list":
        return [_unflatten(o, tensors, prefix) for o in val]
    if kind == "dict":
        return {k: _unflatten(v, tensors, prefix) for k, v in val.items()}
    return val


@dataclass
class _Chunk:
    """One flush of a ``SpillCalls`` sink: ``n`` calls stored as ``nbytes`` raw bytes at
    ``offset`` of the sink's data file; ``meta`` the calls' skeletons (tensors as indices into
    ``specs``), ``specs`` per tensor (dtype name, shape, byte offset in the chunk, bytes)."""

    path: Path
    n: int
    offset: int
    nbytes: int
    meta: list
    specs: list


_ALIGN = 64   # every tensor starts at a multiple of this in its chunk (a dtype view needs alignment)


class _ChunkCache:
    """The calls of one chunk, kept for indexing. A store's ``SpilledCalls`` (every unit's,
    every slice's) share one, so indexing holds at most one chunk of the layer at once (one per
    unit would pin a chunk of every unit for the whole layer's solve)."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.calls: list[UnitCall] | None = None

    def get(self, chunk: _Chunk, load: Callable[[_Chunk], list[UnitCall]]) -> list[UnitCall]:
        key = (chunk.path, chunk.offset)
        if self.key != key:
            self.key = self.calls = None           # the old chunk goes before the new one is read
            self.calls = load(chunk)
            self.key = key
        return self.calls


class LazyCalls(Sequence):
    """A sequence of calls that materialises a call only when it is read (calls spilled to
    disk, calls whose inputs an algorithm rescales); its slices are lazy too. Consumers that
    would copy a sequence into a list (``algorithms.base.UnitData``, ``SolveContext.split``)
    keep these as they are: a list would hold every call of the unit in memory at once."""


class SpilledCalls(LazyCalls):
    """The calls of a ``SpillCalls`` sink, read back from its data file (capture order).
    Iteration reads one chunk (one flush) at a time; indexing keeps the last chunk read (in a
    cache shared with the store's other sequences); a slice (step 1) is again lazy."""

    def __init__(self, chunks: list[_Chunk], head: Sequence[UnitCall] = (),
                 cache: _ChunkCache | None = None, span: tuple[int, int] | None = None):
        self.head = list(head)            # calls kept in memory before the sink started spilling
        self.chunks = chunks
        total = len(self.head) + sum(c.n for c in chunks)
        self._lo, self._hi = (0, total) if span is None else span
        self._cache = cache if cache is not None else _ChunkCache()

    def __len__(self) -> int:
        return self._hi - self._lo

    @property
    def spilled_nbytes(self) -> int:
        """Bytes of the calls on disk (all of the sink's, not only this slice's)."""
        return sum(c.nbytes for c in self.chunks)

    @staticmethod
    def _load(chunk: _Chunk) -> list[UnitCall]:
        buf = torch.empty(chunk.nbytes, dtype=torch.uint8)
        with open(chunk.path, "rb") as f:
            f.seek(chunk.offset)
            got = f.readinto(memoryview(buf.numpy()))
        if got != chunk.nbytes:
            from ..errors import DataError

            raise DataError(f"{chunk.path}: {got} bytes at offset {chunk.offset}, expected {chunk.nbytes} "
                            "(the scratch folder changed under the run)")
        tensors = {}
        for k, (dtype, shape, at, n) in enumerate(chunk.specs):
            dt = getattr(torch, dtype)
            tensors[str(k)] = (buf[at:at + n].view(dt).reshape(shape) if n else torch.empty(shape, dtype=dt))
        calls = [UnitCall(_unflatten(m["args"], tensors, ""), _unflatten(m["kwargs"], tensors, ""),
                          _unflatten(m["output"], tensors, "")) for m in chunk.meta]
        for c in calls:                   # read back: host memory again while the call lives
            CALL_METER.hold(c, call_nbytes(c))
        return calls

    def __iter__(self) -> Iterator[UnitCall]:
        lo, hi = self._lo, self._hi
        g = 0                             # index of the next call over head + chunks
        for c in self.head:
            if lo <= g < hi:
                yield c
            g += 1
        for chunk in self.chunks:
            n = chunk.n
            if g >= hi:
                return
            if g + n > lo:
                calls = self._load(chunk)
                for j in range(max(lo - g, 0), min(hi - g, n)):
                    yield calls[j]
                calls = None              # this chunk goes before the next one is read
            g += n

    def __getitem__(self, i: int) -> UnitCall:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            return SpilledCalls(self.chunks, self.head, self._cache,
                                (self._lo + start, self._lo + max(start, stop)))
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        i += self._lo
        if i < len(self.head):
            return self.head[i]
        i -= len(self.head)
        for chunk in self.chunks:
            if i < chunk.n:
                return self._cache.get(chunk, self._load)[i]
            i -= chunk.n
        raise IndexError(i)


class SpillCalls(CallSink):
    """Append the calls to ONE data file in ``folder`` (created on first write) as raw bytes,
    about ``chunk_bytes`` per flush (None: only when ``flush()`` is called, by the owner of a
    write buffer shared by several sinks: ``CaptureStore``); ``result()`` reads them back lazily
    (``SpilledCalls``); ``discard()`` removes the folder. ``head``: calls already held in memory
    that come first. (One file per unit, not one per flush: a shared write buffer flushes
    often, ~100 times a V4-Flash layer, which as files would be ~26k of them.)"""

    DATA_FILE = "calls.bin"

    def __init__(self, folder: str | Path, chunk_bytes: int | None = 256 * 2 ** 20, head: Sequence[UnitCall] = (),
                 cache: _ChunkCache | None = None):
        self.folder = Path(folder)
        self.chunk_bytes = chunk_bytes
        self.head = list(head)
        self.cache = cache
        self._pending: list[UnitCall] = []
        self._pending_bytes = 0
        self._file_bytes = 0
        self.chunks: list[_Chunk] = []
        self.spilled_bytes = 0

    def add(self, call: UnitCall) -> None:
        n = call_nbytes(call)
        self._pending.append(call)
        self._pending_bytes += n
        CALL_METER.hold(call, n)
        if self.chunk_bytes is not None and self._pending_bytes >= self.chunk_bytes:
            self.flush()

    @property
    def pending_bytes(self) -> int:
        """Bytes of the calls waiting to be written (host memory)."""
        return self._pending_bytes

    def flush(self) -> int:
        """Append the waiting calls to the data file as one chunk; returns their bytes (0: none
        waited). Tensors are written as their own bytes (views of one buffer too)."""
        if not self._pending:
            return 0
        tensors: list[torch.Tensor] = []
        meta = [{"args": _flatten(c.args, tensors), "kwargs": _flatten(c.kwargs, tensors),
                 "output": _flatten(c.output, tensors)} for c in self._pending]
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / self.DATA_FILE
        specs, at = [], 0
        with open(path, "ab") as f:
            for t in tensors:
                t = t.detach().cpu().contiguous()
                raw = t.reshape(-1).view(torch.uint8)
                pad = -at % _ALIGN
                if pad:
                    f.write(bytes(pad))
                    at += pad
                specs.append((str(t.dtype).removeprefix("torch."), tuple(t.shape), at, raw.numel()))
                if raw.numel():
                    f.write(memoryview(raw.numpy()))
                at += raw.numel()
        self.chunks.append(_Chunk(path, len(self._pending), self._file_bytes, at, meta, specs))
        self._file_bytes += at
        n = self._pending_bytes
        self.spilled_bytes += n
        self._pending, self._pending_bytes = [], 0
        return n

    def result(self) -> SpilledCalls:
        self.flush()
        return SpilledCalls(list(self.chunks), self.head, self.cache)

    def discard(self) -> None:
        self._pending, self._pending_bytes, self.head, self.chunks = [], 0, [], []
        shutil.rmtree(self.folder, ignore_errors=True)

    @property
    def nbytes(self) -> int:
        return self._pending_bytes + sum(call_nbytes(c) for c in self.head)


class CaptureStore:
    """Sinks for the units of one layer sharing one host-memory budget.

    ``memory_bytes``: None = no limit (every call in memory); otherwise a unit's calls stay in
    memory while the store's total stays within the budget and spill to
    ``scratch_dir/<unit>/`` from the first call that would exceed it (later calls of that unit
    spill too, so capture order is kept). ``discard()`` of a sink returns its bytes to the budget.

    The calls on their way to disk wait in ONE write buffer of ``buffer_bytes`` shared by all
    the store's sinks: when the next call would overflow it, every spilling sink writes its
    waiting calls. (A buffer per sink held everything: a V4-Flash expert's calls at 128 x 2048,
    ~100 MB, never reach a per-sink 256 MiB, so the 256 experts' 26 GB all waited in memory
    until the capture ended; casebook/real-size-ptq.md.) So the store holds at most
    ``memory_bytes + buffer_bytes`` (a single call larger than the buffer waits alone);
    ``peak_in_memory`` is that accounted maximum (kept + waiting)."""

    def __init__(self, memory_bytes: int | None = None, scratch_dir: str | Path | None = None,
                 chunk_bytes: int = 256 * 2 ** 20):
        if memory_bytes is not None and scratch_dir is None:
            raise ValueError("CaptureStore: a memory budget needs a scratch_dir to spill into")
        if chunk_bytes <= 0:
            raise ValueError(f"CaptureStore: the write buffer must be > 0 bytes, got {chunk_bytes}")
        self.memory_bytes = memory_bytes
        self.scratch_dir = None if scratch_dir is None else Path(scratch_dir)
        self.buffer_bytes = chunk_bytes
        self.in_memory = 0                # calls kept in memory (within memory_bytes)
        self.pending = 0                  # calls waiting in the write buffer
        self.peak_in_memory = 0
        self.spilled_bytes = 0
        self._spilling: list[SpillCalls] = []
        self._cache = _ChunkCache()

    def sink(self, name: str) -> CallSink:
        if self.memory_bytes is None:
            return StoreCalls()
        return _BudgetedCalls(self, name)

    def _note_peak(self) -> None:
        self.peak_in_memory = max(self.peak_in_memory, self.in_memory + self.pending)

    def flush(self) -> None:
        """Every spilling sink writes its waiting calls (the write buffer is then empty)."""
        for sp in self._spilling:
            self.pending -= sp.flush()

    def cleanup(self) -> None:
        self._cache.key = self._cache.calls = None
        if self.scratch_dir is not None:
            shutil.rmtree(self.scratch_dir, ignore_errors=True)


class _BudgetedCalls(CallSink):
    def __init__(self, store: CaptureStore, name: str):
        self.store = store
        self.name = name
        self.memory: list[UnitCall] = []
        self.mem_bytes = 0
        self.spill: SpillCalls | None = None

    def add(self, call: UnitCall) -> None:
        n = call_nbytes(call)
        st = self.store
        if self.spill is None and st.in_memory + n <= st.memory_bytes:
            self.memory.append(call)
            self.mem_bytes += n
            st.in_memory += n
            CALL_METER.hold(call, n)
            st._note_peak()
            return
        if self.spill is None:
            self.spill = SpillCalls(st.scratch_dir / self.name.replace("/", "_"), None, head=self.memory,
                                    cache=st._cache)
            st._spilling.append(self.spill)
        if st.pending and st.pending + n > st.buffer_bytes:
            st.flush()
        self.spill.add(call)
        st.pending += n
        st.spilled_bytes += n
        st._note_peak()

    def result(self) -> Sequence[UnitCall]:
        if self.spill is None:
            return self.memory
        self.store.pending -= self.spill.flush()
        return self.spill.result()

    def discard(self) -> None:
        st = self.store
        if self.spill is not None:
            st.pending -= self.spill.pending_bytes
            self.spill.discard()
            st._spilling = [s for s in st._spilling if s is not self.spill]
            self.spill = None
        st.in_memory -= self.mem_bytes
        self.memory, self.mem_bytes = [], 0

    @property
    def nbytes(self) -> int:
        return self.mem_bytes + (self.spill.pending_bytes if self.spill is not None else 0)


def capture_unit_io(modules: Mapping[str, nn.Module] | Iterable[Any], run_fn: Callable[[], Any],
                    store_device: torch.device | str | None = "cpu",
                    sinks: Mapping[str, CallSink] | None = None) -> tuple[dict[str, Any], Any]:
    """Run ``run_fn()`` with forward hooks on ``modules``; returns (per name the sink's
    ``result()``, run_fn's result).

    ``modules``: a mapping name -> module, or an iterable of objects with ``.name`` and
    ``.module`` (PtqUnits). Every call's args / kwargs / output are detached and, by default,
    moved to the host (``store_device='cpu'``) so captured data does not pile up in device
    memory; pass ``store_device=None`` to keep them where they are. ``sinks``: one ``CallSink``
    per name (default: ``StoreCalls`` for each, i.e. lists of calls). Hooks are removed even if
    ``run_fn`` raises.
    """
    if isinstance(modules, Mapping):
        named = dict(modules)
    else:
        named = {u.name: u.module for u in modules}
    if sinks is None:
        sinks = {name: StoreCalls() for name in named}
    missing = [n for n in named if n not in sinks]
    if missing:
        raise ValueError(f"capture_unit_io: no sink for {missing[:3]}")
    handles = []

    def make_hook(name: str):
        sink = sinks[name]

        def hook(_module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            sink.add(UnitCall(detach_to(args, store_device), detach_to(kwargs, store_device),
                              detach_to(output, store_device)))
        return hook

    try:
        for name, module in named.items():
            handles.append(module.register_forward_hook(make_hook(name), with_kwargs=True))
        result = run_fn()
    finally:
        for h in handles:
            h.remove()
    return {name: sinks[name].result() for name in named}, result
