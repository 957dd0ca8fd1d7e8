"""benchmarks/peer_llmcompressor.py without llm-compressor: its protocol is the project's.

The peer benchmark imports the project's window code inside its own venv; here (project venv)
its --smoke mode must build exactly the windows the workflow builds, and its module-name
mapping / targets must select our default targets attn-linear + moe and nothing else."""
import importlib
import json
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = Path(__file__).resolve().parents[1] / "assets" / "tiny-v4"


@pytest.fixture(scope="module")
def peer():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("peer_llmcompressor")


def test_smoke_mode_windows_equal_workflow(peer, wiki_test_raw, tmp_path, capsys):
    # Short texts keep the test fast (each path tokenizes its file once): the first rows of the
    # test split as the evaluation file and of the project's default calibration text (the
    # validation split) as the calibration file. Calibration text must not be test text: the
    # project's leak guard refuses it.
    lines = wiki_test_raw.read_text(encoding="utf-8").splitlines(keepends=True)
    ev = tmp_path / "wiki.test.raw"
    ev.write_text("".join(lines[:200]), encoding="utf-8")
    valid = peer.default_calib_path().read_text(encoding="utf-8").splitlines(keepends=True)
    cal = tmp_path / "calib.txt"
    cal.write_text("".join(valid[:200]), encoding="utf-8")
    out = tmp_path / "smoke.json"
    rc = peer.main(["--smoke", "--model", str(TINY), "--eval-data", str(ev), "--calib-data", str(cal),
                    "--eval-windows", "3", "--calib-samples", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out.read_text())
    c = res["checks"]
    assert c["eval_windows_equal_workflow"] and c["calib_windows_equal_workflow"], c
    assert c["eval_shape"] == [3, 256] and c["calib_shape"] == [2, 256]
    assert c["targets_cover_mapped_names"] and c["targets_skip_untargeted"]
    p = res["protocol"]
    assert len(p["eval_windows_sha256"]) == 64 and p["eval_windows_sha256"] != p["calib_windows_sha256"]


def test_digest_tells_windows_apart(peer):
    import torch

    a = torch.arange(12).view(3, 4)
    assert peer.digest(a) == peer.digest(a.clone())
    b = a.clone()
    b[2, 3] += 1
    assert peer.digest(a) != peer.digest(b)
    assert peer.digest(a) != peer.digest(a.view(4, 3))  # same values, other windows


def test_targets_select_exactly_our_default_linears(peer):
    """Names of every Linear of transformers' V4 (layer with compressor + indexer, linearized
    experts): the peer targets must match exactly the NAME_MAP images (attn-linear + moe)."""
    pats = [p[3:] for p in peer.TARGETS]
    linears = [
        "self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj", "self_attn.o_a_proj",
        "self_attn.o_b_proj", "self_attn.compressor.kv_proj", "self_attn.compressor.gate_proj",
        "self_attn.compressor.indexer.kv_proj", "self_attn.compressor.indexer.gate_proj",
        "self_attn.compressor.indexer.q_b_proj", "self_attn.compressor.indexer.scorer.weights_proj",
        "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj",
    ] + [f"mlp.experts.{e}.{k}" for e in range(8) for k in ("gate_proj", "up_proj", "down_proj")]
    want = {v.format(e=e) for v in peer.NAME_MAP.values() for e in range(8)}
    got = {n for n in linears if any(re.fullmatch(p, f"model.layers.1.{n}") for p in pats)}
    assert got == want
    assert not any(re.fullmatch(p, "lm_head") for p in pats)


def test_smoothing_mappings_cover_every_reader(peer):
    """Each smoothed tensor's readers (all of them, quantized or not) are balance layers, and
    each balance side is a single pattern (see the mapping comment: set matching per layer)."""
    readers = {
        "input_layernorm": ["self_attn.q_a_proj", "self_attn.kv_proj", "self_attn.compressor.kv_proj",
                            "self_attn.compressor.gate_proj", "self_attn.compressor.indexer.kv_proj",
                            "self_attn.compressor.indexer.gate_proj",
                            "self_attn.compressor.indexer.scorer.weights_proj"],
        "self_attn.q_a_norm": ["self_attn.q_b_proj", "self_attn.compressor.indexer.q_b_proj"],
        "post_attention_layernorm": ["mlp.gate", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"]
                                    + [f"mlp.experts.{e}.{k}" for e in range(8) for k in ("gate_proj", "up_proj")],
    }
    for balance, smooth in peer.SMOOTHQUANT_MAPPINGS:
        assert len(balance) == 1
        (key,) = [k for k in readers if re.fullmatch(smooth[3:], f"model.layers.2.{k}")]
        pat = balance[0][3:]
        for r in readers[key]:
            assert re.fullmatch(pat, f"model.layers.2.{r}"), (key, r)
        assert not re.fullmatch(pat, "model.layers.2.mlp.experts.0.down_proj")
    awq_smooth = {m["smooth_layer"] for m in peer.awq_mappings(())}
    assert {s for _, s in peer.SMOOTHQUANT_MAPPINGS} <= awq_smooth


def test_awq_skips_q_a_norm_only_in_indexer_layers(peer):
    """llm-compressor's AWQ cannot smooth two mappings with one parent (casebook P9)."""
    (m,) = [m for m in peer.awq_mappings([1, 3]) if "q_a_norm" in m["smooth_layer"]]
    kept = [0, 2, 4, 5, 6, 7, 8, 9, 10, 11]
    pat = m["smooth_layer"][3:]
    assert [i for i in range(12) if re.fullmatch(pat, f"model.layers.{i}.self_attn.q_a_norm")] == kept
    # the balance side is restricted to the same layers, else a skipped layer's q_b_proj would
    # be glued onto the next kept layer's set (P3)
    (bal,) = m["balance_layers"]
    for leaf in ("q_b_proj", "compressor.indexer.q_b_proj"):
        got = [i for i in range(12) if re.fullmatch(bal[3:], f"model.layers.{i}.self_attn.{leaf}")]
        assert got == kept
    assert len(peer.awq_mappings([1, 3])) == len(peer.AWQ_MAPPINGS)


def test_recipe_specs_for_every_cell(peer):
    for s in peer.SCHEMES:
        for a in peer.ALGOS:
            spec = peer.recipe_spec(a, s)
            quant = [m for m in spec if m["modifier"] in ("GPTQModifier", "QuantizationModifier")]
            assert len(quant) == 1 and quant[0]["config_groups"]["group_0"]["targets"] == peer.TARGETS
    w = peer.recipe_spec("gptq", "w3a16-g128")[0]["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["symmetric"], w["strategy"], w["group_size"]) == (3, False, "group", 128)
    assert "input_activations" in peer.recipe_spec("awq", "w8a8")[1]["config_groups"]["group_0"]
    with pytest.raises(SystemExit):
        peer.recipe_spec("rtn", "w8a8")


def test_committed_peer_table_reads(peer):
    """The committed peer results load through the reader quality_table.py can use, and hold
    the float check and every (scheme, algorithm) cell."""
    t = peer.load_peer_table(peer.DEFAULT_JSON)
    assert abs(t["float_ppl"] / peer.OUR_FLOAT_PPL - 1) <= peer.FLOAT_RTOL
    assert t["versions"]["llmcompressor"].startswith("0.14")
    assert set(t["cells"]) == set(peer.SCHEMES)
    for scheme, row in t["cells"].items():
        assert set(row) == set(peer.ALGOS), scheme
        for cell in row.values():
            assert "error" in cell or cell["ppl"] > t["float_ppl"] * 0.95


def test_committed_peer_results_used_our_windows(peer, wiki_test_raw):
    """The digests recorded by the peer run (in its own venv) equal the windows the project
    builds here: the same 64 x 256 evaluation and 16 x 256 calibration (seed 0) tokens."""
    import json

    from amct_ext.pipeline.calibration import load_calibration_windows

    rec = json.loads(peer.DEFAULT_JSON.read_text())["protocol"]
    tok = peer.load_tokenizer(TINY)
    from amct_ext.pipeline.perplexity import load_eval_text, tokenize_windows

    # Only the first 64 windows are compared, so a prefix of the text several times their
    # length is tokenized (fast); byte-level BPE merges never reach that far back from the cut.
    # A wrong shortcut could only make the digest differ, never pass falsely.
    text = load_eval_text(wiki_test_raw)
    ev = tokenize_windows(text[: 4 * 4 * rec["seq_len"] * rec["eval_windows"]], tok,
                          rec["seq_len"], rec["eval_windows"])
    cal = load_calibration_windows(None, tok, rec["seq_len"], rec["calib_samples"], rec["seed"])
    assert (rec["eval_windows"], rec["calib_samples"], rec["seq_len"]) == (64, 16, 256)
    assert peer.digest(ev) == rec["eval_windows_sha256"]
    assert peer.digest(cal) == rec["calib_windows_sha256"]
