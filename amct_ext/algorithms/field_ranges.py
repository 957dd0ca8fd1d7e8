"""Range checks every recipe value passes before the plan accepts it (issue 36).

The type check (``recipe._type_ok``) lets any float through, NaN and inf included, and any int.
A NaN learning rate then failed hours later inside the solver with a message about something
else; 10^12 iterations ran until killed. Every algorithm's numeric fields are settings of a
non-negative, finite quantity (a count, a rate, a share, a size), so one rule serves them all,
with an upper bound per field name where a larger value can only be a mistake. The algorithm's
own ``check()`` runs after this and keeps its finer rules (e.g. grid_min in (0, 1]).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

#: the largest sensible value of a field, by name (any algorithm); others: DEFAULT_MAX
FIELD_MAX: dict[str, float] = {
    "lr": 10.0,             # signed-gradient / Adam steps on offsets in [-0.5, 0.5] and clip factors
    "percdamp": 10.0,       # damping as a multiple of the Hessian diagonal's mean
    "alpha": 1.0,
    "grid_min": 1.0,
    "clip_min": 1.0,
    "iters": 10 ** 6,
    "epochs": 10 ** 5,
    "chunk_gb": 2.0 ** 20,
    "hold_gb": 2.0 ** 20,
}
#: any other int (grid points, chunk sizes, block sizes, sweeps): far above every real use
DEFAULT_MAX = 10 ** 7


def check_field_ranges(algo: Any, where: str, finite_only: bool = False) -> str | None:
    """The first numeric field of ``algo`` (a dataclass) that is NaN, infinite, negative or
    absurdly large, as one line naming it; None when all are sensible. ``finite_only``: NaN and
    inf only (checked before the algorithm's own ``check()``, whose comparisons NaN slips through
    or trips with a message naming no file)."""
    for f in dataclasses.fields(algo):
        v = getattr(algo, f.name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        label = f"{where}: {algo.name}.{f.name} = {v!r}"
        if isinstance(v, float) and not math.isfinite(v):
            return f"{label}: must be a finite number"
        if finite_only:
            continue
        if v < 0:
            return f"{label}: must be >= 0"
        top = FIELD_MAX.get(f.name, DEFAULT_MAX)
        if v > top:
            return f"{label}: larger than {top:g}, which no run needs (a typo?)"
    return None


__all__ = ["check_field_ranges", "FIELD_MAX", "DEFAULT_MAX"]
