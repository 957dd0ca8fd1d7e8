"""Calibration samples: random token windows from a text file (GPTQ-style).

The default source is the WikiText-2 *validation* split that ships with the package
(``amct_ext/data/wikitext-2/wiki.valid.tokens``). The test split is reserved for perplexity;
calibrating (or training a tokenizer) on it would leak the evaluation data, so a text sharing
any 64-word run with an evaluation text is refused, whatever its name (``leak_guard``).
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Iterable

import torch

from ..data import CALIB_DEFAULT, EVAL_DEFAULT
from ..errors import DataError
from .leak_guard import refuse_eval_overlap
from .perplexity import encode_text
from .text_files import check_calibration_length, check_utf8_text

# the shipped validation split (package data): a fresh clone or an installed wheel has it
DEFAULT_CALIBRATION_PATH = CALIB_DEFAULT


def refuse_test_split(path: str | os.PathLike, purpose: str,
                      eval_paths: Iterable[str | os.PathLike | None] = ()) -> None:
    """Raise DataError if the text at ``path`` shares a 64-word run with the shipped test split
    or with any of ``eval_paths`` (by content: a renamed test split is refused, a file that
    merely has "test" in its name is not)."""
    refuse_eval_overlap(path, purpose, [EVAL_DEFAULT, *eval_paths])


def load_calibration_windows(
    data_path: str | os.PathLike | None,
    tokenizer,
    seq_len: int,
    n_samples: int,
    seed: int = 0,
    eval_paths: Iterable[str | os.PathLike | None] = (),
) -> torch.LongTensor:
    """``n_samples`` windows of ``seq_len`` tokens at random offsets of a text file.

    - ``data_path=None`` uses :data:`DEFAULT_CALIBRATION_PATH` (the validation split).
    - The whole file is read verbatim and tokenized once, without special tokens: windows
      start at arbitrary offsets, so a BOS at offset 0 would only ever appear by chance.
    - Offsets are drawn like GPTQ's loaders (``randint`` over every valid start) with a
      private ``random.Random(seed)``: the same seed gives the same windows, and the global
      RNG state is neither used nor changed. Windows may overlap, as in GPTQ.
    - A text sharing a 64-word run with the shipped test split or ``eval_paths`` is refused.

    Returns a LongTensor ``[n_samples, seq_len]``.
    """
    if data_path is None:
        data_path = DEFAULT_CALIBRATION_PATH
    path = Path(data_path)
    if not path.is_file():
        raise DataError(
            f"calibration text not found: {path} (pass a text file, e.g. the WikiText-2 "
            "validation split amct_ext/data/wikitext-2/wiki.valid.tokens)"
        )
    refuse_test_split(path, "calibration", eval_paths)
    if seq_len < 1 or n_samples < 1:
        raise DataError(f"calibration needs seq_len >= 1 and n_samples >= 1, got {seq_len}, {n_samples}")

    check_utf8_text(path, "calibration text")
    text = path.read_text(encoding="utf-8")
    ids = encode_text(tokenizer, text, add_special_tokens=False)
    n_tokens = len(ids)
    if n_tokens < seq_len:
        raise DataError(
            f"calibration text {path} has {n_tokens} tokens, fewer than seq_len={seq_len}"
        )
    check_calibration_length(path, n_tokens, n_samples, seq_len)   # not a few sentences drawn again and again
    ids_t = torch.tensor(ids, dtype=torch.long)
    rng = random.Random(seed)
    # randint is inclusive: start == n_tokens - seq_len is the last window that fits.
    starts = [rng.randint(0, n_tokens - seq_len) for _ in range(n_samples)]
    return torch.stack([ids_t[s : s + seq_len] for s in starts])
