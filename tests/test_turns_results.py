"""The quotes of results/block-rounding.md §1b: what tuning the experts in turns costs on the tiny
model (whole split, one host) and how far a V4-Pro layer's block stage got within 60 GiB."""
from __future__ import annotations

import json
import re

from tests.conftest import REPO

BENCH = REPO / "benchmarks"
SCHEMES = ("w4a16-g128", "w3a16-g128", "w4a16", "w2a16-g64", "w4a8")


def _runs(name: str) -> dict:
    return json.loads((BENCH / "quality" / name).read_text())


def test_one_turn_changes_no_number_and_the_turns_cost_what_the_table_says():
    one, before = _runs("turns_rerun.json"), _runs("build_stacks_rerun.json")
    four, eight = _runs("turns4.json"), _runs("turns8.json")
    assert one["cpu_class"] == four["cpu_class"] == eight["cpu_class"] == before["cpu_class"]
    doc = " ".join((BENCH / "results" / "block-rounding.md").read_text().split())
    for s in SCHEMES:
        a = one["runs"][s]
        # the segments' code with one turn: the record before it, to the last digit
        assert a["ppl"] == before["runs"][s]["ppl"] and a["recipe"] == before["runs"][s]["recipe"], s
        row = f"| {s} | {a['ppl']:.4f} |"
        for rec, n in ((four, 4), (eight, 8)):
            b = rec["runs"][s]
            assert (a["windows"], a["seed"], b["windows"], b["seed"]) == (1487, 0, 1487, 0), s
            turned = b["recipe"][-1]
            assert turned["turns"] == n and {k: v for k, v in turned.items() if k != "turns"} == a["recipe"][-1], s
            row += f" {b['ppl']:.4f} | {100 * (b['ppl'] / a['ppl'] - 1):+.2f} % |"
        assert row in doc, row
        assert four["runs"][s]["ppl"] > a["ppl"], s      # four turns: a price on every scheme


def test_the_v4_pro_runs_quoted():
    folder = BENCH / "gpu" / "h100_2026-12-07d_blockround"
    pt = (folder / "call1" / "PT.log").read_text()
    assert "solve:recipe: 5.65 s, device peak 75.2 GiB" in pt and "device peak 76.0 GiB" in pt
    pt2 = (folder / "call2" / "PT2.log").read_text()
    assert "--device-memory-gb 60" in pt2 and re.search(r"solve:block: 0\.12 s.*DeviceMemoryError", pt2)
    pt3 = (folder / "call3" / "PT3.log").read_text()
    assert "--device-memory-gb 60" in pt3 and "the experts in 11 turns" in pt3
    start = re.search(r"start MSE ([0-9.]+) \(([0-9.]+) s\), device peak so far ([0-9.]+) GiB", pt3)
    assert start.groups() == ("0.0434783", "51.2", "54.5")
    assert re.search(r"solve:block: [0-9.]+ s, device peak 55\.6 GiB, host RSS [0-9.]+ GiB \(anon 80\.8\)"
                     r".*DeviceMemoryError", pt3)
    doc = " ".join((BENCH / "results" / "block-rounding.md").read_text().split())
    for quote in ("start MSE 0.0434783 after 51.2 s at a **54.5 GiB** peak", "(55.6 GiB peak before it)",
                  "hclip's Hessian passes alone peaked at 75.2 GiB", "ran out of memory at 76.0 GiB"):
        assert quote in doc, quote


