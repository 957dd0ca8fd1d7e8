"""The block stage's host-side cost at two commits, on this CPU: the tiny-trained default
(`hclip,blockround:...:iters=100`, one thread) run from two source trees in turn, A B A B ...,
the ratio taken pair by pair so a drift of the machine's speed cancels. On the tiny model the
step is Python and small kernels, so what a change adds per step (a loop, a check, a sync) shows
here even where no accelerator is lent; it says nothing of a GPU's kernels.

    python benchmarks/cpu_ab_block_stage.py --a /tmp/tip --b /tmp/old --pairs 3 --json OUT.json

Each tree is a checkout (``git worktree add DIR COMMIT``); each run is ``tools/run_ptq.py`` of
that tree with ``PYTHONPATH`` at it. The figure is the report's ``ptq_wall_s`` (calibration,
every layer's capture, solve and propagate; not the process's start-up), and the layers' unit
seconds summed (the block stage itself)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from amct_ext.runtime.host import cpu_class

DEFAULT_ALGO = "hclip,blockround:keep_best=false:offset_dtype=float16:iters=100"


def _commit(tree: Path) -> str:
    out = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return out.stdout.strip() or "?"


def _one_run(tree: Path, scheme: str, algo: str, out_dir: Path) -> dict:
    cmd = [sys.executable, str(tree / "tools" / "run_ptq.py"), "--model", "tiny-trained", "--scheme", scheme,
           "--algo", algo, "--propagate", "quant", "--no-eval-ppl", "--threads", "1", "--seed", "0",
           "--output-dir", str(out_dir)]
    env = dict(os.environ, PYTHONPATH=str(tree))
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"cpu_ab_block_stage: {tree}: run_ptq exited {done.returncode}:\n{done.stderr[-2000:]}")
    report = json.loads((out_dir / "report.json").read_text())
    return {"process_wall_s": round(wall, 3), "ptq_wall_s": round(report["ptq_wall_s"], 3),
            "unit_seconds": round(sum(u["seconds"] for u in report["summary"]), 3)}


def _spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4), "n": len(values)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", type=Path, required=True, help="source tree A (the change)")
    ap.add_argument("--b", type=Path, required=True, help="source tree B (the baseline)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--scheme", default="w4a16-g128")
    ap.add_argument("--algo", default=DEFAULT_ALGO)
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    for flag, tree in (("--a", args.a), ("--b", args.b)):
        if not (tree / "tools" / "run_ptq.py").is_file():
            ap.error(f"{flag} {tree}: not a source tree (no tools/run_ptq.py)")
    if args.pairs < 1:
        ap.error(f"--pairs {args.pairs}: at least 1")
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.pairs):
            for side, tree in (("a", args.a), ("b", args.b)):
                runs[side].append(_one_run(tree, args.scheme, args.algo, Path(tmp) / f"{side}{k}"))
                print(f"pair {k + 1} {side}: {runs[side][-1]}", flush=True)
    figures = {}
    for key in ("ptq_wall_s", "unit_seconds", "process_wall_s"):
        figures[key] = {"a": _spread([r[key] for r in runs["a"]]), "b": _spread([r[key] for r in runs["b"]]),
                        "ratio_a_over_b": _spread([ra[key] / rb[key] for ra, rb in zip(runs["a"], runs["b"])])}
    record = {"what": __doc__.split("\n\n")[0], "a": {"tree": str(args.a), "commit": _commit(args.a)},
              "b": {"tree": str(args.b), "commit": _commit(args.b)}, "scheme": args.scheme, "algo": args.algo,
              "cpu_class": cpu_class(), "date": time.strftime("%Y-%m-%d"),
              "runs": runs, "figures": figures}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp_json = args.json.with_suffix(".tmp")
    tmp_json.write_text(json.dumps(record, indent=1) + "\n")
    tmp_json.replace(args.json)
    for key, f in figures.items():
        print(f"{key}: A {f['a']['median']} B {f['b']['median']}  A/B {f['ratio_a_over_b']['median']} "
              f"({f['ratio_a_over_b']['min']} - {f['ratio_a_over_b']['max']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
