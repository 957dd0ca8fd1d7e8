#!/usr/bin/env python
"""llm-compressor 0.14's GPTQ on ONE decoder layer of a (synthetic) V4 checkpoint: its speed
beside ours at real size (issue 24 item 4; benchmarks/scripts/h200_recipe_speed.sh runs it).

    PYTHONPATH=SITE python3 benchmarks/peer_llmcompressor_layer.py --model BF16_DIR --layer 2 \\
        --windows 32 --seq-len 2048 --device cuda --json OUT.json

- Model: transformers' ``DeepseekV4ForCausalLM`` from the bf16 copy of the checkpoint
  (benchmarks/scripts/release_to_bf16.py), bf16, every tensor on ``--device`` (the whole model
  resident, as in the issue's measurement); a missing or mismatched tensor is an error. The
  routed experts are unfused with ``linearize_moe`` (casebook/peer-llm-compressor.md P1, P2).
- Targets: the project's default set (attn-linear + moe: q_a / q_b / kv / o_a / o_b, routed and
  shared experts' gate / up / down; ``peer_llmcompressor.TARGETS``), restricted to ``--layer``:
  the other layers run in float, unquantized (the issue's "layers 0-1 ignored"). The quantized
  module count is recorded (a V4-Flash layer: 5 + 3 x 256 + 3 = 776 Linears, as ours).
- Calibration: the SAME windows as ours: ``amct_ext.pipeline.calibration.load_calibration_windows``
  on the checkpoint's tokenizer, the default text, ``--windows`` x ``--seq-len``, seed 0 (what
  run_ptq draws); their sha256 (``workflow.windows_sha256``) is recorded and, with ``--ours-meta``
  (our run's ptq_params/meta.json), checked equal.
- GPTQ at llm-compressor's defaults as peer_llmcompressor.py runs it (block 128, dampening 0.01,
  no act-order, min-max observer), scheme ``--scheme`` (w8a8: int8 symmetric per-channel weights,
  dynamic per-token activations; or w4a16-g128), ``moe_calibrate_all_experts`` at its default
  True unless ``--routed-only``.
- Timed: ``oneshot`` alone (calibration forward of every layer, Hessians, the solve), wall clock
  with a device synchronize at both ends, its device allocator peak and host RSS / anonymous
  peak (``amct_ext.pipeline.phases.PhaseTimer``, the accounting bench_ptq uses); the load is a
  phase of its own.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

G = 2 ** 30


def fail(msg: str):
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def layer_targets(layer: int) -> list[str]:
    """peer_llmcompressor.TARGETS restricted to decoder layer ``layer``."""
    from peer_llmcompressor import TARGETS

    out = []
    for t in TARGETS:
        body = t[len("re:"):]
        if not body.startswith(".*\\."):
            raise AssertionError(f"unexpected target pattern {t}")
        out.append(rf"re:.*\.layers\.{layer}\." + body[len(".*\\."):])
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="bf16 copy (release names), e.g. /tmp/recipe_speed/bf16")
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--windows", type=int, required=True)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--calib-data", type=Path, default=None, help="default: the project's calibration text")
    ap.add_argument("--scheme", default="w8a8", choices=("w8a8", "w4a16-g128"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    ap.add_argument("--routed-only", dest="all_experts", action="store_false",
                    help="moe_calibrate_all_experts=False (llm-compressor's default is True)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ours-meta", type=Path, default=None,
                    help="our run's ptq_params/meta.json: its calibration windows' sha256 must equal these")
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args(argv)
    if not (a.model / "config.json").is_file():
        fail(f"{a.model}: no config.json (make the bf16 copy first: benchmarks/scripts/release_to_bf16.py)")
    cfg = json.loads((a.model / "config.json").read_text())
    if cfg.get("quantization_config"):
        fail(f"{a.model}/config.json has a quantization_config: pass the bf16 copy, not the FP8 release layout")
    n = int(cfg.get("num_hidden_layers", 0))
    if not 0 <= a.layer < n:
        fail(f"--layer {a.layer}: the checkpoint has layers 0..{n - 1}")
    if a.windows < 1 or a.seq_len < 2:
        fail(f"--windows {a.windows} / --seq-len {a.seq_len}: need >= 1 / >= 2")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    import torch

    from amct_ext.io.io_utils import atomic_write_json
    from amct_ext.pipeline.calibration import DEFAULT_CALIBRATION_PATH, load_calibration_windows
    from amct_ext.pipeline.phases import PhaseTimer
    from amct_ext.pipeline.workflow import windows_sha256
    from amct_ext.runtime import device as devmod

    if a.threads:
        torch.set_num_threads(a.threads)
    dev = devmod.resolve_device(a.device)
    res: dict = {"what": "llm-compressor GPTQ, one layer", "args": {k: str(v) for k, v in vars(a).items()},
                 "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
                 "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "device": str(dev)}}

    def save():
        a.json.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(res, a.json)

    from peer_llmcompressor import SCHEMES, quantized_modules, versions

    res["versions"] = versions()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(a.model))
    calib_path = a.calib_data or Path(DEFAULT_CALIBRATION_PATH)
    calib = load_calibration_windows(calib_path, tok, a.seq_len, a.windows, a.seed)
    res["calibration"] = {"samples": a.windows, "seq_len": a.seq_len, "seed": a.seed, "text": str(calib_path),
                          "windows_sha256": windows_sha256(calib)}
    if a.ours_meta is not None:
        ours = json.loads(a.ours_meta.read_text())["calibration"].get("windows_sha256")
        res["calibration"]["ours_windows_sha256"] = ours
        res["calibration"]["same_windows_as_ours"] = ours == res["calibration"]["windows_sha256"]
        if not res["calibration"]["same_windows_as_ours"]:
            save()
            fail(f"{a.ours_meta}: our run's calibration windows differ from these ({ours} vs "
                 f"{res['calibration']['windows_sha256']}): not the same protocol")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    records = []

    def log(r):
        peak = max(r.device_peak_bytes.values(), default=0)
        print(f"[phase] {r.name}: {r.seconds:.2f} s, device peak {peak / G:.1f} GiB, host RSS "
              f"{r.host_peak_bytes / G:.1f} GiB (anon {r.host_anon_peak_bytes / G:.1f})", flush=True)
        records.append({"name": r.name, "seconds": r.seconds, "device_peak_bytes": peak,
                        "host_peak_bytes": r.host_peak_bytes, "host_anon_peak_bytes": r.host_anon_peak_bytes,
                        "tags": r.tags})
        res["phases"] = {x["name"]: x for x in records}
        save()

    try:
        with PhaseTimer([dev], on_record=log) as timer:
            with timer.phase("load"):
                model, info = AutoModelForCausalLM.from_pretrained(
                    str(a.model), dtype=dtype, device_map=str(dev), output_loading_info=True)
                bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "mismatched_keys")}
                if bad:
                    fail(f"{a.model}: transformers did not load every tensor: {str(bad)[:500]}")
                if dtype == torch.bfloat16:
                    # transformers 5.17 keeps V4's norms and hyper-connections in fp32
                    # (_keep_in_fp32_modules_strict); its bf16 forward then feeds an fp32 RMSNorm
                    # output into a bf16 Linear and fails (casebook/peer-llm-compressor.md P12).
                    # The whole model in bf16 runs; ours keeps those islands in fp32 (cheap ops).
                    model.to(torch.bfloat16)
                    res["workarounds"] = ["model.to(bfloat16) after load: transformers 5.17's V4 bf16 "
                                          "forward mixes fp32 norm outputs into bf16 Linears"]
                from llmcompressor.modeling.moe.linearize import linearize_moe

                linearize_moe(model)
                model.eval()
            from datasets import Dataset
            from llmcompressor import oneshot
            from llmcompressor.modifiers.quantization import GPTQModifier

            groups = {"group_0": {"targets": layer_targets(a.layer), **SCHEMES[a.scheme]}}
            recipe = [GPTQModifier(config_groups=groups, block_size=128, dampening_frac=0.01, actorder=None)]
            res["recipe"] = {"GPTQModifier": {"config_groups": groups, "block_size": 128, "dampening_frac": 0.01,
                                              "actorder": None},
                             "moe_calibrate_all_experts": a.all_experts, "pipeline": "independent (default)"}
            data = Dataset.from_dict({"input_ids": calib.tolist(), "attention_mask": torch.ones_like(calib).tolist()})
            with timer.phase("oneshot"):
                oneshot(model=model, dataset=data, recipe=recipe, num_calibration_samples=a.windows,
                        max_seq_length=a.seq_len, shuffle_calibration_samples=False,
                        moe_calibrate_all_experts=a.all_experts)
        res["quantized_modules"] = quantized_modules(model)
        res["quantized_linears"] = sum(res["quantized_modules"].values())
        res["layers_quantized"] = sorted({int(m.group(1)) for name, mod in model.named_modules()
                                          if getattr(mod, "quantization_scheme", None) is not None
                                          for m in [re.search(r"layers\.(\d+)\.", name)] if m})
        res["oneshot_s"] = res["phases"]["oneshot"]["seconds"]
        print(f"llm-compressor GPTQ layer {a.layer}, {a.windows} x {a.seq_len}: oneshot {res['oneshot_s']:.1f} s, "
              f"{res['quantized_linears']} Linears quantized in layers {res['layers_quantized']}", flush=True)
    except SystemExit:
        raise
    except BaseException as e:  # a failed or interrupted peer run is a result to report
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["traceback_tail"] = traceback.format_exc()[-4000:]
        save()
        print(f"llm-compressor run FAILED: {res['error'][:300]}", flush=True)
        return 1
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
