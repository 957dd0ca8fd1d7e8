"""Smoothing (SmoothQuant, AWQ): the folded scales leave the float block unchanged at every layer
kind, never change what the routers see, cut the quantized error where outlier channels make
quantization hard, and reload from the saved parameters into a fresh block bit for bit."""
import copy

import pytest
import torch

from amct_ext.algorithms import SolveContext, UnitData
from amct_ext.algorithms.recipe import parse_algo
from amct_ext.algorithms.smoothing import AWQ, SmoothQuant, awq_scales, commit_scales, smoothquant_scales
from amct_ext.pipeline.capture import capture_unit_io
from amct_ext.errors import AmctError
from amct_ext.quant.schemes import QuantScheme, load_scheme
from amct_ext.pipeline.solver import unit_mse
from models.deepseek_v4.quant_module import (
    QuantV4Expert, iter_block_ptq_units, quantize_block, set_quant_enabled,
)
from models.deepseek_v4.modeling import Expert

T = ["attn-linear", "moe"]
KINDS = {0: "r0-hash", 1: "r4-hash", 2: "r128-score", 3: "r4-score"}
W4 = QuantScheme.from_dict({"name": "w4g16", "weight": {"format": "int", "bits": 4, "symmetric": False,
                                                         "granularity": "group", "group_size": 16},
                            "input": None, "cache": None})


@pytest.fixture(scope="module")
def layer_data(tiny_adapter, one_thread):
    """(ids, float input of each layer) of the tiny fp32 checkpoint on 2 x 150 tokens."""
    ids = torch.randint(2, 512, (2, 150), generator=torch.Generator().manual_seed(0))
    x = tiny_adapter.do_embedding_forward([ids])[0]
    xs = [x]
    with torch.no_grad():
        for i in range(tiny_adapter.num_layers):
            xs.append(tiny_adapter.block(i)(xs[-1], 0, ids))
    return ids, xs


def captured(block, i, ids, x):
    """Units of a quantized block and their captured float calls (the workflow's capture)."""
    units = list(iter_block_ptq_units(block, i, T))
    block.ffn.grouped = False
    set_quant_enabled(block, False)
    with torch.no_grad():
        calls, _ = capture_unit_io(units, lambda: block(x, 0, ids))
    set_quant_enabled(block, True)
    return units, {u.name: UnitData(calls[u.name]) for u in units}


def smoothed_block(tiny_adapter, i, ids, x, algo, scheme=W4):
    block = quantize_block(tiny_adapter.block(i), scheme, T)
    units, datas = captured(block, i, ids, x)
    stats = {u.name: algo.apply(u, datas[u.name], SolveContext()) for u in units}
    return block, units, datas, stats


def rel(out, ref, base):
    return ((out - ref).norm() / (ref - base).norm()).item()


@pytest.mark.parametrize("i", [0, 1, 2, 3], ids=lambda i: KINDS[i])
def test_float_function_unchanged_at_every_layer_kind(tiny_adapter, layer_data, i):
    ids, xs = layer_data
    algo = SmoothQuant(alpha=0.5, keep_if_better=False)   # always folds: the worst case for exactness
    block, units, _, stats = smoothed_block(tiny_adapter, i, ids, xs[i], algo)
    attn = block.attn
    # the scales are far from 1 and every pair of this layer kind was folded
    s = attn.input_smooth
    assert s is not None and float((s.log().abs()).max()) > 0.5
    pairs = set(stats[f"layers.{i}.attn"]["pairs"])
    assert pairs == {"attn_norm", "q_norm", "wo_a"}
    keys = set(attn.export_ptq_params())
    expect = {"input_smooth", "wq_a.weight", "wkv.weight", "q_norm.weight", "wq_b.weight", "wo_a.weight", "wo_b.weight"}
    if attn.ratio:
        expect |= {"compressor.wkv.weight", "compressor.wgate.weight"}
    if attn.ratio == 4:
        expect |= {"indexer.weights_proj.weight", "indexer.wq_b.weight", "indexer.compressor.wkv.weight",
                   "indexer.compressor.wgate.weight"}
    assert expect <= keys
    # fp32 islands stay fp32
    if attn.ratio:
        assert attn.compressor.wkv.weight.dtype == torch.float32
    assert block.attn_norm.weight.dtype == attn.q_norm.weight.dtype == torch.float32
    set_quant_enabled(block, False)
    block.ffn.grouped = True
    with torch.no_grad():
        out = block(xs[i], 0, ids)
    assert rel(out, xs[i + 1], xs[i]) < 2e-6


