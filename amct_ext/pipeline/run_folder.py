"""The one owner of a PTQ run's output folder: layout, meta.json, resume checks, unit files, lock.

Layout of OUTPUT (``RunFolder(OUTPUT)``)::

    OUTPUT/.lock                         held (fcntl.flock) by the run using the folder
    OUTPUT/ptq_params/meta.json          the run's fingerprint (format version META_VERSION)
    OUTPUT/ptq_params/weights/layer_{i}.json
                                         the weights digest layer i's units were computed from
    OUTPUT/ptq_params/{stem}.pt / .json  one unit's parameters / its losses

meta.json records everything that changes a unit's result; a resumed run must agree on every
field (``check_meta``: one line naming the first field that differs, both values). Beyond it:

- the checkpoint's weights: each layer's record holds the digests of the stored tensors its
  units were computed from, and the chain over the stem and every earlier layer
  (``io/weights_digest.py``); a layer whose chain differs is redone, with one line naming the
  first changed layer and tensor (``layer_weights_change``);
- the unit files: a unit counts as done only when its ``.pt`` is a whole torch archive
  (``unit_done``: every member's CRC checked); a truncated or damaged one is redone, with one line;
- the lock: a second run on a folder in use is refused at once (``lock``), not after hours.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import sys
import zipfile
from pathlib import Path
from typing import Any

from ..errors import AmctError, DataError
from ..io.io_utils import atomic_write_json

log = logging.getLogger(__name__)

PARAMS_DIR = "ptq_params"
META_NAME = "meta.json"
LOCK_NAME = ".lock"
WEIGHTS_DIR = "weights"
# 2: the full fingerprint (dtype, device type, calibration hashes, checkpoint identity)
# 3: per-layer weights digests (ptq_params/weights/), unit files checked on resume
META_VERSION = 3
HINT = "pass a fresh --output-dir or delete that folder"

# names shown in messages but not compared: a moved or renamed folder is the same run
_DISPLAY_ONLY = {"scheme", "model.name"}
_FIELD_NAMES = {"version": "format version", "scheme_fingerprint": "scheme"}


class ParamsMismatchError(AmctError):
    """An output folder holds PTQ parameters of another scheme / targets / model / settings."""


class FolderInUseError(AmctError):
    """Another run holds the output folder's lock."""


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        out.update(_flatten(v, key) if isinstance(v, dict) and v else {key: v})
    return out


