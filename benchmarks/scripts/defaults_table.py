#!/usr/bin/env python
"""One markdown table from bench_ptq JSONs (benchmarks/scripts/h200_defaults.sh): per run and
measured layer, capture, solve (and its split by unit kind), the layer's total, host RSS peak
(anonymous), device peak, the floors bench_ptq computes beside them (linear solve FLOPs / the
measured bf16 matmul rate, captured bytes moved / the measured host-to-device bandwidth) and the
V4-Flash projection. A run that ended without its JSON's per-layer record is listed as such.

    python benchmarks/scripts/defaults_table.py $OUT/def_*.json
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

G = 2 ** 30


def stopped(log: Path) -> str:
    """What a run stopped by its time limit (no per-layer record in its JSON) got through, from
    its log: the capture phase and the recipe's per-kind lines (``[solve] ...``)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return f"no result and no log ({log.name})"
    got = []
    for ln in lines:
        m = re.match(r"\[phase\] layer (\d+) (capture|solve:recipe): ([\d.]+) s.*?host RSS ([\d.]+) GiB \(anon ([\d.]+)\)(.*)", ln)
        if m:
            end = " (stopped here)" if "ended_by" in m.group(6) else ""
            got.append(f"{m.group(2)} {float(m.group(3)):.1f} s{end}, host RSS {m.group(4)} GiB (anon {m.group(5)})")
        m = re.match(r"\[solve\] (.*)", ln)
        if m:
            got.append(m.group(1))
    return "stopped by its time limit: " + ("; ".join(got) if got else "nothing logged")


def row(path: Path) -> str:
    tag = path.stem.split("def_", 1)[-1]
    try:
        r = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"| {tag} | unreadable JSON: {e} |"
    p = r.get("ptq")
    if not p:
        return f"| {tag} | {stopped(path.with_suffix('.log'))} |"
    cells = []
    for i, rec in p["per_layer"].items():
        ph = rec["phases"]
        cap = ph.get("capture", {}).get("seconds", 0.0)
        solve = sum(v["seconds"] for k, v in ph.items() if k.startswith("solve:"))
        kinds = ", ".join(f"{k} {v['seconds']:.1f}" for k, v in rec.get("unit_seconds_by_kind", {}).items())
        f = rec["floors"]
        cal = p["report"]["calibration"]
        cells.append(f"| {tag} | {i} | {cal['samples']} x {cal['seq_len']} | {cap:.1f} | {solve:.1f} ({kinds}) | "
                     f"{rec['seconds']:.1f} | {rec['host_peak_bytes'] / G:.1f} ({rec['host_anon_peak_bytes'] / G:.1f}) | "
                     f"{rec['device_peak_bytes'] / G:.1f} | {f['solve_flops_floor_s']:.2f} | {f['h2d_floor_s']:.2f} | "
                     f"{r['projection']['v4-flash']['total_min']:.1f} |")
    return "\n".join(cells)


def main(argv: list[str]) -> int:
    print("| run | layer | calibration | capture s | solve s (units by kind) | layer s | host RSS GiB (anon) | "
          "device peak GiB | FLOP floor s | h2d floor s | V4-Flash projected min |")
    print("| --- | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for a in argv:
        print(row(Path(a)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
