#!/usr/bin/env python
"""Medians and spread of the recorded H200 layer runs (benchmarks/gpu/*.json): the headline figures
of README.md and RESULTS.md §0 come from here, not from the best run.

    python benchmarks/summarize_runs.py            # table + medians (ratio 4 + indexer, B = 1, S = 4096)
    python benchmarks/summarize_runs.py --json     # the same as JSON

Runs: every recorded run of the current float-layer code (grouped expert GEMM, norm / rope kernels,
graph replay), newest first. The w8a8 medians use only the runs WITH the on-device deferred checks
(casebook S14); the two runs before them timed a w8a8 layer that synced once per quantizer.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

GPU = Path(__file__).resolve().parent / "gpu"
# (file stem, label, has the deferred checks)
RUNS = [
    ("layer_final", "final", True),
    ("layer_review", "after the review commit", True),
    ("layer_run9_checks", "run 9", True),
    ("layer_run8_b1b4", "run 8, deferred checks v1", True),
    ("layer_run7_deferred", "run 7, deferred checks v1", True),
    ("layer_run6", "run 6, before the deferred checks", False),
    ("layer_run6_w8a8_graph", "run 6 (w8a8 graph), before the deferred checks", False),
]
VARIANTS = {"ours": "eager", "ours-graphed": "replay", "hf:grouped_mm": "transformers",
            "ours-w8a8": "w8a8_eager", "ours-w8a8-graphed": "w8a8_replay"}


def load_runs(layer: int = 4, batch: int = 1) -> list[dict]:
    rows = []
    for stem, label, deferred in RUNS:
        data = json.loads((GPU / f"{stem}.json").read_text())
        row = {"file": stem, "label": label, "deferred_checks": deferred}
        for entry in data["layers"]:
            if entry.get("layer") != layer:
                continue
            for run in entry["runs"]:
                if run["batch"] == batch and run["variant"] in VARIANTS:
                    row[VARIANTS[run["variant"]]] = run["median_ms"]
                    row["floor"] = run["floors"]["floor_ms"]
        rows.append(row)
    return rows


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(rows: list[dict]) -> dict:
    out: dict = {}
    for key in ("floor", "eager", "replay", "transformers"):
        out[key] = spread([r[key] for r in rows if key in r])
    with_checks = [r for r in rows if r["deferred_checks"]]
    for key in ("w8a8_eager", "w8a8_replay"):
        out[key] = spread([r[key] for r in with_checks if key in r])
    out["eager_vs_floor"] = spread([r["eager"] / r["floor"] for r in rows])
    out["replay_vs_floor"] = spread([r["replay"] / r["floor"] for r in rows])
    out["w8a8_over_float_eager"] = spread([r["w8a8_eager"] / r["eager"] for r in with_checks])
    out["w8a8_over_float_replay"] = spread([r["w8a8_replay"] / r["replay"] for r in with_checks])
    # speed-ups: the median transformers time over our median times (transformers ran in 3 runs)
    out["transformers_over_eager"] = out["transformers"]["median"] / out["eager"]["median"]
    out["transformers_over_replay"] = out["transformers"]["median"] / out["replay"]["median"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = load_runs()
    s = summarize(rows)
    if args.json:
        print(json.dumps({"runs": rows, "summary": s}, indent=1))
        return 0
    cols = ["floor", "eager", "replay", "transformers", "w8a8_eager", "w8a8_replay"]
    print("| run (file) | " + " | ".join(cols) + " |")
    for r in rows:
        print(f"| {r['label']} (`{r['file']}`) | " + " | ".join(f"{r[c]:.3f}" if c in r else "-" for c in cols) + " |")
    for k, v in s.items():
        print(k, v if not isinstance(v, dict) else
              f"median {v['median']:.3f} (min {v['min']:.3f}, max {v['max']:.3f}, n {v['n']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
