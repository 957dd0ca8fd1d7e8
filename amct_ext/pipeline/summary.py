"""The end-of-run summary a person reads: one row per (layer, unit kind), not one per unit
(V4-Flash has 11,094 units), the perplexities with their deltas, and a per-layer error plot.

Per group: the units, how many were resumed, the summed RTN loss and the summed loss kept
(``loss vs RTN`` = their ratio - 1: negative is better than RTN), how many the guard kept at RTN
(``stats['reverted_to_rtn']``, or no learned improvement), and the worst unit (the highest
kept / RTN ratio). The per-unit detail stays in report.json.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence


@dataclass
class GroupSummary:
    layer: int
    kind: str
    units: int = 0
    resumed: int = 0
    kept_rtn: int = 0
    loss_rtn: float = 0.0
    loss_kept: float = 0.0
    measured: int = 0                 # units with both losses (others ran no calls)
    seconds: float = 0.0
    worst: str | None = None
    worst_ratio: float | None = None
    kept_source: int = 0              # units whose stored codes the run kept (algorithms/source_grid.py)

    @property
    def vs_rtn(self) -> float | None:
        """Summed kept loss over summed RTN loss, minus one (None: nothing measured)."""
        if not self.measured or self.loss_rtn <= 0:
            return None
        return self.loss_kept / self.loss_rtn - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "vs_rtn": self.vs_rtn}


def _get(u: Any, key: str, default: Any = None) -> Any:
    return u.get(key, default) if isinstance(u, dict) else getattr(u, key, default)


def _kept_rtn(u: Any) -> bool:
    stats = _get(u, "stats") or {}
    if isinstance(stats, dict) and stats.get("reverted_to_rtn"):
        return True
    before, after = _get(u, "loss_before"), _get(u, "loss_after")
    return before is not None and after is not None and after >= before


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def summarize_units(units: Iterable[Any]) -> list[GroupSummary]:
    """Group ``units`` (UnitResult objects or their report.json dicts) by (layer, kind), in layer order."""
    groups: dict[tuple[int, str], GroupSummary] = {}
    for u in units:
        layer, kind = int(_get(u, "layer")), str(_get(u, "kind"))
        g = groups.setdefault((layer, kind), GroupSummary(layer, kind))
        g.units += 1
        g.resumed += bool(_get(u, "resumed", False))
        g.seconds += float(_get(u, "seconds", 0.0) or 0.0)
        g.kept_rtn += _kept_rtn(u)
        stats = _get(u, "stats") or {}
        g.kept_source += bool(isinstance(stats, dict) and stats.get("kept_source_codes"))
        before, after = _get(u, "loss_before"), _get(u, "loss_after")
        if _finite(before) and _finite(after):
            g.measured += 1
            g.loss_rtn += before
            g.loss_kept += after
            if before > 0:
                ratio = after / before
                if g.worst_ratio is None or ratio > g.worst_ratio:
                    g.worst, g.worst_ratio = str(_get(u, "name")), ratio
    return [groups[k] for k in sorted(groups)]


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:+.2f}%"


def format_summary(groups: Sequence[GroupSummary], ppl: dict[str, float | None] | None = None) -> str:
    """The table (one row per layer and unit kind) and the PPL line(s)."""
    head = (f"{'layer':>5} {'kind':<14} {'units':>6} {'kept RTN':>8} {'loss vs RTN':>11} {'s':>8}  worst unit (loss/RTN)")
    rows = [head, "-" * len(head)]
    for g in groups:
        worst = "-" if g.worst is None else f"{g.worst} ({g.worst_ratio:.3f})"
        res = f" ({g.resumed} resumed)" if g.resumed else ""
        rows.append(f"{g.layer:>5} {g.kind:<14} {g.units:>6} {g.kept_rtn:>8} {_pct(g.vs_rtn):>11} {g.seconds:>8.1f}  "
                    f"{worst}{res}")
    total = sum(g.units for g in groups)
    rtn = sum(g.loss_rtn for g in groups)
    kept = sum(g.loss_kept for g in groups)
    rows.append(f"total: {total} units in {len(groups)} groups, {sum(g.kept_rtn for g in groups)} kept at RTN, "
                f"loss vs RTN {_pct(kept / rtn - 1 if rtn > 0 else None)}")
    n_source = sum(g.kept_source for g in groups)
    if n_source:
        kinds = sorted({g.kind for g in groups if g.kept_source})
        rows.append(f"source codes: {n_source} of {total} units ({', '.join(kinds)}) keep the checkpoint's stored "
                    f"codes bit for bit (their weights are already on the target grid; no algorithm ran on them)")
    if ppl:
        rows.append(format_ppl(ppl))
    return "\n".join(rows)


def format_ppl(ppl: dict[str, float | None]) -> str:
    """``ppl float 274.2 | rtn 276.1 (+0.69%) | ptq 275.0 (+0.28%, -0.40% vs rtn)``."""
    f, r, q = ppl.get("float"), ppl.get("rtn"), ppl.get("quant")

    def rel(a, b):
        return None if a is None or b is None or not b else a / b - 1

    parts = []
    if f is not None:
        parts.append(f"float {f:.4f}")
    if r is not None:
        parts.append(f"rtn {r:.4f}" + (f" ({_pct(rel(r, f))})" if f is not None else ""))
    if q is not None:
        d = [x for x in ((_pct(rel(q, f)) if f is not None else None),
                         (f"{_pct(rel(q, r))} vs rtn" if r is not None else None)) if x]
        parts.append(f"ptq {q:.4f}" + (f" ({', '.join(d)})" if d else ""))
    return "ppl " + (" | ".join(parts) if parts else "-")


def write_error_plot(groups: Sequence[GroupSummary], path: Path) -> Path | None:
    """Per layer, each unit kind's loss vs RTN (a line per kind) as a PNG at ``path``; None when
    matplotlib is not installed (an optional dependency) or nothing was measured."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    series: dict[str, list[tuple[int, float]]] = {}
    for g in groups:
        if g.vs_rtn is not None:
            series.setdefault(g.kind, []).append((g.layer, 100 * g.vs_rtn))
    if not series:
        return None
    from ..io.io_utils import atomic_write

    fig, ax = plt.subplots(figsize=(8, 4))
    for kind, pts in sorted(series.items()):
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=kind)
    ax.axhline(0.0, color="grey", linewidth=0.8)
    ax.set_xlabel("layer")
    ax.set_ylabel("unit output loss vs RTN (%)")
    ax.set_title("PTQ error per layer (below 0: better than RTN)")
    ax.legend()
    fig.tight_layout()
    atomic_write(Path(path), lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
    return Path(path)


__all__ = ["GroupSummary", "summarize_units", "format_summary", "format_ppl", "write_error_plot"]
