"""Which files of a checkpoint folder may be read: never one reached through a link that leaves it.

A checkpoint folder is trusted only for what lies inside it. A symbolic link (a shard, config.json,
a tokenizer or ``generation_config.json`` the export copies) that resolves outside the folder is
refused with one line naming the file and where it points: the link may be a mistake, and what
it points to is not part of the checkpoint that was hashed, checked or named.

One layout is accepted: the Hugging Face hub cache, where every file of a revision is a link
``models--ORG--NAME/snapshots/REV/FILE -> ../../blobs/SHA`` into the same repository folder's
``blobs/``. A link from ``snapshots/REV/`` into ``models--ORG--NAME/blobs/`` of that same
``models--*`` folder is inside the checkpoint for our purpose; a link into another repository's
blobs, or anywhere else, is not.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from ..errors import CheckpointError

HUB_REPO_PREFIX = "models--"


def hub_blobs_dir(root: Path) -> Path | None:
    """``models--X/blobs`` when ``root`` is a hub snapshot folder ``models--X/snapshots/REV``."""
    root = Path(os.path.abspath(root))
    if len(root.parts) >= 3 and root.parent.name == "snapshots" and root.parent.parent.name.startswith(HUB_REPO_PREFIX):
        return root.parent.parent / "blobs"
    return None


def outside_reason(root: Path, name: str) -> str | None:
    """Why ``root/name`` may not be read (it resolves outside ``root`` and is no hub blob of
    ``root``'s repository), or None when it may."""
    root = Path(root)
    real_root = root.resolve()
    target = (root / name).resolve()
    try:
        target.relative_to(real_root)
        return None
    except ValueError:
        pass
    blobs = hub_blobs_dir(root)
    if blobs is not None:
        try:
            rel = target.relative_to(blobs.resolve())
            if len(rel.parts) == 1:      # a blob itself, not a folder below blobs/
                return None
        except ValueError:
            pass
    return f"resolves to {target}, outside the checkpoint folder {root}"


def checked_file(root: Path, name: str, what: str = "file") -> Path:
    """``root/name`` after refusing a link out of ``root`` (see the module doc)."""
    why = outside_reason(root, name)
    if why is not None:
        raise CheckpointError(f"{what} {Path(root) / name}: {why}; copy the file into the folder instead of linking it")
    return Path(root) / name


def check_folder_links(root: Path, names: Iterable[str] | None = None) -> None:
    """Every top-level entry of ``root`` (or only ``names``) that is a link must stay inside."""
    root = Path(root)
    entries = [root / n for n in names] if names is not None else sorted(root.iterdir())
    for p in entries:
        if p.is_symlink():
            checked_file(root, p.name, "checkpoint file")


__all__ = ["checked_file", "check_folder_links", "hub_blobs_dir", "outside_reason"]
