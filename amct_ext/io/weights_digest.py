"""The checkpoint's weights themselves in the resume fingerprint: sha256 of each layer's stored bytes.

meta.json identifies the checkpoint by its config and index only; a fine-tune of the same layout,
or weights changed in place, has the same index. A resumed run must not take a finished unit
computed from other weights. So each layer's stored tensors are hashed -- the bytes of every
tensor the layer reads, as the shard holds them (FP8 / FP4 codes and scales, not decoded), with
its name, dtype and shape -- and a unit's layer record (``RunFolder.write_layer_weights``) keeps
the digest its units were computed from.

A unit's result depends on its layer's weights and on the layer's inputs, i.e. on the embedding
and every earlier layer (the float stream; with ``propagate=quant`` also their quantized units,
themselves functions of the same weights). So besides each group's own digest there is a chain:
``chain(k) = sha256(chain(k-1) | own(k))`` over stem, layer 0, layer 1, ... A layer whose chain
differs from its record is redone; its own digest says whether its weights or an earlier layer's
changed, and the per-tensor digests name the first changed tensor.

Cost: one sha256 pass over every byte the run reads anyway (``benchmarks/weights_digest_cost.py``).
It runs in a background thread (``hashlib`` and file reads release the GIL), at most ``ahead``
groups beyond the one the run last asked for: it reads the next layer's bytes while the current
layer is solved, so the layer's own load then finds them in the page cache.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from ..errors import CheckpointError
from .shard_headers import ShardHeader, read_header

CHUNK_BYTES = 16 * 2 ** 20
LAYER_PREFIX = "layers."


@dataclass
class GroupDigest:
    name: str
    own: str
    chain: str
    tensors: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"own": self.own, "chain": self.chain, "tensors": self.tensors}


def tensor_digest(path: Path, key: str, dtype: str, shape: Sequence[int], start: int, end: int) -> str:
    """sha256 of a tensor's name, dtype, shape and stored bytes (read in chunks)."""
    h = hashlib.sha256(f"{key}|{dtype}|{list(shape)}|".encode())
    with open(path, "rb") as f:
        f.seek(start)
        left = end - start
        while left > 0:
            chunk = f.read(min(CHUNK_BYTES, left))
            if not chunk:
                raise CheckpointError(f"{path}: ends inside tensor {key!r} (truncated since the plan read it?)")
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def weight_groups(weight_map: Mapping[str, str], prefixes: Sequence[tuple[str, str]],
                  extra_prefixes: Sequence[str] = ()) -> list[tuple[str, list[str]]]:
    """[("stem", keys outside every layer), (name, keys under prefix) ...] in the given order;
    ``prefixes``: (group name, key prefix) of each layer the run may build, in run order;
    ``extra_prefixes``: key prefixes of the model's extra layers (``mtp.``), never stem even
    when the run does not build them."""
    stem = sorted(k for k in weight_map if not k.startswith((LAYER_PREFIX, *extra_prefixes)))
    out = [("stem", stem)]
    for name, prefix in prefixes:
        out.append((name, sorted(k for k in weight_map if k.startswith(prefix))))
    return out


class WeightsDigest:
    """Digests of ``groups`` (from :func:`weight_groups`) of the checkpoint at ``root``, computed
    in a background thread; :meth:`get` waits for one. Use as a context manager (or ``close``)."""

    def __init__(self, root: Path, weight_map: Mapping[str, str], groups: list[tuple[str, list[str]]],
                 ahead: int = 1):
        self.root, self.weight_map, self.groups = Path(root), dict(weight_map), groups
        self.ahead = ahead
        self._index = {name: k for k, (name, _) in enumerate(groups)}
        self._done: dict[str, GroupDigest] = {}
        self._error: BaseException | None = None
        self._wanted = 0            # highest group index asked for (the stem is asked at once)
        self._stop = False
        self._cond = threading.Condition()
        self._headers: dict[str, ShardHeader] = {}
        self.bytes_hashed = 0
        self._thread = threading.Thread(target=self._run, name="weights-digest", daemon=True)

    def start(self) -> "WeightsDigest":
        self._thread.start()
        return self

    def _header(self, shard: str) -> ShardHeader:
        if shard not in self._headers:
            self._headers[shard] = read_header(self.root / shard, shard)
        return self._headers[shard]

    def _digest(self, name: str, keys: list[str], prev: str) -> GroupDigest:
        tensors = {}
        for key in keys:
            shard = self.weight_map[key]
            e = self._header(shard).tensors.get(key)
            if e is None:
                raise CheckpointError(f"key {key!r}: the index maps it to shard {shard!r}, whose header does not hold it")
            tensors[key] = tensor_digest(self.root / shard, key, e.dtype, e.shape, e.start, e.end)
            self.bytes_hashed += e.nbytes
        own = hashlib.sha256("".join(f"{k}:{d}\n" for k, d in tensors.items()).encode()).hexdigest()
        chain = hashlib.sha256(f"{prev}|{own}".encode()).hexdigest()
        return GroupDigest(name, own, chain, tensors)

    def _run(self) -> None:
        prev = ""
        try:
            for k, (name, keys) in enumerate(self.groups):
                with self._cond:
                    while not self._stop and k > self._wanted + self.ahead:
                        self._cond.wait()
                    if self._stop:
                        return
                g = self._digest(name, keys, prev)
                prev = g.chain
                with self._cond:
                    self._done[name] = g
                    self._cond.notify_all()
        except BaseException as e:   # handed to the caller of get()
            with self._cond:
                self._error = e
                self._cond.notify_all()

    def get(self, name: str) -> GroupDigest:
        """The digest of group ``name`` (waits for the thread to reach it)."""
        k = self._index[name]
        with self._cond:
            self._wanted = max(self._wanted, k)
            self._cond.notify_all()
            while name not in self._done and self._error is None:
                self._cond.wait()
            if name not in self._done:
                raise self._error   # type: ignore[misc]
            return self._done[name]

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> "WeightsDigest":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def first_changed_tensor(old: Mapping[str, str], new: Mapping[str, str]) -> str | None:
    """The first key (sorted) whose digest differs, or that is in one record only."""
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            return key
    return None


__all__ = ["WeightsDigest", "GroupDigest", "weight_groups", "tensor_digest", "first_changed_tensor"]
