"""Byte-level BPE training: determinism, offline AutoTokenizer load, round trip, sizes."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from amct_ext.errors import ConfigError, DataError
from amct_ext.pipeline.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    MIN_VOCAB_SIZE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    tokenizer_vocab_size,
    train_bpe_tokenizer,
)

REPO = Path(__file__).resolve().parents[1]
from tests.conftest import WIKI_VALID as VALID_TXT  # noqa: E402 (shipped validation split)
VOCAB = 1024


@pytest.fixture(scope="module")
def valid_txt() -> Path:
    assert VALID_TXT.is_file(), f"shared training text missing: {VALID_TXT}"
    return VALID_TXT


@pytest.fixture(scope="module")
def trained(tmp_path_factory, valid_txt) -> Path:
    return train_bpe_tokenizer(valid_txt, VOCAB, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf_tok(trained):
    os.environ["HF_HUB_OFFLINE"] = "1"  # must not need the network for a local folder
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(trained)


def test_writes_both_files_and_exact_size(trained):
    assert (trained / TOKENIZER_FILE).is_file()
    assert (trained / TOKENIZER_CONFIG_FILE).is_file()
    assert tokenizer_vocab_size(trained) == VOCAB
    # no temporary files left behind by the atomic writes
    assert sorted(p.name for p in trained.iterdir()) == sorted([TOKENIZER_FILE, TOKENIZER_CONFIG_FILE])


def test_deterministic_in_process_and_across_processes(trained, valid_txt, tmp_path):
    again = train_bpe_tokenizer(valid_txt, VOCAB, tmp_path / "again")
    ref = (trained / TOKENIZER_FILE).read_bytes()
    assert (again / TOKENIZER_FILE).read_bytes() == ref
    assert (again / TOKENIZER_CONFIG_FILE).read_bytes() == (trained / TOKENIZER_CONFIG_FILE).read_bytes()
    # A fresh process has a fresh (randomly seeded) hash state: the strongest check.
    other = tmp_path / "other"
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from amct_ext.pipeline.tokenizer import train_bpe_tokenizer;"
        "train_bpe_tokenizer(sys.argv[2], int(sys.argv[3]), sys.argv[4])"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(REPO), str(valid_txt), str(VOCAB), str(other)],
        check=True, env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    assert (other / TOKENIZER_FILE).read_bytes() == ref


def test_autotokenizer_offline_special_tokens(hf_tok, trained):
    assert len(hf_tok) == tokenizer_vocab_size(trained) == VOCAB
    assert hf_tok.bos_token == BOS_TOKEN and hf_tok.bos_token_id == 0
    assert hf_tok.eos_token == EOS_TOKEN and hf_tok.eos_token_id == 1
    assert hf_tok.convert_ids_to_tokens([0, 1]) == [BOS_TOKEN, EOS_TOKEN]
    # DeepSeek-like: BOS once at the start by default, nothing added on request.
    with_bos = hf_tok("The game began .")["input_ids"]
    without = hf_tok("The game began .", add_special_tokens=False)["input_ids"]
    assert with_bos == [0] + without
    assert 0 not in without and 1 not in without


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        " = Robert Boulter = \n\n Robert Boulter is an English film , television and theatre actor .\n",
        "  leading and trailing spaces  \n\n\n\ttabs\tand  double  spaces ; 1 @,@ 000 ( x ) ' s \" q \"",
        "".join(chr(c) for c in range(32, 127)),  # every printable ASCII character
        "caf\u00e9 \u2013 na\u00efve \u00b0C",  # bytes never merged still round-trip (full alphabet)
    ],
)
def test_round_trip(hf_tok, text):
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert hf_tok.decode(ids) == text
    assert hf_tok.decode(hf_tok.encode(text), skip_special_tokens=True) == text


def test_bpe_merges_compress_text(hf_tok):
    text = " The company said it would continue to invest in the region ."
    assert len(hf_tok.encode(text, add_special_tokens=False)) < len(text) / 2


def test_small_corpus_gives_smaller_vocab_and_reports_it(tmp_path, caplog):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("aaa bbb aaa bbb ccc\n" * 10)
    with caplog.at_level("WARNING"):
        out = train_bpe_tokenizer(corpus, 4096, tmp_path / "tok")
    actual = tokenizer_vocab_size(out)
    assert MIN_VOCAB_SIZE <= actual < 4096
    assert "4096" in caplog.text and str(actual) in caplog.text


def test_minimum_vocab_is_bytes_plus_specials(tmp_path, valid_txt):
    out = train_bpe_tokenizer(valid_txt, MIN_VOCAB_SIZE, tmp_path / "tok")
    assert tokenizer_vocab_size(out) == MIN_VOCAB_SIZE


def test_errors(tmp_path, valid_txt):
    with pytest.raises(ConfigError, match="257"):
        train_bpe_tokenizer(valid_txt, 257, tmp_path / "a")
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match="nope.txt"):
        train_bpe_tokenizer(missing, 512, tmp_path / "b")
    # the test split under another name is refused by its content (amct_ext.pipeline.leak_guard)
    from tests.conftest import WIKI_TEST_RAW

    renamed = tmp_path / "notes.txt"
    renamed.write_text("".join(WIKI_TEST_RAW.read_text(encoding="utf-8").splitlines(True)[200:260]))
    with pytest.raises(DataError, match="shares a 64-word run with the evaluation text"):
        train_bpe_tokenizer(renamed, 512, tmp_path / "c")
    with pytest.raises(DataError, match="tokenizer file not found"):
        tokenizer_vocab_size(tmp_path / "empty_dir")
