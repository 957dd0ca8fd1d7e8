"""hclip's working set per routed expert, measured, against the estimate its chunk is sized by.

``HessianClip.fitting_chunk`` sizes a chunk of experts by the device's free memory and an
estimate of one expert's working set (``WORK_COPIES`` float32 copies of its weight and two of its
Hessian; casebook i34-24). This runs ``hessian_clip_choice`` on experts of V4-Pro's shapes
(w1 / w3 [3072, 7168], w2 [7168, 3072], w4a16-g128) on the CPU and samples the process's resident
memory while it runs: the working set is the peak above the resident memory before the call plus
the weights and Hessians it was given. CPU only: the device's fused kernels may hold fewer
temporaries. Writes JSON (``--json``)::

    python benchmarks/check_hclip_memory.py --json benchmarks/results/hclip_memory.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from amct_ext.algorithms.hessian_clip import HessianClip, hessian_clip_choice  # noqa: E402
from amct_ext.quant.schemes import TensorSpec  # noqa: E402

SHAPES = {"w1/w3": (3072, 7168), "w2": (7168, 3072)}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def working_set(n: int, rows: int, cols: int) -> dict:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, rows, cols, generator=g) * 0.02
    x = torch.randn(n, 2 * cols, cols, generator=g)
    h = torch.einsum("nkc,nkd->ncd", x, x).unsqueeze(1)      # [N, 1, C, C]
    del x
    before, peak, done = _rss(), [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    t = threading.Thread(target=watch)
    t.start()
    t0 = time.perf_counter()
    hessian_clip_choice(w, h, TensorSpec("int", 4, True, "group", 128), None)
    done.set()
    t.join()
    held = (w.numel() + h.numel()) * 4
    estimate = n * HessianClip.expert_working_bytes((rows, cols))
    return {"experts": n, "rows": rows, "cols": cols, "seconds": round(time.perf_counter() - t0, 1),
            "working_gib": round((max(peak[0], before) - before + held) / 2 ** 30, 3),
            "estimate_gib": round(estimate / 2 ** 30, 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = {name: working_set(args.experts, *shape) for name, shape in SHAPES.items()}
    for name, r in rows.items():
        print(f"{name}: {r['experts']} experts [{r['rows']}, {r['cols']}]: working set {r['working_gib']} GiB, "
              f"estimate {r['estimate_gib']} GiB ({r['seconds']} s)")
    if args.json:
        out = {"what": "hclip's working set on V4-Pro expert shapes (CPU, resident memory sampled)",
               "command": "python benchmarks/check_hclip_memory.py --json benchmarks/results/hclip_memory.json",
               "date": time.strftime("%Y-%m-%d"), "work_copies": HessianClip.WORK_COPIES, "runs": rows}
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
