#!/usr/bin/env python
"""w4a8's default and `--recipe best`, block-wise rounding against the recipes they replaced: the whole
Wikitext-2 test split (1487 windows of 256 tokens) at calibration seeds 0, 1, 2 and the dev windows
64-127 (seed 0), on the bf16 trained tiny (`tiny-trained`) and on the release-format one
(`tiny-trained-release`, issue 35), one CPU class, one thread.

    python benchmarks/scripts/w4a8_default_quality.py --collect RUNS_DIR   # writes the JSON record
    python benchmarks/scripts/w4a8_default_quality.py                       # prints the table
    python benchmarks/scripts/w4a8_default_quality.py --check FILE.md       # exit 1 unless FILE has it

RUNS_DIR holds one folder per run: ``<prefix>-w4a8-s<seed>`` (``tools/run_ptq.py --model M --scheme
w4a8 --algo A --propagate quant --eval-windows 1487 --ppl-modes '' --threads 1 --seed SEED``) and
``...-s0-d64``, a copy of seed 0's folder resumed with ``--eval-windows 64 --eval-first-window 64``
(the resume solves nothing: one quantized model, two views). Prefixes: ``br`` / ``def`` (bf16 tiny,
block-wise rounding / the old default), ``best200`` / ``oldbest`` (today's and the old ``--recipe best``),
``relbr`` / ``reldef`` / ... (the release tiny).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from blockround_default_quality import run_view  # noqa: E402  (one reading of a run folder for both records)
RECORD = REPO / "benchmarks" / "quality" / "w4a8_default.json"
#: label -> (run-folder prefix for the bf16 tiny, for the release tiny, --algo, --propagate)
RECIPES = {
    "block-wise rounding (default since 2026-12-06)": ("br", "relbr", "hclip,blockround:keep_best=false:offset_dtype=float16:iters=100", "quant"),
    "statistics path (default until 2026-12-06)": ("def", "reldef", "hclip,gptq:sequential=false", "quant"),
    "block-wise rounding, 200 steps (`--recipe best` since 2026-12-06)": ("best200", "relbest200", "hclip,blockround:keep_best=false", "quant"),
    "clip,gptq (`--recipe best` until 2026-12-06)": ("oldbest", "reloldbest", "clip,gptq", "float"),
}
MODELS = {"tiny-trained": 0, "tiny-trained-release": 1}   # model -> index of its prefix above
SEEDS = (0, 1, 2)
BEGIN, END = "<!-- w4a8-default-quality:begin -->", "<!-- w4a8-default-quality:end -->"


def collect(runs: Path) -> dict:
    from amct_ext.algorithms.recipe import parse_algo
    from amct_ext.runtime.host import cpu_class

    cells: dict = {}
    for label, (*prefixes, algo, prop) in RECIPES.items():
        want = json.loads(json.dumps(parse_algo(algo).settings()))
        for model, k in MODELS.items():
            got = {}
            for seed in SEEDS:
                rec = run_view(runs / f"{prefixes[k]}-w4a8-s{seed}")
                if rec is not None:
                    got[str(seed)] = rec
            dev = run_view(runs / f"{prefixes[k]}-w4a8-s0-d64")
            if dev is not None:
                got["dev"] = dev
            for view, rec in got.items():      # every folder is the run its name says
                assert (rec["model"], rec["scheme"], rec["recipe"], rec["propagate"]) == (model, "w4a8", want, prop), (label, model, view)
                assert (rec["windows"], rec["first_window"]) == ((64, 64) if view == "dev" else (1487, 0)), (label, model, view)
                assert rec["seed"] == (0 if view == "dev" else int(view)), (label, model, view)
            cells.setdefault(model, {})[label] = got
    return {"what": __doc__.split("\n\n")[0], "cpu_class": cpu_class(), "threads": 1,
            "recipes": {label: {"algo": a, "propagate": p} for label, (_, _, a, p) in RECIPES.items()},
            "cells": cells}


def whole_mean(got: dict) -> float | None:
    vals = [got.get(str(s), {}).get("ppl") for s in SEEDS]
    return None if None in vals else statistics.fmean(vals)


def render(rec: dict) -> str:
    lines = [BEGIN, "| model | recipe | whole split, seeds 0 / 1 / 2 | mean | dev 64-127, seed 0 |",
             "| --- | --- | --- | ---: | ---: |"]
    for model, by_label in rec["cells"].items():
        for label, got in by_label.items():
            if not got:            # not run on this model
                continue
            per = " / ".join("-" if str(s) not in got else f"{got[str(s)]['ppl']:.4f}" for s in SEEDS)
            m = whole_mean(got)
            dev = got.get("dev", {}).get("ppl")
            lines.append(f"| `{model}` | {label} | {per} | {'-' if m is None else f'{m:.4f}'} | "
                         f"{'-' if dev is None else f'{dev:.4f}'} |")
    lines.append(END)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--collect", type=Path, metavar="RUNS_DIR")
    ap.add_argument("--check", type=Path, metavar="FILE")
    args = ap.parse_args(argv)
    if args.collect:
        if not args.collect.is_dir():
            print(f"error: --collect: {args.collect} is not a folder", file=sys.stderr)
            return 2
        from amct_ext.io.io_utils import atomic_write_json

        atomic_write_json(collect(args.collect), RECORD)
        print(f"wrote {RECORD}")
    table = render(json.loads(RECORD.read_text()))
    if args.check:
        ok = table in args.check.read_text(encoding="utf-8")
        print("ok" if ok else f"{args.check}: the table differs from the rendered record")
        return 0 if ok else 1
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
