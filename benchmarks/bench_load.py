"""Layer build + load: one V4-Flash-shaped decoder layer in the released FP8/FP4 format, built onto the
device with dequantization on the device, against the floors of reading and moving its bytes.

Steps
 1. draw the layer's random weights on the device, encode them like the release (FP8 e4m3 + ue8m0
    128x128 scales for the attention / shared-expert linears, MXFP4 for the routed experts, the rest as
    ``release_format.release_tensors`` stores it; the FP8/FP4 encoding runs on the device, the other
    tensors go through ``release_tensors`` itself), write shards + index (``save_sharded``) + config.json;
 2. read the shard files once (page cache warm; nothing is dropped: we measure from page cache);
 3. ceilings: page-cache read bandwidth (raw file reads into host memory), host-to-device bandwidth
    (pageable -- what ``load_block`` does: safetensors hands it ordinary CPU tensors -- and pinned, for
    reference), device copy bandwidth (for the decode's own traffic);
 4. time ``load_block(CheckpointReader(dir), config, layer, dtype=bf16, device=dev)``: median of
    --repeats after a warm-up, each build freed before the next; also the reader's raw fetch alone;
 4b. the NaN / Inf check on load (``CheckpointReader.check_finite``, on by default): ``load_block`` with
    ``check_finite=False`` (same repeats), and the check alone over the decoded layer's tensors; its cost
    is reported relative to the load time (target: < 2 % on the H200);
 5. time the CPU-staging path once: ``load_block(..., device='cpu')`` then ``block.to(dev)``.

floor = file bytes / read bandwidth + file bytes / H2D bandwidth (pageable) + (file bytes + decoded
bytes) / device copy bandwidth; the three happen one after the other in ``load_block``.

    python benchmarks/bench_load.py --device cuda --json $OUT/load.json
    python benchmarks/bench_load.py --smoke
"""
from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
from common import D  # noqa: E402

from amct_ext.io.checkpoint import CheckpointReader  # noqa: E402
from amct_ext.io.checkpoint_writer import save_sharded  # noqa: E402
from amct_ext.io.io_utils import atomic_write_json  # noqa: E402
from amct_ext.io.storage_formats import encode_fp4, encode_fp8_block  # noqa: E402
from models.deepseek_v4.loading import load_block  # noqa: E402
from models.deepseek_v4.release_format import FP4_EXPERT, FP8_LINEAR, official_config_dict, release_tensors  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--smoke", action="store_true", help="tiny config on CPU in a temporary folder")
    p.add_argument("--config", default=None, help="config.json (default: models/deepseek_v4/configs V4-Flash)")
    p.add_argument("--layer", type=int, default=None, help="layer id (default 4: ratio 4 + indexer, score MoE; smoke 3)")
    p.add_argument("--repeats", type=int, default=None, help="timed load_block repeats (default 3; smoke 2)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cpu-repeats", type=int, default=1, help="repeats of the CPU-staging path (0 = skip)")
    p.add_argument("--bw-repeats", type=int, default=5, help="repeats of each bandwidth measurement")
    p.add_argument("--h2d-mib", type=int, default=None, help="host-to-device probe size (default 2048; smoke 16)")
    p.add_argument("--copy-mib", type=int, default=None, help="device copy probe size (default 4096; smoke 32)")
    p.add_argument("--workdir", default=None, help="where to write the layer (default: a new temp folder)")
    p.add_argument("--keep", action="store_true", help="keep the written layer")
    p.add_argument("--time-budget", type=float, default=None, help="seconds; the CPU path is skipped once spent")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="config.json field override, repeatable (e.g. n_routed_experts=16 for a quick run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.smoke and a.device == "auto":
        a.device = "cpu"
    a.layer = a.layer if a.layer is not None else (3 if a.smoke else 4)
    a.repeats = a.repeats or (2 if a.smoke else 3)
    a.h2d_mib = a.h2d_mib or (16 if a.smoke else 2048)
    a.copy_mib = a.copy_mib or (32 if a.smoke else 4096)
    return a


