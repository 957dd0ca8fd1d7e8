"""Keep the evaluation text out of calibration and training, by content (not by file name).

A calibration or tokenizer / model training text is refused when it shares any run of
:data:`WINDOW_WORDS` consecutive whitespace-separated words with an evaluation text. Words,
not model tokens: the check must run before a tokenizer exists (tokenizer training) and must
not depend on which tokenizer is used. 64 words is far longer than any phrase two independent
Wikipedia articles share by chance (the validation and test splits share none), and shorter
than a paragraph, so a copied, renamed or re-wrapped test split is caught (re-wrapping changes
lines, not words).

Cost: one polynomial rolling hash (mod the Mersenne prime 2^61 - 1) per word position; the
evaluation side is a set of window hashes, computed once per file and process and cached by
(path, size, mtime). About a quarter of a second per MB of text on one CPU core.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import DataError

WINDOW_WORDS = 64
_MOD = (1 << 61) - 1
_BASE = 1_000_003  # any fixed base > vocabulary-hash spread works; fixed so hashes are stable
_word_ids: dict[str, int] = {}
_eval_cache: dict[tuple[str, int, int, int], frozenset[int]] = {}
_clean: set[tuple] = set()  # (text key, eval keys): pairs already checked and found clean


def _word_id(w: str) -> int:
    v = _word_ids.get(w)
    if v is None:
        # blake2b, not hash(): stable across processes (PYTHONHASHSEED) and well spread
        v = int.from_bytes(hashlib.blake2b(w.encode("utf-8"), digest_size=8).digest(), "little") % _MOD
        _word_ids[w] = v
    return v


def window_hashes(words: list[str], n: int = WINDOW_WORDS) -> Iterator[tuple[int, int]]:
    """(start, hash) of every window of ``n`` consecutive words."""
    if len(words) < n:
        return
    ids = [_word_id(w) for w in words]
    top = pow(_BASE, n - 1, _MOD)  # weight of the word that leaves the window
    h = 0
    for v in ids[:n]:
        h = (h * _BASE + v) % _MOD
    yield 0, h
    for i in range(n, len(ids)):
        h = ((h - ids[i - n] * top) * _BASE + ids[i]) % _MOD
        yield i - n + 1, h


def _read_words(path: Path, what: str) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").split()
    except OSError as e:
        raise DataError(f"{what} {path}: cannot read ({e})") from None


def _file_key(p: Path, n: int) -> tuple[str, int, int, int]:
    st = p.stat()
    return (str(p.resolve()), st.st_size, st.st_mtime_ns, n)


def eval_window_set(path: str | os.PathLike, n: int = WINDOW_WORDS) -> frozenset[int]:
    """The window hashes of an evaluation text (cached per file and process)."""
    p = Path(path).resolve()
    key = _file_key(p, n)
    cached = _eval_cache.get(key)
    if cached is None:
        cached = frozenset(h for _, h in window_hashes(_read_words(p, "evaluation text"), n))
        _eval_cache[key] = cached
    return cached


def refuse_eval_overlap(path: str | os.PathLike, purpose: str, eval_paths: Iterable[str | os.PathLike],
                        n: int = WINDOW_WORDS) -> None:
    """Raise DataError if ``path`` shares a run of ``n`` words with any existing file of
    ``eval_paths`` (files that do not exist are skipped: nothing to leak)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{purpose} text not found: {path}")
    evals = [Path(e) for e in eval_paths if e is not None and Path(e).is_file()]
    if not evals:
        return
    verdict = (_file_key(path, n), tuple(_file_key(e, n) for e in evals))
    if verdict in _clean:
        return
    words = _read_words(path, f"{purpose} text")
    sets = [(e, eval_window_set(e, n)) for e in evals]
    for start, h in window_hashes(words, n):
        for e, s in sets:
            if h in s:
                snippet = " ".join(words[start:start + 8])
                raise DataError(
                    f"{path} shares a {n}-word run with the evaluation text {e} (from word {start}: "
                    f"{snippet!r} ...); evaluation data must not be used for {purpose} "
                    f"(use the validation split, e.g. the shipped amct_ext/data/wikitext-2/wiki.valid.tokens)")
    _clean.add(verdict)
