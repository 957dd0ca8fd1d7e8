#!/usr/bin/env python
"""The real-size cost of `--recipe best` (hclip,blockround@quant) on one V4-Flash layer, from the
H200 runs of h200_recipe_speed.sh (the dated log benchmarks/history/RESULTS-2026-12-04.md §0.14).

A full 200-step run does not fit one device call (600 s), so the runs are cut short with
``blockround:iters=N`` and the 200-step layer is projected from what they measured:

    step s      = (t_end - 2 * t_start) / N
                  t_start: the log's "start MSE (t s)" (one full evaluation of the 128 samples),
                  t_end: the log's "step N / N (t s)" (N steps and the closing evaluation, which
                  costs as much as the first)
    layer@200 s = layer s - t_end + 2 * t_start + 200 * step s       (the run's own other phases)
    V4-Flash    = 43 x layer@200 + the run's once-only work (outside its layers, without the float
                  predecessor layers): every layer costed like this ratio-4 one, an upper bound

    python benchmarks/scripts/blockround_cost.py [--check-results]

Input: benchmarks/gpu/h200_2026-12-02f/lease*/ (each call's result folder, as the script wrote it).
``--check-results``: exit 1 unless the log's §0.14 carries exactly the rendered table.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "benchmarks" / "gpu" / "h200_2026-12-02f"
#: the section that quotes this table is dated (superseded by RESULTS.md §2's block-rounding table)
LOG = REPO / "benchmarks" / "history" / "RESULTS-2026-12-04.md"
FULL_ITERS = 200                 # blockround's default
FLASH_LAYERS = 43
GIB = 2 ** 30
DEVICE_BOUND_GIB = 64e9 / GIB    # issue 24: device peak <= 64 GB (Ascend 910B)
LAYER = "2"
BEGIN, END = "<!-- blockround-cost:begin -->", "<!-- blockround-cost:end -->"

_START = re.compile(r"blockround layer \d+: \d+ leaves, \d+ samples, start MSE [0-9.e+-]+ \(([0-9.]+) s\)")
_END = re.compile(r"blockround layer \d+: step (\d+) / (\d+), MSE [0-9.e+-]+ \(([0-9.]+) s\)")


def run_record(json_path: Path) -> dict:
    """One run's figures (a bench_ptq JSON beside its log and its `.what` line)."""
    tag = json_path.name.split(".")[0]                       # ours_alt-1
    what = (json_path.parent / f"{tag}.what").read_text().strip()
    log = json_path.with_suffix(".log").read_text()
    starts, ends = _START.findall(log), _END.findall(log)
    if len(starts) != 1 or len(ends) != 1 or ends[0][0] != ends[0][1]:
        raise SystemExit(f"error: {json_path.with_suffix('.log')}: expected one start and one final blockround line")
    t_start, (steps, _, t_end) = float(starts[0]), ends[0]
    steps, t_end = int(steps), float(t_end)
    p = json.loads(json_path.read_text())["ptq"]
    rec = p["per_layer"][LAYER]
    ph = rec["phases"]
    step_s = (t_end - 2 * t_start) / steps
    layer200 = rec["seconds"] - t_end + 2 * t_start + FULL_ITERS * step_s
    once = p["outside_layers_s"] - p["float_predecessors"]["seconds"]
    return {"lease": json_path.parent.name, "run": tag.replace("ours_", ""), "what": what,
            "scheme": what.split()[0], "iters": steps,
            "capture_s": ph["capture"]["seconds"], "hclip_s": ph["solve:recipe"]["seconds"],
            "block_s": ph["solve:block"]["seconds"], "eval_s": t_start, "step_s": step_s,
            "block_peak_gib": ph["solve:block"]["device_peak_bytes"] / GIB,
            "anon_gib": rec["host_anon_peak_bytes"] / GIB, "layer_s": rec["seconds"],
            "layer200_s": layer200, "flash200_h": (FLASH_LAYERS * layer200 + once) / 3600}


def records(root: Path = RUNS) -> list[dict]:
    out = [run_record(j) for j in sorted(root.glob("lease*/ours_alt-*.r1.json"))]
    if not out:
        raise SystemExit(f"error: {root}: no ours_alt-*.r1.json")
    return out


def render(recs: list[dict]) -> str:
    rows = ["| lease | run | scheme | steps run | capture s | hclip s | block stage s | one evaluation s | "
            "s a step | device peak GiB (block stage) | host anon GiB | layer s | layer at 200 steps s | "
            "V4-Flash at 200 steps h |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in recs:
        rows.append(f"| {r['lease']} | {r['run']} | {r['scheme']} | {r['iters']} | {r['capture_s']:.1f} | "
                    f"{r['hclip_s']:.1f} | {r['block_s']:.1f} | {r['eval_s']:.1f} | {r['step_s']:.2f} | "
                    f"{r['block_peak_gib']:.1f} | {r['anon_gib']:.1f} | {r['layer_s']:.1f} | "
                    f"{r['layer200_s']:.0f} | {r['flash200_h']:.1f} |")
    steps = [r["step_s"] for r in recs]
    l200 = [r["layer200_s"] for r in recs]
    fl = [r["flash200_h"] for r in recs]
    rows.append("")
    rows.append(f"Median over the {len(recs)} runs: {statistics.median(steps):.2f} s a step "
                f"[{min(steps):.2f}-{max(steps):.2f}], a layer at {FULL_ITERS} steps "
                f"{statistics.median(l200) / 60:.1f} min [{min(l200) / 60:.1f}-{max(l200) / 60:.1f}], "
                f"V4-Flash {statistics.median(fl):.1f} h [{min(fl):.1f}-{max(fl):.1f}]. "
                f"Device bound {DEVICE_BOUND_GIB:.1f} GiB (64 GB).")
    return BEGIN + "\n" + "\n".join(rows) + "\n" + END


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check-results", action="store_true", help="exit 1 unless the dated log carries this table")
    args = ap.parse_args(argv)
    block = render(records())
    if args.check_results:
        text = LOG.read_text(encoding="utf-8")
        i, j = text.find(BEGIN), text.find(END)
        if i < 0 or text[i:j + len(END)] != block:
            print(f"error: {LOG.relative_to(REPO)}: the blockround-cost block differs from the runs", file=sys.stderr)
            return 1
        return 0
    print(block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
