"""Host memory of a bounded capture, the V4 call pattern on the CPU (issue 24.1).

A layer's capture hooks every unit once per forward: the attention, the shared expert and every
routed expert each get one call per calibration batch, interleaved. This replays that pattern
into a ``capture.CaptureStore`` with a budget and measures, per write-buffer setting:

- the store's accounting (``peak_in_memory``: kept + waiting to be written) and everything the
  process meter counts (``capture.CALL_METER``) through the capture and one read-back pass;
- the process's anonymous resident memory (``RssAnon``) sampled after every call, above the
  value before the capture: the operating system's view of the same thing (each run in a fresh
  process: memory a finished run freed stays in the allocator and would hide the next run's);
- the seconds of the capture (spill writes) and of one read-back pass over every unit.

``--buffer-mb 0`` emulates the old store (a 256 MiB buffer per unit, flushed only when a unit
reaches it: the units of a V4-Flash layer, ~100 MB each at 128 x 2048, never did).

    PYTHONPATH=. python benchmarks/bench_capture_memory.py --units 64 --windows 16 --call-kb 512 \
        --budget-mb 64 --buffer-mb 0 16 --repeats 2 --json benchmarks/cpu/capture_memory.json
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from amct_ext.pipeline.capture import CALL_METER, CaptureStore, UnitCall
from amct_ext.pipeline.phases import rss_anon_bytes

MB = 2 ** 20


def one_run(units: int, windows: int, call_bytes: int, budget: int, buffer: int | None, work: Path) -> dict:
    gc.collect()
    base = rss_anon_bytes()
    CALL_METER.reset_peak()
    live0 = CALL_METER.live
    # buffer None: the old behaviour (a buffer per unit that no unit fills)
    store = CaptureStore(budget, work, chunk_bytes=buffer if buffer is not None else 2 ** 62)
    sinks = [store.sink(f"u{u}") for u in range(units)]
    rows = call_bytes // (2 * 2 * 1024)          # bf16 input and output of width 1024
    rss_peak = 0
    t0 = time.perf_counter()
    for w in range(windows):
        for u, s in enumerate(sinks):
            x = torch.full((rows, 1024), float(w + u), dtype=torch.bfloat16)
            s.add(UnitCall((x,), {}, x * 2))
            rss_peak = max(rss_peak, rss_anon_bytes() - base)
    results = [s.result() for s in sinks]
    t_capture = time.perf_counter() - t0
    t1 = time.perf_counter()
    checksum = 0.0
    for r in results:                              # one read-back pass, unit by unit
        for c in r:
            checksum += float(c.output[0, 0])
        rss_peak = max(rss_peak, rss_anon_bytes() - base)
    t_read = time.perf_counter() - t1
    out = {"buffer_mb": None if buffer is None else buffer / MB, "store_peak_mb": store.peak_in_memory / MB,
           "meter_peak_mb": (CALL_METER.peak - live0) / MB, "rss_anon_peak_mb": rss_peak / MB,
           "spilled_mb": store.spilled_bytes / MB, "capture_s": t_capture, "read_s": t_read,
           "files": sum(1 for p in work.rglob("*") if p.is_file()), "checksum": checksum}
    for s in sinks:
        s.discard()
    store.cleanup()
    del results, sinks
    gc.collect()
    return out


def _child(a) -> int:
    work = Path(tempfile.mkdtemp(prefix="amct-capmem-"))
    try:
        buffer = None if a.child_buffer_mb == 0 else int(a.child_buffer_mb * MB)
        r = one_run(a.units, a.windows, a.call_kb * 1024, int(a.budget_mb * MB), buffer, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("RESULT " + json.dumps(r))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--units", type=int, default=64)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--call-kb", type=int, default=512, help="bytes of one call (input + output)")
    ap.add_argument("--budget-mb", type=float, default=128)
    ap.add_argument("--buffer-mb", type=float, nargs="+", default=[0, 32], help="0: the old per-unit buffer")
    ap.add_argument("--repeats", type=int, default=3, help="after one warm-up run")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child-buffer-mb", type=float, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child_buffer_mb is not None:
        return _child(a)
    total = a.units * a.windows * a.call_kb * 1024
    print(f"{a.units} units x {a.windows} windows x {a.call_kb} KiB = {total / MB:.0f} MiB of calls, "
          f"budget {a.budget_mb:g} MiB")
    report = {"units": a.units, "windows": a.windows, "call_kb": a.call_kb, "budget_mb": a.budget_mb,
              "total_mb": total / MB, "torch": torch.__version__, "runs": {}}
    base = [sys.executable, __file__, "--units", str(a.units), "--windows", str(a.windows),
            "--call-kb", str(a.call_kb), "--budget-mb", str(a.budget_mb)]
    for buf in a.buffer_mb:
        runs = []
        for k in range(a.repeats + 1):
            done = subprocess.run(base + ["--child-buffer-mb", str(buf)], capture_output=True, text=True, check=True)
            r = json.loads(next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))[7:])
            if k:                                   # the first run warms up (file cache, imports)
                runs.append(r)
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "buffer_mb"}
        label = "old (per-unit buffer)" if buf == 0 else f"shared buffer {buf:g} MiB"
        print(f"{label:>24}: store peak {med['store_peak_mb']:.0f} MiB, meter peak {med['meter_peak_mb']:.0f} MiB "
              f"(bound: budget + buffer = {a.budget_mb + buf:.0f} MiB), RssAnon above start "
              f"{med['rss_anon_peak_mb']:.0f} MiB, capture {med['capture_s']:.2f} s, read-back {med['read_s']:.2f} s, "
              f"{med['files']:.0f} files (median of {len(runs)})")
        report["runs"][label] = {"median": med, "runs": runs}
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
