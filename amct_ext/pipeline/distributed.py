"""Scale-out over ``torch.distributed``: one PTQ run spread over the ranks of a torchrun job.

    torchrun --nproc-per-node 8 [--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT] \\
        tools/run_ptq.py --model v4-flash --model-path DIR --output-dir OUT

With float predecessors (workflow.py) the units of layer i depend only on the float model and
the calibration windows, so layers are independent once their float inputs are known. Each rank
takes one contiguous range of the quantized layers, balanced by cost (``layer_costs``,
``partition_layers``), and solves its units into the one shared output folder.

The float inputs of a rank's first layer (the "boundary") reach it in one of two ways:
- ``recompute`` (the default): the rank runs the float layers before its range itself, exactly
  as the single process computes them (``workflow.float_layer_output``). No traffic; every rank
  starts at once; a dead rank never blocks another one's work.
- ``send``: rank r-1 runs a float pass over its range, sends the [n, B, S, hc, D] stream and the
  per-sample state (``input_ids`` for hash routing) to rank r (point-to-point), then solves.
Both give the bits of the one-process run. The critical path is the same (the float pass
through layers 0..start_r-1 is sequential either way: recomputed by rank r, or chained through
ranks 0..r-1); send adds a second load of each rank's own layers and 8.6 GB per boundary at
128 x 2048 x 4 x 4096 bf16, recompute adds (world/2) x the model's reads in aggregate. See
benchmarks/RESULTS.md §12 for the measurements and the choice.

Rank 0 writes ptq_params/meta.json before any rank writes a unit (barrier), gathers the unit
results and writes report.json and the summary. Resume is per rank: a rank skips its finished
units (the same .pt test as one process). The range split does not enter meta.json: a rerun
with another world size resumes the same folder, since the files do not depend on it.

Blockwise perplexity runs as a pipeline: the layers of the whole model are split over the
ranks (by forward cost); rank 0 embeds window batch k, every rank runs its (resident) layers on
it and sends it on, the last rank computes the head NLL, and the sum is broadcast. The batches
and their order are those of one process, so the PPL is the same number.

Failures, three layers (each ends in one clear ``error:`` line; a rerun resumes):
- torchrun stops the other workers of its node when one exits non-zero (SIGTERM,
  ``install_stop_handler``);
- a rank on another node is stopped by the ``Watchdog`` (heartbeats in the job's store, stale
  after ``AMCT_DIST_HEARTBEAT_S``, default 120 s), or earlier by its next collective failing
  ("Connection closed by peer" with gloo);
- a rank blocked in a collective on a hung (alive, silent) peer stops at the process group's
  timeout (``AMCT_DIST_TIMEOUT_S``, default 2 h: a rank that finished early waits at the final
  gather for the slowest one), unless the watchdog fires first.
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ..runtime import device as devmod
from ..base import BaseModel, EvalConfig, PtqConfig
from ..errors import AmctError, ConfigError
from .layer_cost import LayerCost  # noqa: F401  (its old home: importers keep working)
from .perplexity import NllAccumulator
from ..quant.schemes import QuantScheme
from .ptq_spec import PtqSpec
from .ptq_units import UnitResult

if TYPE_CHECKING:
    from .workflow import PtqRuntime

BOUNDARY_MODES = ("recompute", "send")
TIMEOUT_ENV = "AMCT_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 7200.0
# test hook (tests/test_distributed.py): rank AMCT_TEST_DIE_RANK (default 1) exits hard after
# solving AMCT_TEST_DIE_AFTER_UNITS units, as a crashed or killed process would
DIE_AFTER_ENV = "AMCT_TEST_DIE_AFTER_UNITS"
DIE_RANK_ENV = "AMCT_TEST_DIE_RANK"
DIE_EXIT_CODE = 17


class DistributedError(AmctError):
    """A distributed run cannot go on (bad request, or another rank failed)."""


# ----------------------------------------------------------------------------- environment
@dataclass(frozen=True)
class DistEnv:
    """This process's place in a torchrun job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def comm_device(self) -> torch.device:
        """Where tensors must be for the backend: host for gloo, the rank's device otherwise."""
        if self.device is None or self.device.type == "cpu":
            return torch.device("cpu")
        return self.device


