#!/usr/bin/env python
"""Export speed and host memory against their floors (issue 14, "real size").

  python benchmarks/bench_export.py --model-path SYNTH --format compressed-tensors --scheme w8a8 --device cuda
  python benchmarks/bench_export.py --smoke          # tiny FP8/FP4 checkpoint on the CPU (CI)

What it measures
- disk bandwidth of the output folder's filesystem: write (+ fsync) and read of a scratch file of
  ``--probe-mib`` MiB (the read may hit the page cache: it is then an upper bound, which makes the
  floor lower and the ratio below stricter);
- the export (tools/export.py's ``export_checkpoint``): wall time, bytes read (source shards) and
  written (output shards);
- IO floor = bytes_read / read_bw + bytes_written / write_bw; reported ratio = time / floor
  (target: <= 2);
- host memory: the RSS sampled every 10 ms during the export, minus the RSS before it (after
  the imports), against the largest layer's stored bytes and its bf16 size (target: peak <= 2x
  one layer).

The synthetic real-size checkpoint comes from tools/make_synthetic_checkpoint.py (issue 15) when it
exists; any checkpoint folder works with --model-path. Devices only through amct_ext.runtime.device.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MiB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Peak RSS over a section, sampled by a thread (ru_maxrss cannot be reset)."""

    def __init__(self, period_s: float = 0.01):
        self.period, self.peak, self._stop = period_s, 0, threading.Event()

    def __enter__(self):
        self.base = self.peak = _rss()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


def disk_bandwidth(folder: Path, mib: int) -> dict:
    """Write (fsync) then read back a scratch file of ``mib`` MiB in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    block = os.urandom(8 * MiB)
    n = max(1, mib // 8)
    path = folder / ".bench_export_probe"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    tw = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 * MiB):
            pass
    tr = time.perf_counter() - t0
    path.unlink()
    nbytes = n * 8 * MiB
    return {"probe_bytes": nbytes, "write_bytes_per_s": nbytes / tw, "read_bytes_per_s": nbytes / tr}


def layer_bytes(model_path: Path) -> dict:
    """Largest decoder layer: stored bytes and bf16 (decoded) bytes, from the shard headers."""
    from safetensors import safe_open

    from amct_ext.io.checkpoint import CheckpointReader

    stored: dict[str, int] = {}
    logical: dict[str, int] = {}
    with CheckpointReader(model_path) as r:
        by_shard: dict[str, list[str]] = {}
        for k, s in r.weight_map.items():
            by_shard.setdefault(s, []).append(k)
        for shard, keys in by_shard.items():
            with safe_open(str(r.root / shard), "pt") as f:
                for k in keys:
                    if not k.startswith("layers."):
                        continue
                    g = ".".join(k.split(".")[:2])
                    sl = f.get_slice(k)
                    numel = 1
                    for d in sl.get_shape():
                        numel *= d
                    size = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4}.get(sl.get_dtype(), 1)
                    stored[g] = stored.get(g, 0) + numel * size
                    if not k.endswith(".scale"):
                        packed = 2 if sl.get_dtype() in ("I8", "U8", "F4") and ".experts." in k else 1
                        logical[g] = logical.get(g, 0) + numel * packed * 2
    g = max(stored, key=stored.get)
    return {"layer": g, "stored_bytes": stored[g], "bf16_bytes": logical[g]}


def run(args) -> dict:
    import torch

    from amct_ext.runtime import device as D
    from amct_ext.export.exporter import ExportConfig, export_checkpoint
    from amct_ext.quant.schemes import load_scheme

    model_path = Path(args.model_path)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_export_"))
    bw = disk_bandwidth(out, args.probe_mib)
    layer = layer_bytes(model_path)
    cfg = ExportConfig(model_path=model_path, out_dir=out / "export", format=args.format,
                       scheme=load_scheme(args.scheme), targets=args.quant_target.split(","),
                       overwrite=True, device=args.device, dtype=torch.bfloat16,
                       # times the storage path RESULTS records (released FP8 / FP4 kept as is);
                       # a vLLM-served export of an FP8 release needs --dequantize-rest (casebook E16)
                       serve_check=False)
    dev = D.resolve_device(args.device)
    with RssSampler() as rss:
        t0 = time.perf_counter()
        rep = export_checkpoint(cfg)
        D.synchronize(dev)
        wall = time.perf_counter() - t0
    floor = rep.bytes_read / bw["read_bytes_per_s"] + rep.bytes_written / bw["write_bytes_per_s"]
    res = {
        "model_path": str(model_path), "format": args.format, "scheme": args.scheme, "device": str(dev),
        "disk": bw, "largest_layer": layer,
        "export": {"seconds": wall, "bytes_read": rep.bytes_read, "bytes_written": rep.bytes_written,
                   "groups": len(rep.groups_written), "extra_layers": rep.extra_layers},
        "io_floor_s": floor, "time_over_floor": wall / floor if floor > 0 else None,
        "host_rss": {"before_bytes": rss.base, "peak_bytes": rss.peak, "peak_delta_bytes": rss.peak - rss.base,
                     "delta_over_stored_layer": (rss.peak - rss.base) / layer["stored_bytes"],
                     "delta_over_bf16_layer": (rss.peak - rss.base) / layer["bf16_bytes"]},
    }
    if dev.type != "cpu":
        res["device_peak_bytes"] = D.peak_memory_bytes(dev)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="source checkpoint (e.g. the synthetic V4-Flash layer)")
    ap.add_argument("--format", default="compressed-tensors", choices=("compressed-tensors", "ascend"))
    ap.add_argument("--scheme", default="w8a8")
    ap.add_argument("--quant-target", default="attn-linear,moe")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None, help="scratch folder on the disk to measure (default: a temp dir)")
    ap.add_argument("--probe-mib", type=int, default=1024, help="size of the disk bandwidth probe")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--smoke", action="store_true", help="tiny FP8/FP4 checkpoint on the CPU (CI)")
    args = ap.parse_args(argv)
    if args.smoke:
        from models.deepseek_v4.tiny import make_tiny_checkpoint

        tmp = Path(tempfile.mkdtemp(prefix="bench_export_smoke_"))
        args.model_path = str(make_tiny_checkpoint(tmp / "src", fmt="fp8", seed=0))
        args.out, args.device, args.probe_mib = str(tmp / "out"), "cpu", 8
    if not args.model_path:
        ap.error("--model-path is required (or --smoke)")
    res = run(args)
    print(json.dumps(res, indent=2))
    print(f"export {res['export']['seconds']:.2f} s, IO floor {res['io_floor_s']:.3f} s "
          f"(x{res['time_over_floor']:.2f}); host RSS +{res['host_rss']['peak_delta_bytes'] / MiB:.0f} MiB "
          f"= x{res['host_rss']['delta_over_bf16_layer']:.2f} of one bf16 layer", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