def test_the_v4_pro_hundred_steps_quoted():
    """The first V4-Pro run to take all 100 steps within 60 GiB (casebook i34-20): its figures as
    results §1b quotes them, read from its log."""
    folder = BENCH / "gpu" / "h100_2026-12-07e_blockround" / "call1"
    log = (folder / "P1.log").read_text()
    assert "--device-memory-gb 60" in log and "turns=11:micro_batch=2:recompute_units=true:chunk_gb=1" in log
    setup = re.search(r"codes made, their float weights on the host \(([0-9.]+) s\); device ([0-9.]+) GiB allocated", log)
    assert setup.groups() == ("34.4", "20.0")
    assert re.search(r"start MSE 0\.0434783 \(36\.8 s\)", log)
    steps = re.findall(r"(\d+) steps, ([0-9.]+) s a step, device peak so far ([0-9.]+) GiB", log)
    assert steps[0] == ("1", "3.745", "54.5") and steps[-1] == ("100", "2.045", "54.5")
    ends = re.findall(r"turn (\d+) / 11 .* device peak so far ([0-9.]+) GiB \(([0-9.]+) allocated\)", log)
    assert len(ends) == 11 and {e[1] for e in ends} == {"54.5"} and {e[2] for e in ends} == {"30.3", "30.5"}
    assert "end MSE 0.0213008 against 0.0434783 at the start: kept (243.9 s)" in log
    assert re.search(r"solve:block: 251\.67 s, device peak 54\.5 GiB.*DeviceMemoryError", log)
    kernels = (folder / "br_kernels.log").read_text()
    assert "decode_mismatch: 0" in kernels and "decode_ms: 0.240" in kernels and "decode_torch_ms: 3.085" in kernels
    doc = " ".join((BENCH / "results" / "block-rounding.md").read_text().split())
    for quote in ("all 100 steps in 11 turns at 2.045 s a step** (the first 3.745 s)", "a **54.5 GiB** device peak",
                  "end MSE **0.0213008**, kept", "in 34.4 s (20.0 GiB allocated after)", "0.24 ms against 3.09 ms"):
        assert quote in doc, quote
    results = " ".join((BENCH / "RESULTS.md").read_text().split())
    assert "100 steps at 2.045 s within 54.5 GiB (P1, `gpu/h100_2026-12-07e_blockround/`: the stage 251.7 s;" in results
    # RESULTS §4's log as it grew, kept in the appendix of results/block-rounding.md
    assert ("**all 100 steps at 2.045 s a step within a 54.5 GiB peak** (end MSE 0.0435 -> 0.0213, kept; block "
            "stage 251.7 s;") in doc


def test_the_v4_pro_end_quoted():
    """The runs that took a V4-Pro layer to its end within 60 GiB (casebook i34-21): P2 ran out
    as the experts came back, P3 (the turns chosen by the default) ran the whole layer; their
    figures, and the per-layer cost added up from P1-P3's parts, as results §1b, RESULTS and README
    quote them, read from the logs."""
    folder = BENCH / "gpu" / "h100_2026-12-07f_blockround"
    p2 = (folder / "call1" / "P2.log").read_text()
    assert "100 steps, 2.564 s a step, device peak so far 54.5 GiB" in p2
    assert "end MSE 0.0213008 against 0.0434783 at the start: kept" in p2
    assert "settled; device 23.0 GiB allocated" in p2 and "in expert_turns.py:174 (finish), 15.0 GiB allocated" in p2
    p3 = (folder / "call2" / "P3.log").read_text()
    assert "--algo blockround:keep_best=false:offset_dtype=float16:iters=33 " in p3 and "--device-memory-gb 60" in p3
    assert ("the experts' weights and offsets (94.5 GiB) are more than cuda:0 holds (60.0 GiB): 11 turns, "
            "micro_batch=2, recompute_units=true, chunk_gb=1") in p3
    assert "33 steps, 2.757 s a step" in p3 and "settled; device 18.9 GiB allocated" in p3
    assert "end MSE 0.0842683 against 0.0434783 at the start: the start state kept" in p3
    phases = dict(re.findall(r"\[phase\] layer 2 (capture|solve:block|propagate): ([0-9.]+) s", p3))
    assert phases == {"capture": "24.95", "solve:block": "148.29", "propagate": "138.72"}
    row = re.search(r"^2 \(4/hash\).* ([0-9.]+)\s+([0-9.]+) GiB\s+([0-9.]+) GiB \(([0-9.]+) GiB\)", p3, re.M)
    assert row.groups() == ("315.9", "56.89", "122.74", "80.89")
    # the cost of 100 steps from the parts: capture, codes, steps, the end (block stage minus the
    # end MSE's time), the propagate of P3
    logs = [(BENCH / "gpu" / "h100_2026-12-07e_blockround" / "call1" / "P1.log").read_text(), p2, p3]
    capture = [float(re.search(r"layer 2 capture: ([0-9.]+) s", t).group(1)) for t in logs]
    codes = [float(re.search(r"on the host \(([0-9.]+) s\)", t).group(1)) for t in logs]
    step = [float(re.findall(r"100 steps, ([0-9.]+) s a step", t)[-1]) for t in logs[:2]]
    end = float(phases["solve:block"]) - float(re.search(r"start state kept \(([0-9.]+) s\)", p3).group(1))
    lo = min(capture) + min(codes) + 100 * min(step) + end + float(phases["propagate"])
    hi = max(capture) + max(codes) + 100 * max(step) + end + float(phases["propagate"])
    assert round(end) == 8 and (round(lo / 60, 1), round(hi / 60, 1)) == (6.7, 8.2)
    doc = " ".join((BENCH / "results" / "block-rounding.md").read_text().split())
    for quote in ("100 steps at 2.564 s a step within the same 54.5 GiB peak", "15.0 GiB allocated: about 10 GiB",
                  "whole layer ran within 60 GiB: device peak 56.9 GiB, 315.9 s** (capture 24.9 s; codes made in "
                  "43.1 s; 33 steps, 3 a turn, at 2.757 s a step; 18.9 GiB allocated before the experts came back; "
                  "block stage 148.3 s at 54.5 GiB; write 0.2 s; propagate 138.7 s at 56.9 GiB)",
                  "end MSE 0.0842683 against 0.0434783", "80.9 GiB against the bound 64.0 GiB",
                  "capture 17-31 s, codes 34-57 s, 100 steps at 2.045-2.564 s (205-256 s), the end 8 s, the propagate "
                  "139 s", "**6.7-8.2 min a layer**"):
        assert quote in doc, quote
    results = " ".join((BENCH / "RESULTS.md").read_text().split())
    assert "the whole layer at 33 steps 315.9 s, 56.9 GiB, the turns chosen by the default (P3), but host anonymous 80.9 GiB" \
        in results
    assert "6.7-8.2 min a layer at 100 steps" in doc     # RESULTS §4's log, before P7 measured it in one run


