"""Recipes that know their source (issue 35.3): a unit whose weights the target format already
holds exactly (the release's FP4 experts under mxfp4) is kept as stored, codes and all, whatever
the recipe; the run's summary and report say so (amct_ext/algorithms/source_grid.py)."""
import json

import pytest
import torch
from torch import nn

from amct_ext.algorithms.source_grid import is_kept, kept_result, split_kept, weights_on_target_grid
from amct_ext.io.storage_formats import decode_fp4, encode_fp4
from amct_ext.pipeline.ptq_units import make_ptq_unit
from amct_ext.pipeline.summary import format_summary, summarize_units
from amct_ext.quant.quant_linear import QuantLinear
from amct_ext.quant.schemes import load_scheme
from tests.conftest import REPO, stored_tensors

ASSET = REPO / "assets" / "tiny-v4-release"

pytestmark = pytest.mark.usefixtures("one_thread")


def _leaf(weight: torch.Tensor, scheme: str = "mxfp4") -> QuantLinear:
    s = load_scheme(scheme)
    return QuantLinear(nn.Parameter(weight, requires_grad=False), None, s.target("moe").weight, None)


def test_on_grid_is_decided_by_values():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g) * 0.02
    on = decode_fp4(*encode_fp4(w), dtype=torch.float32)      # a released FP4 weight, decoded
    assert weights_on_target_grid(_leaf(on.clone()))
    assert not weights_on_target_grid(_leaf(w.clone()))           # a bf16-style weight: off the grid
    assert not weights_on_target_grid(_leaf(on.clone(), "w4a16-g128"))   # int4 g128 does not hold FP4 x 2^k
    off_one = on.clone()
    off_one[3, 5] += 1e-4
    assert not weights_on_target_grid(_leaf(off_one))             # one element off is enough
    tuned = _leaf(on.clone(), "fp8")
    tuned.weight_quantizer.init_clip(tuned.weight, 0.9)
    assert not weights_on_target_grid(tuned)                      # a clip that moves the grid off the values
    assert not weights_on_target_grid(nn.Linear(4, 4))            # nothing quantized


def test_split_keeps_order_and_the_summary_counts_kept_units():
    g = torch.Generator().manual_seed(1)
    on = decode_fp4(*encode_fp4(torch.randn(32, 64, generator=g)), dtype=torch.float32)
    units = [make_ptq_unit("expert", f"layers.0.ffn.experts.{e}", 0, _leaf(on.clone() if e % 2 else
                                                                          torch.randn(32, 64, generator=g)))
             for e in range(4)]
    kept, solve = split_kept(units)
    assert [u.name for u in kept] == ["layers.0.ffn.experts.1", "layers.0.ffn.experts.3"]
    assert [u.name for u in solve] == ["layers.0.ffn.experts.0", "layers.0.ffn.experts.2"]
    from amct_ext.algorithms.recipe import parse_algo
    from amct_ext.algorithms.runner import run_recipe_on_units

    ran = run_recipe_on_units(units, {}, parse_algo("rtn"), device=torch.device("cpu"), seed=0)
    assert [r.name for r in ran] == [u.name for u in units]          # one result per unit, in order
    assert [is_kept(r) for r in ran] == [False, True, False, True]
    results = [kept_result(u) for u in kept]
    assert all(is_kept(r) and is_kept(r.to_dict()) for r in results)
    groups = summarize_units(results)
    assert groups[0].kept_source == 2
    assert "source codes: 2 of 2 units (expert) keep the checkpoint's stored codes bit for bit" in format_summary(groups)




def _run(tmp_path, scheme: str, algo: str) -> tuple:
    """The main job (library entry point) from the release tiny (few calibration windows, no
    reference PPL); (output dir, report)."""
    from tests.conftest import library_job

    run = tmp_path / "run"
    assert library_job(run, model="tiny-trained-release", scheme=scheme, algo=algo, calib_samples=2, seq_len=128,
                       eval_windows=1, ppl_modes="") is not None
    return run, json.loads((run / "report.json").read_text())


def _quantized_leaves(run, scheme):
    """(release key of the weight, leaf) of every quantized leaf of the model the run leaves:
    its saved parameters loaded, as evaluation and export load them."""
    from amct_ext.algorithms.hessians import quant_leaves
    from amct_ext.base import RunConfig
    from amct_ext.pipeline.workflow import load_unit_params
    from models.deepseek_v4.adapter import DeepseekV4Adapter

    adapter = DeepseekV4Adapter(RunConfig(model_path=ASSET, device="cpu", dtype=torch.float32, progress=False))
    targets = ["attn-linear", "moe"]
    for i in range(adapter.num_layers):
        block = adapter.block(i, device="cpu")
        adapter.quantize_block(block, load_scheme(scheme), targets)
        for unit in adapter.iter_ptq_units(block, i, targets):
            load_unit_params(unit, run / "ptq_params")
            for name, leaf in quant_leaves(unit.module):
                yield f"{unit.name}.{name}", unit, leaf
        adapter.release_block(block)


