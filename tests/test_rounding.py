"""Learnable rounding (AutoRound): offsets in [-0.5, 0.5], zero offsets are RTN bit for bit,
SignSGD beats RTN on a synthetic problem, and the saved state reloads exactly."""
import copy

import pytest
import torch

from amct_ext.quant import formats
from amct_ext.algorithms import SolveContext, UnitData
from amct_ext.algorithms.rounding import AutoRound
from amct_ext.pipeline.capture import UnitCall
from amct_ext.errors import AmctError
from amct_ext.pipeline.ptq_units import make_ptq_unit
from amct_ext.quant.quant_linear import QuantLinear
from amct_ext.quant.quantizers import WeightQuantizer
from amct_ext.quant.schemes import TensorSpec
from models.deepseek_v4.modeling import Expert
from models.deepseek_v4.quant_module import QuantV4Expert

SPECS = [TensorSpec("int", 4, False, "group", 16), TensorSpec("int", 3, True, "channel"),
         TensorSpec("int", 8, True, "channel")]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"int{s.bits}-{s.granularity}-{'sym' if s.symmetric else 'asym'}")
def test_zero_offset_is_rtn_exactly(spec):
    w = torch.randn(24, 32, generator=torch.Generator().manual_seed(1))
    wq = WeightQuantizer(spec)
    rtn, rtn_export = wq(w), wq.export(w)
    wq.init_round_offset(w)
    assert torch.equal(wq(w), rtn)
    for k, v in wq.export(w).items():
        assert torch.equal(v, rtn_export[k]), k
    # a half step moves codes: the offset is really in the path
    with torch.no_grad():
        wq.round_offset.fill_(0.5)
    assert not torch.equal(wq(w), rtn)


def test_offset_export_matches_fake_quant():
    spec = SPECS[0]
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(2))
    v = torch.rand(8, 32, generator=torch.Generator().manual_seed(3)) - 0.5
    d = formats.quantize(w, spec, round_offset=v)
    assert torch.equal(formats.dequantize(d, spec), formats.fake_quant(w, spec, round_offset=v))


def _problem(bits=3, n_calls=4, seed=0):
    """An expert at 3-bit per channel on correlated inputs: rounding choices matter."""
    g = torch.Generator().manual_seed(seed)
    e = Expert(32, 48, 10.0, torch.float32)
    with torch.no_grad():
        for p in e.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    mix = torch.randn(32, 32, generator=g) / 4 + torch.eye(32)
    calls = []
    for _ in range(n_calls):
        x = torch.randn(64, 32, generator=g) @ mix
        with torch.no_grad():
            calls.append(UnitCall((x,), {}, e(x)))
    q = QuantV4Expert(e, TensorSpec("int", bits, True, "channel"), None)
    return q, calls


def test_autoround_beats_rtn_and_offsets_stay_in_range():
    q, calls = _problem()
    unit = make_ptq_unit("expert", "layers.0.ffn.experts.0", 0, q)
    st = AutoRound(iters=120).apply(unit, UnitData(calls), SolveContext())
    assert st["loss_after"] < 0.8 * st["loss_before"], st
    for lin in (q.w1, q.w2, q.w3):
        v = lin.weight_quantizer.round_offset
        assert v is not None and not v.requires_grad
        assert float(v.abs().max()) <= 0.5
        assert float(v.abs().max()) > 0.05        # really learned something
        c = lin.weight_quantizer.clip
        assert bool(((c >= 0.5) & (c <= 1)).all())


def test_offsets_clamped_even_with_a_huge_step():
    """Steps of 0.4 for 6 iterations would carry an unclamped offset to 2.4: the raw parameter
    the forward passes see stays in [-0.5, 0.5] (clamped after every step), and a raw value
    outside is clamped in the forward pass and in the saved state."""
    q, calls = _problem(n_calls=2, seed=1)
    seen = []
    q.w1.register_forward_pre_hook(lambda m, a: seen.append(
        None if m.weight_quantizer.round_offset is None else float(m.weight_quantizer.round_offset.detach().abs().max())))
    AutoRound(iters=6, lr=0.4, eval_every=1, learn_clip=False).apply(
        make_ptq_unit("expert", "e", 0, q), UnitData(calls), SolveContext())
    raw = [v for v in seen if v is not None]
    assert max(raw) == pytest.approx(0.5) and all(v <= 0.5 for v in raw)
    wq = WeightQuantizer(SPECS[0])
    w = torch.randn(8, 32, generator=torch.Generator().manual_seed(4))
    wq.init_round_offset(w)
    with torch.no_grad():
        wq.round_offset.fill_(0.9)
        over = wq(w)
        wq.round_offset.fill_(0.5)
        assert torch.equal(over, wq(w))
        wq.round_offset.fill_(-3.0)
        assert float(wq.ptq_params()["round_offset"].min()) == -0.5


def test_reload_reproduces_and_bad_offsets_refused():
    q, calls = _problem(n_calls=2, seed=2)
    unit = make_ptq_unit("expert", "e", 0, q)
    AutoRound(iters=40).apply(unit, UnitData(calls), SolveContext())
    saved = q.export_ptq_params()
    assert "w1.weight_quantizer.round_offset" in saved and "w1.weight_quantizer.clip" in saved
    fresh_float, _ = _problem(n_calls=2, seed=2)
    fresh = fresh_float
    fresh.load_ptq_params(saved)
    x = calls[0].args[0]
    with torch.no_grad():
        assert torch.equal(fresh(x), q(x))
    bad = dict(saved)
    bad["w1.weight_quantizer.round_offset"] = saved["w1.weight_quantizer.round_offset"] + 0.6
    with pytest.raises(AmctError, match=r"\[-0.5, 0.5\]"):
        _problem(n_calls=1, seed=2)[0].load_ptq_params(bad)
    bad["w1.weight_quantizer.round_offset"] = torch.zeros(3, 3)
    with pytest.raises(AmctError, match="shape"):
        _problem(n_calls=1, seed=2)[0].load_ptq_params(bad)


def test_cached_weight_follows_the_offset():
    lin = QuantLinear(torch.nn.Parameter(torch.randn(8, 16)), None, TensorSpec("int", 4, True, "channel"))
    lin.eval()
    with torch.no_grad():
        w0 = lin.quantized_weight().clone()
        lin.weight_quantizer.init_round_offset(lin.weight)
        lin.weight_quantizer.round_offset.fill_(0.5)
        assert not torch.equal(lin.quantized_weight(), w0)