def test_the_v4_pro_host_parking_quoted():
    """P5 (the experts parked on the host in the release's format, casebook i34-23) and H1 (hclip
    on the same layer, casebook i34-24), as results §1b, RESULTS and README quote them, read from
    the logs; P5's MSEs equal P3's to the digit (the parking gives back every weight)."""
    folder = BENCH / "gpu" / "h100_2026-12-07g_blockround"
    p5 = (folder / "call1" / "P5.log").read_text()
    p3 = (BENCH / "gpu" / "h100_2026-12-07f_blockround" / "call2" / "P3.log").read_text()
    assert "--algo blockround:keep_best=false:offset_dtype=float16:iters=33 " in p5 and "--propagate float" in p5
    assert "their float weights on the host, 12.6 GiB (14.1 s)" in p5 and "on the host (43.1 s)" in p3
    mse = "end MSE 0.0842683 against 0.0434783 at the start: the start state kept"
    assert mse in p5 and mse in p3
    assert "33 steps, 2.302 s a step" in p5 and "BOUND PASSED" not in p5 and "BOUND PASSED" in p3
    phases = dict(re.findall(r"\[phase\] layer 2 (capture|solve:block): ([0-9.]+) s", p5))
    assert phases == {"capture": "18.08", "solve:block": "98.06"}
    assert "solve:block: 98.06 s, device peak 55.6 GiB, host RSS 90.7 GiB (anon 46.2)" in p5
    row = re.search(r"^2 \(4/hash\).* ([0-9.]+)\s+([0-9.]+) GiB\s+([0-9.]+) GiB \(([0-9.]+) GiB\)", p5, re.M)
    assert row.groups() == ("119.8", "55.58", "90.75", "46.17")
    h1 = (folder / "call2" / "H1.log").read_text()
    assert "--algo hclip " in h1 and "'ended_by': 'OutOfMemoryError'" in h1
    assert "solve:recipe: 0.28 s, device peak 59.8 GiB" in h1 and "capture: 5.37 s, device peak 56.7 GiB" in h1
    doc = " ".join((BENCH / "results" / "block-rounding.md").read_text().split())
    for quote in ("\"their float weights on the host, 12.6 GiB (14.1 s)\" (P3: 47.4 GiB, 43.1 s)",
                  "block stage 98.1 s at 55.6 GiB (P3 148.3 s at 54.5)", "33 steps at 2.302 s a step",
                  "**host anonymous peak 46.2 GiB, within the bound 64.0** (P3 80.9)",
                  "The layer without its propagate: 119.8 s", "16 experts at 59.8 GiB"):
        assert quote in doc, quote
    results = " ".join((BENCH / "RESULTS.md").read_text().split())
    assert "host anonymous peak 46.2 GiB against 64.0, was 80.9 (P5, casebook i34-23)" in results
    assert "the release's FP4 format, 12.6 GiB (made in 14.1 s, was 43.1)" in results
    readme = " ".join((BENCH.parent / "README.md").read_text().split())
    assert "(12.6 GiB for a Pro layer, not 47.4 in bf16)" in readme


