#!/usr/bin/env python
"""Block-wise rounding at real size: one V4-Flash ratio-4 layer (and one V4-Pro layer) on one
H200, every run the main job's own path (bench_ptq -> run_ptq) at 128 x 2048 calibration, each
run whole (no projection). Renders the table of RESULTS' block-rounding speed section from the
run folders benchmarks/gpu/h200_2026-12-04_blockround/call*/ (benchmarks/scripts/h200_block_rounding.sh).

    python benchmarks/scripts/block_rounding_speed.py [--check-results]

Per run: steps, the mean seconds a step (the log's last "N steps, X s a step", timed with a
device synchronisation), a step's floors (bench_ptq.block_step_floors: the layer's forward +
backward + recomputed-forward FLOPs over the measured bf16 matmul rate; the bytes of weights,
offsets, fake-quant weights and their gradients over the measured copy bandwidth), each phase's
seconds, capture + solve, the whole layer, the device peak and the host anonymous peak (the
run's own PhaseTimer accounting). ``--check-results``: exit 1 unless RESULTS.md carries exactly
the rendered table between its markers.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "benchmarks" / "gpu"
GIB = 2 ** 30
BEGIN, END = "<!-- block-rounding-speed:begin -->", "<!-- block-rounding-speed:end -->"
H200, H100 = "h200_2026-12-04_blockround", "h100_2026-12-06_blockround"
#: (tag, card folder under benchmarks/gpu, call folder, what it is)
RUN_ORDER = [
    ("hbr200", H200, "call1", "H200; before: per-step SignSGD hook, float32 offsets"),
    ("A32", H200, "call2", "H200; fused step, float32 offsets (`--recipe best`)"),
    ("B16", H200, "call2", "H200; fused step, float16 offsets"),
    ("F150", H200, "call3", "H200; float16 offsets, 150 steps"),
    ("C16", H200, "call2", "H200; no hclip, 40 steps"),
    ("P20", H200, "call3", "H200; V4-Pro layer, 20 steps"),
    ("D100", H100, "call4", "H100; the default (float16 offsets, 100 steps), first run of the machine"),
    ("D100b", H100, "call4", "H100; the default, second run (warm page cache and kernels)"),
    ("D100w3", H100, "call4", "H100; the default at w3a16-g128, third run"),
]
_STEPS = re.compile(r"blockround layer \d+: (\d+) steps, ([0-9.]+) s a step")
_ALGO = re.compile(r"--algo (\S+)")
_OOM = re.compile(r"OutOfMemoryError")


def load(tag: str, card: str, call: str) -> dict:
    folder = GPU / card / call
    log = (folder / f"{tag}.log").read_text()
    rec = json.loads((folder / f"{tag}.json").read_text())
    steps = _STEPS.findall(log)
    out = {"tag": tag, "call": call, "algo": _ALGO.search(log).group(1),
           "model": "v4-pro" if "--model v4-pro" in log else "v4-flash",
           "scheme": re.search(r"--scheme (\S+)", log).group(1),
           "steps": int(steps[-1][0]) if steps else 0, "step_s": float(steps[-1][1]) if steps else None,
           "oom": bool(_OOM.search(log))}
    if "ptq" not in rec:
        return out
    layer = rec["ptq"]["per_layer"]["2"]
    ph = {k: v["seconds"] for k, v in layer["phases"].items()}
    out.update(capture_s=ph["capture"], hclip_s=ph.get("solve:recipe", 0.0), block_s=ph.get("solve:block", 0.0),
               write_s=ph.get("write", 0.0), propagate_s=ph.get("propagate", 0.0), layer_s=layer["seconds"],
               device_gib=layer["device_peak_bytes"] / GIB, host_anon_gib=layer["host_anon_peak_bytes"] / GIB)
    out["capture_solve_s"] = out["capture_s"] + out["hclip_s"] + out["block_s"]
    fl = layer.get("block_step_floors")
    if fl:
        out.update(flops_floor_s=fl["flops_floor_s"], bytes_floor_s=fl["bytes_floor_s"])
    return out


def rows() -> list[dict]:
    return [load(tag, card, call) for tag, card, call, _ in RUN_ORDER]


def fmt(x, spec=".1f", none="-") -> str:
    return none if x is None else format(x, spec)


def render(rs: list[dict]) -> str:
    what = {tag: w for tag, _, _, w in RUN_ORDER}
    head = ("| run | what | `--algo` (`--propagate quant`) | steps | s / step | step floor FLOPs / bytes | "
            "capture s | hclip s | block stage s | capture + solve s | write + propagate s | layer s | device peak GiB | "
            "host anon GiB |\n|" + " --- |" * 14)
    lines = [head]
    for r in rs:
        if "layer_s" not in r:
            lines.append(f"| {r['tag']} ({r['call']}) | {what[r['tag']]} | `{r['algo']}` ({r['scheme']}) | {r['steps']} | - | - | "
                         f"- | - | - | - | - | - | {'out of memory (139.8 GiB)' if r['oom'] else '-'} | - |")
            continue
        floors = (f"{r['flops_floor_s']:.3f} / {r['bytes_floor_s']:.3f}" if "flops_floor_s" in r else "-")
        lines.append(
            f"| {r['tag']} ({r['call']}) | {what[r['tag']]} | `{r['algo']}` ({r['scheme']}) | {r['steps']} | {fmt(r['step_s'], '.3f')} | "
            f"{floors} | {r['capture_s']:.1f} | {r['hclip_s']:.1f} | {r['block_s']:.1f} | {r['capture_solve_s']:.1f} | "
            f"{r['write_s'] + r['propagate_s']:.1f} | {r['layer_s']:.1f} | {r['device_gib']:.1f} | {r['host_anon_gib']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check-results", action="store_true")
    a = ap.parse_args(argv)
    table = render(rows())
    if not a.check_results:
        print(table)
        return 0
    text = (REPO / "benchmarks" / "RESULTS.md").read_text()
    if BEGIN not in text or END not in text:
        print(f"RESULTS.md has no {BEGIN} ... {END} block")
        return 1
    quoted = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    if quoted != table:
        print("RESULTS.md's block-rounding speed table differs from the runs; rendered:\n" + table)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
