"""Calibration and evaluation text checked before any work (issue 36.3): UTF-8 text, and enough
of it for the windows asked.

- :func:`check_utf8_text` reads the file in chunks through an incremental UTF-8 decoder (a few
  GB/s, no copy of the whole text): a binary file, a UTF-16 file (byte-order mark) or a NUL byte
  is one :class:`~amct_ext.errors.DataError` naming the flag, the file, the byte offset and what
  the file looks like, instead of a ``UnicodeDecodeError`` traceback from deep in the
  tokenization (casebook i36t-4).
- :func:`check_calibration_length` refuses calibration text so short that the windows drawn from
  it repeat it: ``samples x seq_len`` tokens drawn from a text of ``n`` tokens cover each token
  ``samples * seq_len / n`` times on average; above :data:`MAX_REUSE` the "calibration set" is a
  few sentences seen again and again (60 words for 8 x 128 windows: casebook i36t-9).
"""
from __future__ import annotations

import codecs
import math
import os
from pathlib import Path

from ..errors import DataError

CHUNK = 1 << 20
#: most times each calibration token may be drawn on average (windows overlap, as in GPTQ)
MAX_REUSE = 2.0
_BOMS = {codecs.BOM_UTF16_LE: "UTF-16 (little-endian byte-order mark)",
         codecs.BOM_UTF16_BE: "UTF-16 (big-endian byte-order mark)",
         codecs.BOM_UTF32_LE: "UTF-32 (byte-order mark)", codecs.BOM_UTF32_BE: "UTF-32 (byte-order mark)"}


def _looks_like(head: bytes) -> str:
    for bom, name in sorted(_BOMS.items(), key=lambda kv: -len(kv[0])):
        if head.startswith(bom):
            return f"it looks like {name}; save it as UTF-8"
    if head[:4096].count(0) > 0:
        return "it holds NUL bytes: a binary file, or UTF-16 without a byte-order mark; pass UTF-8 text"
    return "pass a UTF-8 text file"


def check_utf8_text(path: str | os.PathLike, flag: str) -> None:
    """Raise one DataError unless ``path`` is UTF-8 text without NUL characters."""
    path = Path(path)
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    head = b""
    try:
        with open(path, "rb") as f:
            while True:
                chunk = f.read(CHUNK)
                if not head:
                    head = chunk[:4096]
                final = not chunk
                try:
                    text = decoder.decode(chunk, final)
                except UnicodeDecodeError as e:
                    what = (f"byte 0x{chunk[e.start]:02x} at offset {offset + e.start}" if e.start < len(chunk)
                            else "it ends inside a character")
                    raise DataError(f"{flag} {path}: not UTF-8 text ({what}); {_looks_like(head)}") from None
                if "\x00" in text:
                    at = offset + chunk.index(0)
                    raise DataError(f"{flag} {path}: a NUL byte at offset {at}; {_looks_like(head)}")
                if final:
                    return
                offset += len(chunk)
    except OSError as e:
        raise DataError(f"{flag} {path}: cannot read ({e.strerror or e})") from None


def check_calibration_length(path: str | os.PathLike, n_tokens: int, samples: int, seq_len: int,
                             flag: str = "--calib-data") -> None:
    """Refuse a calibration text whose tokens the ``samples x seq_len`` windows would draw more
    than :data:`MAX_REUSE` times each on average; the line gives the words it has and needs."""
    need_tokens = math.ceil(samples * seq_len / MAX_REUSE)
    if n_tokens >= max(need_tokens, seq_len):
        return
    words = len(Path(path).read_text(encoding="utf-8").split())
    per_word = n_tokens / max(words, 1)
    need_words = math.ceil(max(need_tokens, seq_len) / max(per_word, 1e-9))
    raise DataError(f"{flag} {path}: {words} words ({n_tokens} tokens) are too short for {samples} x {seq_len} "
                    f"calibration windows: every token would be drawn {samples * seq_len / max(n_tokens, 1):.1f} "
                    f"times (at most {MAX_REUSE:g}); give about {need_words} words or more, or fewer "
                    "--calib-samples / a shorter --seq-len")


__all__ = ["check_utf8_text", "check_calibration_length", "MAX_REUSE"]
