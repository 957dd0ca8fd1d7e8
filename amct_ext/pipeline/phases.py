"""Phase timing for long jobs: wall time and peak device / host memory of each named phase.

``run_blockwise_ptq(..., runtime=PtqRuntime(phases=PhaseTimer(...)))`` wraps its steps (build,
capture, each unit's solve, writing) in ``phases.phase(name, layer=i)``; without a timer the
workflow uses ``NO_PHASES``, whose phases cost nothing (no device syncs are added to a plain run).

Per phase:
- seconds: host wall clock with a device synchronize at both ends (queued kernels count in the
  phase that queued them);
- device_peak_bytes: the allocator peak inside the phase (the peak counter is reset at its
  start), for every device given;
- host_peak_bytes: the largest resident set size (RSS) seen by a sampling thread (every
  ``interval`` s) during the phase; the process's peak RSS cannot be reset, so a sampler is the
  only per-phase view. Short spikes between two samples can be missed: it is a lower bound.
  RSS counts the checkpoint's memory-mapped shard pages (file-backed, reclaimable page cache);
  host_anon_peak_bytes is the anonymous part alone (``RssAnon`` of /proc/self/status, Linux):
  tensors, Python, libraries -- the memory a job really needs -- plus the page-locked host memory
  of the accelerator's pinned allocator (the hidden states between layers,
  ``device.pinned_host_bytes``), which the driver maps outside ``RssAnon``.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

import torch

from ..runtime import device as devmod


@dataclass
class PhaseRecord:
    name: str
    layer: int | None
    seconds: float
    device_peak_bytes: dict[str, int] = field(default_factory=dict)
    host_peak_bytes: int = 0
    host_anon_peak_bytes: int = 0      # RssAnon + pinned host memory (job_memory_bytes)
    tags: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def job_memory_bytes() -> int:
    """The host memory a job holds: ``RssAnon`` plus the accelerator's pinned host memory."""
    return rss_anon_bytes() + devmod.pinned_host_bytes()


def rss_anon_bytes() -> int:
    """Anonymous resident memory of this process (0 where /proc/self/status has no RssAnon)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


class _NoPhases:
    """The do-nothing timer a plain run uses."""

    records: list[PhaseRecord] = []

    @contextlib.contextmanager
    def phase(self, name: str, layer: int | None = None, **tags: Any) -> Iterator[None]:
        yield


    def note(self, **tags: Any) -> None:
        pass


NO_PHASES = _NoPhases()


class PhaseTimer:
    """Records one ``PhaseRecord`` per ``with timer.phase(...)`` (phases do not nest)."""

    def __init__(self, devices: Sequence[str | torch.device] = (), interval: float = 0.02,
                 sample_host: bool = True, on_record: Any = None):
        #: called with each finished PhaseRecord (a benchmark's live log: a run cut short by a
        #: time limit still tells what it measured)
        self.on_record = on_record
        self.devices = [torch.device(d) for d in devices if torch.device(d).type != "cpu"]
        self.records: list[PhaseRecord] = []
        self.interval = interval
        self._host_peak = 0
        self._anon_peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if sample_host:
            self._thread = threading.Thread(target=self._sample, name="phase-rss", daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            rss = devmod.memory_allocated("cpu")
            if rss > self._host_peak:
                self._host_peak = rss
            anon = job_memory_bytes()
            if anon > self._anon_peak:
                self._anon_peak = anon
            self._stop.wait(self.interval)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def __enter__(self) -> "PhaseTimer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @contextlib.contextmanager
    def phase(self, name: str, layer: int | None = None, **tags: Any) -> Iterator[None]:
        for d in self.devices:
            devmod.synchronize(d)
            devmod.reset_peak_memory(d)
        self._host_peak = devmod.memory_allocated("cpu")
        self._anon_peak = job_memory_bytes()
        t0 = time.perf_counter()
        ended_by = None
        try:
            yield
        except BaseException as e:
            # a phase cut short (a time limit's SIGINT, an error) is still recorded, but marked:
            # its seconds are where it stopped, not what it costs (casebook i15-5)
            ended_by = type(e).__name__
            raise
        finally:
            for d in self.devices:
                devmod.synchronize(d)
            seconds = time.perf_counter() - t0
            host = max(self._host_peak, devmod.memory_allocated("cpu"))
            anon = max(self._anon_peak, job_memory_bytes())
            rec_tags = dict(tags) if ended_by is None else {**tags, "ended_by": ended_by}
            self.records.append(PhaseRecord(name, layer, seconds,
                                            {str(d): devmod.peak_memory_bytes(d) for d in self.devices},
                                            host, anon, rec_tags))
            if self.on_record is not None:
                self.on_record(self.records[-1])

    def note(self, **tags: Any) -> None:
        """Attach facts (e.g. captured bytes) to the last finished phase."""
        if self.records:
            self.records[-1].tags.update(tags)

    # ------------------------------------------------------------------ summaries
    def max_device_peak(self) -> int:
        return max((v for r in self.records for v in r.device_peak_bytes.values()), default=0)

    def by_name(self, layer: int | None = None) -> dict[str, dict[str, Any]]:
        """Totals per phase name (optionally of one layer): count, seconds, peaks."""
        out: dict[str, dict[str, Any]] = defaultdict(lambda: {"count": 0, "seconds": 0.0,
                                                              "device_peak_bytes": 0, "host_peak_bytes": 0,
                                                              "host_anon_peak_bytes": 0})
        for r in self.records:
            if layer is not None and r.layer != layer:
                continue
            s = out[r.name]
            s["count"] += 1
            s["seconds"] += r.seconds
            s["device_peak_bytes"] = max(s["device_peak_bytes"], max(r.device_peak_bytes.values(), default=0))
            s["host_peak_bytes"] = max(s["host_peak_bytes"], r.host_peak_bytes)
            s["host_anon_peak_bytes"] = max(s["host_anon_peak_bytes"], r.host_anon_peak_bytes)
        return dict(out)
