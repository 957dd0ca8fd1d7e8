#!/usr/bin/env python
"""The quality table from the release-format trained tiny (assets/tiny-v4-release, issue 35):
what users get when they quantize the weights the release ships, the release float as reference.

Each cell is one `tools/run_ptq.py --model tiny-trained-release` command on the whole test split
(1487 windows x 256 tokens, `--ppl-modes ''`: the PTQ model's PPL only, one thread); the float
reference is `--no-ptq --eval-ppl --ppl-modes float`. `--run NAME[,NAME]` runs cells (skipping
those already in the JSON unless `--force`) and stores each one's command, PPL, wall time, CPU
class and the units that kept the release's codes in benchmarks/results/release-testbed.json
(written after every cell: an interrupted queue resumes). `--table` prints the markdown table
benchmarks/results/release-testbed.md carries; `--check-md FILE` verifies that every number of
that table is the JSON's (tests/test_release_testbed.py runs it); `--check NAME` reruns a cell
and compares it with the JSON (TOLERANCE relative, on the CPU class it was recorded on).

    python benchmarks/release_testbed.py --run float,w8a8-default,w8a8-rtn
    python benchmarks/release_testbed.py --table
    python benchmarks/release_testbed.py --check-md benchmarks/results/release-testbed.md
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS_JSON = REPO / "benchmarks" / "results" / "release-testbed.json"
WINDOWS = 1487                       # the whole test split at 256 tokens
TOLERANCE = 1e-4
SCHEMES = ("w8a8", "w4a8", "w4a16-g128", "w4a16", "w3a16-g128", "mxfp4", "fp8")
RECIPES = {"default": [], "rtn": ["--algo", "rtn"], "best": ["--recipe", "best"]}


def cell_args(name: str) -> list[str]:
    """run_ptq arguments of cell ``name``: 'float' or '<scheme>-<recipe>'."""
    base = ["--model", "tiny-trained-release", "--eval-windows", str(WINDOWS), "--threads", "1"]
    if name == "float":
        return [*base, "--no-ptq", "--eval-ppl", "--ppl-modes", "float"]
    scheme, _, recipe = name.rpartition("-")
    if scheme not in SCHEMES or recipe not in RECIPES:
        raise SystemExit(f"error: unknown cell {name!r} (float or <scheme>-<default|rtn|best>, "
                         f"schemes {', '.join(SCHEMES)})")
    return [*base, "--scheme", scheme, "--ppl-modes", "", *RECIPES[recipe]]


def run_cell(name: str, keep: Path | None = None) -> dict:
    """Run cell ``name`` in a temporary folder, or in ``keep/<name>`` (kept: e.g. re-evaluated on
    the dev windows afterwards by a resume with --eval-first-window 64)."""
    from amct_ext.runtime.host import cpu_class

    args = cell_args(name)
    with tempfile.TemporaryDirectory(prefix="release_testbed_") as tmp:
        if keep is not None:
            tmp = str(keep / name)
        cmd = [sys.executable, str(REPO / "tools" / "run_ptq.py"), *args, "--output-dir", tmp]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"error: cell {name} failed (rc {proc.returncode}): {proc.stderr.strip()[-500:]}")
        report = json.loads((Path(tmp) / "report.json").read_text())
    ppl = report["ppl"]["float" if name == "float" else "quant"]
    return {"command": "python tools/run_ptq.py " + " ".join(a if a else "''" for a in args) + " --output-dir OUT",
            "ppl": ppl, "wall_s": round(wall, 1), "cpu": cpu_class(),
            "recipe": report.get("recipe"),
            "units_keeping_source_codes": report.get("units_keeping_source_codes"),
            "eval": report.get("eval")}


def load() -> dict:
    return json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.is_file() else {}


def save(data: dict) -> None:
    from amct_ext.io.io_utils import atomic_write_json

    RESULTS_JSON.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(data, RESULTS_JSON)


DEV_JSON = REPO / "benchmarks" / "results" / "release-testbed-dev.json"
DEV_VIEW = (64, 64)                  # (windows, first window): the dev split, windows 64-127


def add_dev(label: str, folder: Path) -> dict:
    """The dev-split PPL of one candidate recipe, read from a finished run folder of the release
    tiny evaluated on windows 64-127 (a resume of a run with ``--eval-windows 64
    --eval-first-window 64``); stored under ``<scheme>:<label>``."""
    from amct_ext.algorithms.recipe import recipe_label
    from amct_ext.runtime.host import cpu_class

    rep_path = Path(folder) / "report.json"
    if not rep_path.is_file():
        raise SystemExit(f"error: --add-dev {label}={folder}: no report.json there")
    rep = json.loads(rep_path.read_text())
    view = (rep["eval"]["windows"], rep["eval"]["first_window"])
    if rep["model"] != "tiny-trained-release" or view != DEV_VIEW:
        raise SystemExit(f"error: --add-dev {label}={folder}: model {rep['model']}, windows {view}; "
                         f"wanted tiny-trained-release on {DEV_VIEW}")
    algo = recipe_label(rep["recipe"]["algorithms"]) + "@" + rep["recipe"]["propagate"]
    return {"scheme": rep["scheme"], "label": label, "recipe": algo, "ppl": rep["ppl"]["quant"],
            "seed": rep["calibration"]["seed"], "cpu": cpu_class()}


def dev_table(dev: dict) -> str:
    """Per scheme, the candidates on the release's dev split; the lowest is the release's choice."""
    rows = ["| scheme | candidate | recipe | dev PPL (windows 64-127) | chosen |", "| --- | --- | --- | ---: | --- |"]
    schemes = sorted({c["scheme"] for c in dev.values()}, key=lambda s: SCHEMES.index(s) if s in SCHEMES else 99)
    for s in schemes:
        cands = sorted((c for c in dev.values() if c["scheme"] == s), key=lambda c: c["ppl"])
        for k, c in enumerate(cands):
            rows.append(f"| {s} | {c['label']} | `{c['recipe']}` | {c['ppl']:.3f} | {'yes' if k == 0 else ''} |")
    return "\n".join(rows)


def table(data: dict) -> str:
    """One row per scheme, one column per recipe: PPL (vs the release float)."""
    ref = data["float"]["ppl"]
    rows = [f"release float (dequantized FP8 / FP4): **{ref:.3f}**", "",
            "| scheme | " + " | ".join(RECIPES) + " |", "| --- |" + " ---: |" * len(RECIPES)]
    for s in SCHEMES:
        cells = []
        for r in RECIPES:
            c = data.get(f"{s}-{r}")
            cells.append("-" if c is None else f"{c['ppl']:.3f} ({100 * (c['ppl'] / ref - 1):+.2f} %)")
        if any(c != "-" for c in cells):
            rows.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


NUMBER = re.compile(r"(\d+\.\d{3}) \(([+-]\d+\.\d{2}) %\)")


def check_md(path: Path, data: dict) -> list[str]:
    """Every 'PPL (delta %)' of the table in ``path`` equals the JSON's (rounded as printed)."""
    text = path.read_text()
    want = table(data)
    problems = []
    if want not in text:
        problems.append(f"{path}: its table is not the one `--table` prints from {RESULTS_JSON.name}")
    if DEV_JSON.is_file() and dev_table(json.loads(DEV_JSON.read_text())) not in text:
        problems.append(f"{path}: its dev-split table is not the one `--table` prints from {DEV_JSON.name}")
    quoted = set(NUMBER.findall(text))
    known = {(f"{c['ppl']:.3f}", f"{100 * (c['ppl'] / data['float']['ppl'] - 1):+.2f}")
             for k, c in data.items() if k != "float"}
    problems += [f"{path}: {p} ({d} %) is no cell of the JSON" for p, d in sorted(quoted - known)]
    return problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", default=None, help="comma list of cells to run (float, <scheme>-<default|rtn|best>)")
    ap.add_argument("--force", action="store_true", help="rerun cells already in the JSON")
    ap.add_argument("--keep", type=Path, default=None, metavar="DIR",
                    help="run each cell in DIR/<cell> and keep the folder (default: a temporary folder)")
    ap.add_argument("--table", action="store_true")
    ap.add_argument("--check", default=None, help="comma list of cells to rerun and compare")
    ap.add_argument("--check-md", default=None, help="markdown file whose table must be the JSON's")
    ap.add_argument("--add-dev", default=None, metavar="LABEL=FOLDER[,LABEL=FOLDER]",
                    help="record candidates' dev-split PPLs from run folders (release-testbed-dev.json)")
    args = ap.parse_args(argv)
    data = load()
    if args.run:
        for name in args.run.split(","):
            cell_args(name)                     # every name checked before hours of work
        for name in args.run.split(","):
            if name in data and not args.force:
                continue
            cell = run_cell(name, args.keep)
            data = load()              # cells other queues finished meanwhile are kept
            data[name] = cell
            save(data)
            print(f"{name}: {data[name]['ppl']:.4f} ({data[name]['wall_s']:.0f} s)", flush=True)
    if args.check:
        from amct_ext.runtime.host import cpu_class

        bad = 0
        for name in args.check.split(","):
            got, rec = run_cell(name)["ppl"], data[name]
            same_cpu = rec["cpu"] == cpu_class()
            ok = abs(got / rec["ppl"] - 1) <= TOLERANCE or not same_cpu
            bad += not ok
            print(f"{name}: {got:.4f} vs recorded {rec['ppl']:.4f} ({rec['cpu']}) {'ok' if ok else 'DIFFERS'}")
        if bad:
            return 1
    if args.add_dev:
        from amct_ext.io.io_utils import atomic_write_json

        dev = json.loads(DEV_JSON.read_text()) if DEV_JSON.is_file() else {}
        for item in args.add_dev.split(","):
            label, sep, folder = item.partition("=")
            if not sep:
                raise SystemExit(f"error: --add-dev {item!r}: expected LABEL=FOLDER")
            c = add_dev(label, Path(folder))
            dev[f"{c['scheme']}:{label}"] = c
        atomic_write_json(dev, DEV_JSON)
    if args.table:
        print(table(data))
        if DEV_JSON.is_file():
            print("\n" + dev_table(json.loads(DEV_JSON.read_text())))
    if args.check_md:
        problems = check_md(Path(args.check_md), data)
        for p in problems:
            print(p)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
