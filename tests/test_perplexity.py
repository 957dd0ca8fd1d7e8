"""Perplexity protocol: eval text rows, windows, NLL accumulation; calibration windows."""
import math

import pytest
import torch
import torch.nn.functional as F

from amct_ext.pipeline.calibration import load_calibration_windows
from amct_ext.errors import DataError
from amct_ext.pipeline.perplexity import (
    NllAccumulator,
    load_eval_text,
    perplexity,
    read_wikitext_rows,
    tokenize_windows,
)

from tests.conftest import WIKI_TEST_RAW, WIKI_VALID as VALID_TXT  # noqa: E402 (shipped data)


class CharTokenizer:
    """Independent stand-in tokenizer: one id per character, optional BOS (id 0)."""

    def encode(self, text, add_special_tokens=True):
        ids = [ord(c) + 2 for c in text]
        return [0] + ids if add_special_tokens else ids


# ----------------------------------------------------------------------------- NLL


def _reference_nll(logits, ids):
    """Sum of next-token NLL on the full tensor in float64, no chunking."""
    v = logits.shape[-1]
    return F.cross_entropy(
        logits[:, :-1].double().reshape(-1, v), ids[:, 1:].reshape(-1), reduction="sum"
    ).item()


@pytest.mark.parametrize("max_chunk_elements", [1, 3 * 11 * 5, 3 * 11 * 16, 1 << 24])
def test_nll_accumulator_matches_cross_entropy(max_chunk_elements):
    # B=3, S=17 -> 16 predicted positions per row; a 5-position chunk does not divide 16,
    # so the last chunk is partial; 1 element -> one position per chunk.
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 17, 11, generator=g) * 3
    ids = torch.randint(0, 11, (3, 17), generator=g)
    logits2 = torch.randn(2, 9, 11, generator=g)
    ids2 = torch.randint(0, 11, (2, 9), generator=g)

    acc = NllAccumulator(max_chunk_elements=max_chunk_elements)
    acc.update(logits, ids)
    acc.update(logits2, ids2)

    ref_sum = _reference_nll(logits, ids) + _reference_nll(logits2, ids2)
    ref_count = 3 * 16 + 2 * 8
    assert acc.count == ref_count
    assert acc.total_nll == pytest.approx(ref_sum, rel=1e-6)
    assert acc.mean_nll == pytest.approx(ref_sum / ref_count, rel=1e-6)
    assert acc.ppl == pytest.approx(math.exp(ref_sum / ref_count), rel=1e-6)


def test_nll_accumulator_bf16_logits_and_noncontiguous():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 11, 7, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 7, (2, 11), generator=g)
    acc = NllAccumulator(max_chunk_elements=2 * 7 * 3)
    acc.update(logits, ids)
    assert acc.total_nll == pytest.approx(_reference_nll(logits.float(), ids), rel=1e-6)
    # the last position's logits must never be used (nothing follows it)
    poisoned = logits.float().clone()
    poisoned[:, -1] = float("nan")
    acc2 = NllAccumulator(max_chunk_elements=5)
    acc2.update(poisoned, ids)
    assert acc2.total_nll == pytest.approx(acc.total_nll, rel=1e-6)


def test_nll_accumulator_shape_errors_and_empty():
    acc = NllAccumulator()
    with pytest.raises(ValueError):
        acc.update(torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError):
        acc.update(torch.zeros(2, 5, 3), torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError):
        acc.ppl


@pytest.mark.parametrize("vocab", [2, 50, 257, 32000])
def test_uniform_logits_give_ppl_equal_to_vocab(vocab):
    windows = torch.randint(0, vocab, (5, 8), generator=torch.Generator().manual_seed(vocab))
    calls = []

    def model_fn(ids):
        calls.append(ids.shape[0])
        return torch.zeros(ids.shape[0], ids.shape[1], vocab)

    ppl = perplexity(model_fn, windows, batch_size=2, device="cpu", progress=False)
    assert calls == [2, 2, 1]  # last partial batch included
    assert ppl == pytest.approx(vocab, rel=1e-6)


def test_perplexity_accepts_hf_style_output():
    class Out:
        def __init__(self, logits):
            self.logits = logits

    windows = torch.zeros(3, 4, dtype=torch.long)
    ppl = perplexity(lambda ids: Out(torch.zeros(*ids.shape, 16)), windows, 8, "cpu", progress=False)
    assert ppl == pytest.approx(16, rel=1e-6)


# ----------------------------------------------------------------------------- windows


def test_windows_non_overlapping_and_tail_dropped():
    text = "abcdefghijklmnopqrstuvw"  # 23 chars
    tok = CharTokenizer()
    w = tokenize_windows(text, tok, seq_len=5, add_special_tokens=False)
    ids = torch.tensor(tok.encode(text, add_special_tokens=False))
    assert w.dtype == torch.long and w.shape == (4, 5)
    assert torch.equal(w.reshape(-1), ids[:20])  # consecutive, no overlap, tail of 3 dropped
    # default adds special tokens once at the start of the whole text (not per window)
    wb = tokenize_windows(text, tok, seq_len=5)
    assert wb.shape == (4, 5) and wb[0, 0] == 0 and (wb[1:, 0] != 0).all()
    assert torch.equal(wb.reshape(-1)[1:], ids[:19])
    assert torch.equal(tokenize_windows(text, tok, 5, max_windows=2, add_special_tokens=False), w[:2])
    assert tokenize_windows(text, tok, 23, add_special_tokens=False).shape == (1, 23)


