#!/usr/bin/env python
"""The audit cases of issue 36.3 (tracebacks and unclear messages), each run as a user would:
a fresh process of tools/run_ptq.py or tools/export.py on a broken copy of assets/tiny-v4.
Records the exit code, the number of stderr lines, whether any perplexity was printed before
the refusal, and the one `error:` line; writes a JSON file and the markdown table of
benchmarks/results/error-messages.md.

    PYTHONPATH=$PWD python benchmarks/scripts/error_messages.py --work /tmp/errmsg \
        --json benchmarks/results/error-messages.json [--real-fs]

--real-fs (root only): the read-only folder is `chattr +i` (binds root too) and the full disks
are small tmpfs mounts, i.e. the real OS errors; without it those rows are left out (the tests
simulate them: tests/test_os_errors.py).
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

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "assets" / "tiny-v4"
FAST = ["--calib-samples", "2", "--seq-len", "32", "--eval-windows", "2", "--quiet"]


def copy_ckpt(work: Path, name: str, **config) -> Path:
    d = work / name
    if d.exists():
        shutil.rmtree(d)
    shutil.copytree(TINY, d)
    if config:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(config)
        (d / "config.json").write_text(json.dumps(cfg))
    return d


def build_inputs(work: Path) -> dict[str, Path]:
    import torch
    from safetensors.torch import load_file, save_file

    valid = (REPO / "amct_ext" / "data" / "wikitext-2" / "wiki.valid.tokens").read_text(encoding="utf-8")
    p = {"bin": work / "calib.bin", "u16": work / "calib-utf16.txt", "short": work / "short.txt",
         "deep": work / "deep.json", "hold": work / "holdout.json"}
    p["bin"].write_bytes(bytes(range(256)) * 4000)
    p["u16"].write_text(valid[:200000], encoding="utf-16")
    p["short"].write_text(" ".join(valid.split()[1000:1060]))
    p["deep"].write_text("[" * 100000 + "]" * 100000)
    p["hold"].write_text(json.dumps({"recipe": [{"algo": "rtn"}], "holdout": "0.5"}))
    p["vocab"] = copy_ckpt(work, "ck-vocab", vocab_size=100)
    p["strnum"] = copy_ckpt(work, "ck-strnum", hidden_size="128")
    p["notok"] = copy_ckpt(work, "ck-notok")
    (p["notok"] / "tokenizer.json").unlink()
    d = p["tid"] = copy_ckpt(work, "ck-tid")
    key = "layers.0.ffn.gate.tid2eid"
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][key]
    sd = load_file(d / shard)
    t = sd[key].clone()
    t[:, 0] = 99
    sd[key] = t
    save_file(sd, d / shard, metadata={"format": "pt"})
    # a finished run folder whose unit file holds a pickled object
    run = p["pickled"] = work / "run-pickled"
    if run.exists():
        shutil.rmtree(run)
    subprocess.run([sys.executable, "tools/run_ptq.py", "--model", "tiny-trained", *FAST, "--no-eval-ppl",
                    "--output-dir", str(run)], cwd=REPO, check=True, capture_output=True)
    with open(run / "ptq_params" / "layer_0_attn.pt", "wb") as f:
        torch.save({"x": __import__("collections").OrderedDict(a=__import__("fractions").Fraction(1, 3))}, f)
    return p


def cases(work: Path, p: dict[str, Path], real_fs: bool) -> list[tuple[str, list[str]]]:
    run = ["tools/run_ptq.py", "--model", "tiny-trained", *FAST]
    out = str(work / "out")
    c = [
        ("binary calibration file", [*run, "--output-dir", out, "--calib-data", str(p["bin"])]),
        ("UTF-16 calibration file", [*run, "--output-dir", out, "--calib-data", str(p["u16"])]),
        ("UTF-16 evaluation file", [*run, "--output-dir", out, "--eval-data", str(p["u16"])]),
        ("out-of-range expert id in tid2eid", [*run, "--output-dir", out, "--model-path", str(p["tid"])]),
        ("vocab_size smaller than the tokenizer's", [*run, "--output-dir", out, "--model-path", str(p["vocab"])]),
        ("a string where config.json needs a number", [*run, "--output-dir", out, "--model-path", str(p["strnum"])]),
        ("recipe nested 100,000 deep", [*run, "--output-dir", out, "--recipe", str(p["deep"])]),
        ("hclip grid of 10^12", [*run, "--output-dir", out, "--algo", "hclip:grid=1000000000000"]),
        ("--calib-samples 10^9", [*run, "--output-dir", out, "--calib-samples", "1000000000"]),
        ("string holdout in a recipe file", [*run, "--output-dir", out, "--recipe", str(p["hold"])]),
        ("missing tokenizer file", [*run, "--output-dir", out, "--model-path", str(p["notok"])]),
        ("pickled object in a unit file (export)", ["tools/export.py", "--model", "tiny-trained", "--from",
                                                    str(p["pickled"]), "--format", "compressed-tensors", "--out",
                                                    str(work / "e-pickled"), "--quiet"]),
        ("60 words of calibration text for 8 x 32 windows", [*run, "--output-dir", out, "--calib-data",
                                                             str(p["short"]), "--calib-samples", "8"]),
    ]
    if real_fs:
        c += [
            ("read-only output folder (chattr +i)", [*run, "--output-dir", str(work / "ro")]),
            ("full disk: output folder on a 200 KiB tmpfs", [*run, "--output-dir", str(work / "small" / "o")]),
            ("full disk during export: --out on a 200 KiB tmpfs", ["tools/export.py", "--model", "tiny-trained",
                                                                   "--scheme", "w8a8", "--format", "ascend", "--out",
                                                                   str(work / "small" / "e"), "--quiet"]),
        ]
    return c


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--json", default=None)
    ap.add_argument("--real-fs", action="store_true")
    args = ap.parse_args()
    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    p = build_inputs(work)
    if args.real_fs:
        (work / "ro").mkdir(exist_ok=True)
        subprocess.run(["chattr", "+i", str(work / "ro")], check=True)
        (work / "small").mkdir(exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(work / "small")], check=True)
    rows = []
    env = dict(os.environ, PYTHONPATH=str(REPO))
    try:
        for what, argv in cases(work, p, args.real_fs):
            shutil.rmtree(work / "out", ignore_errors=True)
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
            err = r.stderr.strip().splitlines()
            rows.append({"case": what, "command": "python " + " ".join(a.replace(str(work), "$W") for a in argv),
                         "rc": r.returncode, "stderr_lines": len(err), "ppl_before": "ppl[" in r.stdout,
                         "seconds": round(time.perf_counter() - t0, 1),
                         "line": (err[-1] if err else "").replace(str(work), "$W")})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        if args.real_fs:
            subprocess.run(["chattr", "-i", str(work / "ro")])
            subprocess.run(["umount", str(work / "small")])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    print("\n| case | exit | stderr lines | ppl before | the line |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['case']} | {r['rc']} | {r['stderr_lines']} | {'yes' if r['ppl_before'] else 'no'} | "
              f"`{r['line']}` |")
    bad = [r for r in rows if r["rc"] != 2 or r["stderr_lines"] != 1 or r["ppl_before"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
