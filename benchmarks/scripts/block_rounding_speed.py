#!/usr/bin/env python
"""Block-wise rounding at real size: one V4-Flash ratio-4 layer (and one V4-Pro layer) on one
H200, every run the main job's own path (bench_ptq -> run_ptq) at 128 x 2048 calibration, each
run whole (no projection). Renders the table of benchmarks/results/block-rounding.md §1 (RESULTS §2 quotes its summary) from the
run folders benchmarks/gpu/{h200_2026-12-04,h100_2026-12-06,h200_2026-12-06,h100_2026-12-07,h100_2026-12-07b}_blockround/call*/
(benchmarks/scripts/h200_block_rounding.sh), and the default's medians over its repeats.

    python benchmarks/scripts/block_rounding_speed.py [--check-results]

Per run: steps, the mean seconds a step (the log's last "N steps, X s a step", timed with a
device synchronisation), a step's floors (bench_ptq.block_step_floors: the layer's forward +
backward + recomputed-forward FLOPs over the measured bf16 matmul rate; the bytes of weights,
offsets, fake-quant weights and their gradients over the measured copy bandwidth), each phase's
seconds, capture + solve, the whole layer, the device peak and the host anonymous peak (the
run's own PhaseTimer accounting). ``--check-results``: exit 1 unless results/block-rounding.md
carries exactly the rendered table between its markers and RESULTS.md the summary sentence.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "benchmarks" / "gpu"
GIB = 2 ** 30
DOC = REPO / "benchmarks" / "results" / "block-rounding.md"
BEGIN, END = "<!-- block-rounding-speed:begin -->", "<!-- block-rounding-speed:end -->"
H200, H100 = "h200_2026-12-04_blockround", "h100_2026-12-06_blockround"
H200B = "h200_2026-12-06_blockround"
H100C = "h100_2026-12-07_blockround"
H100D = "h100_2026-12-07b_blockround"
H100E = "h100_2026-12-07c_blockround"
H100F = "h100_2026-12-07i_blockround"
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
    ("E1", H100, "call5", "H100 (machine 2); the default, first run (the stream leak, casebook i34-8)"),
    ("E2", H100, "call5", "H100 (machine 2); the default, second run (the stream leak)"),
    ("NR", H100, "call5", "H100 (machine 2); the default without recompute (`recompute=false`)"),
    ("W8BR", H100, "call5", "H100 (machine 3); block-wise rounding at w4a8, first run (leak fixed)"),
    ("E3", H100, "call5", "H100 (machine 3); the default, second run"),
    ("W8BR2", H100, "call5", "H100 (machine 3); w4a8, third run"),
    ("E4", H100, "call5", "H100 (machine 3); the default, fourth run"),
    ("E5", H100, "call6", "H100 (machine 4); the default, first run"),
    ("E6", H100, "call6", "H100 (machine 4); the default, second run"),
    ("W8BR3", H100, "call6", "H100 (machine 4); w4a8, third run"),
    ("B40", H100, "call7", "H100 (machine 5), 40 steps, first run; every unit recomputed (the default until `recompute_units`)"),
    ("U40", H100, "call7", "H100 (machine 5), 40 steps; attention and shared expert held (`recompute_units=false`, the default since)"),
    ("H40", H100, "call7", "H100 (machine 5), 40 steps; every unit recomputed but 8 GiB of expert chunks held (`hold_gb=8`)"),
    ("UH40", H100, "call7", "H100 (machine 5), 40 steps; `recompute_units=false` and `hold_gb=6`"),
    ("G1", H200B, "call8", "H200 (machine 6); the default since `recompute_units=false`, first run"),
    ("R1", H200B, "call8", "H200 (machine 6); the default before it (`recompute_units=true`), second run"),
    ("G2", H200B, "call8", "H200 (machine 6); the default, third run"),
    ("G3", H200B, "call8", "H200 (machine 6); the default, fourth run"),
    ("R2", H200B, "call8", "H200 (machine 6); `recompute_units=true`, fifth run"),
    ("G4", H200B, "call8", "H200 (machine 6); the default, sixth run"),
    ("N40", H100, "call9", "H100 (machine 7), 40 steps, second run; each step's samples copied during the step before (`prefetch`, the default since)"),
    ("O40", H100, "call9", "H100 (machine 7), 40 steps; the same with `prefetch=false` (samples copied on the computing stream, as before)"),
    ("H4", H100, "call9", "H100 (machine 7), 40 steps; `prefetch` and 4 GiB of expert chunks held (`hold_gb=4`)"),
    ("H1", H100C, "call1", "H100 (machine 8), first run; the default with the hc ends' own backward (casebook i34-10), prefetch and the kernels' launch shape"),
    ("N1", H100C, "call2", "H100 (machine 8), second run; the same code before the hc ends' backward (968e83e: prefetch and launch shape)"),
    ("PH", H100C, "call3", "H100 (machine 8), 20 steps, third run; step 6 profiled (`call3/prof_PH.txt`)"),
    ("B1", H100D, "call1", "H100 (machine 9), first run; e2e65f3: the sparse attention's and the experts' combine's own backwards, the build decoding into the stacks"),
    ("N2", H100D, "call1", "H100 (machine 9), second run; the same lease's baseline, main before those three (2a7c30f)"),
    ("S1", H100E, "call1", "H100 (machine 10), first run; main 0657c48 (the default as it stands), repeated for its spread"),
    ("S2", H100E, "call1", "H100 (machine 10), second run; main 0657c48"),
    ("S3", H100E, "call1", "H100 (machine 10), third run (after the attention's GPU check); main 0657c48"),
    ("T1", H100F, "call1", "H100 (machine 11), first run; main d3c1dd0 (the turns, host parking, hclip's chunk), repeated"),
    ("T2", H100F, "call1", "H100 (machine 11), second run; main d3c1dd0"),
    ("T3", H100F, "call1", "H100 (machine 11), third run; main d3c1dd0"),
]
#: the default at w4a16-g128 (BLOCKROUND_DEFAULT): runs in a machine's first run (cold page cache)
#: and warm runs (the checkpoint read before); the headline is the median of the warm runs; w4a8's
#: default (the same recipe) over its warm runs
W4A8_WARM_RUNS = ("W8BR2", "W8BR3")
#: the default since recompute_units=false, on one H200 (the issue's card), one lease: its first run,
#: its warm runs, and the recipe before the knob (recompute_units=true) in the same lease
NOW_FIRST_RUNS = ("G1",)
NOW_WARM_RUNS = ("G2", "G3", "G4")
NOW_BEFORE_RUNS = ("R1", "R2")
#: 2026-12-07, one H100 lease: the hc ends' own backward (machine's first run) and the code before it
HC_RUN, HC_BEFORE_RUN = "H1", "N1"
#: 2026-12-07, a second H100 lease: the attention's and the combine's backwards and the build into
#: the stacks (machine's first run) against main before them (its second run)
LEVERS_RUN, LEVERS_BEFORE_RUN = "B1", "N2"
#: 2026-12-07, a third H100 lease: main as it stands, three runs (its first and two warm)
REPEAT_RUNS = ("S1", "S2", "S3")
#: 2026-12-07, a fourth H100 lease: main d3c1dd0 (after the turns, the host parking and hclip's
#: fitted chunk), three runs (its first and two warm)
TIP_RUNS = ("T1", "T2", "T3")
DEFAULT_FIRST_RUNS = ("D100", "E1", "E5")
DEFAULT_WARM_RUNS = ("D100b", "E2", "E3", "E4", "E6")
#: runs measured before the stream-leak fix (casebook i34-8): over the host bound
BEFORE_STREAM_FIX = ("E1", "E2", "NR")
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


def default_summary(rs: list[dict]) -> dict:
    """The default's headline figures: medians (min - max) of capture + solve and of the step over
    its warm runs, its first runs, and the step over every run of the default."""
    by = {r["tag"]: r for r in rs}

    def stat(tags, key):
        v = sorted(by[t][key] for t in tags)
        return {"median": statistics.median(v), "min": v[0], "max": v[-1], "n": len(v)}

    return {"w4a8_warm_capture_solve_s": stat(W4A8_WARM_RUNS, "capture_solve_s"),
            "warm_capture_solve_s": stat(DEFAULT_WARM_RUNS, "capture_solve_s"),
            "warm_layer_s": stat(DEFAULT_WARM_RUNS, "layer_s"),
            "warm_device_gib": stat(DEFAULT_WARM_RUNS, "device_gib"),
            "first_capture_solve_s": stat(DEFAULT_FIRST_RUNS, "capture_solve_s"),
            "step_s": stat(DEFAULT_WARM_RUNS + DEFAULT_FIRST_RUNS, "step_s"),
            "now_warm_capture_solve_s": stat(NOW_WARM_RUNS, "capture_solve_s"),
            "now_first_capture_solve_s": stat(NOW_FIRST_RUNS, "capture_solve_s"),
            "now_step_s": stat(NOW_WARM_RUNS + NOW_FIRST_RUNS, "step_s"),
            "now_device_gib": stat(NOW_WARM_RUNS + NOW_FIRST_RUNS, "device_gib"),
            "now_before_capture_solve_s": stat(NOW_BEFORE_RUNS, "capture_solve_s"),
            "now_before_step_s": stat(NOW_BEFORE_RUNS, "step_s"),
            "now_before_device_gib": stat(NOW_BEFORE_RUNS, "device_gib"),
            "hc": by[HC_RUN], "hc_before": by[HC_BEFORE_RUN],
            "levers": by[LEVERS_RUN], "levers_before": by[LEVERS_BEFORE_RUN],
            # the leases of repeated runs: every figure's spread, as "<lease>_<figure>"
            **{f"{lease}_{key}": stat(tags, key) for lease, tags in (("repeat", REPEAT_RUNS), ("tip", TIP_RUNS))
               for key in ("step_s", "capture_solve_s", "block_s", "device_gib", "host_anon_gib")}}


def _spread(d, spec) -> str:
    return f"{format(d['median'], spec)} ({format(d['min'], spec)} - {format(d['max'], spec)}, n={d['n']})"


def render_summary(sm: dict) -> str:
    def f(d, spec):
        return f"{format(d['median'], spec)} ({format(d['min'], spec)} - {format(d['max'], spec)}, n={d['n']})"

    return ("The default at w4a16-g128 (since `recompute_units=false`) on one H200, median (min - max): capture + "
            f"solve {f(sm['now_warm_capture_solve_s'], '.1f')} s warm, {f(sm['now_first_capture_solve_s'], '.1f')} s in "
            f"the machine's first run; one step {f(sm['now_step_s'], '.3f')} s; device peak "
            f"{f(sm['now_device_gib'], '.1f')} GiB. The same lease with `recompute_units=true` (the default before): "
            f"{f(sm['now_before_capture_solve_s'], '.1f')} s, a step {f(sm['now_before_step_s'], '.3f')} s, "
            f"{f(sm['now_before_device_gib'], '.1f')} GiB. "
            "Before the knob, on the H100, median (min - max): capture + solve "
            f"{f(sm['warm_capture_solve_s'], '.1f')} s warm, {f(sm['first_capture_solve_s'], '.1f')} s in a "
            f"machine's first run; one step {f(sm['step_s'], '.3f')} s. At w4a8: "
            f"{f(sm['w4a8_warm_capture_solve_s'], '.1f')} s warm.")


def render_hc_lease(sm: dict) -> str:
    """The 2026-12-07 H100 lease (the hc ends' own backward against the code before it): below the
    table in results/block-rounding.md only (RESULTS keeps the H200 headline above)."""
    return (f"On one H100 (2026-12-07, one lease), with the hc ends' own backward: a step {sm['hc']['step_s']:.3f} s, "
            f"capture + solve {sm['hc']['capture_solve_s']:.1f} s (the machine's first run), device peak "
            f"{sm['hc']['device_gib']:.1f} GiB; the code before it, warm: {sm['hc_before']['step_s']:.3f} s, "
            f"{sm['hc_before']['capture_solve_s']:.1f} s, {sm['hc_before']['device_gib']:.1f} GiB.")


def render_levers_lease(sm: dict) -> str:
    """The second 2026-12-07 H100 lease: below the table in results/block-rounding.md only."""
    a, b = sm["levers"], sm["levers_before"]
    return (f"On one H100 (2026-12-07, a second lease), with the sparse attention's and the experts' combine's own "
            f"backwards: a step {a['step_s']:.3f} s, capture + solve {a['capture_solve_s']:.1f} s (the machine's first "
            f"run), block stage {a['block_s']:.1f} s, device peak {a['device_gib']:.1f} GiB; main before them (2a7c30f), "
            f"warm: {b['step_s']:.3f} s, {b['capture_solve_s']:.1f} s, block stage {b['block_s']:.1f} s, "
            f"{b['device_gib']:.1f} GiB.")


def _render_spread_lease(sm: dict, lease: str, head: str) -> str:
    """A lease of repeated runs of one code: ``head``, then each figure's median (min - max)."""
    return (f"{head}, three runs, median (min - max): a step {_spread(sm[f'{lease}_step_s'], '.3f')} s, capture + solve "
            f"{_spread(sm[f'{lease}_capture_solve_s'], '.1f')} s, block stage {_spread(sm[f'{lease}_block_s'], '.1f')} s, "
            f"device peak {_spread(sm[f'{lease}_device_gib'], '.1f')} GiB, host anon "
            f"{_spread(sm[f'{lease}_host_anon_gib'], '.1f')} GiB.")


def render_repeat_lease(sm: dict) -> str:
    """The third 2026-12-07 H100 lease (main 0657c48, three runs): the step's spread."""
    return _render_spread_lease(sm, "repeat", "On one H100 (2026-12-07, a third lease), main at 0657c48")


def render_tip_lease(sm: dict) -> str:
    """The fourth 2026-12-07 H100 lease (main d3c1dd0, three runs): the default after the V4-Pro work."""
    return _render_spread_lease(sm, "tip", "On one H100 (2026-12-07, a fourth lease), main at d3c1dd0 (after the "
                                           "turns, the host parking and hclip's fitted chunk)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check-results", action="store_true")
    a = ap.parse_args(argv)
    rs = rows()
    sm = default_summary(rs)
    summary = render_summary(sm)
    table = (render(rs) + "\n\n" + summary + " " + render_hc_lease(sm) + " " + render_levers_lease(sm) + " "
             + render_repeat_lease(sm) + " " + render_tip_lease(sm))
    if not a.check_results:
        print(table)
        return 0
    # the whole table lives in the question's results file; the RESULTS index quotes the summary
    text = DOC.read_text()
    if BEGIN not in text or END not in text:
        print(f"{DOC.name} has no {BEGIN} ... {END} block")
        return 1
    quoted = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    if quoted != table:
        print(f"{DOC.name}'s block-rounding speed table differs from the runs; rendered:\n" + table)
        return 1
    if summary not in " ".join((REPO / "benchmarks" / "RESULTS.md").read_text().split()):
        print("RESULTS.md does not quote the default's summary:\n" + summary)
        return 1
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