# ------------------------------------------------------------------------------ release writing
@torch.no_grad()
def release_tensors_on_device(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``release_tensors(state_dict, 'fp8')`` with the FP8 / FP4 encoding done where the tensors are
    (a Flash layer's 768 expert matrices take minutes to encode on a CPU). Same rules, same codecs;
    everything else goes through ``release_tensors`` itself. Result on the CPU."""
    out: dict[str, torch.Tensor] = {}
    for key, t in state_dict.items():
        if t.is_floating_point() and (FP4_EXPERT.match(key) or FP8_LINEAR.match(key)):
            if FP4_EXPERT.match(key):
                q, s = encode_fp4(t.float())
            else:
                q, s = encode_fp8_block(t.float(), scale_fmt="ue8m0")
            out[key], out[key[: -len("weight")] + "scale"] = q.cpu(), s.cpu()
        else:
            out.update(release_tensors({key: t}, "fp8"))
    return out


def write_layer(config, layer_id: int, dev: torch.device, folder: Path, seed: int, check_against_cpu: bool) -> dict:
    t0 = time.perf_counter()
    block = C.build_block(config, layer_id, dev, seed=seed)
    D.synchronize(dev)
    t_build = time.perf_counter() - t0
    sd = {f"layers.{layer_id}.{k}": v for k, v in block.state_dict().items()}
    t0 = time.perf_counter()
    tensors = release_tensors_on_device(sd)
    t_encode = time.perf_counter() - t0
    if check_against_cpu:  # the device-side encoder must give exactly what release_tensors gives
        ref = release_tensors({k: v.cpu() for k, v in sd.items()}, "fp8")
        assert ref.keys() == tensors.keys(), set(ref) ^ set(tensors)
        for k in ref:
            a, b = ref[k], tensors[k]
            assert a.dtype == b.dtype and a.shape == b.shape, (k, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b), k
    float_bytes = C.tensor_bytes(block)
    del block, sd
    gc.collect()
    D.empty_cache(dev)
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(official_config_dict(config, "fp8"), folder / "config.json")
    save_sharded(tensors, folder, n_shards=1)
    t_write = time.perf_counter() - t0
    dtypes: dict[str, int] = {}
    for t in tensors.values():
        dtypes[str(t.dtype)] = dtypes.get(str(t.dtype), 0) + t.numel() * t.element_size()
    return {"build_s": t_build, "encode_s": t_encode, "write_s": t_write, "n_tensors": len(tensors),
            "float_bytes": float_bytes, "stored_bytes_by_dtype": dtypes,
            "encode_checked_against_release_tensors": check_against_cpu}


def shard_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


# --------------------------------------------------------------------------------- ceilings
def read_files(files: list[Path], buf: bytearray, chunk: int = 64 * 1024 ** 2) -> int:
    view = memoryview(buf)
    total = 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(view[:chunk])
                if not n:
                    break
                total += n
    return total


def page_cache_read_bw(files: list[Path], repeats: int) -> dict:
    buf = bytearray(64 * 1024 ** 2)
    nbytes = read_files(files, buf)  # the warming read
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        read_files(files, buf)
        times.append((time.perf_counter() - t0) * 1e3)
    s = C.stats(times)
    s.update({"bytes": nbytes, "bytes_per_s": nbytes / (s["median_ms"] * 1e-3),
              "how": "readinto 64 MiB chunks, unbuffered, from page cache"})
    return s


def h2d_bw(dev: torch.device, nbytes: int, repeats: int, pinned: bool) -> dict:
    host = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    if pinned:
        try:
            host = host.pin_memory()
        except Exception as e:  # no accelerator (cpu) or no pinning support
            return {"skipped": f"pin_memory unavailable: {type(e).__name__}: {e}"}
    # on cpu .to(cpu) is a no-op: time a host copy instead so the number means something
    move = (lambda: host.to(dev, non_blocking=False)) if dev.type != "cpu" else (lambda: host.clone())
    s = C.time_host(move, dev, repeats, warmup=1)
    s.update({"bytes": nbytes, "bytes_per_s": nbytes / (s["median_ms"] * 1e-3), "pinned": pinned,
              "how": "Tensor.to(device) incl. device allocation, host clock with synchronize"})
    del host
    return s


# -------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    args = parse_args(argv)
    dev = D.resolve_device(args.device)
    cfg_dict, cfg_src, config = C.bench_config(args)
    kind = C.layer_kind(config, args.layer)
    deadline = C.Deadline(args.time_budget)
    results: dict = {"env": C.environment(dev), "config_source": cfg_src, "args": vars(args),
                     "layer": args.layer, "kind": kind, "notes": []}
    save = lambda: C.write_json(args.json, results)  # noqa: E731
    made_tmp = args.workdir is None
    folder = Path(args.workdir or tempfile.mkdtemp(prefix="bench_load_", dir="/tmp" if Path("/tmp").is_dir() else None))
    print(f"bench_load: device {dev}, config {cfg_src}, layer {args.layer} ({kind}), folder {folder}", flush=True)
    try:
        # 1. write
        w = write_layer(config, args.layer, dev, folder, args.seed + args.layer, check_against_cpu=args.smoke)
        files = shard_files(folder)
        file_bytes = sum(f.stat().st_size for f in files)
        w.update({"files": [f.name for f in files], "file_bytes": file_bytes})
        results["write"] = w
        print(f"wrote {len(files)} shard(s), {C.fmt_bytes(file_bytes)} (float layer {C.fmt_bytes(w['float_bytes'])}): "
              f"build {w['build_s']:.1f} s, encode {w['encode_s']:.1f} s, write {w['write_s']:.1f} s", flush=True)
        save()

        # 2-3. page cache + ceilings
        rd = page_cache_read_bw(files, args.bw_repeats)
        hp = h2d_bw(dev, args.h2d_mib * 1024 ** 2, args.bw_repeats, pinned=False)
        hpin = h2d_bw(dev, args.h2d_mib * 1024 ** 2, args.bw_repeats, pinned=True)
        with torch.inference_mode():
            cp = C.copy_bandwidth(dev, args.copy_mib * 1024 ** 2, args.bw_repeats)
        results["ceilings"] = {"page_cache_read": rd, "h2d_pageable": hp, "h2d_pinned": hpin, "copy": cp}
        print(f"ceilings: page-cache read {rd['bytes_per_s'] / 1e9:.2f} GB/s; H2D pageable "
              f"{hp['bytes_per_s'] / 1e9:.2f} GB/s, pinned "
              f"{(hpin['bytes_per_s'] / 1e9) if 'bytes_per_s' in hpin else float('nan'):.2f} GB/s; device copy "
              f"{cp['bytes_per_s'] / 1e9:.0f} GB/s (read+write)", flush=True)
        save()

        # raw fetch through the reader (the host part of load_block)
        prefix = f"layers.{args.layer}."

        def raw_fetch():
            with CheckpointReader(folder) as r:
                for k in r.keys_under(prefix):
                    r.get_raw(k)
        results["reader_raw_fetch"] = C.time_host(raw_fetch, torch.device("cpu"), args.repeats, warmup=1)

        # 4. load_block onto the device
        holder: dict = {}

        def free_block():
            holder.pop("block", None)
            gc.collect()
            D.empty_cache(dev)

        def load_dev(**kw):
            free_block()
            with CheckpointReader(folder) as r:
                holder["block"], _ = load_block(r, config, args.layer, dtype=torch.bfloat16, device=dev, **kw)

        def timed_loads(**kw) -> list[float]:
            """``args.repeats`` device-timed loads, each after the previous block is freed."""
            times = []
            for _ in range(args.repeats):
                free_block()
                with D.Timer(dev) as t:
                    with CheckpointReader(folder) as r:
                        holder["block"], _ = load_block(r, config, args.layer, dtype=torch.bfloat16, device=dev,
                                                        **kw)
                times.append(t.ms)
            return times

        for _ in range(args.warmup):
            load_dev()
        ld = C.stats(timed_loads())
        decoded_bytes = C.tensor_bytes(holder["block"])
        free_block()
        mem = C.peak_extra(load_dev, dev)
        free_block()
        ld.update(mem)
        ld["decoded_bytes"] = decoded_bytes
        results["load_block_device"] = ld

        # 4b. the NaN / Inf check on load: load without it, and the check alone
        t_off = timed_loads(check_finite=False)
        decoded = {prefix + k: v for k, v in holder["block"].state_dict().items()}
        with CheckpointReader(folder) as r:
            r.check_finite(decoded)  # warm-up
            t_chk = []
            for _ in range(max(args.repeats, 5)):
                with D.Timer(dev) as t:
                    r.check_finite(decoded)
                t_chk.append(t.ms)
        del decoded
        free_block()
        off, chk = C.stats(t_off), C.stats(t_chk)
        results["finite_check"] = {
            "load_without_check": off, "check_alone": chk,
            "check_vs_load_pct": 100 * chk["median_ms"] / ld["median_ms"],
            "load_on_minus_off_pct": 100 * (ld["median_ms"] - off["median_ms"]) / off["median_ms"],
            "how": "check_alone: CheckpointReader.check_finite over the decoded layer (one aminmax per "
                   "floating tensor, one host read per device), host clock with synchronize",
        }
        print(f"NaN/Inf check on load: alone {chk['median_ms']:.2f} ms = "
              f"{results['finite_check']['check_vs_load_pct']:.2f} % of load_block {ld['median_ms']:.1f} ms; "
              f"load without it {off['median_ms']:.1f} ms", flush=True)

        floors = {
            "read_ms": file_bytes / rd["bytes_per_s"] * 1e3,
            "h2d_ms": file_bytes / hp["bytes_per_s"] * 1e3,
            "decode_ms": (file_bytes + decoded_bytes) / cp["bytes_per_s"] * 1e3,
        }
        if "bytes_per_s" in hpin:
            floors["h2d_pinned_ms"] = file_bytes / hpin["bytes_per_s"] * 1e3
        floors["floor_ms"] = floors["read_ms"] + floors["h2d_ms"] + floors["decode_ms"]
        results["floors"] = floors
        ld["vs_floor"] = ld["median_ms"] / floors["floor_ms"]
        print(f"load_block -> {dev}: median {ld['median_ms']:.1f} ms (min {ld['min_ms']:.1f}), "
              f"{ld['vs_floor']:.1f}x floor {floors['floor_ms']:.1f} ms", flush=True)
        save()

        # 5. CPU staging
        if args.cpu_repeats > 0 and not deadline.spent():
            t_cpu, t_move = [], []
            for _ in range(args.cpu_repeats):
                gc.collect()
                with D.Timer(dev) as t:
                    with CheckpointReader(folder) as r:
                        blk, _ = load_block(r, config, args.layer, dtype=torch.bfloat16, device="cpu")
                t_cpu.append(t.ms)
                with D.Timer(dev) as t:
                    blk = blk.to(dev)
                t_move.append(t.ms)
                del blk
                gc.collect()
                D.empty_cache(dev)
            cpu = {"load_cpu": C.stats(t_cpu), "to_device": C.stats(t_move)}
            cpu["total_median_ms"] = cpu["load_cpu"]["median_ms"] + cpu["to_device"]["median_ms"]
            cpu["cpu_threads"] = torch.get_num_threads()
            results["cpu_staging"] = cpu
            print(f"CPU staging: load_block(cpu) {cpu['load_cpu']['median_ms']:.1f} ms + .to({dev}) "
                  f"{cpu['to_device']['median_ms']:.1f} ms", flush=True)
        elif args.cpu_repeats > 0:
            results["notes"].append(f"CPU-staging path SKIPPED: time budget {args.time_budget}s spent")
        save()
    finally:
        if made_tmp and not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
        elif args.keep:
            results["folder"] = str(folder)

    print_report(results)
    save()
    return 0


def print_report(r: dict) -> None:
    w, ce, f, ld = r["write"], r["ceilings"], r["floors"], r["load_block_device"]
    print("\n==== bench_load summary ====")
    print(f"device {r['env']['device']}  torch {r['env']['torch']}  layer {r['layer']} ({r['kind']})  "
          f"config: {r['config_source']}")
    print(f"files: {C.fmt_bytes(w['file_bytes'])} in {len(w['files'])} shard(s); decoded layer "
          f"{C.fmt_bytes(ld['decoded_bytes'])} (bf16 + fp32 islands)")
    rows = [
        ["page-cache read (host)", C.fmt_bytes(ce["page_cache_read"]["bytes"]),
         f"{ce['page_cache_read']['bytes_per_s'] / 1e9:.2f} GB/s", C.fmt_ms(f["read_ms"])],
        ["H2D pageable", C.fmt_bytes(ce["h2d_pageable"]["bytes"]),
         f"{ce['h2d_pageable']['bytes_per_s'] / 1e9:.2f} GB/s", C.fmt_ms(f["h2d_ms"])],
    ]
    if "bytes_per_s" in ce["h2d_pinned"]:
        rows.append(["H2D pinned (reference)", C.fmt_bytes(ce["h2d_pinned"]["bytes"]),
                     f"{ce['h2d_pinned']['bytes_per_s'] / 1e9:.2f} GB/s", C.fmt_ms(f["h2d_pinned_ms"]) + " (not in floor)"])
    rows.append(["device copy (decode traffic)", C.fmt_bytes(ce["copy"]["bytes"]),
                 f"{ce['copy']['bytes_per_s'] / 1e9:.0f} GB/s", C.fmt_ms(f["decode_ms"])])
    print("\nceilings and floor terms for this layer's bytes:")
    print(C.table(rows, ["ceiling", "probe size", "bandwidth", "floor term ms"]))
    rows = [["load_block -> " + r["env"]["device"], C.fmt_ms(ld["median_ms"]), C.fmt_ms(ld["min_ms"]),
             C.fmt_ms(f["floor_ms"]), f"{ld['vs_floor']:.1f}x", C.fmt_bytes(ld["extra_peak_bytes"])],
            ["  reader raw fetch only (host)", C.fmt_ms(r["reader_raw_fetch"]["median_ms"]),
             C.fmt_ms(r["reader_raw_fetch"]["min_ms"]), C.fmt_ms(f["read_ms"]),
             f"{r['reader_raw_fetch']['median_ms'] / f['read_ms']:.1f}x", "-"]]
    if "cpu_staging" in r:
        cs = r["cpu_staging"]
        rows.append(["load_block -> cpu (staging)", C.fmt_ms(cs["load_cpu"]["median_ms"]),
                     C.fmt_ms(cs["load_cpu"]["min_ms"]), "-", "-", "-"])
        rows.append(["  then block.to(device)", C.fmt_ms(cs["to_device"]["median_ms"]),
                     C.fmt_ms(cs["to_device"]["min_ms"]), "-", "-", "-"])
        rows.append(["  staging total", C.fmt_ms(cs["total_median_ms"]), "-", C.fmt_ms(f["floor_ms"]),
                     f"{cs['total_median_ms'] / f['floor_ms']:.1f}x", "-"])
    if "finite_check" in r:
        fc = r["finite_check"]
        rows.append(["  NaN/Inf check alone", C.fmt_ms(fc["check_alone"]["median_ms"]),
                     C.fmt_ms(fc["check_alone"]["min_ms"]), "-", f"{fc['check_vs_load_pct']:.2f} % of load", "-"])
        rows.append(["  load_block, check off", C.fmt_ms(fc["load_without_check"]["median_ms"]),
                     C.fmt_ms(fc["load_without_check"]["min_ms"]), "-", "-", "-"])
    print("\nload timings (host clock with device synchronize; median of repeats):")
    print(C.table(rows, ["path", "median ms", "min ms", "floor ms", "vs floor", "extra peak (load)"]))
    print(f"\nwrite side (not timed carefully): build {w['build_s']:.1f} s, encode {w['encode_s']:.1f} s, "
          f"write {w['write_s']:.1f} s")
    for n in r["notes"]:
        print("note:", n)


if __name__ == "__main__":
    sys.exit(main())
