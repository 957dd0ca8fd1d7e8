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
    st = AutoRound(iters=120, fold_grid=False).apply(unit, UnitData(calls), SolveContext())
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
    AutoRound(iters=40, fold_grid=False).apply(unit, UnitData(calls), SolveContext())
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


# ----------------------------------------------------------------------------- batched experts
def _expert_set(n=7, wspec=TensorSpec("int", 3, False, "group", 16), aspec=None, seed=5, preclip=False):
    """``n`` float64 experts with 1-3 calls of 5-26 rows each (routing weights included),
    expert 1 with a per-channel up limit (smoothed), expert 4 with no call at all. ``preclip``:
    clip factors left by an earlier algorithm on every w1 and on expert 2's w2 only."""
    g = torch.Generator().manual_seed(seed)
    mods, datas = [], []
    for i in range(n):
        e = Expert(32, 48, 2.0, torch.float64)
        with torch.no_grad():
            for p in e.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
        q = QuantV4Expert(e, wspec, aspec)
        if i == 1:
            q.scale_up_limit(torch.rand(48, generator=g, dtype=torch.float64).float() + 0.5)
        for lin in ((q.w1, q.w2) if i == 2 else (q.w1,)) if preclip else ():
            c = lin.weight_quantizer.init_clip(lin.weight)
            with torch.no_grad():
                c.copy_(0.6 + 0.4 * torch.rand(c.shape, generator=g))
        calls = []
        for c in range(0 if i == 4 else 1 + i % 3):
            x = torch.randn(5 + 7 * ((i + c) % 4), 32, generator=g, dtype=torch.float64)
            w = torch.rand(x.shape[0], 1, generator=g, dtype=torch.float64).float()
            with torch.no_grad():
                calls.append(UnitCall((x, w), {}, Expert.forward(e, x, w)))   # the float target
        mods.append(q)
        datas.append(UnitData(calls))
    return mods, datas


def test_grouped_forward_is_each_experts_forward():
    """The batched forward (zero-padded rows, per-channel up limit on one expert, per-token
    int8 inputs) gives every expert its own forward's numbers."""
    mods, datas = _expert_set(4, TensorSpec("int", 4, True, "channel"), TensorSpec("int", 8, True, "token"))
    for m in mods:
        for lin in (m.w1, m.w2, m.w3):
            lin.input_quantizer.mode = "quant"
    assert QuantV4Expert.grouped_forward_blocker(mods) is None
    calls = [d.calls[0] for d in datas]
    T = max(c.args[0].shape[0] for c in calls)
    x = torch.zeros(4, T, 32, dtype=torch.float64)
    w = torch.zeros(4, T, 1)
    for e, c in enumerate(calls):
        x[e, :c.args[0].shape[0]], w[e, :c.args[0].shape[0]] = c.args
    with torch.no_grad():
        wq = {n: torch.stack([getattr(m, n).quantized_weight() for m in mods]) for n in ("w1", "w3", "w2")}
        out = QuantV4Expert.grouped_forward(mods, x, w, wq)
        for e, (m, c) in enumerate(zip(mods, calls)):
            r = c.args[0].shape[0]
            # fp32 SwiGLU inside (see test_batched_experts_equal_one_by_one): ulps, not more
            torch.testing.assert_close(out[e, :r], m(*c.args), rtol=1e-6, atol=1e-6)
            assert not bool(out[e, r:].any())     # padding rows stay zero
    # a static input scale is one per expert: the batched forward must refuse it
    static = _expert_set(2, TensorSpec("int", 4, True, "channel"), TensorSpec("int", 8, True, "tensor", dynamic=False))[0]
    for m in static:
        m.w1.input_quantizer.mode = "quant"
    assert "not per row" in QuantV4Expert.grouped_forward_blocker(static)


@pytest.mark.parametrize("wspec,lr,learn_clip", [(TensorSpec("int", 3, False, "group", 16), 1.0, True),
                                                  (TensorSpec("int", 4, True, "channel"), 1.5, False)],
                         ids=["int3-g16-asym-clip", "int4-channel-sym"])
