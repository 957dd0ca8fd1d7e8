#!/usr/bin/env python
"""The per-recipe layer-speed table (benchmarks/scripts/h200_recipe_speed.sh; RESULTS.md §2): every
run of ours (bench_ptq JSONs ``ours_<tag>.r<k>.json``) and of llm-compressor (``llmc_<windows>.r<k>.json``) on the same
layer, with the floors beside each and the V4-Flash projection; markdown and JSON.

    python benchmarks/scripts/recipe_speed_table.py --probe RES/rates.json --device cuda     # the rates
    python benchmarks/scripts/recipe_speed_table.py --results RES --md RES/recipe_speed.md --json RES/recipe_speed.json

Per row (median over its repeats, [min-max] when there are several): capture s, solve s (ours:
the ``solve:*`` phases; llm-compressor: ``oneshot``, which holds its calibration forward, its
Hessians and its solve), layer s (ours: the layer's phases; llm-compressor: oneshot), host RSS
and anonymous peak, device peak. A run stopped by its time limit is listed with what its log
says it got through (defaults_table.stopped).

Floors, at the rates measured in the same run (``--probe``: bf16 and fp32 8192^3 matmuls, pageable
host-to-device copy; fp32 with TF32 off, as the solvers run):
- GPTQ solve (GPTQ rows): per weight matrix [R, C] two Cholesky factorizations and one Cholesky
  inverse of its C x C Hessian, (4/3) C^3 multiply-adds, plus the column sweep's updates, R C^2 / 2
  (RESULTS §0.9); leaves reading one tensor share one Hessian (experts' w1 | w3; wq_a | wkv); the
  grouped wo_a has one Hessian per output group; at the fp32 rate. The RTN guard's two loss
  products are not counted (a floor of GPTQ, not of our choice to guard it).
- Hessians: 2 T C^2 FLOP per distinct input of T token rows (ours: a routed expert sees its
  routed tokens, T x top-k over the experts; llm-compressor with ``moe_calibrate_all_experts``:
  every expert sees all T tokens, and gate / up each keep one; its o_a_proj pools the groups,
  casebook/peer-llm-compressor.md P6); at the fp32 rate. Part of ours' capture, of llmc's oneshot.
- bench_ptq's own floors for every row of ours: the learned-clip solver's linear FLOPs at the bf16
  rate (indicative for a recipe) and the captured bytes moved to the device once per pass at the
  h2d bandwidth.

V4-Flash projection (ours): 43 layers (2 ratio-0 + 21 ratio-4 + 20 ratio-128), every one costed
like the measured ratio-4 layer (the slowest kind: the ratio-0 / ratio-128 layers have the same
MoE, which dominates, and a cheaper attention, so this is an upper bound of the layer work), plus
what the run spends once outside its layers except the float predecessor layers (a whole-model
run propagates layer by layer and never recomputes them): setup, calibration, embedding.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (REPO, REPO / "benchmarks", HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

G = 2 ** 30
FLASH_LAYERS = 43
HOST_SLACK = 16e9            # the bound: one layer's weights + 16 GB
DEVICE_BOUND = 64e9          # Ascend 910B


# ----------------------------------------------------------------------------- probe
def probe(path: Path, device: str, small: bool) -> int:
    import torch

    import common as C
    from amct_ext.runtime import device as D
    from bench_load import h2d_bw

    dev = D.resolve_device(device)
    n = 256 if small else 8192
    out = {"device": str(dev), "torch": torch.__version__}
    with torch.inference_mode():
        out["matmul_bf16"] = C.matmul_rate(dev, n, repeats=5)
        a = torch.randn(n, n, device=dev, dtype=torch.float32)
        b = torch.randn(n, n, device=dev, dtype=torch.float32)
        s = C.time_fn(lambda: torch.matmul(a, b), dev, 5, warmup=2)
        s.update({"n": n, "flop_per_s": 2.0 * n ** 3 / (s["median_ms"] * 1e-3)})
        out["matmul_fp32"] = s
        del a, b
        out["h2d_pageable"] = h2d_bw(dev, (16 if small else 1024) * 2 ** 20, 3, pinned=False)
        out["d2d_copy"] = C.copy_bandwidth(dev, (16 if small else 1024) * 2 ** 20, 5)
    path.parent.mkdir(parents=True, exist_ok=True)
    from amct_ext.io.io_utils import atomic_write_json

    atomic_write_json(out, path)
    print(f"bf16 {out['matmul_bf16']['flop_per_s'] / 1e12:.1f} TFLOP/s, fp32 {s['flop_per_s'] / 1e12:.1f} TFLOP/s, "
          f"h2d {out['h2d_pageable']['bytes_per_s'] / 1e9:.1f} GB/s, d2d {out['d2d_copy']['bytes_per_s'] / 1e9:.0f} GB/s")
    return 0


# ----------------------------------------------------------------------------- floors
def layer_shapes(config, layer: int) -> dict:
    """The quantized leaves' shapes of one layer (meta block): attention, one expert, shared."""
    from models.deepseek_v4.loading import empty_block

    blk = empty_block(config, layer)
    a, e, s = blk.attn, blk.ffn.experts[0], blk.ffn.shared_experts
    return {"wq_a": tuple(a.wq_a.weight.shape), "wkv": tuple(a.wkv.weight.shape), "wq_b": tuple(a.wq_b.weight.shape),
            "wo_a": tuple(a.wo_a.weight.shape), "wo_b": tuple(a.wo_b.weight.shape), "groups": config.o_groups,
            "w1": tuple(e.w1.weight.shape), "w2": tuple(e.w2.weight.shape),
            "sw1": tuple(s.w1.weight.shape), "sw2": tuple(s.w2.weight.shape),
            "experts": config.n_routed_experts, "topk": config.n_activated_experts,
            "layer_params": sum(p.numel() for p in blk.parameters())}


