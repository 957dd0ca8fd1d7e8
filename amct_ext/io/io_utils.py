"""Atomic file output: write to a temporary name in the same folder, then rename."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | os.PathLike, write: Callable[[str], None]) -> Path:
    """Call ``write(tmp_path)`` then rename onto ``path``; a crash leaves no half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp creates 0600; give the file ordinary permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` done atomically."""
    return atomic_write(path, lambda tmp: torch.save(obj, tmp))


def atomic_write_json(obj: Any, path: str | os.PathLike) -> Path:
    def _write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=False)
            f.write("\n")

    return atomic_write(path, _write)


def safe_torch_load(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """The only way the project reads ``.pt`` files: ``weights_only=True``."""
    return torch.load(path, map_location=map_location, weights_only=True)