def test_a_missing_compensation_is_caught(tiny_adapter, layer_data):
    """The exactness check above can fail: folding attn_norm without scaling one reader (the
    indexer's compressor) changes the block output by far more than its tolerance."""
    ids, xs = layer_data
    block = quantize_block(tiny_adapter.block(1), W4, T)
    pair = next(p for p in block.attn.smoothing_subgraphs() if p.name == "attn_norm")
    pair.readers.remove("indexer.compressor.wkv")
    s = torch.exp(torch.randn(block.attn_norm.weight.shape, generator=torch.Generator().manual_seed(0)))
    commit_scales(block.attn, None, pair, s)
    set_quant_enabled(block, False)
    with torch.no_grad():
        out = block(xs[1], 0, ids)
    assert rel(out, xs[2], xs[1]) > 1e-3


@pytest.mark.parametrize("i", [1, 2], ids=lambda i: KINDS[i])
def test_routing_unchanged(tiny_adapter, layer_data, i):
    """The routers read ffn_norm's output: smoothing never scales it, so the routes (indices)
    are identical and the routing weights equal to fp32 rounding."""
    ids, xs = layer_data

    def routes(block):
        seen = []
        h = block.ffn.gate.register_forward_hook(lambda m, a, out: seen.append(out))
        set_quant_enabled(block, False)
        with torch.no_grad():
            block(xs[i], 0, ids)
        h.remove()
        return seen[0]

    ref_block = quantize_block(tiny_adapter.block(i), W4, T)
    w0, idx0 = routes(ref_block)
    block, *_ = smoothed_block(tiny_adapter, i, ids, xs[i], SmoothQuant(alpha=0.5, keep_if_better=False))
    assert torch.equal(block.ffn_norm.weight, ref_block.ffn_norm.weight)
    assert torch.equal(block.ffn.gate.weight, ref_block.ffn.gate.weight)
    w1, idx1 = routes(block)
    assert torch.equal(idx1, idx0)
    torch.testing.assert_close(w1, w0, rtol=1e-6, atol=1e-7)


def test_expert_clamp_is_exact_with_per_channel_limit(one_thread):
    """w3 -> w2 inside the clamped SwiGLU: with inputs large enough that the clamp at L is
    active, the smoothed expert equals the float one; dividing w3's rows without moving the
    clamp limit (the naive fold) does not."""
    g = torch.Generator().manual_seed(0)
    e = Expert(16, 32, 10.0, torch.float32)
    for p in e.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    x = torch.randn(64, 16, generator=g) * 5
    rw = torch.rand(64, 1, generator=g)
    with torch.no_grad():
        up = e.w3(x)
        assert float((up.abs() > 10).float().mean()) > 0.2       # the clamp really bites
        ref = e(x, rw)
    q = QuantV4Expert(copy.deepcopy(e), W4.target("moe").weight, None)
    pair = q.smoothing_subgraphs()[0]
    s = torch.exp(torch.randn(32, generator=g))
    commit_scales(q, None, pair, s)
    set_quant_enabled(q, False)
    with torch.no_grad():
        out = q(x, rw)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-6
        naive = copy.deepcopy(q)
        naive.up_limit = None                                     # scalar clamp on scaled rows
        assert ((naive(x, rw) - ref).norm() / ref.norm()).item() > 1e-2
    assert set(q.export_ptq_params()) >= {"w3.weight", "w2.weight", "up_limit"}


STATIC_W8A8 = QuantScheme.from_dict({
    "name": "w8a8-static", "weight": {"format": "int", "bits": 8, "symmetric": True, "granularity": "channel"},
    "input": {"format": "int", "bits": 8, "symmetric": True, "granularity": "tensor", "dynamic": False},
    "cache": None})


