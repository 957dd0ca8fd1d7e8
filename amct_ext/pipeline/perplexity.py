"""The standard WikiText-2 perplexity protocol (GPTQ / AMCT / llm-compressor).

1. Text: the rows of the ``test`` split of ``wikitext-2-raw-v1`` joined with ``"\\n\\n"``
   (:func:`load_eval_text`).
2. Tokenize the whole text ONCE (:func:`tokenize_windows`), cut it into non-overlapping
   windows of ``seq_len`` tokens and drop the tail that does not fill a window.
3. Run every window independently (no context carried over) and report
   ``exp(sum NLL / number of predicted tokens)``, where in each window positions
   ``0..S-2`` predict tokens ``1..S-1`` (:class:`NllAccumulator`, :func:`perplexity`).

How the rows are rebuilt from a local file
------------------------------------------
The HF ``wikitext`` builder (``datasets/wikitext/wikitext.py``, which also produced the
parquet files now served for ``Salesforce/wikitext``) reads the raw file like this::

    with open(data_file, encoding="utf-8") as f:
        for idx, row in enumerate(f):
            if row.strip():
                yield idx, {"text": row}
            else:
                yield idx, {"text": ""}

So: one row per line of the file; a row KEEPS its trailing ``"\\n"``; a whitespace-only
line (the " \\n" separators of the original release) becomes the empty row ``""``. It is
NOT the generic ``text`` builder (whose ``keep_linebreaks=False`` default strips them).
Python text mode uses universal newlines, so ``"\\r\\n"`` and a lone ``"\\r"`` end a line
and are read as ``"\\n"``; other characters that ``str.splitlines`` would split on
(``\\x0b``, ``\\x0c``, ``\\x1c``-``\\x1e``, ``\\x85``, ``\\u2028``, ``\\u2029``) do NOT end a
line. :func:`read_wikitext_rows` reproduces exactly that by iterating a text-mode file,
never with ``str.splitlines``. The protocol text is then ``"\\n\\n".join(rows)``.

Both choices are parameters of :func:`load_eval_text` (``keep_linebreaks``, ``verbatim``);
the defaults are the builder's behaviour above.
"""
from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..errors import DataError

ROW_SEPARATOR = "\n\n"
WIKITEXT_HINT = (
    "pass --data-path /path/to/wikitext-2-raw/wiki.test.raw (the test split of "
    "wikitext-2-raw-v1, in wikitext-2-raw-v1.zip from https://wikitext.smerity.com or the "
    "Salesforce/wikitext dataset on the Hugging Face hub)"
)

_TRUE = {"1", "on", "yes", "true"}


def read_wikitext_rows(path: str | os.PathLike, *, keep_linebreaks: bool = True) -> list[str]:
    """The dataset rows of a raw WikiText file, as the HF ``wikitext`` builder yields them.

    One row per line (universal newlines); whitespace-only lines become ``""``; other rows
    keep their trailing ``"\\n"`` unless ``keep_linebreaks=False``.
    """
    path = Path(path)
    rows: list[str] = []
    try:
        # newline=None (the default) is universal-newline mode, exactly as the builder's
        # open(); iterating the file object splits only on \n, \r\n and \r.
        with open(path, encoding="utf-8", newline=None) as f:
            for line in f:
                if not line.strip():
                    rows.append("")
                elif keep_linebreaks:
                    rows.append(line)
                else:
                    rows.append(line[:-1] if line.endswith("\n") else line)
    except FileNotFoundError:
        raise DataError(f"evaluation text not found: {path} ({WIKITEXT_HINT})") from None
    except UnicodeDecodeError as e:
        raise DataError(f"evaluation text {path} is not UTF-8: {e}") from None
    return rows


