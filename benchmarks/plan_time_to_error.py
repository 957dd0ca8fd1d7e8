#!/usr/bin/env python
"""Time to error of every plan refusal (issue 25.1) on V4-Flash-sized inputs.

Writes a V4-Flash checkpoint folder of config.json + model.safetensors.index.json and one shard
a layer whose safetensors header is real and whose data region is a sparse hole (43 layers,
every key of the release layout; the plan reads every header, no tensor data), then runs ``tools/run_ptq.py --model v4-flash`` once per bad input as a new
process and records the wall time until it exits with one ``error:`` line (exit 2), and the
plan of the valid job (``build_job``) in-process.

    PYTHONPATH=$PWD python benchmarks/plan_time_to_error.py --out /tmp/plan-tte [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


#: safetensors dtype names of the stored dtypes of the release layout
ST_DTYPE = {"bfloat16": "BF16", "float32": "F32", "float8_e4m3fn": "F8_E4M3", "float8_e8m0fnu": "F8_E8M0",
            "int8": "I8", "int64": "I64", "int32": "I32", "float16": "F16"}
ST_BITS = {"BF16": 16, "F32": 32, "F8_E4M3": 8, "F8_E8M0": 8, "I8": 8, "I64": 64, "I32": 32, "F16": 16}


def write_sparse_shard(path: Path, entries: dict) -> int:
    """A safetensors file whose header is real ({key: (safetensors dtype, shape)}, offsets in
    order) and whose data region is a hole of the right size (a sparse file: no bytes written),
    so the plan's header checks see a V4-Flash shard as it is. Returns the file's size."""
    import math
    import struct

    header, off = {"__metadata__": {"format": "pt"}}, 0
    for key, (dtype, shape) in entries.items():
        n = -(-math.prod(shape) * ST_BITS[dtype] // 8)
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + off)
    return 8 + len(blob) + off


def write_index_only_checkpoint(out: Path, like: str = "v4-flash", n_layers: int | None = None,
                                drop_keys=(), config_drop=(), config_set=None, mutate=None) -> Path:
    """config.json + index of a ``like`` checkpoint (release key layout) and one shard a layer
    whose header is real and whose data is a sparse hole (``write_sparse_shard``).
    ``mutate(entries_by_shard, weight_map)``: a defect applied before anything is written."""
    import torch

    from models.deepseek_v4.configuration import DeepseekV4Config
    from models.deepseek_v4.modeling import DeepseekV4ForCausalLM
    from models.deepseek_v4.synthetic import base_config_dict, expected_release_layout, synthetic_config_dict
    from amct_ext.runtime.empty import empty_weights

    n = n_layers or int(base_config_dict(like)["num_hidden_layers"])
    cfg_dict = synthetic_config_dict(like, n)
    config = DeepseekV4Config(**json.loads(json.dumps(cfg_dict)))
    out.mkdir(parents=True, exist_ok=True)
    weight_map, shards = {}, {}
    one = DeepseekV4Config(**json.loads(json.dumps(synthetic_config_dict(like, 1))))
    with empty_weights():
        stem = {k: t for k, t in DeepseekV4ForCausalLM(one, dtype=torch.bfloat16).state_dict().items()
                if not k.startswith("layers.")}
    shards["model-00000.safetensors"] = {k: (ST_DTYPE[str(t.dtype)[6:]], tuple(t.shape)) for k, t in stem.items()}
    layouts = {}
    for i in range(n):
        kind = (config.compress_ratios[i], i < config.n_hash_layers)
        if kind not in layouts:
            layouts[kind] = (i, expected_release_layout(config, i))
        rep, lay = layouts[kind]
        name = f"model-{i + 1:05d}.safetensors"
        shards[name] = {f"layers.{i}." + k[len(f"layers.{rep}."):]: (ST_DTYPE[str(dt)[6:]], tuple(shape))
                        for k, (shape, dt) in lay.items()}
    for name, entries in shards.items():
        weight_map.update({k: name for k in entries})
    for k in drop_keys:
        weight_map.pop(k)
    if mutate is not None:
        mutate(shards, weight_map)
    for name, entries in shards.items():
        write_sparse_shard(out / name, entries)
    for k in config_drop:
        cfg_dict.pop(k)
    cfg_dict.update(config_set or {})
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=1))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    # the plan checks the tokenizer (issue 36.3): the trained tiny one (4096 ids <= the vocabulary)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(REPO / "assets" / "tiny-v4" / name, out / name)
    return out


def _defects(root: Path) -> list:
    """(what, folder) of the checkpoint defects the plan finds in the shard headers (issue 36)."""
    def retype(key, dtype):
        def f(shards, wm):
            shards[wm[key]][key] = (dtype, shards[wm[key]][key][1])
        return f

    def reshape(key, shape):
        def f(shards, wm):
            shards[wm[key]][key] = (shards[wm[key]][key][0], shape)
        return f

    def drop_scale(key):
        def f(shards, wm):
            shards[wm[key]].pop(key)
            wm.pop(key)
        return f

    def misplace(key, shard):
        def f(shards, wm):
            wm[key] = shard
        return f

    made = []
    d = write_index_only_checkpoint(root / "truncated")
    last = d / "model-00043.safetensors"
    os.truncate(last, last.stat().st_size - 2 ** 20)
    made.append(("shard truncated (model-00043 1 MiB short)", d))
    d = write_index_only_checkpoint(root / "garbage")
    with open(d / "model-00020.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"\xfe\xffgarbage!" * 8)
    made.append(("garbage safetensors header (model-00020)", d))
    made.append(("wrong shape (layers.42.attn.wq_a.weight)",
                 write_index_only_checkpoint(root / "shape", mutate=reshape("layers.42.attn.wq_a.weight", (1024, 4000)))))
    made.append(("wrong dtype (layers.2.ffn.gate.tid2eid stored as F32)",
                 write_index_only_checkpoint(root / "dtype", mutate=retype("layers.2.ffn.gate.tid2eid", "F32"))))
    made.append(("FP8 weight without its scale (layers.42.attn.wo_b)",
                 write_index_only_checkpoint(root / "noscale", mutate=drop_scale("layers.42.attn.wo_b.scale"))))
    made.append(("key in the wrong shard (layers.42.attn.attn_sink -> model-00001)",
                 write_index_only_checkpoint(root / "misplaced",
                                             mutate=misplace("layers.42.attn.attn_sink", "model-00001.safetensors"))))
    made.append(("config disagrees with the stored shapes (q_lora_rank 1536)",
                 write_index_only_checkpoint(root / "qlora", config_set={"q_lora_rank": 1536})))
    made.append(("config num_hidden_layers 42, checkpoint 43 layers",
                 write_index_only_checkpoint(root / "fewer", config_set={"num_hidden_layers": 42})))
    return made


def _child_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    root = Path(args.out)
    import shutil

    if root.exists():
        shutil.rmtree(root)
    t0 = time.perf_counter()
    good = write_index_only_checkpoint(root / "flash")
    print(f"index-only V4-Flash: {len(json.loads((good / 'model.safetensors.index.json').read_text())['weight_map'])} "
          f"keys, written in {time.perf_counter() - t0:.1f} s", flush=True)
    write_index_only_checkpoint(root / "nokey", drop_keys=["layers.42.attn.attn_sink"])
    for field in ("sliding_window", "rope_scaling", "routed_scaling_factor"):
        write_index_only_checkpoint(root / f"no-{field}", config_drop=[field])
    noshard = write_index_only_checkpoint(root / "noshard")   # (a copy would read the sparse holes)
    (noshard / "model-00043.safetensors").unlink()
    (root / "a-file").write_text("x")
    g96 = root / "w4-g96.json"
    g96.write_text(json.dumps({"name": "w4-g96", "weight": {"format": "int", "bits": 4, "symmetric": False,
                                                            "granularity": "group", "group_size": 96}}))
    other = root / "other-run" / "ptq_params"
    other.mkdir(parents=True)
    from amct_ext.quant.schemes import load_scheme

    (other / "meta.json").write_text(json.dumps({"version": 1, "scheme": "w4a16-g128",
                                                 "scheme_fingerprint": load_scheme("w4a16-g128").fingerprint(),
                                                 "targets": ["attn-linear", "moe"], "dtype": "bf16"}))
    nan_recipe = root / "nan-lr.json"
    nan_recipe.write_text('{"recipe": [{"algo": "clip", "lr": NaN}]}')
    base = ["--model", "v4-flash", "--device", "cpu", "--quiet"]
    o = ["--output-dir", str(root / "o")]
    cases = [
        ("layer key missing from the index (layers.42.attn.attn_sink)", ["--model-path", str(root / "nokey"), *o]),
        ("shard file missing (model-00043)", ["--model-path", str(noshard), *o]),
        ("config without sliding_window", ["--model-path", str(root / "no-sliding_window"), *o]),
        ("config without rope_scaling", ["--model-path", str(root / "no-rope_scaling"), *o]),
        ("config without routed_scaling_factor", ["--model-path", str(root / "no-routed_scaling_factor"), *o]),
        ("group size 96 does not divide a weight", ["--model-path", str(good), "--scheme", str(g96), *o]),
        ("--scheme w4a16-g128 --export ascend", ["--model-path", str(good), "--scheme", "w4a16-g128",
                                                 "--export", "ascend", *o]),
        ("--algo awq --export compressed-tensors (w3 pair: up_limit)",
         ["--model-path", str(good), "--algo", "awq", "--export", "compressed-tensors", "--dequantize-rest", *o]),
        ("--export compressed-tensors of the FP8 release without --dequantize-rest (engine profile)",
         ["--model-path", str(good), "--export", "compressed-tensors", *o]),
        ("--holdout 1.5", ["--model-path", str(good), "--holdout", "1.5", *o]),
        ("--ppl-modes float,bogus", ["--model-path", str(good), "--ppl-modes", "float,bogus", *o]),
        ("--calib-samples 0", ["--model-path", str(good), "--calib-samples", "0", *o]),
        ("--capture-memory-gb -1", ["--model-path", str(good), "--capture-memory-gb", "-1", *o]),
        ("--output-dir is a file", ["--model-path", str(good), "--output-dir", str(root / "a-file")]),
        ("--output-dir of another run (scheme fingerprint)", ["--model-path", str(good), "--scheme", "w8a8",
                                                              "--output-dir", str(root / "other-run")]),
        ("--start-layer 40 --end-layer 50", ["--model-path", str(good), "--start-layer", "40", "--end-layer", "50", *o]),
        ("NaN learning rate in a recipe file (clip.lr)", ["--model-path", str(good), "--recipe", str(nan_recipe), *o]),
    ]
    cases += [(what, ["--model-path", str(d), *o]) for what, d in _defects(root)]
    t, c = time.perf_counter(), _child_cpu()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    floor = {"refusal": "(floor: a process that imports torch and exits)", "seconds": round(time.perf_counter() - t, 2),
             "cpu_s": round(_child_cpu() - c, 2), "in_process_s": None, "rc": 0, "one_line": True, "error": "",
             "command": "python -c 'import torch'"}
    print(f"{floor['seconds']:6.2f} s wall, {floor['cpu_s']:5.2f} s cpu: python -c 'import torch' (floor)", flush=True)
    rows = [floor]
    import contextlib
    import io

    sys.path.insert(0, str(REPO / "tools"))
    import run_ptq  # noqa: E402  (in-process: the plan's own time, imports warm)

    for what, extra in cases:
        cmd = [sys.executable, str(REPO / "tools" / "run_ptq.py"), *base, *extra]
        t, c = time.perf_counter(), _child_cpu()
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600)
        dt, cpu = time.perf_counter() - t, _child_cpu() - c
        lines = p.stderr.strip().splitlines()
        ok = p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "ppl[" not in p.stdout
        err = io.StringIO()
        t = time.perf_counter()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc_in = run_ptq.main([*base, *extra])
        dt_in = time.perf_counter() - t
        ok = ok and rc_in == 2 and err.getvalue().strip().splitlines()[-1:] == lines[-1:]
        rows.append({"refusal": what, "seconds": round(dt, 2), "cpu_s": round(cpu, 2), "in_process_s": round(dt_in, 2),
                     "rc": p.returncode, "one_line": ok,
                     "error": lines[-1] if lines else "", "command": "run_ptq.py " + " ".join(base + extra)})
        print(f"{dt:6.2f} s wall, {cpu:5.2f} s cpu ({dt_in:5.2f} s in-process)  rc {p.returncode}  {'ok ' if ok else 'BAD'}  {what}: {lines[-1] if lines else p.stdout[-200:]}",
              flush=True)
    # the valid job: the plan alone, in-process (the run would go on to the tokenizer and the layers)
    from amct_ext.data import CALIB_DEFAULT, EVAL_DEFAULT
    from amct_ext.pipeline.job import PtqOptions, ResolvedPaths, build_job
    from models.deepseek_v4.plan import DeepseekV4PlanSpec

    t = time.perf_counter()
    job = build_job(PtqOptions(output_dir=str(root / "o"), scheme="w4a16-g128", calib_samples=128, seq_len=2048,
                               batch_size=1, eval_batch_size=1, dtype="bf16", export="compressed-tensors",
                               dequantize_rest=True),
                    DeepseekV4PlanSpec(), ResolvedPaths(good, CALIB_DEFAULT, EVAL_DEFAULT))
    dt = time.perf_counter() - t
    print(f"{dt:6.2f} s  valid plan (in-process, imports warm): {job.n_units} units", flush=True)
    rows.append({"refusal": "(none: the valid w4a16-g128 + compressed-tensors --dequantize-rest plan, in-process)",
                 "seconds": None, "in_process_s": round(dt, 2), "rc": 0, "one_line": True, "error": "", "command": "build_job(...)"})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["one_line"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
