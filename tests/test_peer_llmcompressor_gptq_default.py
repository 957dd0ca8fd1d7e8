"""benchmarks/peer_llmcompressor.py's ``gptq-default``: GPTQ with every GPTQModifier knob left to
llm-compressor (the peer "at its defaults"), beside ``gptq`` (actorder pinned to None). Runs in the
project venv: only the recipe data and the CLI are checked; what the modifier filled in is recorded
by the run itself (``gptq_knobs`` in the cell)."""
import pytest

from tests.conftest import load_script

peer = load_script("benchmarks/peer_llmcompressor.py", "peer_llmcompressor_gd")


def test_gptq_default_sets_no_knob_and_the_projects_scheme():
    (m,) = peer.recipe_spec("gptq-default", "w4a16-g128")
    assert set(m) == {"modifier", "config_groups"} and m["modifier"] == "GPTQModifier"
    assert m["config_groups"] == peer.recipe_spec("gptq", "w4a16-g128")[0]["config_groups"]
    (pinned,) = peer.recipe_spec("gptq", "w8a8")
    assert pinned["actorder"] is None       # the earlier tables' GPTQ is unchanged


def test_gptq_default_only_when_named(wiki_test_raw):
    assert "gptq-default" not in peer.ALGOS   # the default --algos (the issue-13 table) stays as it was
    args = peer.parse_args(["--eval-data", str(wiki_test_raw), "--algos", "gptq-default,gptq"])
    assert args.algos == ["gptq-default", "gptq"]
    with pytest.raises(SystemExit):
        peer.parse_args(["--eval-data", str(wiki_test_raw), "--algos", "gptq-defaults"])