@pytest.mark.parametrize("scheme", ["w8a8", "static"])
def test_smoothquant_cuts_outlier_channel_error(tiny_adapter, layer_data, scheme):
    """Outlier channels in the attention input (attn_norm weight x 30 on 4 channels, readers'
    columns / 30: the same float function) ruin int8 activations (per-token dynamic, or static
    per-tensor ranges, which are re-observed on the smoothed unit); SmoothQuant migrates them
    into the weights and cuts the unit's output error by more than 3x."""
    from amct_ext.pipeline.workflow import finish_static

    ids, xs = layer_data
    i = 0
    block = tiny_adapter.block(i)
    with torch.no_grad():
        block.attn_norm.weight[:4] *= 30
        for name in ("wq_a", "wkv"):
            getattr(block.attn, name).weight[:, :4] /= 30
    block = quantize_block(block, load_scheme("w8a8") if scheme == "w8a8" else STATIC_W8A8, T)
    units, datas = captured(block, i, ids, xs[i])
    unit = units[0]
    if scheme == "static":   # the workflow's observe pass (RTN weights, float inputs)
        with torch.no_grad():
            block(xs[i], 0, ids)
        finish_static(block, i)
        wq_a_range = unit.module.wq_a.input_quantizer.running_max.clone()
    st = SmoothQuant(alpha=0.5).apply(unit, datas[unit.name], SolveContext())
    assert st["pairs"]["attn_norm"]["alpha"] == 0.5
    assert st["loss_after"] < st["loss_before"] / 3
    if scheme == "static":   # re-observed on x / s: the outliers are gone from the range
        assert unit.module.wq_a.input_quantizer.mode == "quant"
        assert float(unit.module.wq_a.input_quantizer.running_max) < 0.5 * float(wq_a_range)
    # the stats are honest: the final loss is the unit's MSE on the rescaled calls
    assert st["loss_after"] == pytest.approx(unit_mse(unit.module, datas[unit.name].calls, torch.device("cpu")),
                                             rel=1e-9)


@pytest.mark.parametrize("i", [1, 2], ids=lambda i: KINDS[i])
def test_awq_never_worse_and_reload_reproduces(tiny_adapter, layer_data, i, tmp_path):
    """AWQ keeps a pair only when it beats the unsmoothed unit; the saved parameters loaded into
    a fresh quantized block give the solved block's output exactly (torch.equal)."""
    ids, xs = layer_data
    block, units, datas, stats = smoothed_block(tiny_adapter, i, ids, xs[i], AWQ(n_grid=5))
    for st in stats.values():
        if "loss_before" in st:
            assert st["loss_after"] <= st["loss_before"]
    assert any(p["alpha"] is not None for st in stats.values() for p in st["pairs"].values())
    assert stats[f"layers.{i}.attn"]["loss_after"] < stats[f"layers.{i}.attn"]["loss_before"]
    saved = {u.name: u.module.export_ptq_params() for u in units}
    assert any("up_limit" in p for p in saved.values())
    fresh = quantize_block(tiny_adapter.block(i), W4, T)
    for u in iter_block_ptq_units(fresh, i, T):
        u.module.load_ptq_params(saved[u.name])
    block.ffn.grouped = fresh.ffn.grouped = True
    with torch.no_grad():
        a, b = block(xs[i], 0, ids), fresh(xs[i], 0, ids)
    assert torch.equal(a, b)
    assert torch.equal(fresh.attn_norm.weight, block.attn_norm.weight)
    # loading twice into the same block would fold input_smooth twice: refused
    with pytest.raises(AmctError, match="input_smooth"):
        fresh.attn.load_ptq_params({"input_smooth": saved[f"layers.{i}.attn"]["input_smooth"]})


def test_scale_formulas():
    a = torch.tensor([4.0, 1.0, 0.0, 9.0])
    w = torch.tensor([1.0, 4.0, 2.0, 0.0])
    s = smoothquant_scales(a, w, 0.5)
    torch.testing.assert_close(s, torch.tensor([2.0, 0.5, 1.0, 1.0]))   # dead channels keep 1
    torch.testing.assert_close(awq_scales(a, 0.0), torch.ones(4))
    s = awq_scales(torch.tensor([1.0, 4.0, 16.0]), 0.5)
    torch.testing.assert_close(s, torch.tensor([0.5, 1.0, 2.0]))         # centred: max * min = 1


