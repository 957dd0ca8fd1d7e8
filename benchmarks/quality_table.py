#!/usr/bin/env python
"""Quantization-quality table of the trained tiny DeepSeek-V4 (assets/tiny-v4).

For every built-in scheme and quant target it runs the main job on `--model tiny-trained` through
the library (``plan_job`` + ``run_job``, what `tools/run_ptq.py` runs; float, direct RTN and
blockwise PTQ perplexity on the same Wikitext-2 test windows) and writes

    OUT/quality.json       every report, keyed "scheme|targets"
    OUT/quality.md         the table (markdown), pasted into benchmarks/RESULTS.md
    OUT/unit_errors.png    per-unit reconstruction error (before / after PTQ) of one scheme
    OUT/unit_errors.md     the same numbers as a table

    python benchmarks/quality_table.py --out benchmarks/quality [--eval-windows 64] [--seq-len 256]

Finished runs are kept in OUT/runs/<scheme>_<targets>/report.json and skipped on a rerun.

Algorithm table (``--algorithms``): rows = every built-in weight scheme, columns = algorithms
(RTN, clip, GPTQ, smoothing + GPTQ, AWQ, learnable rounding, the scheme's default recipe, and
any ``--extra`` combination ``algo[,algo...][@float|@quant]``), each with PPL and PTQ wall time:

    python benchmarks/quality_table.py --algorithms --out runs/quality_i13 [--schemes w3a16-g128,w8a8]

A column whose algorithms are not registered (not merged yet) is shown as "n/a". Writes
OUT/algorithms.json and OUT/algorithms.md; runs are kept in OUT/runs/<scheme>/<column>/.

Choosing defaults (``--split dev``): every cell is measured on the dev windows 64-127 of the test
split (``--eval-first-window 64``), disjoint from the reported windows 0-63; the reported figures
(``--split test``, the default, and benchmarks/quality_headlines.py) are never used for choosing.
``--candidates`` runs only each scheme's candidate recipes (DEV_CANDIDATES) and prints, per
scheme, the best one on dev against DEFAULT_RECIPES (amct_ext/algorithms/recipe.py):

    python benchmarks/quality_table.py --algorithms --split dev --candidates --out runs/quality_dev
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from amct_ext.io.io_utils import atomic_write, atomic_write_json  # noqa: E402

SCHEMES = ("w8a8", "w4a16-g128", "w4a8", "fp8", "mxfp8", "mxfp4")
TARGETS = ("attn-linear", "moe", "attn-linear,moe")
CACHE_RUNS = (("kv8", "attn-cache"), ("kv8-fp8", "attn-cache"), ("w8a8", "attn-linear,attn-cache,moe"))
PLOT_RUN = ("w4a16-g128", "attn-linear,moe")


def run_job_once(run_dir: Path, what: str, **options) -> dict:
    """The job of ``options`` through the library (``plan_job`` + ``run_job``) into ``run_dir``,
    unless its report.json is there already (a table run resumes); the report."""
    import models.deepseek_v4  # noqa: F401  (registers the model names plan_job resolves)
    from amct_ext.errors import AmctError
    from amct_ext.pipeline.job_runner import run_job
    from amct_ext.pipeline.options import PtqOptions, plan_job

    report = run_dir / "report.json"
    if not report.is_file():
        try:
            run_job(plan_job(PtqOptions(output_dir=str(run_dir), **options)))
        except AmctError as e:   # one line, as the CLI's exit 2
            raise SystemExit(f"error: the job failed for {what}: {e}") from None
    return json.loads(report.read_text())


def run_one(scheme: str, targets: str, out: Path, args) -> dict:
    run_dir = out / "runs" / f"{scheme}_{targets.replace(',', '+')}"
    return run_job_once(run_dir, f"{scheme} / {targets}", model="tiny-trained", scheme=scheme, quant_target=targets,
                        eval_windows=args.eval_windows, seq_len=args.seq_len, calib_samples=args.calib_samples,
                        epochs=args.epochs, quiet=True)


WEIGHT_SCHEMES = ("w8a8", "w4a8", "w4a16-g128", "w3a16-g128", "w4a16", "w2a16-g64", "fp8", "mxfp8", "mxfp4")
#: (column title, algo string or None for RTN or "default", propagate or None for the default)
ALGO_COLUMNS = (("RTN", None, None), ("clip", "clip", "float"), ("GPTQ", "gptq", "float"),
                ("smoothing+GPTQ", "smoothquant,gptq", "float"), ("AWQ", "awq", "float"),
                ("learnable rounding", "autoround", "float"), ("default", "default", None))


#: per scheme, the recipes (algo, propagate) worth comparing on the dev split: the winners and
#: runners-up of the full table (RESULTS §3), cheapest first; None = RTN
DEV_CANDIDATES: dict[str, list[tuple[str | None, str | None]]] = {
    "w8a8": [(None, None), ("clip", "float"), ("gptq", "float"), ("awq", "float")],
    "w4a8": [("clip", "float"), ("clip,gptq", "float"), ("clip,gptq", "quant")],
    "w4a16-g128": [("clip", "float"), ("clip,gptq", "float"), ("clip,gptq", "quant"), ("autoround", "float")],
    "w3a16-g128": [("clip", "float"), ("clip,gptq", "quant"), ("autoround", "float")],
    "w4a16": [("clip", "float"), ("clip,gptq", "float"), ("clip,gptq", "quant")],
    "w2a16-g64": [("clip", "float"), ("clip,gptq", "quant")],
    "fp8": [(None, None), ("clip", "float"), ("clip,gptq", "quant")],
    "mxfp8": [(None, None), ("gptq", "float"), ("clip,gptq", "quant")],
    "mxfp4": [(None, None), ("gptq", "float"), ("gptq", "quant"), ("clip,gptq", "quant")],
}
#: the choice rule: the cheapest candidate (first in DEV_CANDIDATES order) within this relative
#: distance of the best dev PPL. 0.1 % is what another calibration seed moves a cell (RESULTS §3,
#: benchmarks/perturbation_check.py): a smaller dev gain does not pay for a slower recipe.
DEV_NOISE = 1e-3
SPLITS = {"test": 0, "dev": 64}   # first window of each 64-window range (the dev range is disjoint)


def _registered(algo: str) -> bool:
    from amct_ext.algorithms.recipe import RecipeError, parse_algo

    try:
        parse_algo(algo)
        return True
    except RecipeError:
        return False


def _column_tag(algo: str | None, prop: str | None) -> str:
    if algo is None:
        return "rtn-eval"
    return algo.replace(",", "+").replace(":", "-").replace("=", "_") + (f"@{prop}" if prop else "")


def run_algo(scheme: str, algo: str | None, prop: str | None, out: Path, args, with_float: bool = False) -> dict:
    run_dir = out / "runs" / scheme / _column_tag(algo, prop)
    options = dict(model="tiny-trained", scheme=scheme, quant_target=args.targets, eval_windows=args.eval_windows,
                   seq_len=args.seq_len, calib_samples=args.calib_samples, quiet=True,
                   eval_first_window=SPLITS[args.split])
    if algo is None:
        options.update(no_ptq=True, ppl_modes="float,rtn" if with_float else "rtn")
    else:
        options.update(algo=algo, ppl_modes="")
        if prop:
            options["propagate"] = prop
    return run_job_once(run_dir, f"{scheme} / {algo}", **options)


def algorithms_main(args) -> int:
    from amct_ext.algorithms.recipe import default_recipe

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    schemes = [s for s in args.schemes.split(",") if s] if args.schemes else list(WEIGHT_SCHEMES)
    if args.split == "dev" and args.eval_windows > SPLITS["dev"]:
        raise SystemExit(f"error: --eval-windows {args.eval_windows}: the dev split starts at window "
                         f"{SPLITS['dev']}, so more would overlap the reported windows")
    if args.candidates:
        return candidates_main(args, out, schemes)
    columns = list(ALGO_COLUMNS)
    for extra in args.extra:
        algo, _, prop = extra.partition("@")
        columns.append((extra, algo, prop or "float"))
    table: dict[str, dict[str, dict]] = {}
    float_ppl = None
    jpath = out / "algorithms.json"
    if jpath.is_file():
        saved = json.loads(jpath.read_text())
        table, float_ppl = saved.get("table", {}), saved.get("float_ppl")
    for si, scheme in enumerate(schemes):
        row = table.setdefault(scheme, {})
        done: dict[tuple, dict] = {}
        for title, algo, prop in columns:
            t0 = time.time()
            if algo == "default":
                algo, prop = default_recipe(scheme)
                cell_note = f"{algo}@{prop}"
                if algo == "rtn":          # the default is plain RTN: the RTN column's run
                    algo, prop = None, None
            else:
                cell_note = None
            if algo is not None and not _registered(algo):
                row[title] = {"ppl": None, "wall_s": None, "note": "n/a (algorithm not registered)"}
                continue
            key = (algo, prop)
            if args.render_only and key not in done and not (
                    out / "runs" / scheme / _column_tag(algo, prop) / "report.json").is_file():
                row[title] = {"ppl": None, "wall_s": None, "note": "not run"}
                continue
            rep = done.get(key) or run_algo(scheme, algo, prop, out, args, with_float=float_ppl is None)
            done[key] = rep
            if algo is None:
                float_ppl = rep["ppl"]["float"] if rep["ppl"].get("float") else float_ppl
                ppl, wall = rep["ppl"]["rtn"], 0.0
            else:
                ppl, wall = rep["ppl"]["quant"], rep.get("ptq_wall_s")
            row[title] = {"ppl": ppl, "wall_s": wall, "note": cell_note}
            print(f"{scheme:12s} {title:20s} ppl {ppl:.3f}  ({time.time() - t0:.0f} s)", flush=True)
            atomic_write_json({"float_ppl": float_ppl, "table": table, "columns": [c[0] for c in columns]}, jpath)
    titles = [c[0] for c in columns]
    lines = [f"Float perplexity **{float_ppl:.3f}** (assets/tiny-v4; {args.eval_windows} x {args.seq_len} tokens of "
             f"wiki.test.raw; calibration {args.calib_samples} x {args.seq_len} of valid.txt; targets {args.targets}). "
             "Each cell: PPL (change vs float) / PTQ wall time.", "",
             "| scheme | " + " | ".join(titles) + " |", "| --- |" + " ---: |" * len(titles)]
    for scheme in schemes:
        cells = []
        for t in titles:
            c = table.get(scheme, {}).get(t)
            if not c or c["ppl"] is None:
                cells.append((c or {}).get("note") or "-")
                continue
            txt = f"{c['ppl']:.2f} ({100 * (c['ppl'] / float_ppl - 1):+.2f} %) / {c['wall_s']:.0f} s"
            if c.get("note"):
                txt += f" [{c['note']}]"
            cells.append(txt)
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    atomic_write(out / "algorithms.md", lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n"))
    print("\n".join(lines))
    return 0


def candidates_main(args, out: Path, schemes: list[str]) -> int:
    """Each scheme's DEV_CANDIDATES on the chosen split; the best per scheme against the default."""
    from amct_ext.algorithms.recipe import default_recipe

    jpath = out / "candidates.json"
    table = json.loads(jpath.read_text()) if jpath.is_file() else {}
    for scheme in schemes:
        row = table.setdefault(scheme, {})
        for algo, prop in DEV_CANDIDATES.get(scheme, []):
            tag = "rtn" if algo is None else f"{algo}@{prop}"
            if tag in row or args.render_only:
                continue
            if algo is not None and not _registered(algo):
                continue
            t0 = time.time()
            rep = run_algo(scheme, algo, prop, out, args)
            ppl = rep["ppl"]["rtn"] if algo is None else rep["ppl"]["quant"]
            row[tag] = {"ppl": ppl, "wall_s": rep.get("ptq_wall_s"), "eval": rep["eval"]}
            print(f"{scheme:12s} {tag:24s} {args.split} ppl {ppl:.4f}  ({time.time() - t0:.0f} s)", flush=True)
            atomic_write_json(table, jpath)
    lines = [f"Candidates on the {args.split} split (windows {SPLITS[args.split]}-"
             f"{SPLITS[args.split] + args.eval_windows - 1} x {args.seq_len}; calibration {args.calib_samples} "
             f"x {args.seq_len} of valid.txt; targets {args.targets}).", "",
             f"Chosen: the cheapest candidate within {100 * DEV_NOISE:g} % of the best dev PPL.", "",
             "| scheme | candidates (PPL) | chosen | current default | change |", "| --- | --- | --- | --- | --- |"]
    for scheme in schemes:
        row = table.get(scheme, {})
        if not row:
            continue
        order = ["rtn" if a is None else f"{a}@{p}" for a, p in DEV_CANDIDATES.get(scheme, [])]
        best_ppl = min(c["ppl"] for c in row.values())
        best = next(t for t in order + sorted(row) if t in row and row[t]["ppl"] <= best_ppl * (1 + DEV_NOISE))
        algo, prop = default_recipe(scheme)
        cur = "rtn" if algo == "rtn" else f"{algo}@{prop}"
        cells = ", ".join(f"{t} {c['ppl']:.3f}" for t, c in sorted(row.items(), key=lambda kv: kv[1]["ppl"]))
        lines.append(f"| {scheme} | {cells} | {best} | {cur} | {'-' if best == cur else 'yes'} |")
    atomic_write(out / "candidates.md", lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n"))
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algorithms", action="store_true", help="the algorithm table (see the module doc)")
    ap.add_argument("--schemes", default=None, help="algorithm table: comma list of schemes (default: all weight schemes)")
    ap.add_argument("--extra", nargs="*", default=[], help="algorithm table: extra columns algo[,algo][@propagate]")
    ap.add_argument("--targets", default="attn-linear,moe", help="algorithm table: quant targets")
    ap.add_argument("--render-only", action="store_true", help="algorithm table: no new runs (missing cells 'not run')")
    ap.add_argument("--split", choices=tuple(SPLITS), default="test",
                    help="algorithm table: evaluate on the reported windows (test, 0-63) or the disjoint dev "
                         "windows (dev, 64-127) that defaults are chosen on")
    ap.add_argument("--candidates", action="store_true",
                    help="algorithm table: only each scheme's DEV_CANDIDATES; prints the best per scheme")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "quality"))
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=2)
    args = ap.parse_args(argv)
    if args.algorithms:
        return algorithms_main(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    runs = [(s, t) for s in SCHEMES for t in TARGETS] + list(CACHE_RUNS)
    reports: dict[str, dict] = {}
    start = time.time()
    for scheme, targets in runs:
        t0 = time.time()
        reports[f"{scheme}|{targets}"] = run_one(scheme, targets, out, args)
        ppl = reports[f"{scheme}|{targets}"]["ppl"]
        print(f"{scheme:12s} {targets:28s} float {ppl['float']:.3f}  rtn {ppl['rtn']:.3f}  "
              f"ptq {ppl['quant']:.3f}  ({time.time() - t0:.0f} s)", flush=True)
    atomic_write_json(reports, out / "quality.json")

    any_report = next(iter(reports.values()))
    float_ppl = any_report["ppl"]["float"]
    lines = [
        f"Float perplexity: **{float_ppl:.3f}** ({any_report['eval']['windows']} windows x "
        f"{any_report['eval']['seq_len']} tokens of wiki.test.raw; calibration "
        f"{args.calib_samples} x {args.seq_len} tokens of valid.txt, {args.epochs} epochs).",
        "",
        "| scheme | targets | RTN PPL | RTN vs float | PTQ PPL | PTQ vs float | PTQ vs RTN |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (scheme, targets) in runs:
        p = reports[f"{scheme}|{targets}"]["ppl"]
        rel = lambda a, b: f"{100 * (a / b - 1):+.2f} %"  # noqa: E731
        lines.append(f"| {scheme} | {targets} | {p['rtn']:.3f} | {rel(p['rtn'], p['float'])} | {p['quant']:.3f} | "
                     f"{rel(p['quant'], p['float'])} | {rel(p['quant'], p['rtn'])} |")
    atomic_write(out / "quality.md", lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n"))

    units = reports[f"{PLOT_RUN[0]}|{PLOT_RUN[1]}"]["units"]
    rows = ["| unit | kind | MSE before (RTN) | MSE after (PTQ) | change |", "| --- | --- | ---: | ---: | ---: |"]
    for u in sorted(units, key=lambda u: -u["loss_before"]):
        change = 100 * (u["loss_after"] / u["loss_before"] - 1) if u["loss_before"] else 0.0
        rows.append(f"| {u['name']} | {u['kind']} | {u['loss_before']:.3e} | {u['loss_after']:.3e} | {change:+.1f} % |")
    atomic_write(out / "unit_errors.md", lambda tmp: Path(tmp).write_text("\n".join(rows) + "\n"))
    plot_units(units, out / "unit_errors.png", f"{PLOT_RUN[0]} on {PLOT_RUN[1]}: per-unit reconstruction MSE")
    print(f"done in {time.time() - start:.0f} s; wrote {out}/quality.md, unit_errors.md, unit_errors.png")
    return 0


def plot_units(units: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [u["name"].replace("layers.", "L").replace(".ffn.experts.", ".e").replace(".ffn.shared_experts", ".shared")
             for u in units]
    before = [u["loss_before"] for u in units]
    after = [u["loss_after"] for u in units]
    fig, ax = plt.subplots(figsize=(max(8, len(units) * 0.28), 4.5))
    x = range(len(units))
    ax.bar([i - 0.2 for i in x], before, width=0.4, label="RTN (before)")
    ax.bar([i + 0.2 for i in x], after, width=0.4, label="PTQ (after)")
    ax.set_yscale("log")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=90, fontsize=7)
    ax.set_ylabel("unit output MSE vs float")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