def _phase_sums(log: str) -> dict[str, tuple[int, float, float]]:
    """{phase: (count, seconds summed, largest device peak GiB)} of layer 2's phase lines."""
    out: dict[str, tuple[int, float, float]] = {}
    for name, sec, peak in re.findall(r"^\[phase\] layer 2 (\S+): ([0-9.]+) s, device peak ([0-9.]+) GiB", log, re.M):
        n, total, top = out.get(name, (0, 0.0, 0.0))
        out[name] = (n + 1, total + float(sec), max(top, float(peak)))
    return out


def test_the_v4_pro_default_recipe_and_whole_layer_quoted():
    """P6 (the default recipe on a V4-Pro layer, hclip fitted since casebook i34-24) and P7
    (blockround alone, the whole layer at 100 steps in one run, the tuned layer kept), as results
    §1b, RESULTS and README quote them; the 9.3-min sum recomputed from the two logs."""
    folder = BENCH / "gpu" / "h100_2026-12-07h_blockround"
    p6 = (folder / "call2" / "P6.log").read_text()
    p7 = (folder / "call3" / "P7.log").read_text()
    assert "--algo hclip,blockround:keep_best=false:offset_dtype=float16:iters=100 --propagate quant" in p6
    assert "--algo blockround:keep_best=false:offset_dtype=float16:iters=100 --propagate quant" in p7
    assert "--device-memory-gb 60" in p6 and "--device-memory-gb 60" in p7
    six, seven = _phase_sums(p6), _phase_sums(p7)
    # P6: hclip's passes before the block stage, and its peak (the i34-24 fit)
    n_cap, cap_s, cap_peak = six["capture"]
    n_rec, rec_s, rec_peak = six["solve:recipe"]
    assert (n_cap, n_rec) == (36, 36) and (round(cap_s, 1), round(rec_s, 1)) == (174.4, 53.3)
    assert max(cap_peak, rec_peak) == 58.8 and round(cap_s + rec_s, 1) == 227.8
    assert sum(int(k) for k in re.findall(r"hclip: (\d+) expert unit\(s\) solved jointly", p6)) == 384
    assert "90 steps, 2.452 s a step, device peak so far 56.3 GiB" in p6 and "'ended_by': 'KeyboardInterrupt'" in p6
    assert "start MSE 0.0289049" in p6 and "end MSE" not in p6
    # P7: the whole layer, its kept end, within both bounds
    assert "end MSE 0.0213008 against 0.0434783 at the start: kept" in p7
    assert "100 steps, 2.519 s a step" in p7 and "device 18.9 GiB allocated before the experts come back" in p7
    row = re.search(r"^2 \(4/hash\).* ([0-9.]+)\s+([0-9.]+) GiB\s+([0-9.]+) GiB \(([0-9.]+) GiB\)", p7, re.M)
    assert row.groups() == ("332.8", "57.70", "95.64", "51.10")
    rep = json.loads((folder / "call3" / "P7.json").read_text())
    bounds = rep["bounds"]
    assert bounds["violations"] == [] and bounds["max_device_gib"] == 60.0
    limit = bounds["layer_weight_bytes"]["2"] + bounds["max_host_anon_extra_gib"] * 2 ** 30
    layer = rep["ptq"]["per_layer"]["2"]
    assert layer["host_anon_peak_bytes"] <= limit and round(limit / 2 ** 30, 1) == 64.0
    assert layer["device_peak_bytes"] <= 60 * 2 ** 30
    assert (round(seven["solve:block"][1], 1), round(seven["propagate"][1], 1)) == (293.2, 13.8)
    assert round(layer["phases"]["write"]["seconds"], 1) == 16.8 and layer["phases"]["write"]["count"] == 386
    # the default recipe a layer: P7 plus what P6's hclip added before its block stage
    pre7 = seven["capture"][1] + seven["solve:recipe"][1]
    added = cap_s + rec_s - pre7
    assert round(pre7, 1) == 4.9 and round(added, 1) == 222.9
    assert round((float(row.group(1)) + added) / 60, 1) == 9.3
    doc = " ".join((BENCH / "results" / "block-rounding.md").read_text().split())
    for quote in ("at a **58.8 GiB** peak", "90 of the 100 steps at 2.452 s a step within **56.3 GiB**",
                  "**the whole layer in one run, 332.8 s, device peak 57.7 GiB, host anonymous peak 51.1 GiB against 64.0**",
                  "end MSE 0.0213008 against 0.0434783 at the start: **kept**", "**13.8 s** at 57.7 GiB",
                  "332.8 s plus the 222.9 s P6's hclip added", "**about 9.3 min a layer**"):
        assert quote in doc, quote
    results = " ".join((BENCH / "RESULTS.md").read_text().split())
    assert "the default recipe's hclip on that layer at a 58.8 GiB peak, 36 passes over the layer, 227.8 s" in results
    assert "**the whole layer at 100 steps in one run, 332.8 s, device peak 57.7 GiB, host anonymous 51.1 GiB against 64.0**" \
        in results and "about 9.3 min (P7's 332.8 s + 222.9 s)" in results