def test_batched_experts_equal_one_by_one(wspec, lr, learn_clip):
    """AutoRound on 7 experts in chunks of 3 (stacked, one batched step for all) lands on the
    same offsets, clips and best steps as one expert at a time (float64 weights and calls), and
    the same losses to fp32 precision. The step size and evaluations make the experts' best
    steps differ, so a best state tracked for the chunk rather than per expert would fail this;
    so would dropping the routing weights, or ignoring a clip an earlier algorithm left."""
    mods, datas = _expert_set(wspec=wspec, preclip=not learn_clip)   # a clip kept fixed must still count
    one_by_one = copy.deepcopy(mods)
    algo = AutoRound(iters=24, lr=lr, eval_every=2, learn_clip=learn_clip, expert_chunk=3, fold_grid=False)
    units = [make_ptq_unit("expert", f"layers.0.ffn.experts.{i}", 0, m) for i, m in enumerate(mods)]
    batched = algo.apply_group(units, datas, SolveContext())
    single = AutoRound(iters=24, lr=lr, eval_every=2, learn_clip=learn_clip, expert_chunk=1, fold_grid=False)
    loop = [single.apply(make_ptq_unit("expert", f"layers.0.ffn.experts.{i}", 0, m), d, SolveContext())
            for i, (m, d) in enumerate(zip(one_by_one, datas))]
    assert batched[4] == loop[4] == {"skipped": "no calls"}
    assert len({r["best_step"] for r in loop if "best_step" in r}) > 1, "the experts' best steps should differ"
    for i, (b, r) in enumerate(zip(batched, loop)):
        if i == 4:
            continue
        assert b["batched_experts"] == 3      # chunks [0, 1, 2] and [3, 5, 6]
        for k in ("best_step", "n_offsets", "n_nonzero_offsets"):
            assert b[k] == r[k], (i, k)
        # the Expert's SwiGLU runs in fp32 (V4's own math) and torch's CPU silu rounds an element
        # by an ulp differently in its vectorised body and its tail: padded rows move elements
        # between the two, so the losses agree to fp32 precision, the offsets exactly
        assert b["loss_before"] == pytest.approx(r["loss_before"], rel=1e-6)
        assert b["loss_after"] == pytest.approx(r["loss_after"], rel=1e-6)
        assert b["loss_after"] <= b["loss_before"]    # best step 0 keeps the start (RTN)
    for m, r in zip(mods, one_by_one):
        for n in ("w1", "w2", "w3"):
            a, o = getattr(m, n).weight_quantizer, getattr(r, n).weight_quantizer
            assert (a.round_offset is None) == (o.round_offset is None)
            if a.round_offset is not None:
                assert torch.equal(a.round_offset, o.round_offset), n
            assert (a.clip is None) == (o.clip is None) and (a.clip is None or torch.equal(a.clip, o.clip)), n
        x = torch.randn(9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
        with torch.no_grad():
            assert torch.equal(m(x), r(x))    # the caches follow the written state


def test_batched_experts_fall_back_where_they_cannot_be_stacked():
    """A per-tensor weight scale is one per expert: stacked it would become one for the chunk.
    AutoRound then solves the experts one by one (no ``batched_experts`` in the result) with
    the same numbers as the per-expert path."""
    spec = TensorSpec("int", 4, True, "tensor")
    mods, datas = _expert_set(3, spec)
    ref = copy.deepcopy(mods)
    units = [make_ptq_unit("expert", f"e{i}", 0, m) for i, m in enumerate(mods)]
    res = AutoRound(iters=6, fold_grid=False).apply_group(units, datas, SolveContext())
    assert all("batched_experts" not in r for r in res)
    for m, r, d in zip(mods, ref, datas):
        AutoRound(iters=6, fold_grid=False).apply(make_ptq_unit("expert", "e", 0, r), d, SolveContext())
        assert torch.equal(m.w2.weight_quantizer.round_offset, r.w2.weight_quantizer.round_offset)


def _saved_bytes(module) -> int:
    return sum(v.numel() * v.element_size() for v in module.export_ptq_params().values())


@pytest.mark.parametrize("bits,sym,gran,group", [(3, True, "channel", None), (4, False, "group", 16), (8, True, "channel", None)],
                         ids=["int3-channel", "int4-g16-asym", "int8-channel"])
def test_fold_to_fixed_grid_is_the_same_function_in_codes(bits, sym, gran, group):
    """Folded (the default), a learned expert computes exactly what its offsets computed; it is
    saved as codes + scales (no float32 offset: several times fewer bytes) and reloads into a
    fresh float expert bit for bit. Batched experts fold alike."""
    spec = TensorSpec("int", bits, sym, gran, group)
    q, calls = _problem(n_calls=3, seed=3)
    q_off = copy.deepcopy(q)
    for m in (q, q_off):
        for lin in (m.w1, m.w2, m.w3):
            lin.weight_quantizer = WeightQuantizer(spec)
    st = AutoRound(iters=30).apply(make_ptq_unit("expert", "e", 0, q), UnitData(calls), SolveContext())
    st_off = AutoRound(iters=30, fold_grid=False).apply(make_ptq_unit("expert", "e", 0, q_off), UnitData(calls), SolveContext())
    assert st["folded_leaves"] == 3 and st_off["folded_leaves"] == 0
    assert st["loss_after"] == st_off["loss_after"] < st["loss_before"]
    x = torch.cat([c.args[0] for c in calls])
    with torch.no_grad():
        assert torch.equal(q(x), q_off(x))
    saved, saved_off = q.export_ptq_params(), q_off.export_ptq_params()
    assert not any(k.endswith("round_offset") for k in saved)
    assert {"w1.weight_codes", "w1.weight_quantizer.scale"} <= saved.keys()
    assert "w1.weight_quantizer.round_offset" in saved_off
    assert _saved_bytes(q) * 3 < _saved_bytes(q_off)
    fresh, _ = _problem(n_calls=3, seed=3)
    for lin in (fresh.w1, fresh.w2, fresh.w3):
        lin.weight_quantizer = WeightQuantizer(spec)
    fresh.load_ptq_params(saved)
    with torch.no_grad():
        assert torch.equal(fresh(x), q(x))
    # the batched experts fold too, each to the state its own offsets gave
    mods, datas = _expert_set(3, spec)
    ref = copy.deepcopy(mods)
    units = [make_ptq_unit("expert", f"e{i}", 0, m) for i, m in enumerate(mods)]
    res = AutoRound(iters=16).apply_group(units, datas, SolveContext())
    assert sum(st["folded_leaves"] for st in res) > 0
    for m, r, d, st in zip(mods, ref, datas, res):
        AutoRound(iters=16, fold_grid=False).apply(make_ptq_unit("expert", "e", 0, r), d, SolveContext())
        moved = sum(getattr(r, n).weight_quantizer.round_offset is not None for n in ("w1", "w2", "w3"))
        assert st["folded_leaves"] == moved and st["batched_experts"] == 3
        with torch.no_grad():
            assert torch.equal(m(x.double()), r(x.double()))


def test_fold_refused_where_the_folded_weight_would_differ(monkeypatch):
    """The fold is checked: where re-quantizing the folded weight would not give the same
    fake-quant weight, the leaf keeps its offset (and its function)."""
    from amct_ext.algorithms import rounding

    q, calls = _problem(n_calls=2, seed=4)
    AutoRound(iters=10, fold_grid=False).apply(make_ptq_unit("expert", "e", 0, q), UnitData(calls), SolveContext())
    before = q.w1.quantized_weight().clone()
    real = formats.fake_quant_with_qparams
    monkeypatch.setattr(rounding.formats, "fake_quant_with_qparams", lambda w, *a: real(w, *a) * 1.0001)
    assert rounding.fold_to_fixed_grid(q.w1) is False
    assert q.w1.weight_quantizer.round_offset is not None and q.w1.weight_quantizer.fixed_scale is None
    assert not getattr(q.w1, "weight_replaced", False)
    assert torch.equal(q.w1.quantized_weight(), before)
