#!/usr/bin/env python
"""The main job (``amct_ext.pipeline.job_runner.run_job``, planned by ``amct_ext.pipeline.options.plan_job``
from run_ptq's flags) on a synthetic V4-shaped checkpoint, phase by phase.

    python benchmarks/bench_ptq.py --device cuda --json $OUT/ptq.json               # 4-layer V4-Flash, 128 x 2048
    python benchmarks/bench_ptq.py --device cuda --algo gptq --json $OUT/gptq.json    # once --algo exists
    python benchmarks/bench_ptq.py --smoke                                            # tiny dims, CPU (CI)

What runs: ``tools/make_synthetic_checkpoint``'s writer (unless --model-path) builds a checkpoint
whose layers 0-3 are V4-Flash's (ratio 0 hash, ratio 0 hash, ratio 4 hash, ratio 128 score), then
``run_job(plan_job(options), phases=PhaseTimer)`` (the flags parsed into ``PtqOptions`` by run_ptq's
parser) -- the job's own code path, with its own defaults
(128 x 2048 calibration, w8a8, the default recipe); options after ``--`` and ``--algo`` go to
run_ptq unchanged. The PhaseTimer records, per layer, wall time and peak device / host memory of:
build (read + decode + wrap), capture (float forward with the unit hooks + static observation),
solve:<unit kind> (summed over the layer's units of that kind), write (parameter files), release.

Projection: the full model's layers are mapped to the measured layer of the same compress ratio
(ratio 4 score layers use the measured ratio 4 hash layer), plus embedding and setup once. The
other model (Pro when Flash was measured, and vice versa) is scaled by its per-kind layer
parameter count: an estimate, marked as such.

Floors per layer (printed beside the measurement): linear FLOPs of the solve passes (RTN loss,
``epochs`` x (forward + backward ~ 3 forwards), ``epochs`` x loss) over the measured bf16 matmul
rate, and the captured bytes moved to the device once per pass over the host-to-device bandwidth.
These count the passes of the learned-clip solver (``--legacy-solver``); a recipe (GPTQ's
Hessians, clipping's grid search) makes other passes, so for it they are indicative only.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import common as C  # noqa: E402
from common import D  # noqa: E402

from amct_ext.pipeline.phases import PhaseTimer  # noqa: E402

PHASES = ("build", "capture", "solve:recipe", "solve:attn", "solve:expert", "solve:shared_expert", "write", "release")
FULL_LAYERS = {"v4-flash": 43, "v4-pro": 61}


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--smoke", action="store_true", help="tiny dims on CPU, 1 x 48 calibration (CI)")
    ap.add_argument("--like", default="v4-flash", choices=("v4-flash", "v4-pro"))
    ap.add_argument("--layers", type=int, default=4, help="layers of the synthetic checkpoint")
    ap.add_argument("--model-path", default=None, help="use this checkpoint instead of writing one")
    ap.add_argument("--workdir", default=None, help="where the checkpoint and the PTQ output go (default: temp)")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--algo", default=None, help="passed to run_ptq as --algo (the algorithms of issue 13)")
    ap.add_argument("--start-layer", type=int, default=None)
    ap.add_argument("--end-layer", type=int, default=None)
    ap.add_argument("--calib-samples", type=int, default=None, help="default: run_ptq's (128 for V4)")
    ap.add_argument("--seq-len", type=int, default=None, help="default: run_ptq's (2048 for V4)")
    ap.add_argument("--matmul-n", type=int, default=None, help="matmul-rate probe size (default 8192; smoke 256)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--max-device-gib", type=float, default=None,
                    help="fail (exit 3) when a measured layer's device peak passes this bound")
    ap.add_argument("--max-host-anon-extra-gib", type=float, default=None,
                    help="fail (exit 3) when host anonymous memory passes the layer's bf16 weights + this")
    a = ap.parse_args(argv)
    a.extra = extra
    if a.smoke and a.device == "auto":
        a.device = "cpu"
    a.matmul_n = a.matmul_n or (256 if a.smoke else 8192)
    return a


def run_ptq_argv(a, ckpt: Path, out: Path, dev: torch.device) -> list[str]:
    model = "tiny" if a.smoke else a.like
    argv = ["--model", model, "--model-path", str(ckpt), "--output-dir", str(out), "--device", str(dev),
            "--quiet", "--no-eval-ppl"]
    if a.smoke:   # tiny defaults are fp32 / 8 x 128; keep CI short and exercise spilling
        argv += ["--calib-samples", "1", "--seq-len", "48", "--epochs", "1", "--capture-memory-gb", "0.00002"]
    for flag, v in (("--calib-samples", a.calib_samples), ("--seq-len", a.seq_len), ("--algo", a.algo),
                    ("--start-layer", a.start_layer), ("--end-layer", a.end_layer)):
        if v is not None:
            argv += [flag, str(v)]
    return argv + a.extra


_PARAMS_CACHE: dict = {}


def layer_linear_params(config, layer_id: int) -> dict[str, int]:
    """Weight elements per unit kind of one layer (meta build, no memory): attention (with its
    compressor / indexer), ONE routed expert, the shared expert; plus the whole layer. A layer's
    counts depend only on its compress ratio and routing (cached: a V4-Pro meta block takes ~0.3 s)."""
    from models.deepseek_v4.loading import empty_block

    key = (config.dim, config.n_heads, config.head_dim, config.q_lora_rank, config.o_lora_rank, config.o_groups,
           config.n_routed_experts, config.moe_inter_dim, config.index_n_heads, config.vocab_size,
           config.compress_ratios[layer_id], layer_id < config.n_hash_layers)
    if key in _PARAMS_CACHE:
        return _PARAMS_CACHE[key]

    blk = empty_block(config, layer_id)
    attn = sum(p.numel() for n, p in blk.attn.named_parameters() if p.dim() == 2)
    expert = sum(p.numel() for p in blk.ffn.experts[0].parameters())
    shared = sum(p.numel() for p in blk.ffn.shared_experts.parameters())
    total = sum(p.numel() for p in blk.parameters())
    _PARAMS_CACHE[key] = {"attn": attn, "expert": expert, "shared_expert": shared, "layer": total}
    return _PARAMS_CACHE[key]


def solve_flops(config, layer_id: int, n_tokens: int, epochs: int) -> float:
    """Linear-layer FLOPs of one layer's solve: 2 * tokens * weights per forward; passes = RTN loss
    + epochs * (forward + backward ~ 3 forwards) + epochs * loss = 1 + 4 * epochs forwards."""
    p = layer_linear_params(config, layer_id)
    per_fwd = 2.0 * n_tokens * (p["attn"] + config.n_activated_experts * p["expert"] + p["shared_expert"])
    return per_fwd * (1 + 4 * epochs)


def bound_violations(per_layer: dict[int, dict], layer_bytes: dict[int, int], max_device_gib: float | None,
                     max_host_anon_extra_gib: float | None) -> list[str]:
    """The memory bounds, read from the run's own phase accounting (PhaseTimer: each phase's
    device peak and host anonymous peak): one line per layer and bound passed."""
    out = []
    for i, rec in per_layer.items():
        dev_peak = rec["device_peak_bytes"] / 2 ** 30
        if max_device_gib is not None and dev_peak > max_device_gib:
            worst = max(rec["phases"].items(), key=lambda kv: kv[1]["device_peak_bytes"])[0]
            out.append(f"layer {i}: device peak {dev_peak:.1f} GiB (phase {worst}) > {max_device_gib:g} GiB")
        if max_host_anon_extra_gib is not None:
            bound = layer_bytes[i] / 2 ** 30 + max_host_anon_extra_gib
            anon = rec["host_anon_peak_bytes"] / 2 ** 30
            if anon > bound:
                out.append(f"layer {i}: host anonymous peak {anon:.1f} GiB > the layer's weights "
                           f"{layer_bytes[i] / 2 ** 30:.1f} GiB + {max_host_anon_extra_gib:g} GiB")
    return out


def block_step_floors(config, layer_id: int, n_tokens: int, matmul_flops: float, copy_bytes_per_s: float,
                      offset_bytes: int = 4) -> dict[str, float]:
    """Floors of one block-wise rounding step on ``n_tokens`` (RESULTS: beside the step's time).

    FLOPs: the layer's linears forward (2 x tokens x active weights), the backward (twice that:
    input and weight gradients), and the recomputed forward of the checkpointed units; over the
    bf16 matmul rate. Bytes: every weight read (bf16) three times (forward, recompute, backward:
    fake quantization), its offset read three times and written once, the fake-quant weight
    written twice and read three times by the GEMMs, its gradient written and read once (bf16);
    over the copy bandwidth."""
    p = layer_linear_params(config, layer_id)
    active = p["attn"] + config.n_activated_experts * p["expert"] + p["shared_expert"]
    flops = 2.0 * n_tokens * active * (1 + 2 + 1)
    weights = p["attn"] + config.n_routed_experts * p["expert"] + p["shared_expert"]
    per_weight = 3 * 2 + 4 * offset_bytes + 5 * 2 + 2 * 2
    return {"flops": flops, "flops_floor_s": flops / matmul_flops,
            "bytes": weights * per_weight, "bytes_floor_s": weights * per_weight / copy_bytes_per_s}


def ratio_kind(config, i: int) -> str:
    return f"ratio{config.compress_ratios[i]}"


def summarize(timer: PhaseTimer, layers: range) -> dict[int, dict]:
    out = {}
    for i in layers:
        by = timer.by_name(layer=i)
        rec = {"phases": by, "seconds": sum(v["seconds"] for v in by.values()),
               "device_peak_bytes": max((v["device_peak_bytes"] for v in by.values()), default=0),
               "host_peak_bytes": max((v["host_peak_bytes"] for v in by.values()), default=0),
               "host_anon_peak_bytes": max((v["host_anon_peak_bytes"] for v in by.values()), default=0)}
        cap = [r for r in timer.records if r.layer == i and r.name == "capture"]
        rec["capture_bytes"] = sum(r.tags.get("capture_bytes", 0) for r in cap)
        rec["spilled_bytes"] = sum(r.tags.get("spilled_bytes", 0) for r in cap)
        # a recipe that replays no calls stores none: per-leaf Hessians instead (device memory)
        rec["hessian_bytes"] = sum(r.tags.get("hessian_bytes", 0) for r in cap)
        # the capture's own accounting: calls kept + waiting to be spilled (the store), and all
        # call data alive at once over the capture and the solve (capture.CALL_METER)
        rec["store_peak_bytes"] = max((r.tags.get("in_memory_peak_bytes", 0) for r in cap), default=0)
        rec["call_memory_peak_bytes"] = max((r.tags.get("call_memory_peak_bytes", 0) for r in timer.records
                                             if r.layer == i), default=0)
        # sequential GPTQ on statistics re-runs the layer once per later stage, inside its solve
        solve = [r for r in timer.records if r.layer == i and r.name.startswith("solve:")]
        rec["recollect_seconds"] = sum(r.tags.get("recollect_seconds", 0.0) for r in solve)
        rec["recollect_forwards"] = sum(r.tags.get("recollect_forwards", 0) for r in solve)
        rec["recollect_runs"] = [run for r in solve for run in r.tags.get("recollect_runs", [])]
        out[i] = rec
    return out


def project(measured: dict[int, dict], config_measured, like: str, once_s: float) -> dict:
    """Totals of the full V4-Flash / V4-Pro from the per-layer measurements (see module doc)."""
    from models.deepseek_v4.configuration import DeepseekV4Config
    from models.deepseek_v4.synthetic import base_config_dict

    by_ratio: dict[str, list[float]] = {}
    params_by_ratio: dict[str, int] = {}
    for i, rec in measured.items():
        k = ratio_kind(config_measured, i)
        by_ratio.setdefault(k, []).append(rec["seconds"])
        params_by_ratio[k] = layer_linear_params(config_measured, i)["layer"]
    per_kind = {k: sum(v) / len(v) for k, v in by_ratio.items()}
    out = {"per_ratio_layer_s": per_kind}
    for target in FULL_LAYERS:
        full = DeepseekV4Config(**json.loads(json.dumps(base_config_dict(target))))
        total, missing, scaled = once_s, set(), target != like
        for i in range(full.n_layers):
            k = ratio_kind(full, i)
            if k not in per_kind:
                missing.add(k)
                continue
            s = per_kind[k]
            if scaled:  # the other model: scale by its layer's parameter count
                s *= layer_linear_params(full, i)["layer"] / params_by_ratio[k]
            total += s
        out[target] = {"layers": full.n_layers, "total_s": total, "total_min": total / 60,
                       "per_layer_mean_s": (total - once_s) / full.n_layers,
                       "how": ("scaled by layer parameter count from the measured " + like + " layers (estimate)"
                               if scaled else "measured layer of the same compress ratio, summed"),
                       "unmeasured_ratios": sorted(missing)}
    return out


def main(argv=None) -> int:
    a = parse_args(argv)
    # tools/run_ptq.py's parser only: this benchmark takes the job's own flags (after --) and
    # records them; the plan and the run are the library's (plan_job, run_job)
    import run_ptq
    from amct_ext.pipeline import job_runner
    from amct_ext.pipeline.options import plan_job

    # the recipe runner's per-kind progress and a block-level algorithm's steps (INFO): a run
    # stopped at its time limit still shows where the solve's time went
    for name in ("amct_ext.algorithms.runner", "amct_ext.algorithms.block_rounding"):
        solve_log = logging.getLogger(name)
        if not solve_log.handlers:
            h = logging.StreamHandler(sys.stdout)
            h.setFormatter(logging.Formatter("[solve] %(message)s"))
            solve_log.addHandler(h)
        solve_log.setLevel(logging.INFO)

    dev = D.resolve_device(a.device)
    results: dict = {"env": C.environment(dev), "args": {k: v for k, v in vars(a).items()}, "notes": []}
    made_tmp = a.workdir is None
    work = Path(a.workdir or tempfile.mkdtemp(prefix="bench_ptq_"))
    try:
        ckpt = Path(a.model_path) if a.model_path else work / "ckpt"
        if not a.model_path:
            from models.deepseek_v4.synthetic import write_synthetic_checkpoint

            t0 = time.perf_counter()
            w = write_synthetic_checkpoint(ckpt, "tiny" if a.smoke else a.like, a.layers, device=dev, seed=a.seed,
                                           log=lambda s: print(s, flush=True))
            results["synthetic_checkpoint"] = {"seconds": time.perf_counter() - t0, "bytes": w["total_bytes"],
                                               "shards": w["shards"]}
            print(f"synthetic checkpoint: {w['total_bytes'] / 2**30:.2f} GiB in "
                  f"{results['synthetic_checkpoint']['seconds']:.1f} s", flush=True)
        from models.deepseek_v4.loading import load_config

        config = load_config(ckpt)
        out = work / "ptq_out"
        argv = run_ptq_argv(a, ckpt, out, dev)
        results["run_ptq_argv"] = argv
        print("run_ptq", " ".join(argv), flush=True)
        args = run_ptq.build_parser().parse_args(argv)
        devices = [dev] if not getattr(args, "sharded_ptq", False) else D.device_list(dev.type)
        def live(r):
            if r.layer is not None:
                peak = max(r.device_peak_bytes.values(), default=0)
                print(f"[phase] layer {r.layer} {r.name}: {r.seconds:.2f} s, device peak {peak / 2**30:.1f} GiB, "
                      f"host RSS {r.host_peak_bytes / 2**30:.1f} GiB (anon {r.host_anon_peak_bytes / 2**30:.1f})"
                      + (f" {r.tags}" if r.tags else ""), flush=True)

        with PhaseTimer(devices, on_record=live) as timer:
            t0 = time.perf_counter()
            # the flags as the library's options, its checked plan, then its entry point
            job_runner.run_job(plan_job(run_ptq.options_from_args(args)), phases=timer, t_start=t0)
            rc = 0
            wall = time.perf_counter() - t0
        if rc != 0:
            print(f"run_ptq returned {rc}", flush=True)
            return rc
        report = json.loads((out / "report.json").read_text())
        layers = range(*report["layers"])
        per_layer = summarize(timer, layers)
        # a recipe run times its layer as one phase: the units' own seconds, per kind
        for rec_i, rec in per_layer.items():
            kinds: dict[str, dict] = {}
            for u in report["units"]:
                if u.get("layer") == rec_i:
                    k = kinds.setdefault(u["kind"], {"units": 0, "seconds": 0.0})
                    k["units"] += 1
                    k["seconds"] += u.get("seconds") or 0.0
            rec["unit_seconds_by_kind"] = kinds
            print(f"layer {rec_i} unit seconds by kind: "
                  + ", ".join(f"{k}: {v['seconds']:.2f} s ({v['units']} units)" for k, v in kinds.items()), flush=True)
        phase_total = sum(r.seconds for r in timer.records)
        once = wall - sum(rec["seconds"] for rec in per_layer.values())
        float_layers = sorted({r.layer for r in timer.records if r.layer is not None and r.layer not in layers})
        float_s = sum(r.seconds for r in timer.records if r.layer in float_layers)
        results["ptq"] = {"wall_s": wall, "phases_s": phase_total, "outside_layers_s": once,
                          "float_predecessors": {"layers": float_layers, "seconds": float_s},
                          "embed_s": sum(r.seconds for r in timer.records if r.name == "embed"),
                          "per_layer": per_layer, "report": {k: report[k] for k in
                                                             ("calibration", "dtype", "device", "ptq_runtime",
                                                              "peak_memory_bytes")},
                          "units": len(report["units"])}
        # ceilings and floors
        with torch.inference_mode():
            mm = C.matmul_rate(dev, a.matmul_n, repeats=5)
        from bench_load import h2d_bw

        h2d = h2d_bw(dev, (16 if a.smoke else 1024) * 2 ** 20, 3, pinned=False)
        results["ceilings"] = {"matmul_bf16": mm, "h2d_pageable": h2d}
        n_tok = report["calibration"]["samples"] * report["calibration"]["seq_len"]
        epochs = report["calibration"]["epochs"]
        for i, rec in per_layer.items():
            flops = solve_flops(config, i, n_tok, epochs)
            solve_s = sum(v["seconds"] for k, v in rec["phases"].items() if k.startswith("solve:"))
            rec["floors"] = {"solve_linear_flops": flops, "solve_flops_floor_s": flops / mm["flop_per_s"],
                             "solve_s": solve_s,
                             "capture_bytes_moved": rec["capture_bytes"] * (1 + 2 * epochs),
                             "h2d_floor_s": rec["capture_bytes"] * (1 + 2 * epochs) / h2d["bytes_per_s"]}
        # once per run: setup, calibration, embedding (float predecessors would be quantized layers)
        results["projection"] = project(per_layer, config, "tiny" if a.smoke else a.like, once - float_s)
        copy = C.copy_bandwidth(dev, (16 if a.smoke else 1024) * 2 ** 20, repeats=5)
        results["ceilings"]["copy"] = copy
        for i, rec in per_layer.items():
            rec["block_step_floors"] = block_step_floors(config, i, 8 * report["calibration"]["seq_len"],
                                                         mm["flop_per_s"], copy["bytes_per_s"])
        print_report(results, config)
        layer_bytes = {i: 2 * layer_linear_params(config, i)["layer"] for i in per_layer}
        violations = bound_violations(per_layer, layer_bytes, a.max_device_gib, a.max_host_anon_extra_gib)
        results["bounds"] = {"max_device_gib": a.max_device_gib, "max_host_anon_extra_gib": a.max_host_anon_extra_gib,
                             "layer_weight_bytes": layer_bytes, "violations": violations}
        for line in violations:
            print(f"BOUND PASSED: {line}", flush=True)
        if violations:
            return 3
    finally:
        C.write_json(a.json, results)
        if made_tmp and not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def print_report(r: dict, config) -> None:
    p = r["ptq"]
    print("\n==== bench_ptq ====")
    print(f"device {r['env']['device']}  torch {r['env']['torch']}  calibration "
          f"{p['report']['calibration']['samples']} x {p['report']['calibration']['seq_len']}  dtype "
          f"{p['report']['dtype']}  runtime {p['report']['ptq_runtime']}")
    rows = []
    for i, rec in p["per_layer"].items():
        ph = rec["phases"]
        kind = f"{config.compress_ratios[i]}/{'hash' if i < config.n_hash_layers else 'score'}"
        cells = [f"{i} ({kind})"] + [C.fmt_ms(ph[n]["seconds"] * 1e3) if n in ph else "-" for n in PHASES]
        f = rec["floors"]
        cells += [f"{rec['seconds']:.1f}", C.fmt_bytes(rec["device_peak_bytes"]),
                  f"{C.fmt_bytes(rec['host_peak_bytes'])} ({C.fmt_bytes(rec['host_anon_peak_bytes'])})",
                  C.fmt_bytes(rec["capture_bytes"]), C.fmt_bytes(rec.get("call_memory_peak_bytes", 0)),
                  f"{f['solve_flops_floor_s']:.2f}", f"{f['h2d_floor_s']:.2f}"]
        rows.append(cells)
    print(C.table(rows, ["layer"] + [f"{n} ms" for n in PHASES] +
                  ["total s", "dev peak", "host RSS peak (anon)", "captured", "calls held at once (accounted)",
                   "flop floor s", "h2d floor s"]))
    fp = p["float_predecessors"]
    print(f"outside the quantized layers: {p['outside_layers_s']:.1f} s (float predecessor layers {fp['layers']}: "
          f"{fp['seconds']:.1f} s; embedding {p['embed_s']:.1f} s; the rest is setup, calibration, report); "
          f"wall {p['wall_s']:.1f} s")
    for name in FULL_LAYERS:
        pr = r["projection"][name]
        print(f"projection {name}: {pr['layers']} layers, {pr['total_min']:.1f} min "
              f"({pr['per_layer_mean_s']:.1f} s/layer; {pr['how']}"
              + (f"; no measurement for {pr['unmeasured_ratios']}" if pr["unmeasured_ratios"] else "") + ")")


if __name__ == "__main__":
    raise SystemExit(main())