def test_the_v4_pro_default_recipe_in_one_run_quoted():
    """P8 (casebook i34-25): the default recipe on a V4-Pro layer, the whole layer in one run
    (started in a session of its own to outlast one device call), within both bounds by the run's
    own accounting, the tuned layer kept; results §1b, RESULTS §0 / §4 and README quote it."""
    folder = BENCH / "gpu" / "h100_2026-12-07i_blockround" / "call2"
    log = (folder / "P8.log").read_text()
    assert "--algo hclip,blockround:keep_best=false:offset_dtype=float16:iters=100 --propagate quant" in log
    assert "--model v4-pro" in log and "--device-memory-gb 60" in log and "ended_by" not in log
    assert "run P8: rc=0" in (folder / "summary.txt").read_text()
    ph = _phase_sums(log)
    assert ph["capture"][0] == ph["solve:recipe"][0] == 36
    assert sum(int(k) for k in re.findall(r"hclip: (\d+) expert unit\(s\) solved jointly", log)) == 384
    assert "end MSE 0.0204583 against 0.0289049 at the start: kept" in log and "100 steps, 2.247 s a step" in log
    rep = json.loads((folder / "P8.json").read_text())
    bounds, layer = rep["bounds"], rep["ptq"]["per_layer"]["2"]
    assert bounds["violations"] == [] and bounds["max_device_gib"] == 60.0
    limit = bounds["layer_weight_bytes"]["2"] + bounds["max_host_anon_extra_gib"] * 2 ** 30
    assert layer["host_anon_peak_bytes"] <= limit and round(limit / 2 ** 30, 1) == 64.0
    assert layer["device_peak_bytes"] <= 60 * 2 ** 30
    phases = {k: v["seconds"] for k, v in layer["phases"].items()}
    gib = 2 ** 30
    figures = {"layer": f"{layer['seconds']:.1f}", "min": f"{layer['seconds'] / 60:.1f}",
               "dev": f"{layer['device_peak_bytes'] / gib:.1f}", "host": f"{layer['host_anon_peak_bytes'] / gib:.1f}",
               "cap": f"{phases['capture']:.1f}", "solve": f"{phases['solve:recipe']:.1f}",
               "hclip": f"{phases['capture'] + phases['solve:recipe']:.1f}", "block": f"{phases['solve:block']:.1f}",
               "write": f"{phases['write']:.1f}", "prop": f"{phases['propagate']:.1f}",
               "flops": f"{layer['block_step_floors']['flops_floor_s']:.3f}",
               "bytes": f"{layer['block_step_floors']['bytes_floor_s']:.3f}"}
    assert figures == {"layer": "479.3", "min": "8.0", "dev": "58.8", "host": "51.1", "cap": "144.4", "solve": "52.8",
                       "hclip": "197.2", "block": "257.6", "write": "13.5", "prop": "7.7", "flops": "0.132",
                       "bytes": "0.314"}
    f = figures
    doc = " ".join((BENCH / "results" / "block-rounding.md").read_text().split())
    for quote in (f"**the whole layer in one run, {f['layer']} s ({f['min']} min), device peak {f['dev']} GiB, host "
                  f"anonymous peak {f['host']} GiB against 64.0**",
                  f"{f['cap']} s of capture", f"{f['solve']} s of solves, {f['hclip']} s before the block stage",
                  f"**100 steps at 2.247 s a step** (floors {f['flops']} s of FLOPs, {f['bytes']} s of bytes)",
                  f"end MSE 0.0204583: **kept**; {f['block']} s", f"the write of 386 units {f['write']} s",
                  f"the propagate on the folded experts {f['prop']} s",
                  f"{f['layer']} s, device peak {f['dev']} GiB, host anonymous {f['host']} GiB against 64.0, the tuned "
                  "layer kept"):
        assert quote in doc, quote
    results = " ".join((BENCH / "RESULTS.md").read_text().split())
    for quote in (f"V4-Pro in 60 GiB (H100): the default recipe, the whole layer in one run, {f['layer']} s, device peak "
                  f"{f['dev']} GiB, host anonymous {f['host']} GiB against 64.0 (the tuned layer kept)",
                  f"**the default recipe, the whole layer, {f['layer']} s ({f['min']} min), device peak {f['dev']} GiB, host "
                  f"anonymous {f['host']} GiB against 64.0**; hclip's 36 passes {f['hclip']} s, 100 steps at 2.247 s "
                  f"(floors {f['flops']} / {f['bytes']} s)"):
        assert quote in results, quote
    readme = " ".join((BENCH.parent / "README.md").read_text().split())
    assert (f"the default recipe ran a whole Pro layer in one run in {f['layer']} s ({f['min']} min; device peak "
            f"{f['dev']} GiB, host anonymous {f['host']} GiB): hclip's 36 passes over the layer {f['hclip']} s, then "
            "100 steps at 2.247 s") in readme