def test_mxfp4_run_from_the_release_keeps_the_released_expert_codes(tmp_path, capsys):
    """PTQ of the release tiny to mxfp4 with a recipe that moves expert weights (AWQ's w3 -> w2
    smoothing rescales them, then GPTQ re-rounds): every routed expert of the quantized model
    holds its released e2m1 codes and e8m0 scales, element for element."""
    from amct_ext.io.storage_formats import unpack_fp4_codes

    run, report = _run(tmp_path, "mxfp4", "awq:pairs=w3,gptq")
    printed = capsys.readouterr().out
    experts = [u for u in report["units"] if u["kind"] == "expert"]
    assert len(experts) == 32 and all(u["stats"]["kept_source_codes"] for u in experts)
    assert report["units_keeping_source_codes"] == 32
    others = [u for u in report["units"] if u["kind"] != "expert"]
    assert others and not any((u["stats"] or {}).get("kept_source_codes") for u in others)
    assert "source codes: 32 of 40 units (expert)" in printed
    rel, n = stored_tensors(ASSET), 0
    for key, unit, leaf in _quantized_leaves(run, "mxfp4"):
        if unit.kind != "expert":
            continue
        got = leaf.export()
        assert torch.equal(got["qweight"].to(torch.uint8), unpack_fp4_codes(rel[key + ".weight"])), key
        assert torch.equal(got["scale_e8m0"].to(torch.uint8), rel[key + ".scale"].view(torch.uint8)), key
        n += 1
    assert n == 96


def test_fp8_block_ue8m0_run_from_the_release_keeps_every_released_code(tmp_path):
    """The release's own FP8 layout as a target (benchmarks/schemes/fp8-block-ue8m0.json: 128x128
    blocks, power-of-two scales) holds the FP8 attention / shared-expert blocks AND the FP4 experts
    exactly: a clip search (which moves scales) touches none of them, and every FP8 leaf exports
    the released e4m3 bytes with the released block scales."""
    from amct_ext.io.storage_formats import e8m0_to_float32

    scheme = str(REPO / "benchmarks" / "schemes" / "fp8-block-ue8m0.json")
    run, report = _run(tmp_path, scheme, "clip")
    assert report["units_keeping_source_codes"] == len(report["units"]) == 40
    rel, n = stored_tensors(ASSET), 0
    for key, unit, leaf in _quantized_leaves(run, scheme):
        got = leaf.export()
        if rel[key + ".weight"].dtype == torch.float8_e4m3fn:
            assert torch.equal(got["qweight"].view(torch.uint8), rel[key + ".weight"].view(torch.uint8)), key
            assert torch.equal(got["scale"].float(), e8m0_to_float32(rel[key + ".scale"])), key
            n += 1
    assert n == 34 - 4    # every FP8 weight but the 4 wo_a (not in the attn-linear target set)


def test_ue8m0_scales_are_powers_of_two_and_keep_the_fingerprints():
    from amct_ext.quant.formats import fake_quant, qparams
    from amct_ext.quant.schemes import QuantConfigError, TensorSpec

    g = torch.Generator().manual_seed(2)
    x = torch.randn(256, 256, generator=g) * 0.05
    pow2 = TensorSpec("fp8", granularity="block", block_size=(128, 128), scale_format="ue8m0")
    plain = TensorSpec("fp8", granularity="block", block_size=(128, 128))
    s, s_plain = qparams(x, pow2)[0], qparams(x, plain)[0]
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))           # exact powers of two
    assert bool((s >= s_plain).all()) and bool((s < 2 * s_plain).all())  # the float scale rounded UP
    assert float(fake_quant(x, pow2).abs().max()) <= float(x.abs().max())
    exact = torch.zeros(128, 128)
    exact[5, 7] = 448 * 2.0 ** -3                                      # amax / 448 already a power of two
    assert float(qparams(exact, pow2)[0]) == 2.0 ** -3 and torch.equal(fake_quant(exact, pow2), exact)
    assert "scale_format" not in plain.to_dict() and pow2.to_dict()["scale_format"] == "ue8m0"
    assert TensorSpec.from_dict(pow2.to_dict()) == pow2
    with pytest.raises(QuantConfigError, match="scale_format='ue8m0' applies to format 'fp8' only"):
        TensorSpec("int", 4, granularity="channel", scale_format="ue8m0")
    with pytest.raises(QuantConfigError, match="scale_format='pow3' is unknown"):
        TensorSpec("fp8", granularity="channel", scale_format="pow3")


def test_float_scaled_fp8_blocks_do_not_hold_the_release():
    """casebook i35-2: with scale = amax / 448 (no power-of-two rounding) a 128x128 fp8 block
    grid keeps few of the release's FP8 values; with ue8m0 it keeps them all."""
    from amct_ext.io.storage_formats import decode_fp8_block
    from amct_ext.quant.formats import fake_quant
    from amct_ext.quant.schemes import TensorSpec
    from models.deepseek_v4.release_format import FP8_LINEAR

    rel = stored_tensors(ASSET)
    plain = TensorSpec("fp8", granularity="block", block_size=(128, 128))
    pow2 = TensorSpec("fp8", granularity="block", block_size=(128, 128), scale_format="ue8m0")
    kept = total = exact = exact_pow2 = n = 0
    for k, t in rel.items():
        if FP8_LINEAR.match(k):
            w = decode_fp8_block(t, rel[k[:-6] + "scale"], dtype=torch.float32)
            q = fake_quant(w, plain)
            kept, total, n = kept + int((q == w).sum()), total + w.numel(), n + 1
            exact += int(torch.equal(q, w))
            exact_pow2 += int(torch.equal(fake_quant(w, pow2), w))
    assert (kept, total, exact, exact_pow2, n) == (128628, 786432, 1, 34, 34)
