"""The two layer benchmarks run end to end in --smoke mode (tiny config, CPU) and report what they promise.

Run in-process through their ``main(argv)`` (one torch / transformers import for both); narrowed to the
ratio-4 layer (compressor + indexer + score-routed MoE: the most code) at a short sequence to stay fast.
"""
import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("bench_layer"), importlib.import_module("bench_load")


def test_bench_layer_smoke(bench, tmp_path, capsys):
    bench_layer, _ = bench
    out = tmp_path / "layer.json"
    rc = bench_layer.main(["--smoke", "--layers", "3", "--seq-len", "64", "--hf-experts", "grouped_mm",
                           "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    for field in ("ceilings:", "fp32 mapping check", "floors", "agreement", "timings", "ours-w8a8"):
        assert field in text, field
    res = json.loads(out.read_text())
    assert not res["failures"], res["failures"]
    assert res["ceilings"]["matmul"]["flop_per_s"] > 0 and res["ceilings"]["copy"]["bytes_per_s"] > 0
    (layer,) = res["layers"]
    assert layer["checks"]["fp32_mapping"]["ok"] and layer["checks"]["fp32_mapping"]["rel_fro"] < 1e-4
    assert layer["checks"]["B2:hf:grouped_mm_vs_ours"]["ok"]
    variants = {r["variant"] for r in layer["runs"]}
    assert variants == {"ours", "hf:grouped_mm", "ours-w8a8"}, variants
    for r in layer["runs"]:
        assert r["median_ms"] > 0 and r["floors"]["floor_ms"] > 0
        assert r["counts"]["moe_flops"] == 2 * 64 * (2 + 1) * 3 * 2 * 64 * 32  # tokens x (k+shared) x 3 x 2 x D x I
        for key in ("peak_bytes", "extra_peak_bytes", "resident_bytes", "vs_floor", "tokens_per_s"):
            assert key in r, key


def test_bench_load_smoke(bench, tmp_path, capsys):
    _, bench_load = bench
    out = tmp_path / "load.json"
    work = tmp_path / "layer"
    rc = bench_load.main(["--smoke", "--workdir", str(work), "--bw-repeats", "2", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    for field in ("load_block -> cpu", "staging total", "page-cache read", "H2D pageable", "floor"):
        assert field in text, field
    res = json.loads(out.read_text())
    w = res["write"]
    assert w["encode_checked_against_release_tensors"] and w["file_bytes"] > 0
    assert "torch.float8_e4m3fn" in w["stored_bytes_by_dtype"] and "torch.int8" in w["stored_bytes_by_dtype"]
    assert res["load_block_device"]["median_ms"] > 0 and res["floors"]["floor_ms"] > 0
    assert res["cpu_staging"]["total_median_ms"] > 0
    assert res["load_block_device"]["decoded_bytes"] > w["file_bytes"]  # FP8 / FP4 expand on load


def test_check_fast_paths_smoke(tmp_path, capsys):
    """On CPU only the torch paths run: the script still measures them, the GEMM comparison and the
    end-to-end layer check (fast paths on and off coincide here), and exits 0."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    check = importlib.import_module("check_fast_paths")
    out = tmp_path / "fast.json"
    rc = check.main(["--smoke", "--layers", "1", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out.read_text())
    assert {a["ratio"] for a in res["attention"]} == {0, 4, 128}
    assert all(a["torch_bf16"]["rel_fro"] < 2e-2 for a in res["attention"])
    assert all(g["fp32_weight"]["fast"]["rel_fro"] < 1e-6 for g in res["gemm"])
    (layer,) = res["layer"]
    assert layer["ok"] and layer["fast_vs_fp32"]["tok_rel_median"] < 2e-2


def test_hf_caller_autocast_only_for_bf16(bench):
    """Once a bf16 call needed autocast, later fp32 calls (the fp32 mapping check) must still run in
    fp32 (casebook S6)."""
    import torch

    import common as C

    seen = []

    def layer(x, **kw):
        seen.append(torch.is_autocast_enabled(x.device.type))
        return x

    caller = object.__new__(C.HFCaller)
    caller.position_embeddings = caller.position_ids = caller.mask = caller.input_ids = None
    saved = C.HFCaller.autocast
    try:
        C.HFCaller.autocast = True
        caller(layer, torch.zeros(2, dtype=torch.float32))
        caller(layer, torch.zeros(2, dtype=torch.bfloat16))
    finally:
        C.HFCaller.autocast = saved
    assert seen == [False, True]


def test_bench_autoround_experts_smoke(tmp_path, capsys):
    """The batched-vs-one-by-one AutoRound benchmark runs and its two modes agree."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    bench = importlib.import_module("bench_autoround_experts")
    out = tmp_path / "ar.json"
    rc = bench.main(["--experts", "5", "--dim", "64", "--inter", "32", "--rows", "8", "--calls", "2", "--iters", "8",
                     "--chunk", "3", "--group", "32", "--repeats", "1", "--warmup", "0", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    for field in ("one_by_one", "batched", "floor", "speed-up of the medians", "agreement"):
        assert field in text, field
    res = json.loads(out.read_text())
    assert set(res["modes"]) == {"one_by_one", "batched"}
    assert res["modes"]["batched"]["chunk"] == 3 and res["floor"]["update_traffic_s"] > 0
    # fp32: bmm and mm may round apart and flip a SignSGD step here and there (the exact
    # agreement is tests/test_rounding.py's, in float64)
    assert res["agreement"]["offsets_equal_fraction"] > 0.99
    assert res["agreement"]["loss_gain_median"] > 0.2      # offsets really learned (not all RTN)
    assert res["agreement"]["loss_after_rel_diff_max"] < 1e-3


def test_check_banded_attention_smoke(tmp_path, capsys):
    """On CPU at a short sequence of V4-Flash's attention, in fp32 (a CPU's bf16 GEMMs take minutes
    here): the script times both paths, finds the
    Function's forward equal to the plain path's to the bit and its gradients no less accurate
    against float64, and exits 0 under --check."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    check = importlib.import_module("check_banded_attention")
    out = tmp_path / "banded.json"
    rc = check.main(["--device", "cpu", "--tokens", "1", "256", "--reps", "1", "--dtype", "float32", "--check", "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out.read_text())
    assert res["forward_bit_for_bit"] and res["banded_no_less_accurate"] and res["ratio"] == 4
    assert set(res["banded"]["rel_fro_vs_fp64"]) == {"out", "grad_q", "grad_kv", "grad_comp_kv"}
    assert all(0 < e < 1e-5 for e in res["banded"]["rel_fro_vs_fp64"].values())
