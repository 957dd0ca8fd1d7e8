"""Clip (or AWQ) on a set of routed experts: one expert at a time against the batched solve, and
where clip's batched time goes (grid only vs grid + learned clipping).

The same experts (random V4 ``Expert`` weights in the model's ``QuantV4Expert`` wrappers) and
the same calls (random rows, routing weights, the float expert's output as target) go through
``Clip.apply_group`` on fresh copies: ``expert_chunk=1`` on the first ``--one-by-one`` experts
(the per-expert loop, main before this branch; seconds per expert), ``expert_chunk=N`` with the
default ``epochs`` and with ``epochs=0`` (the grid start and the held-out check alone: the
difference is the Adam steps). ``--algo awq``: ``AWQ.apply_group`` batched and one by one
instead. Median / min / max over ``--repeats`` after ``--warmup``.

Floor of the learned part: each Adam step must at least read the weight and write its fake-quant
value and, backward, read that value's gradient and the weight again (2 + 2 + 2 + 2 bytes a bf16
weight), at the measured device copy bandwidth; epochs x calls steps per chunk.

    python benchmarks/bench_clip_experts.py --device cuda --experts 32 --dim 4096 --inter 2048 \
        --calls 96 --rows 48 --dtype bf16 --json $OUT/clip_experts.json       # a V4-Flash chunk
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from common import D  # noqa: E402
from bench_autoround_experts import DTYPES, make_experts  # noqa: E402

from amct_ext.algorithms import SolveContext  # noqa: E402
from amct_ext.algorithms.clipping import Clip  # noqa: E402
from amct_ext.algorithms.smoothing import AWQ  # noqa: E402
from amct_ext.pipeline.ptq_units import make_ptq_unit  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--algo", choices=("clip", "awq"), default="clip")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--dim", type=int, default=256, help="hidden size D (V4-Flash: 4096)")
    ap.add_argument("--inter", type=int, default=128, help="expert intermediate size I (V4-Flash: 2048)")
    ap.add_argument("--rows", type=int, default=48, help="mean routed rows per call (V4-Flash at 2048: ~48)")
    ap.add_argument("--calls", type=int, default=8, help="calls per expert (V4-Flash, 128 windows: ~128)")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128, help="weight group size (0: per channel)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--one-by-one", type=int, default=4, help="experts timed one by one (0: skip)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    a.iters = 0   # make_experts reads it for nothing here
    return a


def timed(mods, datas, algo: Clip, dev):
    fresh = copy.deepcopy(mods)
    units = [make_ptq_unit("expert", f"layers.0.ffn.experts.{i}", 0, m) for i, m in enumerate(fresh)]
    D.synchronize(dev)
    t0 = time.perf_counter()
    res = algo.apply_group(units, datas, SolveContext(device=dev))
    D.synchronize(dev)
    return time.perf_counter() - t0, res


def main(argv=None) -> int:
    a = parse_args(argv)
    dev = D.resolve_device(a.device)
    mods, datas = make_experts(a, dev)
    bw = C.copy_bandwidth(dev, 64 * 2 ** 20 if dev.type == "cpu" else 1024 * 2 ** 20, repeats=5)
    n_weights = 3 * a.dim * a.inter * a.experts
    steps = Clip().epochs * (a.calls - -(-a.calls // 4))      # training calls after the 25 % hold-out
    floor_s = steps * n_weights * 4 * DTYPES[a.dtype].itemsize / bw["bytes_per_s"]
    out = {"env": C.environment(dev), "args": vars(a), "modes": {}, "ceilings": {"copy": bw},
           "floor": {"learned_steps_per_chunk": steps, "learned_traffic_s": floor_s}}
    if a.algo == "clip":
        modes = [("batched", mods, datas, Clip(expert_chunk=a.experts)),
                 ("batched_grid_only", mods, datas, Clip(expert_chunk=a.experts, epochs=0))]
        one = Clip(expert_chunk=1)
    else:
        modes = [("batched", mods, datas, AWQ(expert_chunk=a.experts))]
        one = AWQ(expert_chunk=1)
    if a.one_by_one:
        modes.append(("one_by_one", mods[:a.one_by_one], datas[:a.one_by_one], one))
    results = {}
    for name, ms, ds, algo in modes:
        times = []
        for r in range(a.warmup + a.repeats):
            s, res = timed(ms, ds, algo, dev)
            if r >= a.warmup:
                times.append(s)
        results[name] = res
        med = statistics.median(times)
        out["modes"][name] = {"experts": len(ms), "median_s": med, "min_s": min(times), "max_s": max(times),
                              "per_expert_s": med / len(ms), "times_s": [round(t, 4) for t in times]}
    if a.one_by_one:
        b, o = results["batched"][:a.one_by_one], results["one_by_one"]
        if a.algo == "clip":
            out["agreement"] = {"same_choice": sum(x["choice"] == y["choice"] for x, y in zip(b, o)), "of": len(o),
                                "judge_loss_rel_diff_max": max(abs(x["judge_loss"] / y["judge_loss"] - 1)
                                                               for x, y in zip(b, o))}
        else:
            out["agreement"] = {"same_alpha": sum(x["pairs"]["w3"]["alpha"] == y["pairs"]["w3"]["alpha"]
                                                  for x, y in zip(b, o)), "of": len(o),
                                "loss_after_rel_diff_max": max(abs(x["loss_after"] / y["loss_after"] - 1)
                                                               for x, y in zip(b, o))}
        out["speedup_per_expert"] = out["modes"]["one_by_one"]["per_expert_s"] / out["modes"]["batched"]["per_expert_s"]
    print(f"{a.algo}  device {dev}  torch {torch.__version__}  {a.experts} experts D={a.dim} I={a.inter} {a.dtype}  "
          f"int{a.bits} {'g' + str(a.group) if a.group else 'channel'}  {a.calls} calls of ~{a.rows} rows")
    print(C.table([[k, v["experts"], f"{v['median_s']:.3f}", f"{v['min_s']:.3f}-{v['max_s']:.3f}",
                    f"{v['per_expert_s']:.4f}"] for k, v in out["modes"].items()],
                  ["mode", "experts", "median s", "spread s", "s per expert"]))
    if a.algo == "clip":
        print(f"learned-clip floor ({steps} Adam steps a chunk, weight traffic at {bw['bytes_per_s'] / 1e9:.0f} GB/s): "
              f"{floor_s:.3f} s")
    if a.one_by_one:
        print(f"speed-up per expert {out['speedup_per_expert']:.1f}x; agreement {out['agreement']}")
    C.write_json(a.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
