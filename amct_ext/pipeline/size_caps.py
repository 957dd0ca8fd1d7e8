"""Caps on absurd sizes, checked by the job plan before any work (issue 36.3).

A size that only a typo produces used to be accepted and fail much later: an ``hclip`` grid of
10^12 asked torch for 4 TB after the float and RTN perplexities; ``--calib-samples 10^9`` drew
random offsets for minutes before anything was said (casebook i36t-7). Each cap here names the
flag or recipe field, the value, the bound and why.

- :data:`MAX_GRID` candidates in a search grid (``clip.grid``, ``hclip.grid``, ``awq.n_grid``):
  every candidate is scored on every weight group, so time and memory grow linearly with it, and
  1024 factors between ``grid_min`` and 1 already step by less than 0.001 -- finer than any
  clip factor that a 2- to 8-bit grid can tell apart.
- The calibration stream (:func:`check_calibration_memory`): the hidden states of every
  calibration window are kept on the host between layers, twice (a layer's inputs and its
  outputs), so ``2 x samples x seq_len x values per token x bytes`` must fit the host's memory.
"""
from __future__ import annotations

import os
from typing import Any, Iterable

from ..errors import ConfigError

MAX_GRID = 1024
#: recipe fields that are a number of search candidates
GRID_FIELDS = ("grid", "n_grid")


def host_memory_bytes() -> int | None:
    """Physical memory of this host (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def check_recipe_sizes(algorithms: Iterable[Any], source: str) -> None:
    """Refuse a search grid above :data:`MAX_GRID` (one line naming ``algo.field`` and ``source``)."""
    from ..algorithms.recipe import RecipeError

    for algo in algorithms:
        for name in GRID_FIELDS:
            value = getattr(algo, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_GRID:
                raise RecipeError(f"{algo.name}.{name}={value} ({source}): at most {MAX_GRID} candidates (each is "
                                  "scored on every weight group, so time and memory grow with it; 1024 factors "
                                  "already step by < 0.001)")


def check_calibration_memory(samples: int, seq_len: int, values_per_token: int, dtype_bytes: int,
                             host_bytes: int | None = None) -> None:
    """Refuse ``--calib-samples x --seq-len`` whose hidden states between layers (two copies:
    a layer's inputs and outputs) exceed the host's physical memory."""
    host = host_memory_bytes() if host_bytes is None else host_bytes
    if host is None or values_per_token <= 0:
        return
    need = 2 * samples * seq_len * values_per_token * dtype_bytes
    if need > host:
        raise ConfigError(f"--calib-samples {samples} x --seq-len {seq_len}: the calibration hidden states kept "
                          f"between layers take about {_size(need)} (2 x {samples} x {seq_len} tokens x "
                          f"{values_per_token} values x {dtype_bytes} bytes), more than this host's "
                          f"{_size(host)} of memory; lower --calib-samples or --seq-len")


def _size(n: int) -> str:
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


__all__ = ["MAX_GRID", "check_recipe_sizes", "check_calibration_memory", "host_memory_bytes"]
