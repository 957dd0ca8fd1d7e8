"""One progress display for the run and the export that stays readable in a log file.

On a terminal the loops' own bars show (tqdm, ``RunConfig.progress``). When stdout or stderr is
not a terminal (a log file, a pipe, a CI job) the bars are off -- their carriage returns and
cursor moves are escape codes in a file -- and :class:`PtqProgress` prints one plain line per
finished layer instead (the export prints one per written group, ``exporter.py``)::

    ptq: layer 3 done (4/43 layers, 1032/11094 units, 412.3 s, ~1h08m left)
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence


def interactive() -> bool:
    """True when both output streams are terminals (bars are then readable)."""
    return all(getattr(s, "isatty", lambda: False)() for s in (sys.stdout, sys.stderr))


def _eta(seconds: float) -> str:
    m = int(seconds // 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{int(seconds % 60):02d}s"


class PtqProgress:
    """Counts finished units per layer (``on_unit_done`` of the PTQ loop). ``done_before``:
    {layer: units already finished by an earlier run}. ``on_layer_done(i)`` runs when layer i's
    last unit is saved (tools/run_ptq.py records the layer's completion there)."""

    def __init__(self, units_per_layer: Mapping[int, int], enabled: bool = True,
                 done_before: Mapping[int, int] | None = None,
                 on_layer_done: Callable[[int], None] | None = None, out=None):
        self.total = dict(units_per_layer)
        self.done = {i: int((done_before or {}).get(i, 0)) for i in self.total}
        self.enabled = enabled
        self.on_layer_done = on_layer_done
        self.out = out
        self.t0 = time.perf_counter()
        self.units_now = 0

    def layers_done(self) -> int:
        return sum(self.done[i] >= n for i, n in self.total.items())

    def unit_done(self, result) -> None:
        i = int(result.layer)
        if i not in self.total:
            return
        self.done[i] += 1
        self.units_now += 1
        if self.done[i] != self.total[i]:
            return
        if self.on_layer_done is not None:
            self.on_layer_done(i)
        if self.enabled:
            units = sum(self.done.values())
            all_units = sum(self.total.values())
            el = time.perf_counter() - self.t0
            left = ""
            if self.units_now and units < all_units:
                left = f", ~{_eta(el / self.units_now * (all_units - units))} left"
            print(f"ptq: layer {i} done ({self.layers_done()}/{len(self.total)} layers, {units}/{all_units} units, "
                  f"{el:.1f} s{left})", file=self.out or sys.stdout, flush=True)


def done_units(params_dir: Path, stems: Mapping[int, Sequence[str]]) -> dict[int, int]:
    """{layer: units whose parameter file exists} (one directory listing)."""
    have = {p.stem for p in Path(params_dir).glob("layer_*.pt")} if Path(params_dir).is_dir() else set()
    return {i: sum(s in have for s in st) for i, st in stems.items()}
