"""Calibration samples: random token windows from a text file (GPTQ-style).

The default source is the WikiText-2 *validation* split (``wikitext-2/valid.txt`` of the
shared data). The test split is reserved for perplexity; calibrating (or training a
tokenizer) on it would leak the evaluation data, so such paths are refused by name.
"""
from __future__ import annotations

import os
import random
import re
from pathlib import Path

import torch

from .errors import DataError
from .perplexity import encode_text

# <repo>/../shared/data/wikitext-2/valid.txt: where the project's shared data lives.
DEFAULT_CALIBRATION_PATH = (
    Path(__file__).resolve().parents[1].parent / "shared" / "data" / "wikitext-2" / "valid.txt"
)

# "test" as a whole dot/dash/underscore-separated word of the file name: wiki.test.raw,
# test.txt, wikitext-2-test.txt; not "latest.txt" or "contest.txt".
_TEST_SPLIT_NAME = re.compile(r"(^|[._\-])test([._\-]|$)", re.IGNORECASE)


def refuse_test_split(path: str | os.PathLike, purpose: str) -> None:
    """Raise DataError if ``path`` names a test split (evaluation data must not leak)."""
    name = Path(path).name
    if _TEST_SPLIT_NAME.search(name):
        raise DataError(
            f"{path} looks like a test split; it is reserved for perplexity evaluation and "
            f"must not be used for {purpose} (use the validation split, e.g. wikitext-2/valid.txt)"
        )


def load_calibration_windows(
    data_path: str | os.PathLike | None,
    tokenizer,
    seq_len: int,
    n_samples: int,
    seed: int = 0,
) -> torch.LongTensor:
    """``n_samples`` windows of ``seq_len`` tokens at random offsets of a text file.

    - ``data_path=None`` uses :data:`DEFAULT_CALIBRATION_PATH` (the validation split).
    - The whole file is read verbatim and tokenized once, without special tokens: windows
      start at arbitrary offsets, so a BOS at offset 0 would only ever appear by chance.
    - Offsets are drawn like GPTQ's loaders (``randint`` over every valid start) with a
      private ``random.Random(seed)``: the same seed gives the same windows, and the global
      RNG state is neither used nor changed. Windows may overlap, as in GPTQ.

    Returns a LongTensor ``[n_samples, seq_len]``.
    """
    if data_path is None:
        data_path = DEFAULT_CALIBRATION_PATH
    path = Path(data_path)
    if not path.is_file():
        raise DataError(
            f"calibration text not found: {path} (pass a text file, e.g. the WikiText-2 "
            "validation split wikitext-2/valid.txt)"
        )
    refuse_test_split(path, "calibration")
    if seq_len < 1 or n_samples < 1:
        raise DataError(f"calibration needs seq_len >= 1 and n_samples >= 1, got {seq_len}, {n_samples}")

    text = path.read_text(encoding="utf-8")
    ids = encode_text(tokenizer, text, add_special_tokens=False)
    n_tokens = len(ids)
    if n_tokens < seq_len:
        raise DataError(
            f"calibration text {path} has {n_tokens} tokens, fewer than seq_len={seq_len}"
        )
    ids_t = torch.tensor(ids, dtype=torch.long)
    rng = random.Random(seed)
    # randint is inclusive: start == n_tokens - seq_len is the last window that fits.
    starts = [rng.randint(0, n_tokens - seq_len) for _ in range(n_samples)]
    return torch.stack([ids_t[s : s + seq_len] for s in starts])