def test_registered_and_checked():
    r = parse_algo("smoothquant:alpha=0.7,awq:n_grid=4:pairs=attn_norm,autoround:iters=3")
    assert r.names == ["smoothquant", "awq", "autoround"]
    assert r.algorithms[1].pairs == "attn_norm"
    with pytest.raises(AmctError, match="alpha"):
        parse_algo("smoothquant:alpha=1.5")
    with pytest.raises(AmctError, match="pairs"):
        parse_algo("awq:pairs=ffn_norm")


def test_rtn_guard_restore_undoes_smoothing(tiny_adapter, layer_data):
    """The recipe runner's fall back to RTN (snapshot / restore) also puts back what lives
    outside the unit's state_dict: the block's attn_norm, input_smooth, the experts' up_limit."""
    from amct_ext.algorithms.runner import restore_unit, snapshot_unit

    ids, xs = layer_data
    block = quantize_block(tiny_adapter.block(1), W4, T)
    units, datas = captured(block, 1, ids, xs[1])
    with torch.no_grad():
        ref = block(xs[1], 0, ids)
    norm0 = block.attn_norm.weight.detach().clone()
    snaps = {u.name: snapshot_unit(u.module) for u in units}
    for u in units:
        SmoothQuant(alpha=0.5, keep_if_better=False).apply(u, datas[u.name], SolveContext())
    assert not torch.equal(block.attn_norm.weight, norm0)
    for u in units:
        restore_unit(u.module, snaps[u.name])
    assert torch.equal(block.attn_norm.weight, norm0) and block.attn.input_smooth is None
    assert all(getattr(u.module, "up_limit", None) is None for u in units)
    assert all(not any(k.endswith(".weight") or k in ("input_smooth", "up_limit") for k in u.module.export_ptq_params())
               for u in units)
    with torch.no_grad():
        assert torch.equal(block(xs[1], 0, ids), ref)


def test_workflow_saves_what_was_solved(tiny_adapter, tmp_path):
    """Through run_blockwise_ptq (files on disk): a fresh block loading the saved parameters
    of each unit reproduces the loss the recipe reported for that unit (on the same float
    inputs; the attention's input is attn_norm's output with s folded in, equal to x / s up to
    fp32 rounding, hence the relative tolerance -- far below the gains)."""
    from amct_ext.base import PtqConfig
    from amct_ext.pipeline.workflow import PARAMS_DIR, load_unit_params, run_blockwise_ptq

    ids = torch.randint(2, 512, (2, 64), generator=torch.Generator().manual_seed(5))
    cfg = PtqConfig(n_samples=2, seq_len=64, batch_size=2)
    recipe = parse_algo("awq:n_grid=3,autoround:iters=4")
    res = run_blockwise_ptq(tiny_adapter, W4, T, cfg, tmp_path, layers=range(1, 2), calib_windows=ids,
                            recipe=recipe)
    reported = {u.name: u for u in res.units}
    x = tiny_adapter.do_embedding_forward([ids])[0]
    with torch.no_grad():
        x = tiny_adapter.block(0)(x, 0, ids)                          # layer 1's float input
    block = quantize_block(tiny_adapter.block(1), W4, T)
    units = list(iter_block_ptq_units(block, 1, T))
    for u in units:
        load_unit_params(u, tmp_path / PARAMS_DIR)
    _, datas = captured(block, 1, ids, x)
    gains = 0
    for u in units:
        r = reported[u.name]
        if not len(datas[u.name]):
            continue
        loss = unit_mse(u.module, datas[u.name].calls, torch.device("cpu"))
        assert loss == pytest.approx(r.loss_after, rel=1e-4), u.name
        gains += r.loss_after < 0.99 * r.loss_before
    assert gains >= 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_in_place_writes_never_reach_later_loads(tiny_ckpt, dtype):
    """Smoothing / GPTQ / loading a replaced weight write into a block's parameters in place.
    A parameter read without conversion used to be a view of the cached shard memory map, so
    the write changed every later load of the layer in the process (the PTQ evaluation then
    folded input_smooth into an already folded attn_norm). Every loaded tensor owns its memory."""
    from amct_ext.base import RunConfig
    from models.deepseek_v4.adapter import DeepseekV4Adapter

    with DeepseekV4Adapter(RunConfig(tiny_ckpt, device="cpu", dtype=dtype, progress=False)) as ad:
        first = ad.block(1)
        before = {n: p.detach().clone() for n, p in first.named_parameters()}
        with torch.no_grad():
            for p in first.parameters():
                p.mul_(2)
        again = dict(ad.block(1).named_parameters())
        assert [n for n, v in before.items() if not torch.equal(again[n], v)] == []