def test_the_cpu_ab_of_the_block_stage_quoted():
    """The tip against 0657c48 (the last V4-Flash timing on a device), the tiny default's block
    stage on the CPU (benchmarks/cpu_ab_block_stage.py): the figures recomputed from the runs,
    pair by pair, and RESULTS §4 quoting them."""
    rec = json.loads((BENCH / "results" / "cpu_ab_block_stage.json").read_text())
    assert rec["b"]["commit"] == "0657c48" and rec["scheme"] == "w4a16-g128"
    assert rec["algo"] == "hclip,blockround:keep_best=false:offset_dtype=float16:iters=100"
    a, b = rec["runs"]["a"], rec["runs"]["b"]
    assert len(a) == len(b) == 3
    ratios = sorted(x["unit_seconds"] / y["unit_seconds"] for x, y in zip(a, b))
    fig = rec["figures"]["unit_seconds"]
    assert (round(ratios[1], 4), round(ratios[0], 4), round(ratios[-1], 4)) == \
        (fig["ratio_a_over_b"]["median"], fig["ratio_a_over_b"]["min"], fig["ratio_a_over_b"]["max"])
    med_a = sorted(x["unit_seconds"] for x in a)[1]
    med_b = sorted(y["unit_seconds"] for y in b)[1]
    results = " ".join((BENCH / "RESULTS.md").read_text().split())
    assert (f"median {ratios[1]:.3f} of 3 pairs run in turn ({ratios[0]:.3f} - {ratios[-1]:.3f}; this host's noise), "
            f"{med_a:.1f} s against {med_b:.1f} s") in results
    assert f"`results/cpu_ab_block_stage.json`, {rec['cpu_class']}, {rec['date']}" in results
