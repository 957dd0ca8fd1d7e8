"""Write a flat state dict as sharded safetensors + model.safetensors.index.json (the release layout)."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from .io_utils import atomic_write, atomic_write_json

INDEX_NAME = "model.safetensors.index.json"


def shard_file_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def layer_group(key: str) -> str:
    """The shard group of ``key``: a numbered layer (``name.{i}.*``: the decoder layers
    ``layers.{i}``, a model's extra layers such as ``mtp.{j}``) is one group, every other key
    goes with its first name part (``embed``, ``norm``, ``head``)."""
    parts = key.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0]


def save_sharded(tensors: dict[str, torch.Tensor], out_dir: str | os.PathLike, n_shards: int = 2,
                 group_of=None) -> Path:
    """Split ``tensors`` over ``n_shards`` files, keeping tensors of one group (default: one
    numbered layer, :func:`layer_group`) in one shard like the release, and write the index last
    (atomically), so a half-written checkpoint has no index."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    group_of = group_of or layer_group
    groups: dict[str, list[str]] = {}
    for key in tensors:
        groups.setdefault(group_of(key), []).append(key)
    # greedy balance by bytes
    loads = [0] * n_shards
    members: list[list[str]] = [[] for _ in range(n_shards)]
    for g in sorted(groups, key=lambda g: -sum(tensors[k].numel() * tensors[k].element_size() for k in groups[g])):
        i = loads.index(min(loads))
        members[i].extend(groups[g])
        loads[i] += sum(tensors[k].numel() * tensors[k].element_size() for k in groups[g])
    weight_map: dict[str, str] = {}
    total = 0
    for i, keys in enumerate(members):
        name = shard_file_name(i, n_shards)
        shard = {k: tensors[k].contiguous() for k in sorted(keys)}
        atomic_write(out_dir / name, lambda tmp, shard=shard: save_file(shard, tmp, metadata={"format": "pt"}))
        for k in keys:
            weight_map[k] = name
            total += tensors[k].numel() * tensors[k].element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return atomic_write_json(index, out_dir / INDEX_NAME)
