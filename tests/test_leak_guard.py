"""Calibration / training text is refused when it shares a 64-word run with the evaluation text,
by content, not by file name (issue 17, item 4)."""
import shutil

import pytest

from amct_ext.pipeline import leak_guard
from amct_ext.pipeline.calibration import refuse_test_split
from amct_ext.errors import DataError
from tests.conftest import WIKI_TEST_RAW, WIKI_VALID


def test_renamed_test_split_is_refused(tmp_path):
    renamed = tmp_path / "my_corpus.txt"
    shutil.copy(WIKI_TEST_RAW, renamed)
    with pytest.raises(DataError) as e:
        refuse_test_split(renamed, "calibration")
    msg = str(e.value)
    assert "my_corpus.txt" in msg and "wiki.test.raw" in msg and "64-word run" in msg and "\n" not in msg


def test_an_excerpt_rewrapped_inside_other_text_is_refused(tmp_path):
    words = WIKI_TEST_RAW.read_text(encoding="utf-8").split()
    excerpt = " ".join(words[50000:50070])                     # 70 words, joined on one line
    valid = WIKI_VALID.read_text(encoding="utf-8")
    mixed = tmp_path / "mixed.txt"
    mixed.write_text(valid[:20000] + "\n" + excerpt.replace(" ", "\n", 5) + "\n" + valid[20000:40000])
    with pytest.raises(DataError, match="evaluation text"):
        refuse_test_split(mixed, "tokenizer training")
    # 63 words are not a 64-word run
    short = tmp_path / "short.txt"
    short.write_text(valid[:20000] + "\n" + " ".join(words[50000:50063]) + "\n")
    refuse_test_split(short, "calibration")


def test_validation_split_passes_and_names_do_not_matter(tmp_path):
    refuse_test_split(WIKI_VALID, "calibration")
    named_like_test = tmp_path / "wiki.test.raw"               # refused by the old name rule
    named_like_test.write_text(WIKI_VALID.read_text(encoding="utf-8")[:50000])
    refuse_test_split(named_like_test, "calibration")


def test_extra_eval_paths_are_guarded_too(tmp_path):
    own_eval = tmp_path / "eval.txt"
    own_eval.write_text(WIKI_VALID.read_text(encoding="utf-8")[:30000])
    with pytest.raises(DataError, match="eval.txt"):
        refuse_test_split(WIKI_VALID, "calibration", [own_eval])


def test_window_hashes_match_a_direct_computation():
    words = [f"w{i % 97}" for i in range(300)]
    n = 8
    rolled = list(leak_guard.window_hashes(words, n))
    direct = []
    for s in range(len(words) - n + 1):
        h = 0
        for w in words[s:s + n]:
            h = (h * leak_guard._BASE + leak_guard._word_id(w)) % leak_guard._MOD
        direct.append((s, h))
    assert rolled == direct
    assert list(leak_guard.window_hashes(words[:n - 1], n)) == []
