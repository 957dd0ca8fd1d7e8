#!/usr/bin/env python
"""Whether two run folders of tools/run_ptq.py hold the same results, bit for bit.

    python benchmarks/check_bit_for_bit.py BEFORE_DIR AFTER_DIR [--json OUT.json]
    python benchmarks/check_bit_for_bit.py --manifest RUN_DIR          # what a folder holds

Compared: the perplexities of report.json ("ppl": float, rtn, quant) exactly, and every file
under ptq_params/:
- same sha256 -> "same bytes";
- a ``.pt`` whose bytes differ is loaded on both sides (``torch.load(weights_only=True)``) and
  compared tensor by tensor: same keys, dtype, shape and bits (``torch.equal``; NaN == NaN at the
  same place) -> "same values". Its bytes differ between any two runs because torch.save names
  the archive's folder after the file it writes, and the atomic save writes a temp file of a
  random name first;
- a ``.json`` whose bytes differ is compared with every key naming a time ("seconds",
  "layer_seconds", "recollect_seconds", ...) removed -> "same (times aside)".
Anything else is "DIFFERENT" and the exit code is 1.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

PARAMS = "ptq_params"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest(run_dir: Path) -> dict[str, Any]:
    """The run's perplexities and the sha256 of every file under ptq_params/."""
    report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
    pdir = run_dir / PARAMS
    files = {str(p.relative_to(pdir)): sha256(p) for p in sorted(pdir.rglob("*")) if p.is_file()}
    return {"ppl": report.get("ppl"), "files": files}


def _drop_times(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_times(v) for k, v in value.items() if "seconds" not in str(k)}
    if isinstance(value, list):
        return [_drop_times(v) for v in value]
    return value


def _same_tensors(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.is_floating_point():
            both_nan = torch.isnan(a) & torch.isnan(b)
            return bool(torch.equal(torch.where(both_nan, 0, a), torch.where(both_nan, 0, b))) and \
                bool(torch.equal(torch.isnan(a), torch.isnan(b)))
        return bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_tensors(x, y) for x, y in zip(a, b))
    return a == b


def compare_file(a: Path, b: Path) -> str:
    if sha256(a) == sha256(b):
        return "same bytes"
    if a.suffix == ".pt":
        import torch

        ta, tb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
        return "same values" if _same_tensors(ta, tb) else "DIFFERENT"
    if a.suffix == ".json":
        ja = json.loads(a.read_text(encoding="utf-8"))
        jb = json.loads(b.read_text(encoding="utf-8"))
        return "same (times aside)" if _drop_times(ja) == _drop_times(jb) else "DIFFERENT"
    return "DIFFERENT"


def compare(before: Path, after: Path) -> dict[str, Any]:
    ra = json.loads((before / "report.json").read_text(encoding="utf-8"))
    rb = json.loads((after / "report.json").read_text(encoding="utf-8"))
    pa, pb = before / PARAMS, after / PARAMS
    names_a = {str(p.relative_to(pa)) for p in pa.rglob("*") if p.is_file()}
    names_b = {str(p.relative_to(pb)) for p in pb.rglob("*") if p.is_file()}
    files = {n: compare_file(pa / n, pb / n) for n in sorted(names_a & names_b)}
    files.update({n: "DIFFERENT (only before)" for n in sorted(names_a - names_b)})
    files.update({n: "DIFFERENT (only after)" for n in sorted(names_b - names_a)})
    verdicts: dict[str, int] = {}
    for v in files.values():
        verdicts[v] = verdicts.get(v, 0) + 1
    same_ppl = ra.get("ppl") == rb.get("ppl")
    return {"before": str(before), "after": str(after), "ppl_before": ra.get("ppl"), "ppl_after": rb.get("ppl"),
            "ppl_equal": same_ppl, "files": len(files), "verdicts": verdicts,
            "different": [n for n, v in files.items() if v.startswith("DIFFERENT")],
            "identical": same_ppl and not any(v.startswith("DIFFERENT") for v in files.values())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", type=Path, help="BEFORE AFTER (or one folder with --manifest)")
    ap.add_argument("--manifest", action="store_true", help="print the folder's PPL and file hashes as JSON")
    ap.add_argument("--json", type=Path, default=None, help="also write the comparison as JSON")
    a = ap.parse_args(argv)
    if a.manifest:
        print(json.dumps({str(d): manifest(d) for d in a.dirs}, indent=1))
        return 0
    if len(a.dirs) != 2:
        ap.error("give two run folders: BEFORE AFTER")
    res = compare(*a.dirs)
    print(f"{a.dirs[0]} vs {a.dirs[1]}: ppl {res['ppl_before']} vs {res['ppl_after']} "
          f"({'equal' if res['ppl_equal'] else 'DIFFERENT'}); {res['files']} files under {PARAMS}/: "
          + ", ".join(f"{n} {v}" for v, n in sorted(res["verdicts"].items()))
          + ("" if not res["different"] else f"; different: {', '.join(res['different'][:10])}"))
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
    return 0 if res["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
