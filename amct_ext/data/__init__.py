"""Text that ships with the package, so a fresh clone (or an installed wheel) runs offline.

- ``wikitext-2/wiki.valid.tokens``: the WikiText-2 *validation* split in its tokenised form
  (rare words as ``<unk>``, space-separated punctuation). Default calibration text and the
  text tiny tokenizers / the trained tiny model are trained on.
- ``wikitext-2-raw/wiki.test.raw``: the *test* split of ``wikitext-2-raw-v1``, byte for byte
  (SHA-256 in :data:`EVAL_TEST_SHA256`). Default evaluation text; never calibration or training
  (``amct_ext.pipeline.leak_guard`` refuses text that shares long runs with it).

Licence: WikiText is CC BY-SA 3.0 (Merity et al. 2016, Salesforce); see ``README.md`` here.

``--calib-dataset NAME`` (online only, the optional ``datasets`` extra) is
:func:`dataset_calibration_file`: the rows of a Hugging Face dataset split written once into a
cache file, so the rest of the pipeline (content hash, leak guard) sees a plain text file.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from ..errors import DataError

DATA_DIR = Path(__file__).resolve().parent
CALIB_DEFAULT = DATA_DIR / "wikitext-2" / "wiki.valid.tokens"
EVAL_DEFAULT = DATA_DIR / "wikitext-2-raw" / "wiki.test.raw"
EVAL_TEST_SHA256 = "4f3e427e4aff23acff917a8a51aeae21bf12832256e26914c8fc250dcef4103c"

_TRUE = {"1", "on", "yes", "true"}


def cache_root() -> Path:
    """Where generated and fetched inputs are cached: ``$AMCT_CACHE``, else ~/.cache/amct_ext."""
    return Path(os.environ.get("AMCT_CACHE") or Path.home() / ".cache" / "amct_ext")


def _offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in _TRUE
               for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def parse_dataset_name(name: str) -> tuple[str, str | None, str]:
    """``PATH[:CONFIG[:SPLIT]]`` -> (path, config or None, split); the split defaults to 'train'.
    e.g. ``wikitext:wikitext-2-raw-v1:validation``."""
    parts = name.split(":")
    if not parts[0] or len(parts) > 3 or any(not p for p in parts[1:]):
        raise DataError(f"--calib-dataset {name!r}: expected PATH[:CONFIG[:SPLIT]], "
                        f"e.g. wikitext:wikitext-2-raw-v1:validation")
    path = parts[0]
    config = parts[1] if len(parts) > 1 else None
    split = parts[2] if len(parts) > 2 else "train"
    return path, config, split


def dataset_calibration_file(name: str, cache_dir: str | os.PathLike, text_field: str = "text") -> Path:
    """Fetch ``name`` with ``datasets`` and write its rows (joined with '\\n\\n') to a file under
    ``cache_dir``; returns that file (reused on the next call). Needs the ``datasets`` extra and
    network access: otherwise one DataError line says so and how to pass a file instead."""
    path, config, split = parse_dataset_name(name)
    if split.lower().startswith("test"):
        raise DataError(f"--calib-dataset {name!r}: split {split!r} is an evaluation split; "
                        f"calibrate on a train or validation split")
    key = hashlib.sha256(f"{path}\0{config}\0{split}\0{text_field}".encode()).hexdigest()[:16]
    out = Path(cache_dir) / "calib-datasets" / f"{path.replace('/', '--')}-{key}.txt"
    if out.is_file():
        return out
    hint = "or pass --calib-data FILE (the shipped default is the WikiText-2 validation split)"
    if importlib.util.find_spec("datasets") is None:
        raise DataError(f"--calib-dataset needs the optional `datasets` package "
                        f"(pip install -e '.[datasets]'), which is not installed; {hint}")
    if _offline():
        raise DataError(f"--calib-dataset {name!r} needs network access, but Hugging Face offline mode "
                        f"is set (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE); {hint}")
    import datasets

    try:
        ds = datasets.load_dataset(path, config, split=split)
        rows = ds[text_field]
    except Exception as e:  # network, hub, unknown name or field: one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise DataError(f"--calib-dataset {name!r}: could not load it with datasets "
                        f"({type(e).__name__}: {first}); {hint}") from None
    from ..io.io_utils import atomic_write

    out.parent.mkdir(parents=True, exist_ok=True)
    text = "\n\n".join(rows)
    atomic_write(out, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))
    return out
