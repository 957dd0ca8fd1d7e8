"""Streamed, resumable sharded safetensors output: one shard per group (the stem, each decoder
layer, the MTP layer), the index written last.

The shard list is fixed up front (group k -> ``{stem}-{k+1:05d}-of-{N:05d}.safetensors``), so a
shard never needs renaming. After each shard, ``.amct_export_state.json`` (atomic) records the
group as done, with its tensors' dtypes and shapes and the export's fingerprint. A rerun with the
same fingerprint skips the done groups; a different fingerprint is refused (naming the first
field that differs) unless the caller overwrites. The index is written only after every group,
so an interrupted export is never mistaken for a checkpoint; the state file is removed after it.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import save_file

from ..errors import AmctError, os_error_line
from ..io.io_utils import atomic_write, atomic_write_json

STATE_NAME = ".amct_export_state.json"


class ExportOutputError(AmctError):
    """The output folder cannot take this export (not empty, another export's partial state)."""


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
              torch.float8_e8m0fnu: "F8_E8M0"}


def save_streaming(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None) -> None:
    """A safetensors file written tensor by tensor from the tensors' own memory.

    ``safetensors.torch.save_file`` first turns every tensor into a bytes object, i.e. a second
    copy of the whole shard in host memory; for a V4-Flash layer that doubles the export's peak.
    Same format (8-byte header length, JSON header padded to 8 bytes, data in header order, larger
    elements first so each stays aligned); dtypes it does not map (packed F4) use save_file.
    """
    if any(t.dtype not in _ST_DTYPES for t in tensors.values()):
        save_file(tensors, path, metadata=metadata)
        return
    names = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for k in names:
        t = tensors[k]
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for k in names:
            # reshape(-1): a contiguous tensor may still carry an odd stride on a size-1 dim
            # ([out, 1] scales), which view(uint8) refuses
            t = tensors[k].contiguous().reshape(-1)
            if t.numel() and t.stride(0) != 1:   # a 1-element tensor keeps its odd stride
                t = torch.empty(t.shape, dtype=t.dtype).copy_(t)
            if t.numel():
                f.write(memoryview(t.view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def _names_os_errors(method):
    """A full disk / read-only folder while a shard streams: one ExportOutputError naming the
    shard file and the OS cause instead of a bare OSError (issue 36.3; the partial file never
    reaches its final name)."""
    import functools

    @functools.wraps(method)
    def wrapped(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except OSError as e:
            if e.errno is None:
                raise
            raise ExportOutputError(f"cannot write {os_error_line(e, self.path)}") from None
    return wrapped


class ShardStream:
    """One safetensors shard written while its tensors are produced: host memory holds one tensor
    at a time (plus the small ones, kept for the end).

    The data starts after a reserved header region; ``close`` writes the JSON header there, padded
    with spaces (valid JSON whitespace) to the reserved size, so no byte is written twice. Large
    tensors whose size is a multiple of 8 go out at once, which keeps every offset 8-aligned;
    small or odd-sized ones are written last, larger elements first (as safetensors orders them).
    A header that outgrows the reserve is rewritten once into a fresh file.
    """

    BIG = 1 << 20

    @_names_os_errors
    def __init__(self, path: str | os.PathLike, n_hint: int, metadata: dict[str, str] | None = None):
        self.path = str(path)
        self.metadata = dict(metadata or {})
        self.reserve = 8 * (-(-(4096 + 160 * max(n_hint, 1)) // 8))
        self.f = open(self.path, "wb")
        self.f.seek(8 + self.reserve)
        self.offset = 0
        self.entries: dict[str, dict[str, Any]] = {}
        self.pending: dict[str, torch.Tensor] = {}
        self.fallback: dict[str, torch.Tensor] | None = None

    @_names_os_errors
    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.entries or name in self.pending or (self.fallback is not None and name in self.fallback):
            raise ExportOutputError(f"tensor {name!r} written twice into {self.path}")
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype not in _ST_DTYPES:        # packed F4 and the like: safetensors' own writer
            self.fallback = {} if self.fallback is None else self.fallback
            self.fallback[name] = t.contiguous()
            return
        n = t.numel() * t.element_size()
        if n >= self.BIG and n % 8 == 0:
            self._write(name, t)
        else:
            self.pending[name] = t.contiguous()

    @_names_os_errors
    def add_file_range(self, name: str, st_dtype: str, shape: list[int], src: str | os.PathLike,
                       start: int, nbytes: int) -> bool:
        """Copy a tensor's bytes straight from another safetensors file (a tensor copied as
        released), in chunks: no host copy of the tensor. Returns False when the tensor should go
        through :meth:`add` instead (small, odd-sized, or a dtype this writer does not map)."""
        if st_dtype not in _ST_DTYPES.values() or nbytes < self.BIG or nbytes % 8:
            return False
        if name in self.entries or name in self.pending:
            raise ExportOutputError(f"tensor {name!r} written twice into {self.path}")
        with open(src, "rb") as f:
            f.seek(start)
            left = nbytes
            while left:
                chunk = f.read(min(left, 64 << 20))
                if not chunk:
                    raise ExportOutputError(f"{src}: truncated while copying tensor {name!r}")
                self.f.write(chunk)
                left -= len(chunk)
        self.entries[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [self.offset, self.offset + nbytes]}
        self.offset += nbytes
        return True

    def _write(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        flat = t.contiguous().reshape(-1)
        if flat.numel() and flat.stride(0) != 1:     # a 1-element tensor keeps its odd stride
            flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)
        if n:
            self.f.write(memoryview(flat.view(torch.uint8).numpy()))
        self.entries[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self.offset, self.offset + n]}
        self.offset += n

    @property
    def layout(self) -> dict[str, list]:
        out = {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in (self.fallback or {}).items()}
        inv = {v: k for k, v in _ST_DTYPES.items()}
        out.update({k: [str(inv[e["dtype"]]).replace("torch.", ""), e["shape"]] for k, e in self.entries.items()})
        return out

    @property
    def nbytes(self) -> int:
        return self.offset + sum(v.numel() * v.element_size() for v in (self.fallback or {}).values())

    @_names_os_errors
    def close(self) -> None:
        for name in sorted(self.pending, key=lambda k: (-self.pending[k].element_size(), k)):
            self._write(name, self.pending.pop(name))
        if self.fallback is not None:   # rare: rebuild the whole shard with save_file
            self.f.close()
            data = {}
            if self.entries:
                from safetensors.torch import load_file
                data = load_file(self._finish_header_to(self.path + ".tmp2"))
                os.unlink(self.path + ".tmp2")
            data.update(self.fallback)
            save_file(data, self.path, metadata=self.metadata or None)
            self.entries = {}
            self.offset = 0
            self.fallback = data
            return
        header: dict[str, Any] = {"__metadata__": self.metadata} if self.metadata else {}
        header.update(self.entries)
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        if len(blob) <= self.reserve:
            self.f.seek(0)
            self.f.write(self.reserve.to_bytes(8, "little"))
            self.f.write(blob + b" " * (self.reserve - len(blob)))
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()
            return
        # header larger than reserved: copy the data region behind a header of the right size
        self.f.flush()
        self.f.close()
        tmp = self.path + ".grow"
        self._copy_behind_header(blob, tmp, fsync=True)
        os.replace(tmp, self.path)

    def _finish_header_to(self, path: str) -> str:
        """The streamed part as a standalone file (fallback path only)."""
        header = dict(self.entries)
        self._copy_behind_header(json.dumps(header, separators=(",", ":")).encode("utf-8"), path, fsync=False)
        return path

    def _copy_behind_header(self, blob: bytes, path: str, fsync: bool) -> None:
        """Write ``path``: the safetensors header ``blob`` (padded to 8 bytes) and then the data
        region streamed so far (behind the reserved header of ``self.path``)."""
        blob += b" " * (-len(blob) % 8)
        with open(self.path, "rb") as src, open(path, "wb") as dst:
            dst.write(len(blob).to_bytes(8, "little"))
            dst.write(blob)
            src.seek(8 + self.reserve)
            shutil.copyfileobj(src, dst, 64 << 20)
            if fsync:
                dst.flush()
                os.fsync(dst.fileno())

    def abort(self) -> None:
        try:
            self.f.close()
        finally:
            if os.path.exists(self.path):
                os.unlink(self.path)


class ShardedWriter:
    def __init__(self, out_dir: str | os.PathLike, groups: Sequence[str], fingerprint: dict[str, Any],
                 shard_stem: str, index_name: str, overwrite: bool = False,
                 protect: Sequence[str | os.PathLike] = ()):
        self.out = Path(out_dir)
        self.groups = list(groups)
        self.fingerprint = fingerprint
        self.shard_stem = shard_stem
        self.index_name = index_name
        self.state_path = self.out / STATE_NAME
        self.state: dict[str, Any] = {"fingerprint": fingerprint, "groups": {}}
        self._prepare(overwrite, [Path(p).resolve() for p in protect])

    # ------------------------------------------------------------------ output folder
    def _prepare(self, overwrite: bool, protect: list[Path]) -> None:
        out = self.out.resolve()
        for p in protect:  # never delete the source checkpoint (or a folder holding it)
            if out == p or p.is_relative_to(out):
                raise ExportOutputError(f"--out {self.out} is (or contains) the source checkpoint {p}; choose another folder")
        if not self.out.exists():
            self.out.mkdir(parents=True)
            self._save_state()   # from the start: a rerun after a hard stop resumes, never "not empty"
            return
        if not self.out.is_dir():
            raise ExportOutputError(f"--out {self.out} exists and is not a folder")
        entries = list(self.out.iterdir())
        if not entries:
            self._save_state()
            return
        if overwrite:
            for e in entries:
                shutil.rmtree(e) if e.is_dir() and not e.is_symlink() else e.unlink()
            self._save_state()
            return
        if self.state_path.is_file():
            try:
                old = json.loads(self.state_path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ExportOutputError(f"{self.state_path}: unreadable ({e}); pass --overwrite") from None
            why = _first_difference(old.get("fingerprint", {}), self.fingerprint)
            if why:
                raise ExportOutputError(f"--out {self.out} holds a partial export of another kind ({why}); "
                                        "pass --overwrite to replace it")
            # resume: keep only groups whose shard is really there
            self.state = {"fingerprint": self.fingerprint,
                          "groups": {g: v for g, v in old.get("groups", {}).items()
                                     if g in self.groups and (self.out / v["shard"]).is_file()}}
            return
        raise ExportOutputError(f"--out {self.out} is not empty ({len(entries)} entries, e.g. {entries[0].name}); "
                                "pass --overwrite to replace its contents")

    # ------------------------------------------------------------------ groups
    def shard_name(self, group: str) -> str:
        k = self.groups.index(group)
        return f"{self.shard_stem}-{k + 1:05d}-of-{len(self.groups):05d}.safetensors"

    def done(self, group: str) -> bool:
        return group in self.state["groups"]

    @property
    def resumed_groups(self) -> list[str]:
        return list(self.state["groups"])

    def open_group(self, group: str, n_hint: int) -> ShardStream:
        """A stream into the group's shard (a temporary name until :meth:`close_group`)."""
        tmp = self.out / f".{self.shard_name(group)}.partial"
        return ShardStream(tmp, n_hint, metadata={"format": "pt"})

    def close_group(self, group: str, stream: ShardStream, extra: dict[str, Any] | None = None) -> int:
        """Finish the shard, move it to its name, record the group as done (atomically)."""
        name = self.shard_name(group)
        try:
            stream.close()
        except BaseException:
            stream.abort()
            raise
        os.replace(stream.path, self.out / name)
        self.state["groups"][group] = {"shard": name, "bytes": stream.nbytes, "tensors": dict(sorted(stream.layout.items())),
                                       "extra": extra or {}}
        self._save_state()
        return stream.nbytes

    def _save_state(self) -> None:
        # compact: the state grows with every layer (all tensor layouts) and is rewritten per layer
        blob = json.dumps(self.state, separators=(",", ":"))
        atomic_write(self.state_path, lambda tmp: Path(tmp).write_text(blob, encoding="utf-8"))

    def write_group(self, group: str, tensors: dict[str, torch.Tensor]) -> int:
        """Write one group's tensors (host tensors) as its shard; returns the bytes written."""
        name = self.shard_name(group)
        data = {k: v.detach().contiguous() for k, v in sorted(tensors.items())}
        for k, v in data.items():
            if v.device.type != "cpu":
                data[k] = v.cpu()
        atomic_write(self.out / name, lambda tmp: save_streaming(data, tmp, metadata={"format": "pt"}))
        nbytes = sum(v.numel() * v.element_size() for v in data.values())
        self.state["groups"][group] = {"shard": name, "bytes": nbytes,
                                       "tensors": {k: [_dtype_name(v), list(v.shape)] for k, v in data.items()}}
        self._save_state()
        return nbytes

    def finish(self, metadata: dict[str, Any] | None = None) -> Path:
        """The index (last), then drop the state file."""
        missing = [g for g in self.groups if not self.done(g)]
        if missing:
            raise ExportOutputError(f"export incomplete: groups {missing[:5]} were not written")
        weight_map: dict[str, str] = {}
        total = 0
        for g in self.groups:
            info = self.state["groups"][g]
            total += info["bytes"]
            for k in info["tensors"]:
                if k in weight_map:
                    raise ExportOutputError(f"tensor {k!r} written twice ({weight_map[k]} and {info['shard']})")
                weight_map[k] = info["shard"]
        index = {"metadata": {"total_size": total, **(metadata or {})}, "weight_map": dict(sorted(weight_map.items()))}
        path = atomic_write_json(index, self.out / self.index_name)
        self.state_path.unlink(missing_ok=True)
        return path

    def absorb(self, staging: str | os.PathLike) -> list[str]:
        """Take over the finished shards another process wrote into ``staging`` (a writer of
        the same groups and fingerprint, e.g. one torchrun rank's layer range): each shard is
        moved into this folder under its final name and recorded as done; ``staging`` is then
        removed. Returns the groups taken over."""
        staging = Path(staging)
        state_path = staging / STATE_NAME
        if not state_path.is_file():
            return []
        try:
            other = json.loads(state_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ExportOutputError(f"{state_path}: unreadable ({e}); pass --overwrite") from None
        why = _first_difference(other.get("fingerprint", {}), self.fingerprint)
        if why:
            raise ExportOutputError(f"{staging} holds shards of another export ({why}); pass --overwrite")
        taken = []
        for group, info in other.get("groups", {}).items():
            src = staging / info["shard"]
            if group in self.groups and src.is_file() and info["shard"] == self.shard_name(group):
                os.replace(src, self.out / info["shard"])
                self.state["groups"][group] = info
                taken.append(group)
        self._save_state()
        shutil.rmtree(staging, ignore_errors=True)
        return taken

    def tensor_layout(self) -> dict[str, list]:
        return {k: v for g in self.groups if self.done(g) for k, v in self.state["groups"][g]["tensors"].items()}


def _first_difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            return f"field {key!r}: {old.get(key)!r} != {new.get(key)!r}"
    return None