def test_held_out_calls_veto_a_scale_that_does_not_generalise(tiny_adapter, layer_data):
    """validate: a pair's scales are kept only when they also lower the loss of the held-out
    calls. Here the held-out call's target is the RTN output itself (RTN loss 0 there), so
    every scale is worse on it and is refused, although it wins on the training call."""
    from amct_ext.pipeline.capture import UnitCall

    ids, xs = layer_data
    block = tiny_adapter.block(0)
    with torch.no_grad():
        block.attn_norm.weight[:4] *= 30
        for name in ("wq_a", "wkv"):
            getattr(block.attn, name).weight[:, :4] /= 30
    block = quantize_block(block, load_scheme("w8a8"), T)
    units, datas = captured(block, 0, ids, xs[0])
    unit, call = units[0], datas[units[0].name].calls[0]
    with torch.no_grad():
        rtn_out = unit.module(*call.args)
    held = UnitCall(call.args, call.kwargs, rtn_out)
    ctx = SolveContext(holdout=0.5)
    st = SmoothQuant(alpha=0.5).apply(unit, UnitData([call, held]), ctx)
    info = st["pairs"]["attn_norm"]
    assert info["loss_with_alpha"] < info["loss_before"] / 3          # wins on the training call
    assert info["kept"] is False and info["held_out_after"] > info["held_out_before"] == 0.0
    assert unit.module.input_smooth is None
    SmoothQuant(alpha=0.5, validate=False, keep_if_better=False).apply(unit, UnitData([call, held]), ctx)
    assert unit.module.input_smooth is not None


def test_smoothquant_then_gptq_then_clip_reloads_exactly(tiny_adapter, layer_data):
    """The composed recipe of the issue (smoothquant,gptq,clip) through the recipe runner:
    GPTQ's fixed grids sit on the smoothed weights, and a fresh block loading the saved
    parameters reproduces the solved block bit for bit. Smoothing after GPTQ is refused."""
    from amct_ext.algorithms.runner import run_recipe_on_units

    ids, xs = layer_data
    i = 1
    block = quantize_block(tiny_adapter.block(i), W4, T)
    units, datas = captured(block, i, ids, xs[i])
    units = [units[0], units[1], units[-1]]          # the attention, a routed and the shared expert
    calls = {u.name: datas[u.name].calls for u in units}
    rs = run_recipe_on_units(units, calls, parse_algo("smoothquant:keep_if_better=false,gptq,clip:epochs=0:grid=4"),
                             device=torch.device("cpu"), seed=0, guard=False)
    assert all(r.loss_after is not None for r in rs if r.n_calls)
    saved = {u.name: u.module.export_ptq_params() for u in units}
    attn = saved[f"layers.{i}.attn"]
    # GPTQ's result on wq_a is saved as the float weight or, on a fixed grid, as its codes
    # (export_ptq_params: the same values); which one depends on the clip's choice
    assert "input_smooth" in attn and "q_norm.weight" in attn and ("wq_a.weight" in attn or "wq_a.weight_codes" in attn)
    fresh = quantize_block(tiny_adapter.block(i), W4, T)
    for u in iter_block_ptq_units(fresh, i, T):
        if u.name in saved:
            u.module.load_ptq_params(saved[u.name])
    block.ffn.grouped = fresh.ffn.grouped = True
    with torch.no_grad():
        assert torch.equal(block(xs[i], 0, ids), fresh(xs[i], 0, ids))
    # a fixed grid (what GPTQ leaves) in the unit: smoothing refuses to scale under it
    from amct_ext.quant import formats

    other = quantize_block(tiny_adapter.block(i), W4, T)
    ounits, odatas = captured(other, i, ids, xs[i])
    wq = ounits[0].module.wq_a
    wq.weight_quantizer.set_fixed_qparams(wq.weight, *formats.qparams(wq.weight, wq.weight_quantizer.spec))
    with pytest.raises(AmctError, match="before gptq"):
        SmoothQuant().apply(ounits[0], odatas[ounits[0].name], SolveContext())
