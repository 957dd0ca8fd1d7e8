"""benchmarks/results/release-testbed-peers.{json,md}: the summary is what
benchmarks/release_testbed_peers.py computes from the peers' raw JSON and the testbed's release
float, the markdown quotes its numbers, and the peers measured the project's evaluation windows."""
import json

import pytest
from transformers import AutoTokenizer

from amct_ext.pipeline.perplexity import load_eval_text, tokenize_windows
from tests.conftest import REPO, WIKI_TEST_RAW, load_script

tool = load_script("benchmarks/release_testbed_peers.py", "release_testbed_peers")
plc = load_script("benchmarks/peer_llmcompressor.py", "peer_llmcompressor")


@pytest.fixture(scope="module")
def summary():
    return json.loads(tool.SUMMARY.read_text())


def test_summary_is_recomputed_from_the_raw_json(summary):
    again = tool.summarize(json.loads(tool.TESTBED.read_text()), tool.load_raws())
    # a testbed cell of ours run after the summary was written may add an `ours_default` (rerun the
    # script to quote it); one the summary quotes must still be the testbed's
    for peer, entry in again["peers"].items():
        for scheme, cell in entry["cells"].items():
            if "ours_default" not in summary["peers"].get(peer, {}).get("cells", {}).get(scheme, {}):
                cell.pop("ours_default", None)
    assert again == summary
    assert summary["peers"], "no peer result recorded"


def test_markdown_quotes_the_summary(summary):
    assert tool.check_md(tool.MD, summary) == []


def test_a_changed_quote_is_caught(summary, tmp_path):
    cell = next(c for e in summary["peers"].values() for c in e["cells"].values() if "ppl" in c)
    quoted = f"{cell['ppl']:.3f}"
    text = tool.MD.read_text()
    assert quoted in text
    bad = tmp_path / "x.md"
    bad.write_text(text.replace(quoted, f"{cell['ppl'] + 0.01:.3f}"))
    assert tool.check_md(bad, summary) == [quoted]


def test_peers_ran_on_the_testbeds_windows_and_float(summary):
    """The peers' windows are the testbed's (the whole test split, same cut), and transformers'
    float PPL of the dequantized release reproduces the project's release float."""
    testbed = json.loads(tool.TESTBED.read_text())["float"]["eval"]
    tok = AutoTokenizer.from_pretrained(str(REPO / "assets" / "tiny-v4-release"))
    windows = tokenize_windows(load_eval_text(WIKI_TEST_RAW), tok, testbed["seq_len"])
    assert windows.shape[0] == testbed["windows"] == 1487 and testbed["first_window"] == 0
    for peer, entry in summary["peers"].items():
        assert entry["eval_windows"] == testbed["windows"], peer
        assert entry["eval_windows_sha256"] == plc.digest(windows), peer
        # measured 2026-12-06: see the .md; fp32 vs fp32 forwards agreeing to ~1e-5 in the logits
        assert abs(entry["float"]["vs_release_float_pct"]) <= 1e-3, peer


def test_results_index_quotes_the_auto_round_cells():
    """RESULTS §3.1 quotes auto-round's three cells from the summary and that each is behind our
    default (the testbed's cells)."""
    import json

    from tests.conftest import REPO

    peers = json.loads((REPO / "benchmarks" / "results" / "release-testbed-peers.json").read_text())
    cells = peers["peers"]["auto-round"]["cells"]
    order = ("w4a16-g128", "w4a16", "w3a16-g128")
    quoted = " / ".join(f"{cells[s]['ppl']:.3f}" for s in order)
    assert f"w4a16-g128 / w4a16 / w3a16-g128 = {quoted}, behind our defaults at each" in (REPO / "benchmarks" / "RESULTS.md").read_text()
    assert all(cells[s]["ours_default"]["ppl"] < cells[s]["ppl"] for s in order)
    llmc = peers["peers"]["llm-compressor"]["cells"]
    gptq = [llmc[f"{s} gptq-default"]["ppl"] for s in ("w4a16-g128", "w8a8")]
    text = (REPO / "benchmarks" / "RESULTS.md").read_text()
    assert f"GPTQ at its defaults, w4a16-g128 / w8a8 = {gptq[0]:.3f} / {gptq[1]:.3f}, behind ours" in text
    testbed = json.loads((REPO / "benchmarks" / "results" / "release-testbed.json").read_text())
    assert testbed["w4a16-g128-default"]["ppl"] < gptq[0] and testbed["w8a8-default"]["ppl"] < gptq[1]


