#!/usr/bin/env python
"""Checker: are two export folders the same tensors? Prints the names only one side has, every
tensor whose dtype / shape / values differ (torch.equal), the count, and the top-level config.json
keys that differ. Used by benchmarks/results/vllm-cpu-serving.md to show that an export made by
two commits is unchanged:  python benchmarks/consumers/compare_export_tensors.py DIR_A DIR_B"""
import json, sys
from pathlib import Path
from safetensors import safe_open
import torch
a, b = Path(sys.argv[1]), Path(sys.argv[2])
def tensors(d):
    idx = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for f in sorted(set(idx.values())):
        with safe_open(str(d / f), "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out
ta, tb = tensors(a), tensors(b)
print("only in A:", sorted(set(ta) - set(tb))[:20]); print("only in B:", sorted(set(tb) - set(ta))[:20])
diff = 0
for k in sorted(set(ta) & set(tb)):
    x, y = ta[k], tb[k]
    if x.dtype != y.dtype or x.shape != y.shape:
        print("META", k, x.dtype, tuple(x.shape), y.dtype, tuple(y.shape)); diff += 1; continue
    if not torch.equal(x, y):
        d = (x.float() - y.float()).abs()
        print("VAL", k, x.dtype, tuple(x.shape), "ndiff", int((d > 0).sum()), "max", float(d.max())); diff += 1
print("tensors", len(ta), len(tb), "differing", diff)
ca, cb = json.loads((a / "config.json").read_text()), json.loads((b / "config.json").read_text())
for k in sorted(set(ca) | set(cb)):
    if ca.get(k) != cb.get(k):
        print("CONFIG", k, json.dumps(ca.get(k))[:600], "||", json.dumps(cb.get(k))[:600])
