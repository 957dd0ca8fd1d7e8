"""Byte-level BPE tokenizer training for tiny checkpoints.

A tiny DeepSeek-V4 checkpoint needs a real tokenizer so that perplexity numbers mean
something, but the released tokenizer (128k+ vocab) would make the embedding dominate a
tiny model. We therefore train a small byte-level BPE with the `tokenizers` library that
behaves like DeepSeek's:

- byte-level pre-tokenization / decoding, so every string is encodable and ASCII text
  round-trips exactly;
- special tokens ``<｜begin▁of▁sentence｜>`` (id 0, BOS) and ``<｜end▁of▁sentence｜>``
  (id 1, EOS), as in DeepSeek's vocabulary;
- a post-processor that prepends BOS when ``add_special_tokens=True`` (DeepSeek's
  ``tokenizer.json`` does the same), so ``tokenizer(text)`` behaves like the real one.

The output folder holds ``tokenizer.json`` and ``tokenizer_config.json`` and loads with
``transformers.AutoTokenizer.from_pretrained(out_dir)`` with no network access.

Training text must never be the evaluation split (see ``amct_ext.pipeline.calibration.refuse_test_split``).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from .calibration import refuse_test_split
from ..errors import ConfigError, DataError
from ..io.io_utils import atomic_write, atomic_write_json

logger = logging.getLogger(__name__)

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)  # order == ids: bos=0, eos=1

# 2 special tokens + the 256-symbol byte alphabet: the smallest vocabulary with no merges.
N_BYTE_SYMBOLS = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + N_BYTE_SYMBOLS

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def train_bpe_tokenizer(
    text_path: str | os.PathLike,
    vocab_size: int,
    out_dir: str | os.PathLike,
    *,
    min_frequency: int = 2,
    model_max_length: int = 131072,
) -> Path:
    """Train a byte-level BPE on ``text_path`` and write it to ``out_dir``; return ``out_dir``.

    ``vocab_size`` counts the 2 special tokens and the 256 byte symbols, so it must be at
    least 258. The result has exactly ``vocab_size`` entries unless the corpus runs out of
    pairs seen ``min_frequency`` times; then it is smaller and a warning gives the actual
    size (read it back with :func:`tokenizer_vocab_size`, which equals
    ``len(AutoTokenizer.from_pretrained(out_dir))``).

    Deterministic: no seed is involved and the `tokenizers` BPE trainer breaks count ties
    by pair order, so two runs on the same file give a byte-identical ``tokenizer.json``
    (checked by the tests, also across processes).
    """
    # Imported here so that importing amct_ext does not require `tokenizers`.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    text_path = Path(text_path)
    if not text_path.is_file():
        raise DataError(f"tokenizer training text not found: {text_path}")
    refuse_test_split(text_path, "tokenizer training")
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ConfigError(
            f"vocab_size={vocab_size!r} is too small for a byte-level BPE: it must be >= "
            f"{MIN_VOCAB_SIZE} (2 special tokens + 256 byte symbols)"
        )
    if text_path.stat().st_size == 0:
        raise DataError(f"tokenizer training text is empty: {text_path}")

    tok = Tokenizer(models.BPE())
    # GPT-2 style split regex + byte mapping; no prefix space so that decode(encode(x)) == x.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),  # added first -> ids 0 and 1
        # Seed the full byte alphabet so that any byte is encodable even if the corpus
        # never contains it (otherwise non-ASCII text could not round-trip).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(text_path)], trainer)

    bos_id, eos_id = tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)
    if (bos_id, eos_id) != (0, 1):  # a library change would silently break bos=0/eos=1
        raise RuntimeError(f"special token ids are {bos_id}, {eos_id}; expected 0, 1")
    # BOS once at the start of every sequence, like DeepSeek's tokenizer.json. Byte-level
    # offsets need no trimming post-processor since add_prefix_space is off.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )

    actual = tok.get_vocab_size(with_added_tokens=True)
    if actual != vocab_size:
        logger.warning(
            "BPE vocabulary of %s has %d entries, not the requested %d: the corpus has no "
            "more pairs seen >= %d times", text_path, actual, vocab_size, min_frequency,
        )

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(out_dir / TOKENIZER_FILE, lambda tmp: tok.save(tmp, pretty=True))
    atomic_write_json(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            # DeepSeek pads with EOS; batching code needs *some* pad token.
            "pad_token": EOS_TOKEN,
            "add_bos_token": True,
            "add_eos_token": False,
            # The default cleanup turns " ." into "." and would break the round trip on
            # wikitext's space-separated punctuation.
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
        },
        out_dir / TOKENIZER_CONFIG_FILE,
    )
    return out_dir


def tokenizer_vocab_size(out_dir: str | os.PathLike) -> int:
    """Number of token ids of the tokenizer in ``out_dir`` (special tokens included).

    Size a model's embedding with this (== ``len(AutoTokenizer.from_pretrained(out_dir))``),
    not with the ``vocab_size`` that was requested at training time.
    """
    from tokenizers import Tokenizer

    path = Path(out_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise DataError(f"tokenizer file not found: {path}")
    return Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