def env_from(environ: dict[str, str] | None = None) -> DistEnv | None:
    """The torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK), or None when this process was
    not started by torchrun or is its only worker (then the one-process code runs)."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError:
        raise DistributedError(f"torchrun environment is malformed: RANK={env.get('RANK')!r} "
                               f"WORLD_SIZE={env.get('WORLD_SIZE')!r} LOCAL_RANK={env.get('LOCAL_RANK')!r}") from None
    if world <= 1:
        return None
    if not 0 <= rank < world:
        raise DistributedError(f"torchrun environment: RANK={rank} is outside WORLD_SIZE={world}")
    return DistEnv(rank, world, local)


def timeout_s(environ: dict[str, str] | None = None) -> float:
    env = os.environ if environ is None else environ
    raw = env.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise DistributedError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds")
    return value


def init(dist_env: DistEnv, device_pref: str) -> DistEnv:
    """Pick this rank's device (``device.local_rank_device``) and join the process group with
    the device's backend (gloo / nccl / hccl). Returns the env with its device set."""
    import torch.distributed as tdist

    dev = devmod.local_rank_device(device_pref, dist_env.local_rank)
    backend = devmod.dist_backend(dev.type)
    kwargs: dict[str, Any] = {}
    if dev.type == "cuda":
        kwargs["device_id"] = dev   # binds the NCCL communicator to this rank's device
    tdist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s()), **kwargs)
    if tdist.get_rank() != dist_env.rank or tdist.get_world_size() != dist_env.world_size:
        raise DistributedError(f"process group rank {tdist.get_rank()}/{tdist.get_world_size()} does not match "
                               f"torchrun's RANK={dist_env.rank} WORLD_SIZE={dist_env.world_size}")
    return DistEnv(dist_env.rank, dist_env.world_size, dist_env.local_rank, dev)


def shutdown(ok: bool = True) -> None:
    """End this rank's part: mark it done for the peers' watchdogs (``ok``), leave the group."""
    global _WATCHDOG
    import torch.distributed as tdist

    if _WATCHDOG is not None:
        if ok:
            _WATCHDOG.finish()
        elif _WATCHDOG._stop is not None:
            _WATCHDOG._stop.set()
        _WATCHDOG = None
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def barrier(dist_env: DistEnv) -> None:
    import torch.distributed as tdist

    if dist_env.comm_device.type == "cpu":
        tdist.barrier()
    else:
        tdist.barrier(device_ids=[dist_env.comm_device.index])


def check_propagate(propagate: str | None) -> None:
    """Quantized predecessors make layer i+1's inputs depend on layer i's solved parameters:
    the layers are a chain, so their ranges cannot be solved side by side. None = the default
    (float). Call it with the RESOLVED value (a recipe's default propagation included)."""
    if propagate not in (None, "float"):
        raise DistributedError(f"--propagate {propagate} is refused under torchrun: with quantized "
                               "predecessors each layer needs the solved layer before it, so layer ranges "
                               "cannot run in parallel (use --propagate float, or one process)")