def meta_mismatch(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """The first field that differs, as ``field: OLD in the folder, NEW now``; or None."""
    if old.get("version") != new["version"]:
        return f"format version: {old.get('version')!r} in the folder, {new['version']!r} now"
    flat_old, flat_new = _flatten(old), _flatten(new)
    for key in [*flat_new, *(k for k in flat_old if k not in flat_new)]:
        if key in _DISPLAY_ONLY:
            continue
        a, b = flat_old.get(key, "<absent>"), flat_new.get(key, "<absent>")
        if a != b:
            if key == "scheme_fingerprint":  # the names say more than two hashes
                return f"scheme: {old.get('scheme')!r} in the folder, {new.get('scheme')!r} now (different fingerprint)"
            return f"{_FIELD_NAMES.get(key, key)}: {a!r} in the folder, {b!r} now"
    return None


class RunFolder:
    """OUTPUT of one run (see the module doc). Cheap to make: nothing is read or written until asked."""

    def __init__(self, output_dir: str | os.PathLike, params_dir: str | os.PathLike | None = None):
        self.root = Path(output_dir)
        # ``params_dir``: a parameters folder given by itself (evaluation's params_dir)
        self.params = Path(params_dir) if params_dir is not None else self.root / PARAMS_DIR
        self._lock_fd: int | None = None

    @classmethod
    def of_params(cls, params_dir: str | os.PathLike) -> "RunFolder":
        """The run folder of a parameters folder (OUTPUT/ptq_params, or any folder so used)."""
        return cls(Path(params_dir).parent, params_dir)

    # ------------------------------------------------------------------ meta.json
    @property
    def meta_path(self) -> Path:
        return self.params / META_NAME

    def read_meta(self, error: type[AmctError] = DataError, context: str = "") -> dict[str, Any] | None:
        """meta.json as a dict, None when absent; unreadable or not an object: ``error``."""
        p = self.meta_path
        if not p.is_file():
            return None
        try:
            meta = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise error(f"{context}{p}: unreadable ({e})" + ("; " + HINT if error is ParamsMismatchError else "")
                        ) from None
        if not isinstance(meta, dict):
            raise error(f"{context}{p}: expected a JSON object")
        return meta

    def require_meta(self) -> dict[str, Any]:
        """meta.json of a folder that must hold parameters (evaluation of 'ptq', export)."""
        meta = self.read_meta()
        if meta is None:
            raise DataError(f"{self.meta_path} not found: no PTQ parameters in {self.params} (run PTQ first)")
        return meta

    def write_meta(self, meta: dict[str, Any]) -> None:
        atomic_write_json(meta, self.meta_path)

    def check_meta(self, meta: dict[str, Any]) -> bool:
        """True when the folder already holds parameters of this exact run (resume); False when
        it holds none. Raises ParamsMismatchError for anything else (never mix)."""
        old = self.read_meta(ParamsMismatchError)
        if old is not None:
            why = meta_mismatch(old, meta)
            if why:
                raise ParamsMismatchError(f"{self.params} holds PTQ parameters of another run: {why}; {HINT}")
            return True
        if self.params.is_dir() and any(p.suffix == ".pt" for p in self.params.iterdir()):
            raise ParamsMismatchError(f"{self.params} holds .pt files but no {META_NAME} (unknown scheme); {HINT}")
        return False

    def check_settled(self, now: dict[str, Any], scheme_name: str | None = None) -> bool:
        """The fields known before the model is opened (``now``: dotted meta keys -> value) against
        meta.json; False when there is none. Compared as meta.json stores them (JSON round trip);
        a different scheme is shown by its names (``scheme_name`` now)."""
        old = self.read_meta(ParamsMismatchError)
        if old is None:
            return False
        flat_old = _flatten(old)
        now = json.loads(json.dumps(now))
        for key, value in now.items():
            was = flat_old.get(key)
            if key.startswith("solver.") and was is None:     # an empty list / dict left whole
                was = (old.get("solver") or {}).get(key.split(".", 1)[1])
            if value != was:
                a, b = (old.get("scheme"), scheme_name) if key == "scheme_fingerprint" else (was, value)
                name = "scheme" if key == "scheme_fingerprint" else key
                raise ParamsMismatchError(f"{self.params} holds PTQ parameters of another run: {name}: {a!r} in "
                                          f"the folder, {b!r} now; {HINT}")
        return True

    # ------------------------------------------------------------------ unit files
    def unit_path(self, stem: str) -> Path:
        return self.params / f"{stem}.pt"

    def unit_done(self, stem: str) -> bool:
        """True when ``{stem}.pt`` exists and is a whole torch archive. A truncated or damaged
        file (a disk that filled, a copy cut short) is not done: one warning line, and the unit
        is solved again."""
        p = self.unit_path(stem)
        if not p.is_file():
            return False
        why = unit_file_problem(p)
        if why is None:
            return True
        warn(f"{p}: {why}; the unit is solved again")
        return False

    # ------------------------------------------------------------------ weights records
    def weights_record_path(self, layer: int) -> Path:
        return self.params / WEIGHTS_DIR / f"layer_{layer}.json"

    def read_layer_weights(self, layer: int) -> dict[str, Any] | None:
        p = self.weights_record_path(layer)
        if not p.is_file():
            return None
        try:
            rec = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            return {}
        return rec if isinstance(rec, dict) else {}

    def write_layer_weights(self, layer: int, digest) -> None:
        """Record the weights digest layer ``layer``'s units are about to be computed from
        (written before any of its units, so a unit never exists without its record)."""
        atomic_write_json(digest.to_dict(), self.weights_record_path(layer))

    def layer_weights_change(self, layer: int, digest, has_done_units: bool) -> str | None:
        """Why layer ``layer``'s finished units do not belong to the checkpoint now (one line),
        or None when they do (or there are none)."""
        from ..io.weights_digest import first_changed_tensor

        if not has_done_units:
            return None
        rec = self.read_layer_weights(layer)
        if rec is None or "chain" not in rec:
            return (f"layer {layer}: finished units without a weights record "
                    f"({self.weights_record_path(layer)}); its units are solved again")
        if rec["chain"] == digest.chain:
            return None
        if rec.get("own") != digest.own:
            key = first_changed_tensor(rec.get("tensors") or {}, digest.tensors)
            return (f"layer {layer}'s weights changed since this run started ({key}): its units, and those of "
                    "every later layer, are solved again")
        return (f"layer {layer}: the embedding or an earlier layer's weights changed since its units were solved "
                "(its inputs differ): its units are solved again")

    # ------------------------------------------------------------------ the lock
    def lock(self) -> "RunFolder":
        """Hold OUTPUT/.lock for this process (released by :meth:`unlock` or at exit); another
        run holding it: FolderInUseError at once."""
        if self._lock_fd is not None:
            return self
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = ""
            try:
                holder = os.read(fd, 64).decode("ascii", "replace").strip()
            except OSError:
                pass
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FolderInUseError(f"--output-dir {self.root} is in use by another run"
                                       + (f" (pid {holder})" if holder else "")
                                       + f" (lock {path}); wait for it to end or pass another --output-dir") from None
            raise
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd
        return self

    def unlock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    def __del__(self) -> None:   # a run that ends by an exception releases its lock too
        try:
            self.unlock()
        except Exception:
            pass

    def __enter__(self) -> "RunFolder":
        return self.lock()

    def __exit__(self, *exc) -> None:
        self.unlock()


def warn(line: str) -> None:
    """One ``warning:`` line on stderr (and the log): a resumed run redoing work says why."""
    log.debug(line)
    print(f"warning: {line}", file=sys.stderr, flush=True)


def unit_file_problem(path: Path) -> str | None:
    """What is wrong with a unit's ``.pt`` (a torch zip archive), or None: unreadable, not an
    archive (truncated: the directory at its end is gone), or a member failing its CRC."""
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as e:
        return f"unreadable unit file ({type(e).__name__}: {e}; truncated?)"
    if bad is not None:
        return f"unit file damaged (member {bad!r} fails its CRC)"
    return None


__all__ = ["RunFolder", "ParamsMismatchError", "FolderInUseError", "meta_mismatch", "unit_file_problem",
           "PARAMS_DIR", "META_NAME", "META_VERSION", "WEIGHTS_DIR", "LOCK_NAME"]
