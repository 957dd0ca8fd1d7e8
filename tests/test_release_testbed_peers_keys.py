"""benchmarks/release_testbed_peers.py reads both raw layouts: auto-round's cells keyed by scheme
with ``quantize_s``, peer_llmcompressor.py's keyed ``scheme|algo`` with ``scheme`` and
``oneshot_s``; the project's default on the same scheme is attached to either."""
import pytest

from tests.conftest import load_script

tool = load_script("benchmarks/release_testbed_peers.py", "release_testbed_peers")

TESTBED = {"float": {"ppl": 200.0, "command": "run float"},
           "w4a16-g128-default": {"ppl": 210.0}}


def _raw(command, cells, versions):
    return {"command": command, "versions": versions, "date": "d", "machine": {"description": "m"},
            "protocol": {"eval_windows": 3, "eval_windows_sha256": "ab" * 32},
            "float": {"ppl": 200.0}, "cells": cells}


def test_llmcompressor_cells_are_named_scheme_algo_with_their_oneshot_time():
    raw = _raw("peer_llmcompressor.py --model /x/deq --schemes w4a16-g128,w8a8 --algos gptq",
               {"w4a16-g128|gptq": {"scheme": "w4a16-g128", "algo": "gptq", "ppl": 205.0, "oneshot_s": 12.5},
                "w8a8|gptq": {"scheme": "w8a8", "algo": "gptq", "error": "boom"}},
               {"llmcompressor": "0.14.0.1"})
    cells = tool.summarize(TESTBED, {"llm-compressor": raw})["peers"]["llm-compressor"]["cells"]
    assert set(cells) == {"w4a16-g128 gptq", "w8a8 gptq"}
    c = cells["w4a16-g128 gptq"]
    assert c["quantize_s"] == 12.5
    assert c["vs_release_float_pct"] == pytest.approx(2.5, rel=1e-12)
    assert c["ours_default"] == {"ppl": 210.0, "vs_release_float_pct": pytest.approx(5.0, rel=1e-12)}
    assert c["command"] == "python benchmarks/peer_llmcompressor.py --model DEQ --schemes w4a16-g128 --algos gptq"
    assert cells["w8a8 gptq"] == {"error": "boom"}


def test_autoround_cells_keep_their_scheme_names():
    raw = _raw("peer_autoround.py --model /x/deq --schemes w4a16-g128",
               {"w4a16-g128": {"ppl": 202.0, "quantize_s": 7.0}}, {"auto-round": "0.16.1"})
    cells = tool.summarize(TESTBED, {"auto-round": raw})["peers"]["auto-round"]["cells"]
    assert list(cells) == ["w4a16-g128"] and cells["w4a16-g128"]["quantize_s"] == 7.0
    assert cells["w4a16-g128"]["ours_default"]["ppl"] == 210.0


def test_page_heading_carries_the_pip_named_version():
    raw = _raw("peer_llmcompressor.py --model /x/deq --schemes w4a16-g128 --algos gptq",
               {"w4a16-g128|gptq": {"scheme": "w4a16-g128", "ppl": 205.0, "oneshot_s": 1.0}},
               {"llmcompressor": "0.14.0.1"})
    md = tool.render_md(tool.summarize(TESTBED, {"llm-compressor": raw}))
    assert "## llm-compressor 0.14.0.1" in md


def test_a_cells_command_names_its_algorithm_and_the_committed_raw_file():
    raw = _raw("peer_llmcompressor.py --model /x/deq --schemes w4a16-g128 --algos gptq --json /tmp/part1.json",
               {"w4a16-g128|gptq-default": {"scheme": "w4a16-g128", "algo": "gptq-default", "ppl": 205.0,
                                            "oneshot_s": 1.0}}, {"llmcompressor": "0.14.0.1"})
    raw["commands"] = [raw["command"], "peer_llmcompressor.py --algos gptq-default --json /tmp/part2.json"]
    entry = tool.summarize(TESTBED, {"llm-compressor": raw})["peers"]["llm-compressor"]
    committed = tool.RAW["llm-compressor"].relative_to(tool.REPO)
    assert entry["cells"]["w4a16-g128 gptq-default"]["command"] == (
        f"python benchmarks/peer_llmcompressor.py --model DEQ --schemes w4a16-g128 --algos gptq-default --json {committed}")
    assert entry["processes"] == 2
    assert "Run split over 2 processes" in tool.render_md(tool.summarize(TESTBED, {"llm-compressor": raw}))