# ----------------------------------------------------------------------------- cost model
# The layer costs come from the model's adapter (``BaseModel.layer_cost``; DeepSeek-V4's cost
# model is ``models/deepseek_v4/cost.py``); this module only splits layers by them.
def partition_layers(layers: range, costs: Sequence[LayerCost], n_ranks: int, *, prefix: bool = True,
                     use: str = "ptq") -> list[range]:
    """Split ``layers`` into ``n_ranks`` contiguous ranges (in order; a range may be empty when
    there are more ranks than layers) minimising the largest rank time.

    ``costs[i]`` is layer i's cost for every i < layers.stop. A rank's time is the sum of its
    layers' cost (``use='ptq'``: float pass + solving; ``'float'``: the float pass only) plus,
    with ``prefix``, the float passes of every layer before its range (the recomputed
    boundary, or equally the chain of float passes that brings the boundary to it). Exact
    (dynamic programming over split points); deterministic.
    """
    if n_ranks < 1:
        raise ConfigError(f"partition_layers: n_ranks must be >= 1, got {n_ranks}")
    if len(costs) < layers.stop:
        raise ConfigError(f"partition_layers: {len(costs)} layer costs for layers up to {layers.stop - 1}")
    own = [(c.ptq_s if use == "ptq" else c.float_s) for c in costs]
    n, s0 = len(layers), layers.start
    pre_f = [0.0]
    for i in range(layers.stop):
        pre_f.append(pre_f[-1] + costs[i].float_s)
    pre_own = [0.0]
    for i in layers:
        pre_own.append(pre_own[-1] + own[i])

    def rank_time(p: int, q: int) -> float:
        if q == p:
            return 0.0
        return (pre_f[s0 + p] if prefix else 0.0) + pre_own[q] - pre_own[p]

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(n_ranks)]
    cut = [[0] * (n + 1) for _ in range(n_ranks)]
    for q in range(n + 1):
        best[0][q] = rank_time(0, q)
    for r in range(1, n_ranks):
        for q in range(n + 1):
            for p in range(q + 1):     # ascending p, strict '<': a tie keeps the smallest p
                if best[r - 1][p] >= best[r][q]:
                    break              # best[r-1] never decreases in p: no later p can do better
                t = max(best[r - 1][p], rank_time(p, q))
                if t < best[r][q] - 1e-12 * max(1.0, abs(t)):
                    best[r][q], cut[r][q] = t, p
    bounds = [n]
    for r in range(n_ranks - 1, 0, -1):
        bounds.append(cut[r][bounds[-1]])
    bounds.append(0)
    bounds.reverse()
    return [range(s0 + bounds[r], s0 + bounds[r + 1]) for r in range(n_ranks)]


def rank_times(layers: range, costs: Sequence[LayerCost], ranges: Sequence[range], *, prefix: bool = True,
               use: str = "ptq") -> list[float]:
    """The time of each rank under ``partition_layers``' model (for reports and tests)."""
    out = []
    for rg in ranges:
        if not len(rg):
            out.append(0.0)
            continue
        t = sum((costs[i].ptq_s if use == "ptq" else costs[i].float_s) for i in rg)
        if prefix:
            t += sum(costs[i].float_s for i in range(rg.start))
        out.append(t)
    return out


# ----------------------------------------------------------------------------- boundary traffic
def _dtype_from(name: str) -> torch.dtype:
    dt = getattr(torch, name.rpartition(".")[2], None)
    if not isinstance(dt, torch.dtype):
        raise DistributedError(f"stream header names an unknown dtype {name!r}")
    return dt


def _send_bytes(blob: bytes, dst: int, dev: torch.device) -> None:
    import torch.distributed as tdist

    tdist.send(torch.tensor([len(blob)], dtype=torch.int64, device=dev), dst)
    tdist.send(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(dev), dst)


def _recv_bytes(src: int, dev: torch.device) -> bytes:
    import torch.distributed as tdist

    n = torch.zeros(1, dtype=torch.int64, device=dev)
    tdist.recv(n, src)
    buf = torch.empty(int(n.item()), dtype=torch.uint8, device=dev)
    tdist.recv(buf, src)
    return bytes(buf.cpu().numpy().tobytes())


def send_stream(stream, dst: int, dist_env: DistEnv) -> None:
    """Point-to-point send of a ``workflow.Stream`` (hidden states per batch + per-sample state).

    A JSON header (shapes, dtypes, the state's plain values) goes first, then every tensor in
    header order; no pickling, so the receiving rank unpacks data, never code."""
    import torch.distributed as tdist

    dev = dist_env.comm_device
    tensors: list[torch.Tensor] = []
    hidden = []
    for h in stream.hidden:
        hidden.append({"shape": list(h.shape), "dtype": str(h.dtype)})
        tensors.append(h)
    state = []
    for kw in stream.state:
        entry = {}
        for k in sorted(kw):
            v = kw[k]
            if isinstance(v, torch.Tensor):
                entry[k] = {"tensor": list(v.shape), "dtype": str(v.dtype)}
                tensors.append(v)
            else:
                entry[k] = {"value": v}
        state.append(entry)
    _send_bytes(json.dumps({"hidden": hidden, "state": state}).encode("utf-8"), dst, dev)
    for t in tensors:
        tdist.send(t.detach().contiguous().to(dev), dst)


