"""Block-wise SignRound (``blockround``): one layer's leaves tuned together against its output.

- on a block of one unit with one calibration sample it IS the per-unit AutoRound (the same
  offsets and clips after the same steps, float64), so the two share one definition;
- on a block of two units it lowers the block's loss and never ends above its start;
- the recipe keeps it last; the workflow refuses what it cannot serve (a sharded layer, a
  torchrun hand-off without the float stream) before any layer is built;
- with ``propagate=quant`` its targets are the float MODEL's outputs (target=float_model) or
  the float layer on the quantized inputs (target=float_layer), each checked against a float
  forward computed here;
- a tiny-model run saves every unit, and the saved parameters give back the run's PTQ PPL.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from amct_ext.algorithms import SolveContext, UnitData
from amct_ext.algorithms.base import BlockData
from amct_ext.algorithms.block_rounding import BlockRound
from amct_ext.algorithms.recipe import RecipeError, parse_algo
from amct_ext.algorithms.rounding import AutoRound
from amct_ext.errors import ConfigError
from amct_ext.pipeline.capture import UnitCall
from amct_ext.pipeline.ptq_units import make_ptq_unit
from amct_ext.quant.schemes import TensorSpec
from models.deepseek_v4.modeling import Expert
from models.deepseek_v4.quant_module import QuantV4Expert
from tests.export_helpers import TINY

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = TensorSpec("int", 3, False, "group", 16)


def _expert(seed: int, dim=32, inter=48, dtype=torch.float64) -> QuantV4Expert:
    g = torch.Generator().manual_seed(seed)
    e = Expert(dim, inter, 10.0, dtype)
    with torch.no_grad():
        for p in e.parameters():
            p.copy_((torch.randn(p.shape, generator=g) * 0.3).to(dtype))
    return QuantV4Expert(e, SPEC, None)


def _inputs(n, seed=7, dim=32, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g) / 4 + torch.eye(dim)
    return [(torch.randn(40, dim, generator=g) @ mix).to(dtype) for _ in range(n)]


def _offsets(q):
    return {n: (getattr(q, n).weight_quantizer.round_offset.detach().clone(),
                getattr(q, n).weight_quantizer.clip.detach().clone()) for n in ("w1", "w2", "w3")}


def test_one_unit_one_sample_is_the_per_unit_autoround():
    """The same problem both ways: AutoRound on the unit's one call, BlockRound on a 'layer' that is
    that unit, its one sample and the same float target. Equal offsets and clips, every step's
    sign decision included (float64: no reduction-order ties)."""
    from models.deepseek_v4.quant_module import set_quant_enabled

    x = _inputs(1)[0]
    a, b = _expert(1), _expert(1)
    with torch.no_grad():
        set_quant_enabled(a, False)
        target = a(x)
        set_quant_enabled(a, True)
    settings = dict(iters=30, eval_every=5, fold_grid=False)
    ua = make_ptq_unit("expert", "layers.0.ffn.experts.0", 0, a)
    ra = AutoRound(**settings).apply(ua, UnitData([UnitCall((x,), {}, target)]), SolveContext())
    ub = make_ptq_unit("expert", "layers.0.ffn.experts.0", 0, b)
    rb = BlockRound(batch=1, **settings).apply_block(
        BlockData(units=[ub], inputs=[x], states=[{}], targets=[target], forward=lambda xx, st: b(xx)))
    rb = rb[ub.name]
    assert ra["loss_after"] < 0.9 * ra["loss_before"], ra      # it learned something to compare
    assert rb["layer_loss_before"] == pytest.approx(ra["loss_before"], rel=1e-12)
    assert rb["layer_loss_after"] == pytest.approx(ra["loss_after"], rel=1e-12)
    assert rb["best_step"] == ra["best_step"]
    oa, ob = _offsets(a), _offsets(b)
    for n in oa:
        assert torch.equal(oa[n][0], ob[n][0]), n
        assert torch.equal(oa[n][1], ob[n][1]), n


class _TwoUnits(nn.Module):
    """A 'layer' of two experts in sequence with a residual: the second unit sees the first's
    error, which only a joint (block) objective can compensate."""

    def __init__(self):
        super().__init__()
        self.e0, self.e1 = _expert(3, dtype=torch.float32), _expert(4, dtype=torch.float32)

    def forward(self, x):
        h = x + self.e0(x)
        return h + self.e1(h)


def test_block_loss_falls_and_never_ends_above_its_start():
    from models.deepseek_v4.quant_module import set_quant_enabled

    m = _TwoUnits()
    xs = _inputs(6, dtype=torch.float32)
    with torch.no_grad():
        set_quant_enabled(m, False)
        ys = [m(x) for x in xs]
        set_quant_enabled(m, True)
    units = [make_ptq_unit("expert", f"layers.0.ffn.experts.{k}", 0, getattr(m, f"e{k}")) for k in (0, 1)]
    data = BlockData(units=units, inputs=xs, states=[{}] * len(xs), targets=ys, forward=lambda x, st: m(x))
    r = BlockRound(iters=40, batch=3).apply_block(data)
    st = r[units[0].name]
    assert st == {**r[units[1].name], "n_offsets": st["n_offsets"], "n_nonzero_offsets": st["n_nonzero_offsets"],
                  "folded_leaves": st["folded_leaves"]}         # one layer loss, shared
    assert st["layer_loss_after"] < 0.8 * st["layer_loss_before"], st
    assert st["folded_leaves"] == 3 and r[units[1].name]["folded_leaves"] == 3    # codes on fixed grids
    with torch.no_grad():   # the kept state is what the stats say (folded: same fake-quant weights)
        mse = sum(float((m(x) - y).square().sum()) for x, y in zip(xs, ys)) / sum(y.numel() for y in ys)
    assert mse == pytest.approx(st["layer_loss_after"], rel=1e-5)
    # a step size that only makes things worse: the start state is kept, bit for bit
    m2 = _TwoUnits()
    before = {k: v.clone() for k, v in m2.state_dict().items()}
    units2 = [make_ptq_unit("expert", f"layers.0.ffn.experts.{k}", 0, getattr(m2, f"e{k}")) for k in (0, 1)]
    r2 = BlockRound(iters=3, batch=6, lr=0.5, learn_clip=False).apply_block(
        BlockData(units=units2, inputs=xs, states=[{}] * 6, targets=ys, forward=lambda x, st: m2(x)))
    st2 = r2[units2[0].name]
    assert st2["layer_loss_after"] <= st2["layer_loss_before"]
    if st2["best_step"] == 0:
        assert all(torch.equal(before[k], v) for k, v in m2.state_dict().items())
        for q in (m2.e0, m2.e1):
            assert all(getattr(q, n).weight_quantizer.round_offset is None for n in ("w1", "w2", "w3"))


def test_keep_best_false_keeps_the_end_or_the_start():
    """keep_best=False evaluates the start and the end only: where the end is the best state
    anyway (a small steady step) it gives the very state keep_best=True gives; where the end is
    worse than the start (one step of 5: every offset to +-0.5, every clip to a bound) the start
    comes back, bit for bit."""
    from models.deepseek_v4.quant_module import set_quant_enabled

    xs = _inputs(4, dtype=torch.float32)
    runs = []
    for keep, lr, iters in ((True, 0.0, 10), (False, 0.0, 10), (False, 5.0, 1)):
        m = _TwoUnits()
        start = {k: v.clone() for k, v in m.state_dict().items()}
        with torch.no_grad():
            set_quant_enabled(m, False)
            ys = [m(x) for x in xs]
            set_quant_enabled(m, True)
        units = [make_ptq_unit("expert", f"layers.0.ffn.experts.{k}", 0, getattr(m, f"e{k}")) for k in (0, 1)]
        st = BlockRound(iters=iters, batch=2, lr=lr, keep_best=keep, fold_grid=False).apply_block(
            BlockData(units=units, inputs=xs, states=[{}] * 4, targets=ys, forward=lambda x, st, m=m: m(x)))
        runs.append((m, start, st[units[0].name]))
    (m_a, _, st_a), (m_b, _, st_b), (m_c, start_c, st_c) = runs
    assert st_a["best_step"] == 10 and st_b["best_step"] == 10     # the end was the best: same state
    assert st_b["layer_loss_after"] == st_a["layer_loss_after"]
    for k, v in m_a.state_dict().items():
        assert torch.equal(v, m_b.state_dict()[k]), k
    assert st_c["best_step"] == 0 and st_c["layer_loss_after"] == st_c["layer_loss_before"]
    for q in (m_c.e0, m_c.e1):
        for n in ("w1", "w2", "w3"):
            wq = getattr(q, n).weight_quantizer
            assert wq.round_offset is None
            assert torch.equal(wq.clip, torch.ones_like(wq.clip))


def test_recompute_gives_the_same_state():
    """Activation checkpointing per unit (``recompute``, for a real-size layer's memory) and the
    samples copied a step ahead (``prefetch``) change where tensors live, not the numbers: the
    same offsets and clips."""
    from models.deepseek_v4.quant_module import set_quant_enabled

    xs = _inputs(4, dtype=torch.float32)
    states = []
    for recompute, units, ahead in ((False, False, True), (True, True, True), (True, False, True),
                                    (True, False, False)):
        m = _TwoUnits()
        with torch.no_grad():
            set_quant_enabled(m, False)
            ys = [m(x) for x in xs]
            set_quant_enabled(m, True)
        units = [make_ptq_unit("expert", f"layers.0.ffn.experts.{k}", 0, getattr(m, f"e{k}")) for k in (0, 1)]
        BlockRound(iters=12, batch=2, fold_grid=False, recompute=recompute, recompute_units=units,
                   prefetch=ahead).apply_block(
            BlockData(units=units, inputs=xs, states=[{}] * 4, targets=ys, forward=lambda x, st, m=m: m(x)))
        states.append({**_offsets(m.e0), **{f"e1.{k}": v for k, v in _offsets(m.e1).items()}})
        assert "forward" not in m.e0.__dict__ and "forward" not in m.e1.__dict__   # unpatched after
    for other in states[1:]:
        assert states[0].keys() == other.keys()
        for k in states[0]:
            assert torch.equal(states[0][k][0], other[k][0]), k
            assert torch.equal(states[0][k][1], other[k][1]), k
    assert any(bool(v[0].any()) for v in states[0].values())


def test_each_batch_is_fetched_one_batch_ahead_in_draw_order(monkeypatch):
    """``prefetch``: batch t+1's copies are issued before batch t is handed to its step (so they
    overlap it), every batch exactly once, in the order drawn; without it, each on demand."""
    from amct_ext.algorithms import block_rounding as br

    log = []

    class Recorded:
        def __init__(self, tensors, device):
            self.tensors = list(tensors)
            log.append(("fetch", [int(t[0]) for t in self.tensors]))

        def get(self):
            return self.tensors

    monkeypatch.setattr(br.devmod, "CopiesAhead", Recorded)
    xs = [torch.full((1,), float(k)) for k in range(6)]
    data = BlockData(units=[], inputs=xs, states=[{}] * 6, targets=xs, forward=lambda x, st: x)
    draws = [[4, 1], [0, 5], [2, 3]]
    for ahead, expected in ((True, ["f0", "f1", "u0", "f2", "u1", "u2"]), (False, ["f0", "u0", "f1", "u1", "f2", "u2"])):
        log.clear()
        loss = br._LayerLoss(data, [], [], batch=2, ahead=ahead)
        for ks, fetched in loss.batches(iter(draws)):
            log.append(("use", ks))
            assert [int(t[0]) for t in fetched.get()] == ks + ks      # inputs then targets of ks
        names = [("f" if kind == "fetch" else "u") + str(draws.index(ks[:2] if kind == "fetch" else ks))
                 for kind, ks in log]
        assert names == expected, ahead


def test_recipe_keeps_the_block_algorithm_last():
    r = parse_algo("hclip,blockround:iters=5")
    assert r.block_algorithm is not None and r.block_algorithm.iters == 5
    assert r.unit_recipe().names == ["hclip"]
    assert parse_algo("blockround").unit_recipe().names == ["rtn"]
    with pytest.raises(RecipeError, match="must be the last entry"):
        parse_algo("blockround,gptq")
    with pytest.raises(RecipeError, match="two block-level"):
        parse_algo("blockround,blockround")
    with pytest.raises(RecipeError, match="target"):
        parse_algo("blockround:target=float")
    with pytest.raises(ConfigError, match="runs through the workflow"):
        BlockRound().apply(None, UnitData([]), SolveContext())


# ----------------------------------------------------------------------------- the workflow
SEQ = 64


def _adapter(path):
    from amct_ext.base import RunConfig
    from models.deepseek_v4.adapter import DeepseekV4Adapter

    return DeepseekV4Adapter(RunConfig(path, device="cpu", dtype=torch.float32, progress=False))


@pytest.fixture(scope="module")
def calib_text(tmp_path_factory):
    from amct_ext.pipeline.calibration import DEFAULT_CALIBRATION_PATH

    p = tmp_path_factory.mktemp("bc") / "calib.txt"
    p.write_text(DEFAULT_CALIBRATION_PATH.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    return p


def _spec(calib_text, algo, propagate, scheme="w4a16-g128"):
    from amct_ext.base import PtqConfig
    from amct_ext.pipeline.ptq_spec import PtqSpec
    from amct_ext.quant.schemes import load_scheme

    return PtqSpec(load_scheme(scheme), ["attn-linear", "moe"], PtqConfig(n_samples=2, seq_len=SEQ, calib_path=calib_text),
                   recipe=algo, propagate=propagate)


@pytest.mark.parametrize("target", ["float_model", "float_layer"])
def test_targets_are_the_float_model_or_the_float_layer(tmp_path, calib_text, monkeypatch, target):
    """Layer 1's targets under propagate=quant, recorded from inside the block stage, against
    forwards computed here: the float model's layer-1 output, or the float layer 1 on the
    quantized layer 0's output (the inputs the stage gets)."""
    from amct_ext.pipeline.workflow import embed_stream, load_calib_windows, run_blockwise_ptq

    seen = {}
    real = BlockRound.apply_block

    def spy(self, data):
        seen[data.layer_idx] = ([x.clone() for x in data.inputs], [y.clone() for y in data.targets])
        return real(self, data)

    monkeypatch.setattr(BlockRound, "apply_block", spy)
    spec = _spec(calib_text, f"blockround:iters=3:target={target}", "quant")
    with _adapter(TINY) as a:
        run_blockwise_ptq(a, spec, tmp_path / "run", layers=range(0, 2))
        windows = load_calib_windows(a, spec.resolved().calibration)
        stream = embed_stream(a, windows, 1)
        f0 = a.block(0)
        float0 = a.do_block_forward(f0, stream.hidden, stream.state)
        f1 = a.block(1)
        float1 = a.do_block_forward(f1, float0, stream.state)
        float1_on_q = a.do_block_forward(f1, seen[1][0], stream.state)
    xs1, ys1 = seen[1]
    assert not torch.allclose(xs1[0], float0[0])                  # layer 1 reads the quantized layer 0
    want, other = (float1, float1_on_q) if target == "float_model" else (float1_on_q, float1)
    for y, w, o in zip(ys1, want, other):
        assert torch.allclose(y, w, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(y, o, atol=1e-5, rtol=1e-5)
    for y, w in zip(seen[0][1], float0):                           # layer 0: one stream
        assert torch.allclose(y, w, atol=1e-5, rtol=1e-5)


def test_refused_before_any_layer_where_it_cannot_run(tmp_path, calib_text):
    from amct_ext.pipeline.workflow import LayerSlice, PtqRuntime, Stream, run_blockwise_ptq

    with _adapter(TINY) as a:
        with pytest.raises(ConfigError, match="sharded layer"):
            run_blockwise_ptq(a, _spec(calib_text, "blockround", "quant"), tmp_path / "s",
                              runtime=PtqRuntime(sharded=True), layers=range(0, 1))
        x = [torch.zeros(1, SEQ, 1, 1)]
        with pytest.raises(ConfigError, match="float model's stream"):
            run_blockwise_ptq(a, _spec(calib_text, "blockround", "quant"), tmp_path / "t", layers=range(1, 2),
                              part=LayerSlice(start=(1, Stream(x, [{}]))))


def test_a_block_stage_larger_than_the_device_is_refused_before_any_layer(tmp_path, calib_text, monkeypatch):
    """The experts' weights (counted from the config) and their offsets alone over the device's
    memory: one ConfigError naming the layer, the sizes and the way out, before the calibration
    stream is embedded; at the bound's edge (and without a known device size) the run is not refused.
    The bound is the V4-Pro case: 25.4 G expert weights, 94.7 GiB in bf16 with float16 offsets."""
    from amct_ext.errors import ConfigError as CE
    from amct_ext.pipeline import workflow
    from amct_ext.pipeline.workflow import run_blockwise_ptq
    from models.deepseek_v4.cost import v4_target_weight_count

    with _adapter(TINY) as a:
        n = sum(v4_target_weight_count(a.config, 0, "moe") for _ in (0,))
        per = 4 + 2                               # fp32 weights (the tiny run) + float16 offsets
        assert n == a.config.n_routed_experts * 3 * a.config.dim * a.config.moe_inter_dim + 3 * a.config.dim * \
            a.config.moe_inter_dim * a.config.n_shared_experts

        def embed(*args, **kwargs):
            raise AssertionError("embedded before the refusal")

        monkeypatch.setattr(workflow, "embed_stream", embed)
        for total in (n * per - 1, n * per // 2):
            monkeypatch.setattr(workflow.devmod, "total_memory_bytes", lambda dev=None, _t=total: _t)
            with pytest.raises(CE, match=r"layer 0's block stage \('blockround'\) holds at least .* GiB .*"
                                         r"--algo hclip,gptq:sequential=false"):
                run_blockwise_ptq(a, _spec(calib_text, "hclip,blockround:offset_dtype=float16:turns=1", "quant"),
                                  tmp_path / "r", layers=range(0, 2))
        stage = workflow.BlockStage(parse_algo("blockround:offset_dtype=float16:turns=1").block_algorithm, "quant", 0)
        spec = _spec(calib_text, "blockround", "quant").resolved()
        for total in (n * per, None):
            monkeypatch.setattr(workflow.devmod, "total_memory_bytes", lambda dev=None, _t=total: _t)
            stage.check_device_memory(a, "r", spec.scheme, spec.targets, range(0, 2))     # not refused
        # float32 offsets hold 2 bytes more a weight; attention-only targets count nothing here
        monkeypatch.setattr(workflow.devmod, "total_memory_bytes", lambda dev=None: n * per)
        stage32 = workflow.BlockStage(parse_algo("blockround:turns=1").block_algorithm, "quant", 0)
        with pytest.raises(CE, match="block stage"):
            stage32.check_device_memory(a, "r", spec.scheme, spec.targets, range(0, 1))
        stage32.check_device_memory(a, "r", spec.scheme, ("attn-linear",), range(0, 1))
        # blockround that cannot go in turns (keep_best) keeps that bound, and says how it could;
        # one that can (turns asked for by number, or turns=0 with keep_best=false) holds at least
        # the weights, every expert's back on the device at the end: refused only under that
        default = workflow.BlockStage(parse_algo("blockround").block_algorithm, "quant", 0)
        with pytest.raises(CE, match=r"block stage.*go in turns where the device needs it: --algo blockround:keep_best=false"):
            default.check_device_memory(a, "r", spec.scheme, spec.targets, range(0, 1))
        for algo in ("blockround:offset_dtype=float16:keep_best=false:turns=4", "blockround:keep_best=false"):
            turned = workflow.BlockStage(parse_algo(algo).block_algorithm, "quant", 0)
            monkeypatch.setattr(workflow.devmod, "total_memory_bytes", lambda dev=None: n * 4)
            turned.check_device_memory(a, "r", spec.scheme, spec.targets, range(0, 1))
            monkeypatch.setattr(workflow.devmod, "total_memory_bytes", lambda dev=None: n * 4 - 1)
            with pytest.raises(CE, match=r"block stage.* at 4 bytes each.*for this model \(e.g. [^;]*\)$"):
                turned.check_device_memory(a, "r", spec.scheme, spec.targets, range(0, 1))


def test_a_tiny_run_saves_every_unit_and_its_params_give_back_its_ppl(tmp_path, calib_text, wiki_test_raw):
    from amct_ext.base import EvalConfig
    from amct_ext.pipeline.workflow import PARAMS_DIR, evaluate_blockwise, load_eval_windows, run_blockwise_ptq

    spec = _spec(calib_text, "hclip,blockround:iters=6", "quant", scheme="w3a16-g128")
    ecfg = EvalConfig(seq_len=SEQ, max_windows=2, batch_size=2, data_path=wiki_test_raw)
    with _adapter(TINY) as a:
        res = run_blockwise_ptq(a, spec, tmp_path / "run")
        saved = sorted((tmp_path / "run" / PARAMS_DIR).glob("layer_*.pt"))
        assert len(saved) == len(res.units) == len({u.name for u in res.units}), [p.name for p in saved]
        stats = [u.stats["blockround"] for u in res.units]
        assert all(s["layer_loss_after"] <= s["layer_loss_before"] for s in stats)
        assert any(s["layer_loss_after"] < 0.99 * s["layer_loss_before"] for s in stats)
        assert all(u.loss_after is None for u in res.units)
        win = load_eval_windows(a, ecfg)
        ptq = evaluate_blockwise(a, win, ecfg, "ptq", scheme=spec.scheme, targets=spec.targets,
                                 params_dir=tmp_path / "run" / PARAMS_DIR).ppl
        rtn = evaluate_blockwise(a, win, ecfg, "rtn", scheme=spec.scheme, targets=spec.targets).ppl
        # a second run on the same folder resumes every layer (nothing solved again)
        again = run_blockwise_ptq(a, spec, tmp_path / "run")
        assert all(u.resumed for u in again.units)
        ptq2 = evaluate_blockwise(a, win, ecfg, "ptq", scheme=spec.scheme, targets=spec.targets,
                                  params_dir=tmp_path / "run" / PARAMS_DIR).ppl
    assert ptq == ptq2
    assert ptq != rtn


def test_v4_samples_concatenate_into_one_block_call(calib_text):
    """``concat_samples``: one call on the joined samples is each sample's call, joined (a hash-
    routed layer reads input_ids row by row); what it cannot join is None, never a wrong batch."""
    from amct_ext.pipeline.workflow import embed_stream, load_calib_windows

    spec = _spec(calib_text, "blockround", "quant").resolved()
    with _adapter(TINY) as a:
        stream = embed_stream(a, load_calib_windows(a, spec.calibration), 1)
        joined = a.concat_samples(stream.hidden, stream.state)
        assert joined is not None and joined[0].shape[0] == len(stream.hidden)
        assert "input_ids" in joined[1]
        for i in (0, 2):   # layer 0 routes by hash, layer 2 by score
            blk = a.block(i)
            with torch.no_grad():
                one = a.block_forward_sample(blk, *joined)
                each = torch.cat(a.do_block_forward(blk, stream.hidden, stream.state))
            assert torch.allclose(one, each, atol=1e-5, rtol=1e-5), i
        assert a.concat_samples(stream.hidden, [{**stream.state[0], "other": 1}] + stream.state[1:]) is None
        short = [stream.hidden[0], stream.hidden[1][:, :8]]
        assert a.concat_samples(short, stream.state[:2]) is None


@pytest.mark.parametrize("name, weights_g, gib, weights_gib, parked_gib",
                         [("flash", 6.47, 24.1, 12.0, 3.2), ("pro", 25.43, 94.7, 47.4, 12.6)])
def test_the_released_configs_expert_counts(tmp_path, name, weights_g, gib, weights_gib, parked_gib):
    """The figures casebook i34-6, i34-17 and i34-23 quote: the experts' weights of a V4-Flash /
    V4-Pro layer from the shipped official config.json, what blockround (bf16, float16 offsets)
    holds for them at least in one turn or where it cannot go in turns (keep_best), and where it
    can (the weights alone: every expert is back on the device at the stage's end); and what their
    float weights take parked on the host in turns, in the release's FP4 format (a HostStack's
    bytes a weight, measured on a stack of that format)."""
    import shutil

    from models.deepseek_v4.cost import v4_target_weight_count
    from models.deepseek_v4.loading import load_config
    from tests.conftest import CONFIGS

    shutil.copy(CONFIGS / f"deepseek-v4-{name}.config.json", tmp_path / "config.json")
    n = v4_target_weight_count(load_config(tmp_path), 0, "moe")
    assert round(n / 1e9, 2) == weights_g
    for turns in (0, 1):
        assert round(n * BlockRound(offset_dtype="float16", turns=turns).block_bytes_per_weight(2) / 2 ** 30, 1) == gib
    for turns in (0, 11):
        algo = BlockRound(offset_dtype="float16", keep_best=False, turns=turns)
        assert round(n * algo.block_bytes_per_weight(2) / 2 ** 30, 1) == weights_gib
    assert v4_target_weight_count(load_config(tmp_path), 0, "attn-linear") == 0
    from tests.test_host_stack import _release_like
    from amct_ext.io.host_stack import HostStack

    sample = HostStack(_release_like())
    assert sample.compact and round(n * sample.nbytes() / _release_like().numel() / 2 ** 30, 1) == parked_gib