def _hf_offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in _TRUE
               for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def load_eval_text(
    data_path: str | os.PathLike | None,
    split: str = "test",
    *,
    keep_linebreaks: bool = True,
    verbatim: bool = False,
) -> str:
    """The evaluation text: ``"\\n\\n".join(rows of the wikitext-2-raw-v1 split)``.

    ``data_path``: a local raw WikiText file (e.g. ``wikitext-2-raw/wiki.test.raw``); its
    rows are rebuilt with :func:`read_wikitext_rows` (see the module docstring). ``split``
    is then ignored: a local file is its own split. ``verbatim=True`` returns the file's
    text unchanged instead (for corpora that are not WikiText).

    ``data_path=None``: ``datasets.load_dataset("wikitext", "wikitext-2-raw-v1",
    split=split)``, only when ``datasets`` is installed and HF offline mode is not set;
    otherwise a DataError says to pass ``--data-path``.
    """
    if data_path is not None:
        path = Path(data_path)
        if not path.is_file():
            raise DataError(f"evaluation text not found: {path} ({WIKITEXT_HINT})")
        if verbatim:
            try:
                return path.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"evaluation text {path} is not UTF-8: {e}") from None
        return ROW_SEPARATOR.join(read_wikitext_rows(path, keep_linebreaks=keep_linebreaks))

    if importlib.util.find_spec("datasets") is None:
        raise DataError(f"no evaluation text: `datasets` is not installed; {WIKITEXT_HINT}")
    if _hf_offline():
        raise DataError(f"no evaluation text: Hugging Face offline mode is set; {WIKITEXT_HINT}")
    import datasets

    try:
        ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split=split)
    except Exception as e:  # network, hub or cache failures: one clear line for the user
        raise DataError(
            f"could not load wikitext-2-raw-v1 split {split!r} with datasets "
            f"({type(e).__name__}: {e}); {WIKITEXT_HINT}"
        ) from e
    rows = ds["text"]
    if not keep_linebreaks:
        rows = [r[:-1] if r.endswith("\n") else r for r in rows]
    return ROW_SEPARATOR.join(rows)