def recv_stream(src: int, dist_env: DistEnv, store: torch.device | str | None = "cpu"):
    """Receive what ``send_stream`` sent; tensors land on ``store`` (host by default, like the
    hidden states of one process between layers)."""
    import torch.distributed as tdist

    from .workflow import Stream

    dev = dist_env.comm_device
    head = json.loads(_recv_bytes(src, dev).decode("utf-8"))

    def take(shape, dtype):
        t = torch.empty(shape, dtype=_dtype_from(dtype), device=dev)
        tdist.recv(t, src)
        return t.to(store) if store is not None else t

    hidden = [take(h["shape"], h["dtype"]) for h in head["hidden"]]
    state = []
    for entry in head["state"]:
        kw = {}
        for k, spec in entry.items():
            kw[k] = take(spec["tensor"], spec["dtype"]) if "tensor" in spec else spec["value"]
        state.append(kw)
    return Stream(hidden, state)


def all_gather_json(obj: Any, dist_env: DistEnv) -> list[Any]:
    """Every rank's JSON-able ``obj``, in rank order (lengths first, then padded bytes)."""
    import torch.distributed as tdist

    dev = dist_env.comm_device
    blob = json.dumps(obj).encode("utf-8")
    n = torch.tensor([len(blob)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(dist_env.world_size)]
    tdist.all_gather(sizes, n)
    width = int(max(int(s.item()) for s in sizes))
    buf = torch.zeros(width, dtype=torch.uint8, device=dev)
    buf[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(dev) if blob else buf[:0]
    outs = [torch.zeros(width, dtype=torch.uint8, device=dev) for _ in range(dist_env.world_size)]
    tdist.all_gather(outs, buf)
    return [json.loads(bytes(o[:int(s.item())].cpu().numpy().tobytes()).decode("utf-8"))
            for o, s in zip(outs, sizes)]


# ----------------------------------------------------------------------------- failure handling
def die_hook(dist_env: DistEnv | None) -> Callable[[UnitResult], None] | None:
    """The ``AMCT_TEST_DIE_AFTER_UNITS`` test hook as an ``on_unit_done`` callback (or None)."""
    raw = os.environ.get(DIE_AFTER_ENV)
    if dist_env is None or not raw:
        return None
    after, who = int(raw), int(os.environ.get(DIE_RANK_ENV, "1"))
    if dist_env.rank != who:
        return None
    done = [0]

    def hook(_r: UnitResult) -> None:
        done[0] += 1
        if done[0] >= after:
            print(f"rank {dist_env.rank}: {DIE_AFTER_ENV}={after} reached, exiting hard (test hook)",
                  file=sys.stderr, flush=True)
            os._exit(DIE_EXIT_CODE)

    return hook


_STOP_REPORTED = False


def mark_stop_reported() -> None:
    """This rank has printed why it stops (a lost peer): a SIGTERM from torchrun while it shuts
    down then exits without a second line (casebook/distributed.md)."""
    global _STOP_REPORTED
    _STOP_REPORTED = True


def install_stop_handler(dist_env: DistEnv) -> None:
    """torchrun ends the surviving workers with SIGTERM when one fails: say so in one line
    (instead of a traceback from wherever the signal landed) and exit at once. Finished units
    are on disk (atomic writes), so a rerun of the same command resumes."""
    def on_term(signum, _frame):
        if _STOP_REPORTED:
            os._exit(128 + signum)
        print(f"error: rank {dist_env.rank}/{dist_env.world_size}: stopped by torchrun (signal {signum}) because "
              "another rank failed (see torchrun's failure summary); rerun the same command to resume, "
              "finished units are kept", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)


HEARTBEAT_ENV = "AMCT_DIST_HEARTBEAT_S"
DEFAULT_STALE_S = 120.0


class Watchdog:
    """Peer liveness over the job's key-value store, for the case torchrun does not cover.

    One node's torchrun stops its own workers when one fails, but a worker on ANOTHER node
    goes on with its layer range until its next collective (verified with two agents on
    loopback, benchmarks/RESULTS.md §12) -- at real size that can be hours. So every rank bumps
    a counter in the store every ``period_s`` and watches the others' counters; a peer whose
    counter has not moved for ``stale_s`` (local clock; no cross-host clock comparison) is
    taken as dead or hung, and ``on_dead(message)`` runs (default: one line, exit 4). A rank that
    finished normally marks itself done first and is not watched. An unreachable store counts
    as a failure too (the node hosting it went away)."""

    def __init__(self, store, rank: int, world_size: int, *, period_s: float = 5.0, stale_s: float = DEFAULT_STALE_S,
                 on_dead: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.period_s, self.stale_s, self.clock = period_s, stale_s, clock
        self.on_dead = on_dead or self._exit
        self.count = 0
        start = clock()
        self.last_value: dict[int, bytes | None] = {r: None for r in range(world_size) if r != rank}
        self.last_seen = {r: start for r in self.last_value}
        self._stop = None

    def _exit(self, message: str) -> None:
        print(f"error: rank {self.rank}/{self.world_size}: {message}; stopping. Rerun the same command to "
              "resume, finished units are kept", file=sys.stderr, flush=True)
        os._exit(4)

    def beat(self) -> None:
        self.count += 1
        self.store.set(f"amct/hb/{self.rank}", str(self.count))

    def check(self) -> str | None:
        """The message for the first dead peer, or None."""
        now = self.clock()
        for peer in self.last_value:
            if self.store.check([f"amct/done/{peer}"]):
                continue
            key = f"amct/hb/{peer}"
            value = self.store.get(key) if self.store.check([key]) else None
            if value != self.last_value[peer]:
                self.last_value[peer], self.last_seen[peer] = value, now
            elif now - self.last_seen[peer] > self.stale_s:
                return (f"rank {peer} gave no sign of life for {now - self.last_seen[peer]:.0f} s "
                        f"(> {HEARTBEAT_ENV}={self.stale_s:g}): its process died or is frozen")
        return None

    def step(self) -> bool:
        """One beat and one check; False once a peer was found dead (``on_dead`` was called)."""
        try:
            self.beat()
            msg = self.check()
        except Exception as e:  # noqa: BLE001 - the store's host is gone: the job is broken
            msg = f"the job's store is unreachable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        if msg and not (self._stop is not None and self._stop.is_set()):
            # (once this rank is finishing, a vanished peer or store is the normal end of the job)
            self.on_dead(msg)
            return False
        return msg is None

    def start(self) -> "Watchdog":
        import threading

        self._stop = threading.Event()

        def loop():
            while not self._stop.is_set() and self.step():
                self._stop.wait(self.period_s)

        threading.Thread(target=loop, name="amct-watchdog", daemon=True).start()
        return self

    def finish(self) -> None:
        """Normal end: mark this rank done (peers stop watching it), stop the thread."""
        if self._stop is not None:
            self._stop.set()
        try:
            self.store.set(f"amct/done/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - peers gone already: nothing to tell them
            pass


_WATCHDOG: Watchdog | None = None


def start_watchdog(dist_env: DistEnv) -> Watchdog | None:
    """The ``Watchdog`` on the process group's store; ``AMCT_DIST_HEARTBEAT_S`` (default 120)
    sets the staleness bound, 0 turns it off."""
    global _WATCHDOG
    import torch.distributed as tdist

    raw = os.environ.get(HEARTBEAT_ENV)
    try:
        stale = DEFAULT_STALE_S if raw is None else float(raw)
    except ValueError:
        raise DistributedError(f"{HEARTBEAT_ENV}={raw!r}: expected seconds (0 = no watchdog)") from None
    get_store = getattr(tdist.distributed_c10d, "_get_default_store", None)
    if stale <= 0 or get_store is None:
        return None
    _WATCHDOG = Watchdog(get_store(), dist_env.rank, dist_env.world_size, period_s=min(5.0, stale / 4),
                         stale_s=stale).start()
    return _WATCHDOG


def is_comm_failure(exc: BaseException) -> bool:
    """A collective / point-to-point failure: the peer died (connection closed) or timed out."""
    import torch.distributed as tdist

    kinds = tuple(k for k in (getattr(tdist, "DistError", None), getattr(tdist, "DistBackendError", None)) if k)
    if kinds and isinstance(exc, kinds):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Timed out", "timed out", "Socket Timeout",
        "NCCL error", "HCCL", "Gloo"))


# ----------------------------------------------------------------------------- PTQ
def ptq_ranges(adapter: BaseModel, dist_env: DistEnv, layers: range, targets: Sequence[str],
               cfg: PtqConfig) -> list[range]:
    n_tokens = cfg.n_samples * cfg.seq_len
    costs = [adapter.layer_cost(i, targets, n_tokens, cfg.epochs) for i in range(layers.stop)]
    return partition_layers(layers, costs, dist_env.world_size)


def eval_ranges(adapter: BaseModel, dist_env: DistEnv, n_tokens: int) -> list[range]:
    every = range(adapter.num_layers)
    costs = [adapter.layer_cost(i, [], n_tokens, 0) for i in every]
    return partition_layers(every, costs, dist_env.world_size, prefix=False, use="float")


def run_ptq(dist_env: DistEnv, adapter: BaseModel, spec: PtqSpec, output_dir: str | Path, *, layers: range,
            calib_windows: torch.Tensor, boundary: str = "recompute", ranges: Sequence[range] | None = None,
            runtime: PtqRuntime | None = None):
    """``workflow.run_blockwise_ptq`` over the ranks of a torchrun job (one process calls
    ``run_blockwise_ptq`` itself).

    Every rank returns the whole run's unit results (gathered, in layer order) and the largest
    peak memory; ``result.ranges`` holds the split. Rank 0 writes the meta.json of ``spec``
    before any rank writes a unit; every rank then runs its range with ``spec`` and
    ``runtime`` (its ``on_unit_done`` defaults to the test hook ``die_hook``)."""
    from .workflow import (LayerSlice, MemoryStats, PtqResult, PtqRuntime, embed_stream, float_layer_output,
                           prepare_params_dir, run_blockwise_ptq)

    if dist_env is None:
        raise DistributedError("distributed.run_ptq needs a torchrun environment; one process calls "
                               "workflow.run_blockwise_ptq")
    if boundary not in BOUNDARY_MODES:
        raise ConfigError(f"boundary mode {boundary!r} is unknown; valid: {', '.join(BOUNDARY_MODES)}")
    spec = spec.resolved()
    check_propagate(spec.propagate)
    t0 = time.perf_counter()
    scheme, targets, cfg = spec.scheme, spec.targets, spec.calibration
    ranges = list(ranges) if ranges is not None else ptq_ranges(adapter, dist_env, layers, targets, cfg)
    mine = ranges[dist_env.rank]
    if dist_env.is_main:
        prepare_params_dir(adapter, output_dir, spec, calib_windows=calib_windows)   # before any unit
    barrier(dist_env)
    runtime = runtime or PtqRuntime()
    if runtime.on_unit_done is None:
        runtime = replace(runtime, on_unit_done=die_hook(dist_env))
    res = None
    if boundary == "recompute":
        if len(mine):
            res = run_blockwise_ptq(adapter, spec, output_dir, layers=mine, calib_windows=calib_windows,
                                    runtime=runtime, part=LayerSlice(float_like=layers))
    else:
        # the boundary stream: rank 0 embeds and runs the float layers before the quantized range
        first = mine.start
        if dist_env.is_main:
            stream = embed_stream(adapter, calib_windows, cfg.batch_size)
            for i in range(first):
                block = adapter.block(i)
                stream = float_layer_output(adapter, block, stream, False, scheme, targets)
                adapter.release_block(block)
        else:
            stream = recv_stream(dist_env.rank - 1, dist_env)
        if not dist_env.is_last:
            out = stream
            for i in mine:   # float pass over the own range first, so the next rank starts early
                block = adapter.block(i)
                out = float_layer_output(adapter, block, out, True, scheme, targets)
                adapter.release_block(block)
            send_stream(out, dist_env.rank + 1, dist_env)
        if len(mine):
            res = run_blockwise_ptq(adapter, spec, output_dir, layers=mine, calib_windows=calib_windows,
                                    runtime=runtime, part=LayerSlice(start=(first, stream)))
    local_units = [u.to_dict() for u in res.units] if res is not None else []
    peak = res.memory.peak_memory_bytes if res is not None else devmod.peak_memory_bytes(adapter.device)
    gathered = all_gather_json({"units": local_units, "peak": peak, "seconds": time.perf_counter() - t0,
                                "unobserved": res.unobserved_static if res is not None else 0}, dist_env)
    units = [UnitResult(**u) for g in gathered for u in g["units"]]
    mem = MemoryStats(device=str(adapter.device), peak_memory_bytes=max(g["peak"] for g in gathered),
                      max_layer_bytes=res.memory.max_layer_bytes if res is not None else 0,
                      hidden_bytes=res.memory.hidden_bytes if res is not None else 0)
    out = PtqResult(units=units, params_dir=str(Path(output_dir) / "ptq_params"),
                    seconds=time.perf_counter() - t0, memory=mem,
                    unobserved_static=sum(g["unobserved"] for g in gathered))
    out.ranges = ranges
    out.rank_peaks = [g["peak"] for g in gathered]
    out.rank_seconds = [g["seconds"] for g in gathered]   # each rank's own work, before the gather
    return out


# ----------------------------------------------------------------------------- perplexity
def evaluate(dist_env: DistEnv, adapter: BaseModel, windows: torch.Tensor, cfg: EvalConfig,
             mode: str = "float", *, scheme: QuantScheme | None = None, targets: Sequence[str] | None = None,
             layers: range | None = None, calib_windows: torch.Tensor | None = None, calib_batch_size: int = 1,
             params_dir: str | Path | None = None, ranges: Sequence[range] | None = None):
    """``workflow.evaluate_blockwise`` as a pipeline over the ranks: this rank's stage (its
    layers by forward cost, kept built; streams from the previous rank, to the next one; the
    last rank's sums broadcast). Every rank returns the same PPL; memory is this rank's. One
    process calls ``evaluate_blockwise`` itself."""
    from .workflow import EvalStage, evaluate_blockwise

    if dist_env is None:
        raise DistributedError("distributed.evaluate needs a torchrun environment; one process calls "
                               "workflow.evaluate_blockwise")
    import torch.distributed as tdist

    ranges = list(ranges) if ranges is not None else eval_ranges(adapter, dist_env, int(windows.numel()))
    prev, nxt = dist_env.rank - 1, dist_env.rank + 1

    def reduce(acc: NllAccumulator, unobserved: int) -> int:
        # the last rank's sums to everyone (a broadcast: the very float64 the last rank summed)
        tot = torch.tensor([acc.total_nll, float(acc.count)], dtype=torch.float64, device=dist_env.comm_device)
        tdist.broadcast(tot, src=dist_env.world_size - 1)
        acc.total_nll, acc.count = float(tot[0].item()), int(tot[1].item())
        n_unobs = torch.tensor([unobserved], dtype=torch.int64, device=dist_env.comm_device)
        tdist.all_reduce(n_unobs)   # static quantizers left in float, over every rank's layers
        return int(n_unobs.item())

    stage = EvalStage(ranges[dist_env.rank], resident=True,
                      recv=None if dist_env.is_main else (lambda: recv_stream(prev, dist_env)),
                      send=None if dist_env.is_last else (lambda s: send_stream(s, nxt, dist_env)),
                      reduce=reduce)
    return evaluate_blockwise(adapter, windows, cfg, mode, scheme=scheme, targets=targets, layers=layers,
                              calib_windows=calib_windows, calib_batch_size=calib_batch_size,
                              params_dir=params_dir, stage=stage)


# ----------------------------------------------------------------------------- export hook
def run_layer_ranges(dist_env: DistEnv | None, layers: range, costs: Sequence[LayerCost],
                     work: Callable[[range], Any]) -> list[Any]:
    """Run ``work(own_range)`` on every rank over a cost-balanced split of ``layers`` (no
    boundary: for jobs whose layers are independent given the saved parameters, e.g. export)
    and return every rank's JSON-able result in rank order. One process: ``[work(layers)]``.
    (The export has its own driver, ``export.exporter.export_checkpoint_distributed``: its
    ranks share one output folder, which needs an ordering this generic hook does not give.)"""
    if dist_env is None:
        return [work(layers)]
    ranges = partition_layers(layers, costs, dist_env.world_size, prefix=False, use="float")
    mine = ranges[dist_env.rank]
    result = work(mine) if len(mine) else None
    return all_gather_json(result, dist_env)