def gptq_solve_flops(sh: dict) -> float:
    return sum(gptq_solve_flop_parts(sh).values())


def gptq_solve_flop_parts(sh: dict) -> dict[str, float]:
    """Cholesky x 2 + inverse, (4/3) C^3 MAC a Hessian; sweep R C^2 / 2 MAC a matrix; FLOP = 2 MAC;
    per unit kind (attention, all routed experts, the shared expert)."""
    def mat(r, c, hessians=1):
        return hessians * (4.0 / 3.0) * c ** 3 + r * c ** 2 / 2.0
    g = sh["groups"]
    attn = (mat(sh["wq_a"][0] + sh["wkv"][0], sh["wq_a"][1]) + mat(*sh["wq_b"])
            + g * mat(sh["wo_a"][0] // g, sh["wo_a"][1]) + mat(*sh["wo_b"]))
    expert = mat(2 * sh["w1"][0], sh["w1"][1]) + mat(*sh["w2"])
    shared = mat(2 * sh["sw1"][0], sh["sw1"][1]) + mat(*sh["sw2"])
    return {"attn": 2.0 * attn, "experts": 2.0 * sh["experts"] * expert, "shared_expert": 2.0 * shared}


def hessian_flops(sh: dict, tokens: int, all_experts: bool, llmc: bool) -> float:
    """2 T C^2 per accumulated Hessian (see the module doc)."""
    dim, inter, g = sh["w1"][1], sh["w2"][1], sh["groups"]
    cg = sh["wo_a"][1]
    if llmc:   # per module: q_a, kv, q_b, o_a (groups pooled: T*g rows), o_b
        attn = tokens * (2 * dim ** 2 + sh["wq_b"][1] ** 2 + g * cg ** 2 + sh["wo_b"][1] ** 2)
        per_expert_in = (2 * dim ** 2 + inter ** 2)
        shared = tokens * per_expert_in
    else:      # shared inputs: x (wq_a | wkv), qr, per group, wo_b; w1 | w3 one Hessian
        attn = tokens * (dim ** 2 + sh["wq_b"][1] ** 2 + g * cg ** 2 + sh["wo_b"][1] ** 2)
        per_expert_in = dim ** 2 + inter ** 2
        shared = tokens * per_expert_in
    expert_tokens = tokens * (sh["experts"] if all_experts else sh["topk"])
    return 2.0 * (attn + expert_tokens * per_expert_in + shared)


# ----------------------------------------------------------------------------- rows
def _stats(xs: list[float]) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _fmt(st: dict | None, digits: int = 1) -> str:
    if st is None:
        return "-"
    s = f"{st['median']:.{digits}f}"
    if st["n"] > 1:
        s += f" [{st['min']:.{digits}f}-{st['max']:.{digits}f}]"
    return s


def _gib(st: dict | None) -> str:
    return "-" if st is None else f"{st['median'] / G:.1f}"


def what_of(tag: str, run_args: dict) -> tuple[str, str, str]:
    """(kind, scheme, algo) of a run of ours from its tag and recorded bench args."""
    extra = list(run_args.get("extra") or [])
    scheme = extra[extra.index("--scheme") + 1] if "--scheme" in extra else "w8a8"
    algo = run_args.get("algo")
    rest = [x for i, x in enumerate(extra) if x != "--scheme" and (i == 0 or extra[i - 1] != "--scheme")]
    if tag.startswith("def-"):
        try:
            from amct_ext.algorithms.recipe import default_recipe

            algo = f"default (`{default_recipe(scheme)[0]}`)"
        except Exception:  # noqa: BLE001  an older tree: name it by the tag only
            algo = "default"
        return "default", scheme, algo
    if tag.startswith("gptq-"):
        return "gptq", scheme, f"`{algo}`"
    return "alternative", scheme, "`" + " ".join([f"--algo {algo}"] * bool(algo) + rest) + "`"


def recipe_text(entries: list[dict]) -> str | None:
    """The --algo string of a run's recorded recipe (ptq_params/meta.json solver.recipe): each
    algorithm with the options that differ from its defaults, so a default run is named by what
    RAN, not by what the tree's default is today."""
    try:
        from amct_ext.algorithms.recipe import recipe_label

        return recipe_label(entries)
    except Exception:  # noqa: BLE001  an older tree / an unknown algorithm: fall back to the tag
        return None


def failed_or_stopped(log: Path) -> str:
    """A run without its result: the error it ended with, else how far its time limit let it get."""
    from defaults_table import stopped

    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    err = [ln for ln in lines if ln.startswith("error: ") or "Error: " in ln.split(" ", 1)[0] + " "]
    if err and "KeyboardInterrupt" not in err[-1]:
        return "failed: " + err[-1][:400]
    return stopped(log)


def ours_rows(res: Path, layer: int, rates: dict, sh: dict | None) -> list[dict]:

    groups: dict[str, list[Path]] = {}
    for p in sorted(res.glob("ours_*.r*.json")):
        if p.name.endswith(".meta.json"):
            continue
        groups.setdefault(p.name[len("ours_"):].rsplit(".r", 1)[0], []).append(p)
    # a run killed before bench_ptq wrote its JSON (its limit hit in the probes after the layer, say)
    # still has its log: listed as stopped, never dropped from the table
    for log in sorted(res.glob("ours_*.r*.log")):
        if not log.with_suffix(".json").is_file():
            groups.setdefault(log.name[len("ours_"):].rsplit(".r", 1)[0], []).append(log.with_suffix(".json"))
    rows = []
    for tag, files in groups.items():
        recs, logs, stops, meta = [], [], [], None
        kind = scheme = algo = None
        for f in files:
            # what ran, from the layer's saved parameters beside the run (absent: an older run)
            m = f.with_name(f.name[: -len(".json")] + ".meta.json")
            mj = json.loads(m.read_text()) if m.is_file() else None
            ran = recipe_text(mj.get("solver", {}).get("recipe") or []) if mj else None
            if not f.is_file():      # no JSON: the scheme and recipe come from meta.json alone
                kind, scheme, algo = what_of(tag, {})
                scheme = (mj or {}).get("scheme") or scheme
                if ran:
                    algo = f"default (`{ran}`)" if kind == "default" else f"`{ran}`"
                stops.append(failed_or_stopped(f.with_suffix(".log")) + " (no JSON written)")
                continue
            try:
                r = json.loads(f.read_text())
            except (OSError, ValueError) as e:
                stops.append(f"unreadable JSON {f.name}: {e}")
                continue
            kind, scheme, algo = what_of(tag, r.get("args", {}))
            p = r.get("ptq")
            if mj:
                meta = mj.get("calibration", {}).get("windows_sha256")
                if kind == "default" and ran:
                    algo = f"default (`{ran}`)"
            if not p:
                stops.append(failed_or_stopped(f.with_suffix(".log")))
                continue
            rec = p["per_layer"].get(str(layer)) or p["per_layer"].get(layer)
            if rec is None:
                stops.append(f"no record of layer {layer}")
                continue
            ph = rec["phases"]
            cap = ph.get("capture", {}).get("seconds", 0.0)
            solve = sum(v["seconds"] for k, v in ph.items() if k.startswith("solve:"))
            once = p["outside_layers_s"] - p["float_predecessors"]["seconds"]
            recs.append({"capture_s": cap, "solve_s": solve, "capture_solve_s": cap + solve, "layer_s": rec["seconds"],
                         # sequential GPTQ's re-runs of the layer (one per later stage), inside its solve
                         "recollect_s": rec.get("recollect_seconds", 0.0),
                         "recollect_forwards": rec.get("recollect_forwards", 0),
                         # [unit kinds, leaves, seconds] per re-run (absent in runs before 2026-12-02c)
                         "recollect_runs": rec.get("recollect_runs", []),
                         "host": rec["host_peak_bytes"], "anon": rec["host_anon_peak_bytes"],
                         # a run cut after its layer, in bench_ptq's probes, has no floors: still a row
                         "device": rec["device_peak_bytes"], "floors": rec.get("floors", {}),
                         "kinds": {k: v["seconds"] for k, v in rec.get("unit_seconds_by_kind", {}).items()},
                         "samples": p["report"]["calibration"]["samples"],
                         "seq_len": p["report"]["calibration"]["seq_len"],
                         "projection_min": (FLASH_LAYERS * rec["seconds"] + once) / 60.0})
        row = {"source": "ours", "tag": tag, "kind": kind or tag.split("-")[0], "scheme": scheme, "algo": algo,
               "runs": len(recs), "stopped": stops, "windows_sha256": meta}
        if recs:
            row["windows"] = recs[0]["samples"]
            row["seq_len"] = recs[0]["seq_len"]
            for k in ("capture_s", "solve_s", "capture_solve_s", "layer_s", "host", "anon", "device", "projection_min",
                      "recollect_s"):
                row[k] = _stats([x[k] for x in recs])
            row["recollect_forwards"] = recs[0]["recollect_forwards"]
            if recs[0]["recollect_runs"]:   # per re-run: median over the runs of the row
                # the median over the runs that have the j-th re-run (older or cut runs may not)
                row["recollect_runs"] = [[run[0], statistics.median(x["recollect_runs"][j][2] for x in recs
                                                                    if len(x["recollect_runs"]) > j)]
                                         for j, run in enumerate(recs[0]["recollect_runs"])]
            row["kinds_s"] = {k: statistics.median([x["kinds"].get(k, 0.0) for x in recs]) for k in recs[0]["kinds"]}
            f0 = recs[0]["floors"]
            row["bench_flop_floor_s"] = f0.get("solve_flops_floor_s")
            row["h2d_floor_s"] = f0.get("h2d_floor_s")
            if sh and rates and kind == "gptq":
                t = row["windows"] * row["seq_len"]
                fp32 = rates["matmul_fp32"]["flop_per_s"]
                row["gptq_floor_s"] = gptq_solve_flops(sh) / fp32
                row["hessian_floor_s"] = hessian_flops(sh, t, all_experts="all_tokens=true" in (algo or ""),
                                                       llmc=False) / fp32
        rows.append(row)
    return rows


def llmc_rows(res: Path, rates: dict, sh: dict | None) -> list[dict]:
    groups: dict[str, list[Path]] = {}
    for p in sorted(res.glob("llmc_*.r*.json")):
        groups.setdefault(p.name[len("llmc_"):].rsplit(".r", 1)[0], []).append(p)
    rows = []
    for tag, files in sorted(groups.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
        recs, stops, info = [], [], {}
        for f in files:
            r = json.loads(f.read_text())
            info = r
            if "oneshot_s" not in r:
                ph = r.get("phases", {})
                stops.append(r.get("error", "stopped") + (f" (load {ph['load']['seconds']:.1f} s)" if "load" in ph else ""))
                continue
            o = r["phases"]["oneshot"]
            recs.append({"oneshot_s": r["oneshot_s"], "load_s": r["phases"]["load"]["seconds"],
                         "host": o["host_peak_bytes"], "anon": o["host_anon_peak_bytes"],
                         "device": max(o["device_peak_bytes"], r["phases"]["load"]["device_peak_bytes"])})
        cal = info.get("calibration", {})
        all_exp = info.get("recipe", {}).get("moe_calibrate_all_experts", True)
        row = {"source": "llm-compressor", "tag": f"llmc-{tag}", "kind": "peer",
               "scheme": info.get("args", {}).get("scheme"), "runs": len(recs), "stopped": stops,
               "algo": f"llm-compressor {info.get('versions', {}).get('llmcompressor')} GPTQ"
                       + ("" if all_exp else " (routed tokens only)"),
               "windows": cal.get("samples"), "seq_len": cal.get("seq_len"),
               "windows_sha256": cal.get("windows_sha256"), "same_windows_as_ours": cal.get("same_windows_as_ours"),
               "quantized_linears": info.get("quantized_linears"), "layers_quantized": info.get("layers_quantized")}
        if recs:
            for k in ("oneshot_s", "load_s", "host", "anon", "device"):
                row[k] = _stats([x[k] for x in recs])
            row["layer_s"] = row["solve_s"] = row["oneshot_s"]
        if sh and rates and row["windows"]:
            fp32 = rates["matmul_fp32"]["flop_per_s"]
            row["gptq_floor_s"] = gptq_solve_flops(sh) / fp32
            row["hessian_floor_s"] = hessian_flops(sh, row["windows"] * row["seq_len"], all_experts=all_exp,
                                                   llmc=True) / fp32
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------- output
def markdown(rows: list[dict], rates: dict, sh: dict | None, env: str) -> str:
    bound = (sh["layer_params"] * 2 + HOST_SLACK) if sh else None
    lines = ["# One real-size layer per recipe: every default recipe, GPTQ beside llm-compressor", ""]
    if env:
        lines += ["Machine: " + "; ".join(x for x in env.splitlines() if x.strip()), ""]
    if rates:
        lines += [f"Rates measured in this run: bf16 matmul {rates['matmul_bf16']['flop_per_s'] / 1e12:.0f} TFLOP/s, "
                  f"fp32 {rates['matmul_fp32']['flop_per_s'] / 1e12:.1f} TFLOP/s ({rates['matmul_fp32']['n']}^3), "
                  f"host-to-device {rates['h2d_pageable']['bytes_per_s'] / 1e9:.1f} GB/s (pageable), device copy "
                  f"{rates['d2d_copy']['bytes_per_s'] / 1e9:.0f} GB/s.", ""]
    lines += ["| run | scheme | recipe | windows | capture s | solve s | capture + solve s | layer s | "
              "host RSS GiB (anon) | device peak GiB | GPTQ solve floor s | Hessian floor s | bench FLOP floor s | "
              "h2d floor s | V4-Flash projected min | targets |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    order = {"default": 0, "alternative": 1, "gptq": 2, "peer": 3}
    rows = sorted(rows, key=lambda r: (order.get(r["kind"], 9), r.get("windows") or 0, r["tag"]))
    for r in rows:
        if not r.get("runs"):
            lines.append(f"| {r['tag']} | {r.get('scheme') or '-'} | {r.get('algo') or '-'} | {r.get('windows') or '-'} | "
                         + "; ".join(r["stopped"])[:900].replace("|", "/") + " |" + " |" * 11)
            continue
        fl = lambda k: f"{r[k]:.3g}" if r.get(k) is not None else "-"  # noqa: E731
        verdict = []
        if r["source"] == "ours":
            cs = r["capture_solve_s"]["median"]
            if r["kind"] == "default":
                verdict.append(f"{'met' if cs <= 60 else 'MISSED'} <= 60 s")
            if r["kind"] == "gptq":
                verdict.append(f"solve {'met' if r['solve_s']['median'] <= 20 else 'MISSED'} <= 20 s")
                if r.get("recollect_forwards"):
                    rest = r["solve_s"]["median"] - r["recollect_s"]["median"]
                    each = ""
                    if r.get("recollect_runs"):
                        each = " (" + ", ".join(f"{k} {s_:.1f}" for k, s_ in r["recollect_runs"]) + ")"
                    verdict.append(f"of the solve, {r['recollect_forwards']} re-runs of the layer "
                                   f"{r['recollect_s']['median']:.1f} s{each}, the rest {rest:.1f} s")
                peer = next((p for p in rows if p["source"] != "ours" and p.get("windows") == r["windows"]
                             and p.get("oneshot_s")), None)
                if peer:
                    verdict.append(f"{'ahead of' if cs < peer['oneshot_s']['median'] else 'BEHIND'} llm-compressor "
                                   f"({peer['oneshot_s']['median']:.1f} s)")
            if bound:
                verdict.append(f"anon {'<=' if r['anon']['median'] <= bound else '>'} bound {bound / G:.1f} GiB")
            verdict.append(f"device {'<=' if r['device']['median'] <= DEVICE_BOUND else '>'} 64 GB")
            if r["kind"] == "default":
                verdict.append(f"projection {'met' if r['projection_min']['median'] <= 45 else 'MISSED'} <= 45 min")
            kinds = ", ".join(f"{k} {v:.1f}" for k, v in r.get("kinds_s", {}).items())
            solve = _fmt(r["solve_s"]) + (f" ({kinds})" if kinds else "")
            cells = [_fmt(r["capture_s"]), solve, _fmt(r["capture_solve_s"]), _fmt(r["layer_s"])]
            proj = _fmt(r["projection_min"])
        else:
            cells = ["(in oneshot)", "(in oneshot)", _fmt(r["oneshot_s"]) + " (oneshot)",
                     _fmt(r["oneshot_s"]) + f" (+ load {_fmt(r['load_s'])})"]
            proj = "-"
            if r.get("same_windows_as_ours") is not None:
                verdict.append("same windows as ours" if r["same_windows_as_ours"] else "OTHER windows than ours")
            if r.get("quantized_linears"):
                verdict.append(f"{r['quantized_linears']} Linears in layers {r.get('layers_quantized')}")
        if r.get("stopped"):
            verdict.append(f"{len(r['stopped'])} run(s) stopped/failed")
        lines.append(f"| {r['tag']} | {r.get('scheme') or '-'} | {r.get('algo') or '-'} | "
                     f"{r.get('windows')} x {r.get('seq_len')} | " + " | ".join(cells) +
                     f" | {_gib(r['host'])} ({_gib(r['anon'])}) | {_gib(r['device'])} | {fl('gptq_floor_s')} | "
                     f"{fl('hessian_floor_s')} | {fl('bench_flop_floor_s')} | {fl('h2d_floor_s')} | {proj} | "
                     + "; ".join(verdict) + " |")
    lines += ["", "Cells: median over the runs of a row, [min-max] when there are several. Ours: capture and solve "
              "are the layer's phases (bench_ptq; solve split by unit kind), layer s adds build, write and release; "
              "the float layers before it are not counted. llm-compressor: `oneshot` alone (its calibration forward "
              "of every layer, the other layers propagated in float, its Hessians and its solve), the whole model "
              "resident on the device; its load is beside it. Floors: see benchmarks/scripts/recipe_speed_table.py "
              "(GPTQ: Cholesky + inverse + sweep at the fp32 rate; Hessians: 2 T C^2 per accumulated Hessian; "
              "bench_ptq's learned-clip FLOPs at the bf16 rate and captured bytes at the h2d bandwidth).",
              "", "V4-Flash projection: 43 layers (2 ratio-0 + 21 ratio-4 + 20 ratio-128), each costed like this "
              "ratio-4 layer (the slowest kind: an upper bound of the layer work), plus the run's once-only work "
              "outside its layers (setup, calibration, embedding; not the float predecessor layers, which a "
              "whole-model run never recomputes)."
              + (f" Host bound: one layer's bf16 weights {sh['layer_params'] * 2 / G:.1f} GiB + 16 GB = "
                 f"{bound / G:.1f} GiB anonymous." if sh else ""), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--probe", type=Path, default=None, help="measure the rates into this JSON and exit")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--small", action="store_true", help="small probe sizes (CPU)")
    ap.add_argument("--results", type=Path, default=None)
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--gptq-scheme", default="w8a8")
    ap.add_argument("--ckpt", type=Path, default=None, help="the checkpoint (default RESULTS/../ckpt)")
    ap.add_argument("--md", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.probe:
        return probe(a.probe, a.device, a.small)
    if a.results is None or not a.results.is_dir():
        print(f"error: --results {a.results}: no such folder", file=sys.stderr)
        return 2
    rates = json.loads((a.results / "rates.json").read_text()) if (a.results / "rates.json").is_file() else {}
    ckpt = a.ckpt or a.results.parent / "ckpt"
    sh = None
    cfg_file = ckpt / "config.json" if (ckpt / "config.json").is_file() else a.results / "ckpt_config.json"
    if cfg_file.is_file():   # the checkpoint's config (a copy in the results once the checkpoint is gone)
        from models.deepseek_v4.configuration import DeepseekV4Config

        sh = layer_shapes(DeepseekV4Config(**json.loads(cfg_file.read_text())), a.layer)
    rows = ours_rows(a.results, a.layer, rates, sh) + llmc_rows(a.results, rates, sh)
    env = (a.results / "env.txt").read_text() if (a.results / "env.txt").is_file() else ""
    md = markdown(rows, rates, sh, env)
    from amct_ext.io.io_utils import atomic_write, atomic_write_json

    if a.md:
        atomic_write(a.md, lambda tmp: Path(tmp).write_text(md, encoding="utf-8"))
    if a.json:
        atomic_write_json({"rows": rows, "rates": rates, "layer_shapes": sh, "env": env}, a.json)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
