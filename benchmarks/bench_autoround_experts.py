"""AutoRound on a set of routed experts: one expert at a time against the batched solve.

The same experts (random V4 ``Expert`` weights, the model's ``QuantV4Expert`` wrappers) and the
same captured calls (random rows, routing weights, the float expert's output as target) go
through ``AutoRound.apply_group`` twice per repeat, each time on a fresh copy:
``expert_chunk=1`` (the per-expert loop, main before casebook i13s-4) and ``expert_chunk=N``
(stacked, one bmm-batched step per chunk). Reported: median / min / max seconds over
``--repeats`` after ``--warmup``, the speed-up of the medians, the agreement of the two results
(per-expert loss after, offsets equal), and a floor.

Floor: every step must at least read each offset (fp32) and the weight, and read + write the
offset's gradient and the offset itself: (4 + 2|4 + 4 + 4 + 4) bytes a weight a step, at the
measured device copy bandwidth. Fake-quant intermediates and the forward itself come on top,
so real steps sit well above it; it says how far from memory-bound a path is.

    python benchmarks/bench_autoround_experts.py --device cpu --experts 32 --dim 512 --inter 256 \
        --iters 50 --repeats 3 --json benchmarks/cpu/autoround_experts.json
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

from amct_ext.algorithms import SolveContext, UnitData  # noqa: E402
from amct_ext.algorithms.rounding import AutoRound  # noqa: E402
from amct_ext.pipeline.capture import UnitCall  # noqa: E402
from amct_ext.pipeline.ptq_units import make_ptq_unit  # noqa: E402
from amct_ext.quant.schemes import TensorSpec  # noqa: E402
from models.deepseek_v4.modeling import Expert  # noqa: E402
from models.deepseek_v4.quant_module import QuantV4Expert  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--dim", type=int, default=512, help="hidden size D (V4-Flash: 4096)")
    ap.add_argument("--inter", type=int, default=256, help="expert intermediate size I (V4-Flash: 2048)")
    ap.add_argument("--rows", type=int, default=48, help="mean routed rows per call (V4-Flash at 2048: ~48)")
    ap.add_argument("--calls", type=int, default=4, help="calls per expert (calibration windows)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--chunk", type=int, default=16, help="experts per batched solve")
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--group", type=int, default=128, help="weight group size (0: per channel)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    return ap.parse_args(argv)


def make_experts(a, dev: torch.device):
    """E wrapped experts on ``dev`` and their calls (row counts vary around ``--rows``)."""
    dtype = DTYPES[a.dtype]
    spec = TensorSpec("int", a.bits, False, "group", a.group) if a.group else TensorSpec("int", a.bits, True, "channel")
    g = torch.Generator().manual_seed(a.seed)
    mods, datas = [], []
    for _ in range(a.experts):
        e = Expert(a.dim, a.inter, 10.0, dtype)
        with torch.no_grad():
            for p in e.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * a.dim ** -0.5)
        e = e.to(dev)
        calls = []
        for _ in range(a.calls):
            n = max(1, int(a.rows * (0.5 + torch.rand(1, generator=g).item())))
            x = torch.randn(n, a.dim, generator=g).to(device=dev, dtype=dtype)
            w = torch.rand(n, 1, generator=g).to(dev)
            with torch.no_grad():
                calls.append(UnitCall((x, w), {}, e(x, w)))
        mods.append(QuantV4Expert(e, spec, None))
        datas.append(UnitData(calls))
    return mods, datas


def run_mode(mods, datas, chunk: int, iters: int, dev: torch.device):
    """One AutoRound pass over fresh copies; (seconds, results, solved modules)."""
    fresh = copy.deepcopy(mods)
    units = [make_ptq_unit("expert", f"layers.0.ffn.experts.{i}", 0, m) for i, m in enumerate(fresh)]
    algo = AutoRound(iters=iters, expert_chunk=chunk, fold_grid=False)
    D.synchronize(dev)
    t0 = time.perf_counter()
    res = algo.apply_group(units, datas, SolveContext(device=dev))
    D.synchronize(dev)
    return time.perf_counter() - t0, res, fresh


def main(argv=None) -> int:
    a = parse_args(argv)
    dev = D.resolve_device(a.device)
    mods, datas = make_experts(a, dev)
    n_weights = sum(3 * a.dim * a.inter for _ in mods)
    w_bytes = DTYPES[a.dtype].itemsize
    bw = C.copy_bandwidth(dev, 64 * 2 ** 20 if dev.type == "cpu" else 1024 * 2 ** 20, repeats=5)
    floor_s = a.iters * n_weights * (16 + w_bytes) / bw["bytes_per_s"]
    out = {"env": C.environment(dev), "args": vars(a), "weights": n_weights, "modes": {},
           "ceilings": {"copy": bw}, "floor": {"update_traffic_s": floor_s,
                                              "bytes_per_weight_step": 16 + w_bytes}}
    solved = {}
    for name, chunk in (("one_by_one", 1), ("batched", a.chunk)):
        times = []
        for r in range(a.warmup + a.repeats):
            s, res, fresh = run_mode(mods, datas, chunk, a.iters, dev)
            if r >= a.warmup:
                times.append(s)
        solved[name] = (res, fresh)
        out["modes"][name] = {"chunk": chunk, "median_s": statistics.median(times), "min_s": min(times),
                              "max_s": max(times), "times_s": [round(t, 4) for t in times],
                              "vs_floor": statistics.median(times) / floor_s}
    (r1, m1), (r2, m2) = solved["one_by_one"], solved["batched"]
    rel = [abs(x["loss_after"] / y["loss_after"] - 1) if y["loss_after"] else 0.0 for x, y in zip(r2, r1)]
    same = total = 0
    for x, y in zip(m2, m1):
        for n in ("w1", "w2", "w3"):
            lin_x, lin_y = getattr(x, n), getattr(y, n)
            # an offset left all zero is dropped (None): it stands for zeros
            vx, vy = (lin.weight_quantizer.round_offset if lin.weight_quantizer.round_offset is not None
                      else torch.zeros_like(lin.weight, dtype=torch.float32) for lin in (lin_x, lin_y))
            same += int((vx == vy).sum())
            total += vx.numel()
    out["agreement"] = {"loss_after_rel_diff_max": max(rel), "offsets_equal_fraction": same / max(total, 1),
                        "loss_gain_median": statistics.median(1 - y["loss_after"] / y["loss_before"]
                                                              for y in r1 if y["loss_before"])}
    out["speedup_of_medians"] = out["modes"]["one_by_one"]["median_s"] / out["modes"]["batched"]["median_s"]
    print(f"device {dev}  torch {torch.__version__}  {a.experts} experts D={a.dim} I={a.inter} {a.dtype}  "
          f"int{a.bits} {'g' + str(a.group) if a.group else 'channel'}  {a.iters} iterations  {a.calls} calls of ~{a.rows} rows")
    print(C.table([[k, v["chunk"], f"{v['median_s']:.3f}", f"{v['min_s']:.3f}-{v['max_s']:.3f}",
                    f"{v['vs_floor']:.1f}x"] for k, v in out["modes"].items()],
                  ["mode", "chunk", "median s", "spread s", "vs floor"]))
    print(f"floor (update traffic at {bw['bytes_per_s'] / 1e9:.1f} GB/s copy): {floor_s:.4f} s; "
          f"speed-up of the medians {out['speedup_of_medians']:.2f}x")
    ag = out["agreement"]
    print(f"agreement: loss after max rel diff {ag['loss_after_rel_diff_max']:.2e}, offsets equal "
          f"{ag['offsets_equal_fraction']:.4%}; AutoRound's median loss gain over RTN {ag['loss_gain_median']:.1%}")
    C.write_json(a.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