def test_msmodelslim_cells(summary):
    """msModelSlim 26.1's shipped V4 recipes on DEQ (benchmarks/peer_msmodelslim.py, measured
    2026-12-06, whole split): the two cells, what they are compared with, and the run's own checks
    (its model computes the tiny; its output has the reference run's layout; QuaRot folded)."""
    raw = json.loads(tool.RAW["msModelSlim"].read_text())
    cells = summary["peers"]["msModelSlim"]["cells"]
    assert set(cells) == {"w8a8 flash-w8a8", "w4a8 pro-w4a8"}
    w8, w4 = cells["w8a8 flash-w8a8"], cells["w4a8 pro-w4a8"]
    assert round(w8["ppl"], 3) == 302.862 and round(w8["vs_release_float_pct"], 2) == 0.04
    assert round(w4["ppl"], 3) == 305.886 and round(w4["vs_release_float_pct"], 2) == 1.04
    # ours (the testbed's defaults; w8a8's is the release's own since 2026-12-06, gptq:sequential=false):
    # w8a8 0.018 PPL ahead of msModelSlim's Flash recipe (inside the seed spread), w4a8 ahead
    assert w8["ours_default"]["ppl"] < w8["ppl"] and w8["ppl"] - w8["ours_default"]["ppl"] < 0.02
    assert w4["ours_default"]["ppl"] < w4["ppl"]
    assert raw["float"]["ppl"] == json.loads(tool.TESTBED.read_text())["float"]["ppl"]   # same evaluator, DEQ
    fwd = raw["forward_check"]
    assert fwd["argmax_agree"] and fwd["min_cosine"] > 0.9999
    for cell in raw["cells"].values():
        assert cell["layout_matches_reference_run"] is True and cell["quarot_rotation"] is True
        assert cell["eval_windows"] == 1487 and cell["argv"][:2] == ["msmodelslim", "quant"]
    assert raw["cells"]["w4a8|pro-w4a8"]["weight_types"] == {"FLOAT": 48, "W4A8_DYNAMIC": 96, "W8A8_DYNAMIC": 26}
    assert len(raw["workarounds"]) == 4


def test_results_index_quotes_the_msmodelslim_cells(summary):
    """RESULTS §3.1 quotes msModelSlim's two cells and the w8a8 gap to our default as measured."""
    cells = summary["peers"]["msModelSlim"]["cells"]
    w8, w4 = cells["w8a8 flash-w8a8"], cells["w4a8 pro-w4a8"]
    gap = w8["ours_default"]["ppl"] - w8["ppl"]
    text = (REPO / "benchmarks" / "RESULTS.md").read_text()
    head = f"Flash w8a8 / Pro w4a8 = {w8['ppl']:.3f} / {w4['ppl']:.3f}: "
    if gap > 0:                                  # the sentence says which side of the peer ours is, by how much
        assert f"{head}ours is {gap:.3f} PPL ({100 * gap / w8['ppl']:.3f} %) behind at w8a8" in text
    else:
        assert (f"{head}ours is ahead at both, {w8['ours_default']['ppl']:.3f} at w8a8 "
                f"(by {100 * -gap / w8['ppl']:.3f} %") in text
        assert f"{w4['ours_default']['ppl']:.3f} at w4a8" in text
    assert w4["ours_default"]["ppl"] < w4["ppl"]


def test_msmodelslim_recipe_edit_changes_the_dataset_line_only():
    """peer_msmodelslim.recipe_text: the shipped recipe keeps every line but ``dataset:``; a recipe
    with no or two dataset lines is one clear error, not a silently wrong calibration."""
    pm = load_script("benchmarks/peer_msmodelslim.py", "peer_msmodelslim")
    shipped = "spec:\n  process:\n  - type: quarot\n    block_size: 32\n  dataset: mix_calib.jsonl\n  save: []\n"
    edited = pm.recipe_text(shipped, REPO / "c.jsonl")
    assert [a for a, b in zip(shipped.splitlines(), edited.splitlines()) if a != b] == ["  dataset: mix_calib.jsonl"]
    assert f"  dataset: {REPO / 'c.jsonl'}\n" in edited
    for bad in (shipped.replace("  dataset: mix_calib.jsonl\n", ""), shipped + "  dataset: x.jsonl\n"):
        with pytest.raises(SystemExit):
            pm.recipe_text(bad, REPO / "c.jsonl")
