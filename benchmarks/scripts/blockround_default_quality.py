#!/usr/bin/env python
"""Block-wise rounding as the weight-only default: its quality on the trained tiny V4 against Intel's
auto-round 0.16.1 at its defaults, on the whole Wikitext-2 test split (1487 windows of 256 tokens),
the mean over calibration seeds 0, 1 and 2 on both sides, one CPU class (issue 34, item 2).

    python benchmarks/scripts/blockround_default_quality.py --collect RUNS_DIR   # writes the JSON record
    python benchmarks/scripts/blockround_default_quality.py                       # prints the tables
    python benchmarks/scripts/blockround_default_quality.py --check FILE.md       # exit 1 unless FILE has them

RUNS_DIR holds one folder per run of ours (``<recipe>-<scheme>-s<seed>``: ``tools/run_ptq.py --model
tiny-trained --scheme S --algo A --propagate quant --eval-windows 1487 --ppl-modes '' --threads 1 --seed
SEED``, with copies ``-r64`` / ``-d64`` re-evaluated on windows 0-63 / 64-127; the resume solves
nothing, so every view measures one quantized model) and one JSON per auto-round run
(``ar-<scheme>-s<seed>.json``: ``benchmarks/peer_autoround.py --eval-windows 1487 --seed SEED``). Seed
0 of auto-round at w4a16-g128 / w3a16-g128 / w4a16 is the rerun of benchmarks/quality/
peer_autoround_rerun.json (same versions, same CPU class) when RUNS_DIR has no JSON of its own.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECORD = REPO / "benchmarks" / "quality" / "blockround_default.json"
RERUN = REPO / "benchmarks" / "quality" / "peer_autoround_rerun.json"
SCHEMES = ("w4a16-g128", "w3a16-g128", "w4a16", "w2a16-g64")
SEEDS = (0, 1, 2)
#: the recipes measured: run-folder prefix -> (--algo, --propagate)
RECIPES = {
    "ours100": ("hclip,blockround:keep_best=false:offset_dtype=float16:iters=100", "quant"),
    "best200": ("hclip,blockround:keep_best=false", "quant"),
}
VIEWS = {"all": (1487, 0), "reported": (64, 0), "dev": (64, 64)}
#: turn-3 main's defaults on windows 0-63, the limits of issue 34 item 2
TURN3_LIMITS = {"w3a16-g128": 279.2, "w2a16-g64": 326.2, "w4a16-g128": 276.09, "w4a16": 275.4}
BEGIN, END = "<!-- blockround-default-quality:begin -->", "<!-- blockround-default-quality:end -->"


def run_view(folder: Path) -> dict | None:
    """What a quality record keeps of one run folder's report.json (None: no finished run there);
    also read by w4a8_default_quality.py."""
    f = folder / "report.json"
    if not f.is_file():
        return None
    rep = json.loads(f.read_text())
    return {"ppl": rep["ppl"]["quant"], "model": rep["model"], "scheme": rep["scheme"], "windows": rep["eval"]["windows"],
            "first_window": rep["eval"]["first_window"], "seed": rep["calibration"]["seed"],
            "recipe": rep["recipe"]["algorithms"], "propagate": rep["recipe"]["propagate"],
            "ptq_wall_s": rep["ptq_wall_s"]}


def collect_before(before: Path) -> dict:
    """Seed 0, whole split, of the defaults these replaced: ``before/old-<scheme>`` (run on a checkout
    of main ba169f2 with the same command, no --algo: that commit's default recipe)."""
    from amct_ext.algorithms.recipe import recipe_label

    out = {}
    for s in SCHEMES:
        rec = run_view(before / f"old-{s}")
        if rec is None:
            continue
        assert (rec["windows"], rec["first_window"], rec["seed"]) == (1487, 0, 0), (s, rec)
        out[s] = {"ppl": rec["ppl"], "recipe": recipe_label(rec["recipe"]) + "@" + rec["propagate"],
                  "source": "main ba169f2's default"}
    return out


BEFORE_BEGIN, BEFORE_END = "<!-- blockround-before-after:begin -->", "<!-- blockround-before-after:end -->"


def render_before_after(rec: dict) -> str:
    lines = [BEFORE_BEGIN, "| scheme | before (recipe) | after | change |", "| --- | ---: | ---: | ---: |"]
    for s, b in rec.get("before", {}).items():
        after = rec["cells"][s]["ours100"]["0"]["all"]["ppl"]
        lines.append(f"| {s} | {b['ppl']:.4f} (`{b['recipe']}`) | {after:.4f} | {100 * (after / b['ppl'] - 1):+.2f} % |")
    lines.append(BEFORE_END)
    return "\n".join(lines)


def collect(runs: Path) -> dict:
    from amct_ext.runtime.host import cpu_class
    rerun = json.loads(RERUN.read_text())
    cells: dict = {s: {"ar": {}, **{r: {} for r in RECIPES}} for s in SCHEMES}
    for s in SCHEMES:
        for seed in SEEDS:
            for r in RECIPES:
                views = {}
                for view, suffix in (("all", ""), ("reported", "-r64"), ("dev", "-d64")):
                    rec = run_view(runs / f"{r}-{s}-s{seed}{suffix}")
                    if rec is not None:
                        assert (rec["windows"], rec["first_window"]) == VIEWS[view], (r, s, seed, view, rec)
                        assert rec["seed"] == seed and rec["propagate"] == RECIPES[r][1], (r, s, seed, rec)
                        views[view] = rec
                if views:
                    cells[s][r][str(seed)] = views
            ar = runs / f"ar-{s}-s{seed}.json"
            d = json.loads(ar.read_text()) if ar.is_file() else {"cells": {}}
            if s in d["cells"]:                  # (a run still going has written no cell yet)
                c = d["cells"][s]
                cells[s]["ar"][str(seed)] = {"ppl": c["ppl"], "source": ar.name, "versions": d["versions"],
                                             "calib_windows_sha256": d["protocol"]["calib_windows_sha256"],
                                             "eval_windows_sha256": d["protocol"]["eval_windows_sha256"],
                                             "quantized_modules": c["quantized_modules"]["total"]}
            elif seed == 0 and s in rerun["full_split"]["peer"]:
                fs = rerun["full_split"]
                cells[s]["ar"]["0"] = {"ppl": fs["peer"][s]["ppl"], "source": RERUN.name,
                                       "versions": rerun["versions"],
                                       "calib_windows_sha256": fs["calib_windows_sha256"],
                                       "eval_windows_sha256": fs["eval_windows_sha256"],
                                       "quantized_modules": fs["peer"][s]["quantized_modules"]["total"]}
    return {"what": __doc__.split("\n\n")[0], "machine": {"cpu": platform.processor() or platform.machine(),
                                                          "cpu_class": cpu_class(), "threads": 1},
            "recipes": {r: {"algo": a, "propagate": p} for r, (a, p) in RECIPES.items()},
            "turn3_limits_windows_0_63": TURN3_LIMITS, "cells": cells}


def seed_values(d: dict, view: str | None = None) -> list[float | None]:
    """Per seed: the PPL of an auto-round cell (``view`` None) or of one view of ours; None if missing."""
    out = []
    for seed in SEEDS:
        cell = d.get(str(seed), {})
        cell = cell if view is None else cell.get(view, {})
        out.append(cell.get("ppl"))
    return out


def mean(d: dict, view: str | None = None) -> float | None:
    """Mean PPL over the three seeds, or None while a seed is missing."""
    vals = seed_values(d, view)
    return None if None in vals else statistics.fmean(vals)


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _pct(a: float | None, b: float | None) -> str:
    return "" if a is None or b is None else f" ({100 * (a / b - 1):+.2f} %)"


def render(rec: dict) -> str:
    lines = [BEGIN,
             "| scheme | auto-round, all, seeds 0 / 1 / 2 | auto-round, mean | default (`ours100`), all, seeds 0 / 1 / 2 "
             "| default, mean (vs auto-round) | `--recipe best` (`best200`), all, seeds 0 / 1 / 2 "
             "| best, mean (vs auto-round) | default, windows 0-63, seed 0 (limit) | default, dev 64-127, seed 0 |",
             "| --- | --- | ---: | --- | ---: | --- | ---: | ---: | ---: |"]
    for s, c in rec["cells"].items():
        ar, ours, best = c["ar"], c["ours100"], c["best200"]
        per = lambda d, view=None: " / ".join(_f(v) for v in seed_values(d, view))
        m_ar, m_ours = mean(ar), mean(ours, "all")
        m_best = mean(best, "all")
        r64 = ours.get("0", {}).get("reported", {}).get("ppl")
        d64 = ours.get("0", {}).get("dev", {}).get("ppl")
        lines.append(f"| {s} | {per(ar)} | {_f(m_ar)} | {per(ours, 'all')} | {_f(m_ours)}{_pct(m_ours, m_ar)} "
                     f"| {per(best, 'all')} | {_f(m_best)}{_pct(m_best, m_ar)} | {_f(r64)} ({TURN3_LIMITS[s]}) | {_f(d64)} |")
    lines.append(END)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--collect", type=Path, metavar="RUNS_DIR", help="build the JSON record from run folders")
    ap.add_argument("--check", type=Path, metavar="FILE", help="exit 1 unless FILE carries the rendered table")
    ap.add_argument("--before", type=Path, metavar="DIR", help="--collect: also the replaced defaults' runs (old-<scheme>)")
    args = ap.parse_args(argv)
    if args.collect:
        if not args.collect.is_dir():
            print(f"error: --collect: {args.collect} is not a folder", file=sys.stderr)
            return 2
        rec = collect(args.collect)
        if args.before:
            rec["before"] = collect_before(args.before)
        RECORD.write_text(json.dumps(rec, indent=1) + "\n")
        print(f"wrote {RECORD}")
    rec = json.loads(RECORD.read_text())
    tables = [render(rec)] + ([render_before_after(rec)] if rec.get("before") else [])
    table = "\n\n".join(tables)
    if args.check:
        text = args.check.read_text(encoding="utf-8")
        ok = all(t in text for t in tables)
        print("ok" if ok else f"{args.check}: the table differs from the rendered record")
        return 0 if ok else 1
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