def test_windows_errors_name_sizes():
    tok = CharTokenizer()
    with pytest.raises(DataError, match="seq_len must be >= 2"):
        tokenize_windows("abcdef", tok, seq_len=1)
    with pytest.raises(DataError, match=r"6 tokens.*seq_len=7"):
        tokenize_windows("abcdef", tok, seq_len=7, add_special_tokens=False)


def test_windows_with_trained_hf_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from amct_ext.pipeline.tokenizer import train_bpe_tokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" the cat sat on the mat .\n" * 200)
    tok = AutoTokenizer.from_pretrained(train_bpe_tokenizer(corpus, 300, tmp_path / "tok"))
    text = " the cat sat on the mat ." * 50
    w = tokenize_windows(text, tok, seq_len=16)
    full = tok(text)["input_ids"]
    assert full[0] == tok.bos_token_id
    assert w.shape == (len(full) // 16, 16)
    assert w.reshape(-1).tolist() == full[: w.numel()]


# ----------------------------------------------------------------------------- eval text


def test_load_eval_text_real_test_split():
    assert WIKI_TEST_RAW.is_file(), f"shared test split missing: {WIKI_TEST_RAW}"
    raw = WIKI_TEST_RAW.read_bytes()
    lines = raw.splitlines()  # bytes.splitlines: \n, \r\n, \r only, like universal newlines
    rows = read_wikitext_rows(WIKI_TEST_RAW)
    assert len(rows) == len(lines)
    # independent reconstruction of the datasets rows: newline kept, blank lines -> ""
    expected_rows = [(ln.decode("utf-8") + "\n") if ln.strip() else "" for ln in lines]
    assert rows == expected_rows
    text = load_eval_text(WIKI_TEST_RAW)
    assert text == "\n\n".join(expected_rows)
    # the row keeps its "\n" and the joiner adds two more
    assert text.startswith(" = Robert Boulter = \n\n\n Robert Boulter is")
    assert "\r" not in text
    # joining adds exactly 2 characters per row boundary
    assert len(text) == sum(len(r) for r in rows) + 2 * (len(rows) - 1)


def test_load_eval_text_row_rules(tmp_path):
    f = tmp_path / "wiki.test.raw"
    # blank and whitespace-only lines, CRLF, a lone CR, a form feed inside a line (not a
    # line break for a text-mode file), and no final newline.
    f.write_bytes(b" = T = \r\n \r\n\r\nA b .\x0c c\rlast")
    rows = read_wikitext_rows(f)
    assert rows == [" = T = \n", "", "", "A b .\x0c c\n", "last"]
    assert load_eval_text(f) == "\n\n".join(rows)
    assert load_eval_text(f, keep_linebreaks=False) == " = T = \n\n\n\n\n\nA b .\x0c c\n\nlast"
    assert load_eval_text(f, verbatim=True) == " = T = \n \n\nA b .\x0c c\nlast"


def test_load_eval_text_missing_file(tmp_path):
    missing = tmp_path / "nowhere" / "wiki.test.raw"
    with pytest.raises(DataError) as e:
        load_eval_text(missing)
    msg = str(e.value)
    assert str(missing) in msg and "--data-path" in msg and "\n" not in msg


def test_load_eval_text_without_path_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError) as e:
        load_eval_text(None)
    assert "--data-path" in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- calibration


def test_calibration_windows_deterministic_and_in_text(tmp_path):
    f = tmp_path / "valid.txt"
    text = "".join(chr(97 + (i * 7) % 26) for i in range(1000))
    f.write_text(text)
    tok = CharTokenizer()
    a = load_calibration_windows(f, tok, seq_len=32, n_samples=8, seed=3)
    b = load_calibration_windows(f, tok, seq_len=32, n_samples=8, seed=3)
    c = load_calibration_windows(f, tok, seq_len=32, n_samples=8, seed=4)
    assert a.shape == (8, 32) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    ids = tok.encode(text, add_special_tokens=False)
    for row in a.tolist():  # every window is a contiguous slice of the token stream
        assert any(ids[s : s + 32] == row for s in range(len(ids) - 31))
    # exactly one window fits: it must be the whole text
    full = load_calibration_windows(f, tok, seq_len=1000, n_samples=2)
    assert full.tolist() == [ids, ids]


def test_calibration_real_validation_split():
    assert VALID_TXT.is_file(), f"shared validation split missing: {VALID_TXT}"
    w = load_calibration_windows(VALID_TXT, CharTokenizer(), seq_len=64, n_samples=4, seed=0)
    assert w.shape == (4, 64)


def test_calibration_errors(tmp_path):
    tok = CharTokenizer()
    with pytest.raises(DataError, match="missing.txt"):
        load_calibration_windows(tmp_path / "missing.txt", tok, 8, 2)
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(DataError, match=r"3 tokens.*seq_len=8"):
        load_calibration_windows(short, tok, 8, 2)
    renamed = tmp_path / "calib.txt"   # the test split under a neutral name: refused by content
    renamed.write_text("".join(WIKI_TEST_RAW.read_text(encoding="utf-8").splitlines(True)[:80]))
    with pytest.raises(DataError, match="evaluation text"):
        load_calibration_windows(renamed, tok, 8, 2)
