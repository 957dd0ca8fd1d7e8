#!/usr/bin/env python
"""w8a8's default from the release (issue 35.3): the candidates measured on the release-format tiny
(`tiny-trained-release`) and on the bf16 one (`tiny-trained`), whole test split (1487 windows x 256)
at calibration seeds 0-2 and the release's dev windows 64-127 (seed 0), one thread, one AMD CPU.

    python tools/run_ptq.py --model M --scheme w8a8 --algo A --eval-windows 1487 --threads 1 \\
        --ppl-modes '' [--seed S] [--eval-windows 64 --eval-first-window 64] --output-dir RUNS/NAME
    python benchmarks/scripts/release_w8a8_choice.py --collect RUNS   # writes the JSON record
    python benchmarks/scripts/release_w8a8_choice.py                  # prints the table

RUNS/NAME: ``<rel|bf>-<candidate>[-s1|-s2]`` (whole split) and ``dev-<rel|bf>-<candidate>`` (dev).
The rule (amct_ext/algorithms/recipe.py): the best mean over seeds on the whole split among the
recipes that export (smoothing the experts' w3 pair leaves a per-channel SwiGLU limit no engine
reads) and fit the real-size time bound.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from blockround_default_quality import run_view  # noqa: E402  (one reading of a run folder for every record)

RECORD = REPO / "benchmarks" / "results" / "release-testbed-w8a8.json"
#: candidate -> (--algo, exportable, capture + solve of a V4-Flash layer at w8a8 in s (None: not
#: measured), its run in benchmarks/gpu). Smoothing the experts' w3 pair leaves a per-channel SwiGLU
#: limit no engine reads: not exportable.
CANDIDATES = {
    "rtn": ("rtn", True, 31.0, "h200_2026-12-02/res def-w8a8"),
    "gptq": ("gptq:sequential=false", True, 16.8, "h200_2026-12-02e/res gptq-nseq-128"),
    "hclip": ("hclip", True, None, ""),
    "smoothx": ("smoothquant:pairs=attn_norm+q_norm+wo_a", True, None, ""),
    "sqg": ("smoothquant:pairs=attn_norm+q_norm+wo_a,gptq:sequential=false", True, None, ""),
    "smooth": ("smoothquant", False, None, ""),
}
#: the real-size bound of a default without a block stage (issue 24)
BOUND_S = 60.0
MODELS = {"rel": "tiny-trained-release", "bf": "tiny-trained"}
#: run-folder names of the first sweep (before this script named them)
ALIASES = {"dev-rel-rtn": "dev-tiny-trained-release-rtn",
           "dev-rel-gptq": "dev-tiny-trained-release-gptq_sequential_false",
           "dev-rel-smooth": "dev-tiny-trained-release-smoothquant",
           "dev-rel-smoothx": "dev-tiny-trained-release-smoothquant_pairs_attn_norm_q_norm_wo_a",
           "dev-bf-rtn": "dev-tiny-trained-rtn", "dev-bf-gptq": "dev-tiny-trained-gptq_sequential_false",
           "dev-bf-smooth": "dev-tiny-trained-smoothquant",
           "dev-bf-smoothx": "dev-tiny-trained-smoothquant_pairs_attn_norm_q_norm_wo_a"}


def collect(runs: Path) -> dict:
    import platform

    cells: dict = {}
    for m in MODELS:
        for c in CANDIDATES:
            for key, names in (("whole", [f"{m}-w8a8-{c}", f"{m}-w8a8-{c}-s1", f"{m}-w8a8-{c}-s2"]),
                               ("dev", [f"dev-{m}-{c}"])):
                got = {}
                for n in names:
                    v = run_view(runs / ALIASES.get(n, n))
                    if v is not None:
                        got[str(v["seed"])] = v
                if got:
                    cells.setdefault(m, {}).setdefault(c, {})[key] = got
    return {"what": __doc__.split("\n\n")[0], "cpu_class": f"{platform.processor() or 'x86_64'}",
            "candidates": {c: {"algo": a, "exportable": e, "real_size_s": t, "real_size_run": r}
                           for c, (a, e, t, r) in CANDIDATES.items()}, "cells": cells}


def means(rec: dict, model: str) -> dict[str, float]:
    """Whole-split mean over the seeds measured (RTN draws no calibration: one run)."""
    return {c: statistics.mean(v["ppl"] for v in cell["whole"].values())
            for c, cell in rec["cells"][model].items() if "whole" in cell}


def eligible(rec: dict, c: str) -> bool:
    """Exports, and its real-size capture + solve is measured within the bound."""
    spec = rec["candidates"][c]
    return spec["exportable"] and spec["real_size_s"] is not None and spec["real_size_s"] <= BOUND_S


def choice(rec: dict, model: str) -> str:
    """The rule: among eligible candidates measured at seeds 0-2 (RTN: one run), the lowest mean."""
    ok = {c: p for c, p in means(rec, model).items() if eligible(rec, c)
          and (c == "rtn" or len(rec["cells"][model][c]["whole"]) == 3)}
    return min(ok, key=ok.get)


def table(rec: dict) -> str:
    lines = ["| candidate (`--algo`) | exports | V4-Flash layer s | release: whole split, seeds 0 / 1 / 2 (mean) | release: dev 64-127 | bf16: whole split (mean) |",
             "| --- | --- | ---: | --- | ---: | --- |"]
    for c, spec in rec["candidates"].items():
        def whole(m):
            cell = rec["cells"].get(m, {}).get(c, {}).get("whole")
            if not cell:
                return "-"
            v = [cell[s]["ppl"] for s in sorted(cell)]
            return " / ".join(f"{x:.3f}" for x in v) + (f" ({statistics.mean(v):.3f})" if len(v) > 1 else "")
        dev = rec["cells"].get("rel", {}).get(c, {}).get("dev")
        secs = "-" if spec["real_size_s"] is None else f"{spec['real_size_s']:.1f}"
        lines.append(f"| `{spec['algo']}` | {'yes' if spec['exportable'] else 'no'} | {secs} | {whole('rel')} | "
                     f"{format(dev['0']['ppl'], '.3f') if dev else '-'} | {whole('bf')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--collect", type=Path, metavar="RUNS")
    a = ap.parse_args(argv)
    if a.collect:
        rec = collect(a.collect)
        tmp = RECORD.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec, indent=1) + "\n")
        tmp.replace(RECORD)
    rec = json.loads(RECORD.read_text())
    print(table(rec))
    print(f"\nchoice from the release: {choice(rec, 'rel')}; from bf16: {choice(rec, 'bf')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
