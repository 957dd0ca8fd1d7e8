"""The checkpoint's tokenizer checked by the job plan (issue 36.3): present, readable, and not
larger than the model's vocabulary.

A missing tokenizer.json used to surface as transformers' "Couldn't instantiate the backend
tokenizer from one of: ..." naming no file, and a config.json ``vocab_size`` smaller than the
tokenizer's as an index error (or a shape mismatch) once the embedding met a large id
(casebook i36t-5). Both are one line here, before any work.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError, DataError
from .tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, tokenizer_vocab_size

#: other files transformers builds a tokenizer from (SentencePiece, a BPE vocab + merges)
OTHER_TOKENIZER_FILES = ("tokenizer.model", "vocab.json")


def missing_tokenizer_line(model_path: str | os.PathLike) -> str | None:
    """One line naming the missing tokenizer file of ``model_path``, or None when one is there."""
    p = Path(model_path)
    if (p / TOKENIZER_FILE).is_file() or any((p / n).is_file() for n in OTHER_TOKENIZER_FILES):
        return None
    return (f"{p / TOKENIZER_FILE}: not found (the checkpoint's tokenizer; copy {TOKENIZER_FILE} and "
            f"{TOKENIZER_CONFIG_FILE} from the release into {p})")


def check_tokenizer(model_path: str | os.PathLike, vocab_size: int | None) -> None:
    """Raise one line when the tokenizer file is missing or unreadable, or holds more token ids
    than config.json's ``vocab_size`` (an id past the embedding)."""
    p = Path(model_path)
    line = missing_tokenizer_line(p)
    if line is not None:
        raise DataError(line)
    if not (p / TOKENIZER_FILE).is_file():
        return   # another tokenizer form: transformers reads it when the run starts
    try:
        n = tokenizer_vocab_size(p)
    except Exception as e:   # truncated / foreign JSON: name the file, one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise DataError(f"{p / TOKENIZER_FILE}: cannot read the tokenizer ({type(e).__name__}: {first})") from None
    if isinstance(vocab_size, int) and n > vocab_size:
        raise ConfigError(f"{p / 'config.json'}: vocab_size={vocab_size} is smaller than the tokenizer's {n} "
                          f"token ids ({p / TOKENIZER_FILE}): ids >= {vocab_size} would index past the "
                          "embedding; fix vocab_size or use the checkpoint's own tokenizer")


__all__ = ["check_tokenizer", "missing_tokenizer_line"]