def encode_text(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    """Token ids of ``text`` with a `transformers` tokenizer or a raw `tokenizers.Tokenizer`."""
    if callable(tokenizer):  # transformers tokenizer
        # verbose=False: the text is far longer than model_max_length on purpose (it is cut
        # into windows afterwards), so the length warning would only be noise.
        enc = tokenizer(
            text, add_special_tokens=add_special_tokens, verbose=False,
            return_attention_mask=False,
        )
        return list(enc["input_ids"])
    enc = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return list(enc.ids if hasattr(enc, "ids") else enc)


def tokenize_windows(
    text: str,
    tokenizer: Any,
    seq_len: int,
    max_windows: int | None = None,
    *,
    add_special_tokens: bool = True,
    first_window: int = 0,
) -> torch.LongTensor:
    """Tokenize ``text`` once and cut it into non-overlapping ``[n_windows, seq_len]`` windows.

    The tail shorter than ``seq_len`` is dropped. ``max_windows`` keeps the first windows
    only (a deterministic prefix, for quick runs). ``first_window`` skips the windows before it:
    windows ``[first_window, first_window + max_windows)`` of the same cut, so a dev range of
    windows (recipe choice) and the reported range never share a token.

    ``add_special_tokens=True`` (default) is the tokenizer's own default and what GPTQ's
    ``tokenizer("\\n\\n".join(rows))`` does: for DeepSeek / Llama tokenizers one BOS at the
    very start of the text (so only window 0 begins with BOS). Keep it for numbers
    comparable with published ones; pass False for raw text only.
    """
    if seq_len < 2:
        raise DataError(f"seq_len must be >= 2 to predict at least one token, got {seq_len}")
    if max_windows is not None and max_windows < 1:
        raise DataError(f"max_windows must be >= 1 or None, got {max_windows}")
    if first_window < 0:
        raise DataError(f"first_window must be >= 0, got {first_window}")
    ids = encode_text(tokenizer, text, add_special_tokens=add_special_tokens)
    n_windows = len(ids) // seq_len
    if n_windows == 0:
        raise DataError(
            f"evaluation text has {len(ids)} tokens, fewer than one window of seq_len={seq_len}"
        )
    if first_window >= n_windows:
        raise DataError(f"evaluation text has {n_windows} windows of seq_len={seq_len}; "
                        f"first window {first_window} is past the end")
    n_windows -= first_window
    if max_windows is not None:
        n_windows = min(n_windows, max_windows)
    start = first_window * seq_len
    return torch.tensor(ids[start: start + n_windows * seq_len], dtype=torch.long).view(n_windows, seq_len)


class NllAccumulator:
    """Running sum of next-token NLL over every predicted token of every window.

    ``update`` computes log-softmax chunk by chunk along the sequence so that at most
    ``max_chunk_elements`` logits are materialized again (a [B, S, V] fp32 tensor with a
    large vocabulary is not duplicated). Per-token NLL is computed in fp32 and summed in
    float64 on the host, so the total does not drift over hundreds of thousands of tokens.
    """

    def __init__(self, max_chunk_elements: int = 1 << 24) -> None:
        if max_chunk_elements < 1:
            raise ValueError(f"max_chunk_elements must be >= 1, got {max_chunk_elements}")
        self.max_chunk_elements = max_chunk_elements
        self.total_nll = 0.0  # python float == float64
        self.count = 0

    @torch.no_grad()
    def update(self, logits: torch.Tensor, input_ids: torch.Tensor) -> None:
        if logits.dim() != 3:
            raise ValueError(f"logits must be [B, S, V], got shape {tuple(logits.shape)}")
        b, s, v = logits.shape
        if tuple(input_ids.shape) != (b, s):
            raise ValueError(
                f"input_ids shape {tuple(input_ids.shape)} does not match logits {tuple(logits.shape)}"
            )
        if s < 2:
            return  # nothing is predicted inside a 1-token window
        targets = input_ids[:, 1:].to(device=logits.device, dtype=torch.long)
        # positions per chunk so that one chunk holds <= max_chunk_elements logits
        step = max(1, self.max_chunk_elements // (b * v))
        total = 0.0
        for start in range(0, s - 1, step):
            end = min(s - 1, start + step)
            # .float() is a no-op for fp32; for bf16/fp16 logits it upcasts one chunk only.
            chunk = logits[:, start:end, :].float().reshape(-1, v)
            nll = F.cross_entropy(chunk, targets[:, start:end].reshape(-1), reduction="none")
            # float64 on the host: portable to devices without float64 support.
            total += nll.detach().to("cpu", torch.float64).sum().item()
        self.total_nll += total
        self.count += b * (s - 1)

    @property
    def mean_nll(self) -> float:
        if self.count == 0:
            raise ValueError("no predicted tokens accumulated")
        return self.total_nll / self.count

    @property
    def ppl(self) -> float:
        return math.exp(self.mean_nll)


def perplexity(
    model_fn: Callable[[torch.Tensor], Any],
    windows: torch.Tensor,
    batch_size: int,
    device: str | torch.device,
    *,
    progress: bool = True,
    desc: str = "perplexity",
) -> float:
    """``exp(mean NLL)`` of ``model_fn`` over ``windows`` ``[n, seq_len]``.

    ``model_fn(input_ids) -> logits [B, S, V]`` (an object with a ``.logits`` attribute,
    like a `transformers` output, is accepted too). Windows are independent sequences.
    """
    if windows.dim() != 2 or windows.shape[0] == 0:
        raise DataError(f"windows must be a non-empty [n, seq_len] tensor, got {tuple(windows.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    from tqdm.auto import tqdm

    acc = NllAccumulator()
    n = windows.shape[0]
    with torch.no_grad():
        for i in tqdm(range(0, n, batch_size), desc=desc, disable=not progress,
                      total=math.ceil(n / batch_size)):
            ids = windows[i : i + batch_size].to(device)
            out = model_fn(ids)
            logits = getattr(out, "logits", out)
            acc.update(logits, ids)
            del out, logits  # free the batch's logits before the next forward
    return acc.ppl
