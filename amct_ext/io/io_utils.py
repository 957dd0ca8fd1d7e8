"""Atomic file output: write to a temporary name in the same folder, then rename.

An OS error on the way (read-only folder, full disk, no permission) leaves no temporary file and
no half-written final file, and is raised as :class:`~amct_ext.errors.OutputError` naming the
final path and the OS cause (one line; issue 36.3)."""
from __future__ import annotations

import json
import os
import pickle
import re
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import CheckpointError, OutputError, os_error_line


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` then rename onto ``path``; a crash leaves no half-written file."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:   # read-only / missing permission on the folder: nothing was created
        raise OutputError(f"cannot write {os_error_line(e, path)}") from None
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file ordinary permissions
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        os_error = _os_error_in(e)
        if os_error is not None:   # full disk, quota, I/O error
            raise OutputError(f"cannot write {os_error_line(os_error, path)}") from None
        raise
    return path


def _os_error_in(e: BaseException | None) -> OSError | None:
    """The OSError behind ``e``: itself, or one it was raised while handling. torch.save's zip
    writer, failing mid-file, raises a RuntimeError ("unexpected pos") from its ``__exit__``
    with the ENOSPC as its context."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno is not None:
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` done atomically. It writes through an open file object: torch's own file
    writer turns a full disk into a RuntimeError about stream positions, Python's file object
    raises the OSError (ENOSPC) that :func:`atomic_write` names (casebook i36t-2)."""
    def _write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            torch.save(obj, f)

    return atomic_write(path, _write)


def atomic_write_json(obj: Any, path: str | os.PathLike) -> Path:
    def _write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")

    return atomic_write(path, _write)


def safe_torch_load(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """The only way the project reads ``.pt`` files: ``weights_only=True``. A file holding other
    Python objects is refused in one line naming it and the object (torch's own refusal runs to
    seven lines of advice to load it unsafely: casebook i36t-8)."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path}: refused: {unpickling_refusal(str(e))}; this tool never writes such "
                              "a file, so it was replaced or tampered with: delete it (a rerun redoes it)") from None


def load_error_line(e: BaseException) -> str:
    """One line for a failed ``torch.load`` (truncated, foreign or pickled-object file)."""
    if isinstance(e, pickle.UnpicklingError):
        return unpickling_refusal(str(e))
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"


def unpickling_refusal(text: str) -> str:
    """The one fact in torch's weights_only refusal: which object it would not load."""
    m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if m:
        return f"it holds a Python object ({m.group(1)}) that weights_only loading does not allow"
    m = re.search(r"WeightsUnpickler error: ([^\n]*)", text)
    detail = m.group(1).strip() if m else (text.strip().splitlines() or ["?"])[-1].strip()
    return f"not a plain tensor file ({detail[:160]})"
