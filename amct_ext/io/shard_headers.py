"""Every shard's safetensors header read and checked at plan time: no tensor data is read.

A safetensors file is ``u64 header length | JSON header | data``; the header gives each tensor's
dtype, shape and byte range. Reading only the headers of every shard (kilobytes each) lets the
job plan refuse, before any layer work, what the loader would otherwise meet only when it reaches
that layer -- after every earlier layer's work at real size:

- a truncated shard (the file is shorter than its header says) or one with bytes after its data;
- a garbage header (length out of range, not JSON, an entry without dtype / shape / offsets,
  byte ranges that overlap, leave the data region or disagree with dtype x shape);
- a key the index maps to a shard whose header does not hold it (a key in the wrong shard);
- a tensor whose dtype the loader cannot decode, a float tensor where the model expects integers
  (or the reverse), an FP8 / packed-FP4 weight without its ``.scale`` companion or with a scale
  of the wrong shape;
- a tensor whose (decoded) shape differs from the model skeleton's, i.e. config.json disagrees
  with the stored shapes.

The storage rules are those of ``checkpoint.CheckpointReader._load_one`` (FP8 block weights with
a block scale, MXFP4 packed as int8 / uint8 / F4 with an e8m0 scale, plain floats and integers).
What the model expects comes from the caller (the model's meta skeleton); this module knows no
model. ``ShardHeader`` also gives each tensor's absolute byte range, which the weights digest
(``weights_digest``) reads.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import CheckpointError
from .storage_formats import FP4_BLOCK, FP8_BLOCK

#: bits per element of each safetensors dtype
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
              "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64,
              "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "C64": 64}
FLOAT_STORED = frozenset({"F32", "BF16", "F16", "F64"})
INT_STORED = frozenset({"I32", "I64"})
FP8_STORED = "F8_E4M3"
FP4_PACKED_STORED = frozenset({"I8", "U8"})      # two e2m1 codes a byte: logical columns = 2 x stored
FP4_STORED = "F4"                                # the header's shape is already the logical one
SCALE_STORED = frozenset({"F8_E8M0", "U8", "F32", "BF16", "F16"})
#: a header longer than this is not a checkpoint header (safetensors' own limit is 100 MB)
MAX_HEADER_BYTES = 100 * 2 ** 20
WEIGHT_SUFFIX, SCALE_SUFFIX = ".weight", ".scale"


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    start: int          # absolute byte offsets in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class ShardHeader:
    name: str
    path: Path
    size: int
    tensors: dict[str, TensorEntry]


def _bad(name: str, why: str) -> CheckpointError:
    return CheckpointError(f"shard file {name!r}: {why}; re-download that shard")


def read_header(path: str | os.PathLike, name: str | None = None) -> ShardHeader:
    """The checked header of one safetensors file (see the module doc for what is refused)."""
    path = Path(path)
    name = name or path.name
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _bad(name, f"{size} bytes, too short to hold a safetensors header (truncated?)")
            (n,) = struct.unpack("<Q", head)
            if n < 2 or n > MAX_HEADER_BYTES or n > size - 8:
                why = "is longer than the file (truncated?)" if n <= MAX_HEADER_BYTES else "is absurd"
                raise _bad(name, f"header length {n} {why} (file of {size} bytes): not a safetensors file")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"shard file {name!r}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad(name, f"the header is not JSON ({e.__class__.__name__}: {str(e)[:80]})") from None
    if not isinstance(header, dict):
        raise _bad(name, "the header is not a JSON object")
    base = 8 + n
    tensors: dict[str, TensorEntry] = {}
    for key, e in header.items():
        if key == "__metadata__":
            continue
        tensors[key] = _entry(name, key, e, base)
    spans = sorted((t.start, t.end, k) for k, t in tensors.items())
    for (a0, a1, ka), (b0, b1, kb) in zip(spans, spans[1:]):
        if b0 < a1:
            raise _bad(name, f"tensors {ka!r} and {kb!r} overlap in the data region")
    data_end = max((t.end for t in tensors.values()), default=base)
    if data_end > size:
        raise _bad(name, f"{size} bytes on disk, its header describes {data_end} (truncated: "
                         f"{data_end - size} bytes missing)")
    if data_end < size:
        raise _bad(name, f"{size} bytes on disk, its header describes {data_end} ({size - data_end} bytes "
                         "after the data: not the file the header was written for)")
    return ShardHeader(name=name, path=path, size=size, tensors=tensors)


def _entry(shard: str, key: str, e: Any, base: int) -> TensorEntry:
    if not isinstance(e, dict):
        raise _bad(shard, f"header entry {key!r} is not an object")
    dtype, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise _bad(shard, f"tensor {key!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise _bad(shard, f"tensor {key!r} has a malformed shape {shape!r}")
    if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) and not isinstance(o, bool)
                                                               for o in offs) and 0 <= offs[0] <= offs[1]):
        raise _bad(shard, f"tensor {key!r} has malformed data_offsets {offs!r}")
    want = -(-math.prod(shape) * DTYPE_BITS[dtype] // 8)
    if offs[1] - offs[0] != want:
        raise _bad(shard, f"tensor {key!r}: {dtype} {shape} needs {want} bytes, its data_offsets span "
                          f"{offs[1] - offs[0]}")
    return TensorEntry(dtype, tuple(shape), base + offs[0], base + offs[1])


def read_headers(root: Path, shards: list[str]) -> dict[str, ShardHeader]:
    """{shard name: header} of every shard (names relative to ``root``, already checked to stay
    inside it by ``CheckpointReader``)."""
    out = {}
    for s in shards:
        p = Path(root) / s
        if not p.is_file():
            raise CheckpointError(f"shard file {s!r} is missing ({p})")
        out[s] = read_header(p, s)
    return out


def check_index_against_headers(headers: Mapping[str, ShardHeader], weight_map: Mapping[str, str],
                                where: str) -> None:
    """Every key of the index is held by the shard the index names."""
    for key, shard in weight_map.items():
        if key not in headers[shard].tensors:
            holder = next((s for s, h in headers.items() if key in h.tensors), None)
            also = f"; it is in {holder!r}" if holder else "; no shard holds it"
            raise CheckpointError(f"{where}: key {key!r} is mapped to shard {shard!r}, whose header does not hold "
                                  f"it{also} (an index of another checkpoint?)")


def _torch_is_int(dtype: torch.dtype | None) -> bool | None:
    if dtype is None:
        return None
    return not dtype.is_floating_point


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def stored_logical(key: str, entry: TensorEntry, scale: TensorEntry | None, shard: str) -> tuple[tuple[int, ...], bool]:
    """(the shape the loader decodes ``key`` to, whether it decodes to integers), or a refusal
    naming the key when the loader could not decode it (``CheckpointReader._load_one``'s rules)."""
    d, shape = entry.dtype, entry.shape
    where = f"tensor {key!r} in shard {shard!r}"
    if d == FP8_STORED or (scale is not None and (d in FP4_PACKED_STORED or d == FP4_STORED)):
        if len(shape) != 2:
            raise CheckpointError(f"{where}: {d} weight must be 2-D, the header says {list(shape)}")
        if scale is None:
            raise CheckpointError(f"{where}: FP8 weight without its companion "
                                  f"{key[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX!r} (not in the index)")
        if scale.dtype not in SCALE_STORED:
            raise CheckpointError(f"{where}: its scale is stored as {scale.dtype}, not a scale dtype")
        if d == FP8_STORED:
            logical = shape
            want = (_cdiv(shape[0], FP8_BLOCK), _cdiv(shape[1], FP8_BLOCK))
        else:
            logical = shape if d == FP4_STORED else (shape[0], 2 * shape[1])
            want = (logical[0], _cdiv(logical[1], FP4_BLOCK))
        if tuple(scale.shape) != want:
            raise CheckpointError(f"{where}: {d} weight {list(logical)} needs a scale of shape {list(want)}, "
                                  f"the header gives {list(scale.shape)}")
        return tuple(logical), False
    if d in FLOAT_STORED:
        return shape, False
    if d in INT_STORED:
        return shape, True
    hint = " (packed FP4 needs a companion .scale)" if d in FP4_PACKED_STORED or d == FP4_STORED else ""
    raise CheckpointError(f"{where}: stored dtype {d} cannot be decoded{hint}")


def check_expected(headers: Mapping[str, ShardHeader], weight_map: Mapping[str, str],
                   expected: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]], where: str,
                   shapes_from: str = "config.json") -> int:
    """Every expected tensor present in the index, as the loader would decode it, against the
    model skeleton's (shape, dtype); returns how many were checked. Expected names absent from
    the index are the caller's concern (its key check names them)."""
    checked = 0
    for key, (want_shape, want_dtype) in expected.items():
        shard = weight_map.get(key)
        if shard is None:
            continue
        entry = headers[shard].tensors[key]
        scale = None
        if key.endswith(WEIGHT_SUFFIX):
            skey = key[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX
            if skey in weight_map:
                scale = headers[weight_map[skey]].tensors[skey]
        logical, is_int = stored_logical(key, entry, scale, shard)
        wants_int = _torch_is_int(want_dtype)
        if wants_int is not None and wants_int != is_int:
            raise CheckpointError(f"{where}: tensor {key!r} in shard {shard!r} is stored as {entry.dtype}, the model "
                                  f"expects {'integer' if wants_int else 'floating'} values ({want_dtype})")
        if tuple(logical) != tuple(want_shape):
            raise CheckpointError(f"{where}: tensor {key!r} in shard {shard!r} has shape {list(logical)}, "
                                  f"{shapes_from} gives {list(want_shape)} (config.json and the checkpoint disagree)")
        checked += 1
    return checked


__all__ = ["ShardHeader", "TensorEntry", "read_header", "read_headers", "check_index_against_headers",
           "check_expected", "stored_logical", "DTYPE_BITS"]
