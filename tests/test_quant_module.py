"""DeepSeek-V4 quant wrappers: float equivalence when off, quantizers really in the path when on,
exact module / unit counts per layer kind, PTQ parameter round trip, dtypes untouched."""
import copy
import io

import pytest
import torch

from amct_ext.errors import QuantConfigError
from amct_ext.io.io_utils import safe_torch_load
from amct_ext.quant.quant_linear import QuantLinear
from amct_ext.quant.schemes import QuantScheme, load_scheme
from models.deepseek_v4.quant_module import (
    QuantV4Attention, QuantV4Compressor, QuantV4Expert, QuantV4Indexer, count_quant_modules,
    iter_block_ptq_units, quantize_block, set_activation_mode, set_quant_enabled,
)
from models.deepseek_v4.tiny import random_tiny_model

ALL = ["attn-linear-all", "attn-cache", "moe"]   # AMCT's widest set: every quantizable leaf
# tiny config: layer 0 ratio 0 hash, 1 ratio 4 hash, 2 ratio 128 score, 3 ratio 4 score
KINDS = {0: "r0-hash", 1: "r4-hash", 2: "r128-score", 3: "r4-score"}


@pytest.fixture(scope="module")
def model():
    return random_tiny_model(0, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def layer_inputs(model):
    """Each layer's float input on 2 sequences of 150 tokens (ratio-128 layer has an entry)."""
    ids = torch.randint(2, 512, (2, 150), generator=torch.Generator().manual_seed(0))
    xs = [model.embed_tokens(ids)]
    with torch.no_grad():
        for block in model.layers:
            xs.append(block(xs[-1], 0, ids))
    return ids, xs


def wrapped(model, i, scheme="w8a8", targets=ALL):
    return quantize_block(copy.deepcopy(model.layers[i]), load_scheme(scheme), targets)


@pytest.mark.parametrize("i", [0, 1, 2, 3], ids=lambda i: KINDS[i])
def test_off_is_bit_identical(model, layer_inputs, i):
    ids, xs = layer_inputs
    q = wrapped(model, i)
    set_quant_enabled(q, False)
    with torch.no_grad():
        out = q(xs[i], 0, ids)
    assert torch.equal(out, xs[i + 1])


@pytest.mark.parametrize("i", [0, 1, 2, 3], ids=lambda i: KINDS[i])
def test_w8a8_close_and_2bit_far(model, layer_inputs, i):
    ids, xs = layer_inputs
    ref = xs[i + 1].float()

    def rel_err(q):
        with torch.no_grad():
            out = q(xs[i], 0, ids).float()
        # the residual stream dominates the block output; measure the change the block makes
        return ((out - ref).norm() / (ref - xs[i].float()).norm()).item()

    w8 = rel_err(wrapped(model, i))
    two_bit = QuantScheme.from_dict({
        "name": "w2", "weight": {"format": "int", "bits": 2, "symmetric": True, "granularity": "channel"},
        "input": None, "cache": None})
    w2 = rel_err(quantize_block(copy.deepcopy(model.layers[i]), two_bit, ["attn-linear", "moe"]))
    print(f"\n{KINDS[i]}: relative error of the block update, w8a8 {w8:.4f}, w2 {w2:.4f}")
    assert w8 < 0.08
    assert w2 > 5 * w8 and w2 > 0.2


EXPECTED_COUNTS = {
    # QuantLinear: attn 4 (+ compressor 2) (+ indexer wq_b, weights_proj, compressor 2) + 9 experts x 3
    # ActivationQuantizer: one per QuantLinear + wo_a input + 2 per QuantMatmul (qk, pv, index score)
    0: {"QuantLinear": 31, "ActivationQuantizer": 36, "QuantMatmul": 2, "WoAQuant": 1},
    1: {"QuantLinear": 37, "ActivationQuantizer": 44, "QuantMatmul": 3, "WoAQuant": 1},
    2: {"QuantLinear": 33, "ActivationQuantizer": 38, "QuantMatmul": 2, "WoAQuant": 1},
    3: {"QuantLinear": 37, "ActivationQuantizer": 44, "QuantMatmul": 3, "WoAQuant": 1},
}


#: attn-linear is what the serving engines quantize (serving.ENGINE_ATTN_LEAVES): wq_a, wkv, wq_b,
#: wo_b (+ the indexer's wq_b at ratio 4); no wo_a, no compressor, no weights_proj
ENGINE_COUNTS = {
    0: {"QuantLinear": 31, "ActivationQuantizer": 35, "QuantMatmul": 2, "WoAQuant": 0},
    1: {"QuantLinear": 32, "ActivationQuantizer": 38, "QuantMatmul": 3, "WoAQuant": 0},
    2: {"QuantLinear": 31, "ActivationQuantizer": 35, "QuantMatmul": 2, "WoAQuant": 0},
    3: {"QuantLinear": 32, "ActivationQuantizer": 38, "QuantMatmul": 3, "WoAQuant": 0},
}


@pytest.mark.parametrize("i", [0, 1, 2, 3], ids=lambda i: KINDS[i])
def test_attn_linear_is_the_engine_set(model, i):
    from models.deepseek_v4.serving import ENGINE_ATTN_LEAVES

    q = wrapped(model, i, targets=["attn-linear", "attn-cache", "moe"])
    assert count_quant_modules(q) == ENGINE_COUNTS[i]
    attn_leaves = sorted(n for n, m in q.attn.named_modules() if isinstance(m, QuantLinear))
    assert attn_leaves == sorted(n for n in ENGINE_ATTN_LEAVES if q.attn.ratio == 4 or not n.startswith("indexer."))


@pytest.mark.parametrize("i", [0, 1, 2, 3], ids=lambda i: KINDS[i])
def test_counts_and_units(model, i):
    q = wrapped(model, i)
    assert count_quant_modules(q) == EXPECTED_COUNTS[i]
    assert isinstance(q.attn, QuantV4Attention)
    if q.attn.ratio:
        assert isinstance(q.attn.compressor, QuantV4Compressor)
    if q.attn.ratio == 4:
        assert isinstance(q.attn.indexer, QuantV4Indexer)
        assert isinstance(q.attn.indexer.compressor, QuantV4Compressor)  # nested compressor
    assert all(isinstance(e, QuantV4Expert) for e in q.ffn.experts)
    assert isinstance(q.ffn.shared_experts, QuantV4Expert)
    # wo_a stays a plain linear applied as a grouped einsum
    assert not isinstance(q.attn.wo_a, QuantLinear)

    units = list(iter_block_ptq_units(q, i, ["attn-linear"]))
    assert [(u.kind, u.name) for u in units] == [("attn", f"layers.{i}.attn")]
    assert [u.kind for u in iter_block_ptq_units(q, i, ["attn-cache"])] == ["attn"]
    moe = list(iter_block_ptq_units(q, i, ["moe"]))
    assert [u.kind for u in moe] == ["expert"] * 8 + ["shared_expert"]
    assert [u.metadata["expert_idx"] for u in moe[:8]] == list(range(8))
    assert moe[3].name == f"layers.{i}.ffn.experts.3" and moe[3].file_stem == f"layer_{i}_ffn_experts_3"


def test_targets_select_what_is_wrapped(model):
    q = wrapped(model, 1, targets=["moe"])
    assert not isinstance(q.attn, QuantV4Attention)
    assert count_quant_modules(q)["QuantLinear"] == 27
    q = wrapped(model, 1, scheme="kv8", targets=["attn-cache"])
    assert count_quant_modules(q) == {"QuantLinear": 0, "ActivationQuantizer": 6, "QuantMatmul": 3, "WoAQuant": 0}
    with pytest.raises(QuantConfigError, match="MoE"):
        wrapped(model, 1, targets=["mlp"])


def test_dtypes_unchanged_and_params_shared(model):
    block = copy.deepcopy(model.layers[3])
    before = {n: (p.dtype, p.data_ptr()) for n, p in block.named_parameters()}
    q = quantize_block(block, load_scheme("w8a8"), ALL)
    for n, p in q.named_parameters():
        if "quantizer" in n:
            continue
        assert (p.dtype, p.data_ptr()) == before[n], n
    assert q.attn.compressor.wkv.weight.dtype == torch.float32  # fp32 island kept
    assert q.hc_attn_fn.dtype == torch.float32 and q.attn.wq_a.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("i", [1, 2])
def test_ptq_params_round_trip(model, layer_inputs, i):
    ids, xs = layer_inputs
    q = wrapped(model, i, scheme="w8a8")
    units = list(iter_block_ptq_units(q, i, ALL))
    gen = torch.Generator().manual_seed(i)
    for u in units:
        for p in u.module.ptq_parameters():  # pretend the solver learned something
            with torch.no_grad():
                p.copy_(0.7 + 0.3 * torch.rand(p.shape, generator=gen))
        u.module.freeze_ptq_parameters()
    with torch.no_grad():
        learned = q(xs[i], 0, ids)
    saved = {}
    for u in units:
        buf = io.BytesIO()
        torch.save(u.module.export_ptq_params(), buf)
        buf.seek(0)
        saved[u.name] = safe_torch_load(buf)
    assert saved[f"layers.{i}.attn"] and saved[f"layers.{i}.ffn.experts.0"]

    fresh = wrapped(model, i, scheme="w8a8")
    with torch.no_grad():
        assert not torch.equal(fresh(xs[i], 0, ids), learned)  # the parameters matter
    for u in iter_block_ptq_units(fresh, i, ALL):
        u.module.load_ptq_params(saved[u.name])
    with torch.no_grad():
        assert torch.equal(fresh(xs[i], 0, ids), learned)


def test_unknown_ptq_param_is_refused(model):
    q = wrapped(model, 0)
    with pytest.raises(QuantConfigError, match="nonexistent"):
        q.attn.load_ptq_params({"nonexistent.weight_quantizer.clip": torch.ones(1)})


def test_activation_modes(model, layer_inputs):
    ids, xs = layer_inputs
    q = wrapped(model, 0)
    set_activation_mode(q, "off")
    set_quant_enabled(q, True)
    with torch.no_grad():
        weights_only = q(xs[0], 0, ids)
    set_activation_mode(q, "quant")
    with torch.no_grad():
        both = q(xs[0], 0, ids)
    assert not torch.equal(weights_only, both)


def test_wrapping_keeps_eval_mode(model):
    """New wrapper modules start in training mode; in an eval block that would disable the
    fake-quant weight cache and re-quantize every weight on every forward."""
    block = copy.deepcopy(model.layers[1]).eval()
    q = quantize_block(block, load_scheme("w8a8"), ALL)
    assert not any(m.training for m in q.modules())
    lin = q.ffn.experts[0].w1
    with torch.no_grad():
        assert lin.quantized_weight() is lin.quantized_weight()  # cached
