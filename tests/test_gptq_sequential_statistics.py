"""Sequential GPTQ without stored calls (issue 24): stage 0 from the capture's Hessians, each
later stage from a re-run of the layer with the earlier stages quantized, the layer's units
solved downstream first. Oracle: the stored-calls path, which replays each unit's float calls
with its earlier stages quantized (the definition of the sequential stages)."""
import copy

import pytest
import torch

from amct_ext.algorithms.hessians import HessianCollector
from amct_ext.algorithms.recipe import RecipeError, parse_algo
from amct_ext.algorithms.runner import run_recipe_on_units
from amct_ext.pipeline.capture import capture_unit_io
from amct_ext.pipeline.phases import PhaseTimer
from amct_ext.pipeline.ptq_spec import PtqSpec
from amct_ext.pipeline.ptq_units import make_ptq_unit, parallel_groups
from amct_ext.pipeline.workflow import PARAMS_DIR, PtqRuntime, load_calib_windows, run_blockwise_ptq
from amct_ext.quant.schemes import QuantScheme, load_scheme

from tests.test_hessian_capture import (PTQ, TARGETS, W4G32, _collect, _forward, _layer, assert_same_saved_params,
                                        saved_params, units_params_equal)

pytestmark = pytest.mark.usefixtures("one_thread")


def _rerun(block, x, ids, log):
    """The workflow's LayerRerun for a bare block: quantization on in ``units`` only."""
    from models.deepseek_v4.quant_module import set_quant_enabled

    def recollect(units, leaves):
        log.append({k: set(v) for k, v in leaves.items()})
        set_quant_enabled(block, False)
        for u in units:
            set_quant_enabled(u.module, True)
        col = HessianCollector(units, only=leaves).attach(block)
        try:
            _forward(block, x, ids)
        finally:
            col.detach()
            set_quant_enabled(block, True)
        col.release()
        return {u.name: col.stats(u.name) for u in units}
    return recollect


def test_capture_records_each_leafs_stage():
    """Stages = the unit's input tensors in order of first use: x -> qr -> wo_a's output for the
    attention (attn-linear), x -> SwiGLU rows for every expert (grouped path and module calls)."""
    block, units, x, ids = _layer(torch.float32)
    col, _ = _collect(block, units, x, ids, grouped=True)
    attn = col.stats(units[0].name)
    assert {k: v.stage for k, v in attn.items()} == {"wq_a": 0, "wkv": 0, "wq_b": 1, "indexer.wq_b": 1, "wo_b": 2}
    for u in units[1:]:
        assert {k: v.stage for k, v in col.stats(u.name).items()} == {"w1": 0, "w3": 0, "w2": 1}, u.name
    loop, _ = _collect(block, units, x, ids, grouped=False)
    for u in units:
        assert {k: v.stage for k, v in loop.stats(u.name).items()} == \
            {k: v.stage for k, v in col.stats(u.name).items()}, u.name


def test_a_leaf_first_seen_after_the_first_call_comes_last():
    """Recording stops after the unit's first call (no activation kept); a leaf reached only
    later gets a stage after every recorded one, never stage 0 (casebook i24-sq2)."""
    from amct_ext.algorithms.hessians import _UnitStats

    lin = torch.nn.Linear(4, 4)
    st = _UnitStats()
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    st.feed("a", lin, x)
    st.feed("b", lin, x)
    st.feed("c", lin, y)
    st.stop_recording()
    st.feed("late", lin, torch.randn(3, 4))
    assert {k: v.stage for k, v in st.by_leaf.items()} == {"a": 0, "b": 0, "c": 1, "late": 2}
    assert st.by_leaf["a"] is st.by_leaf["b"] and st._inputs == []


def test_only_collects_the_named_leaves():
    block, units, x, ids = _layer(torch.float32)
    experts = [u for u in units if u.kind == "expert"]
    only = {units[0].name: {"wo_b"}, **{u.name: {"w2"} for u in experts}}
    col, _ = _collect(block, units, x, ids, grouped=True)
    part = HessianCollector(units, only=only).attach(block)
    try:
        _forward(block, x, ids)
    finally:
        part.detach()
    assert set(part.stats(units[0].name)) == {"wo_b"}
    assert all(set(part.stats(u.name)) == {"w2"} for u in experts)
    assert part.stats(units[-1].name) == {}                    # the shared expert: nothing asked
    for u in experts:
        a, b = part.stats(u.name)["w2"], col.stats(u.name)["w2"]
        assert a.n == b.n and (a.n == 0 or torch.equal(a.H, b.H))
    assert torch.equal(part.stats(units[0].name)["wo_b"].H, col.stats(units[0].name)["wo_b"].H)


def test_parallel_groups():
    m = torch.nn.Identity()
    block, units, _, _ = _layer(torch.float32)
    groups = parallel_groups(units)
    assert [len(g) for g in groups] == [1, len(units) - 1]    # the attention; routed + shared experts
    plain = [make_ptq_unit(k, f"u{i}", 0, m) for i, k in enumerate(["attn", "expert", "expert", "mlp"])]
    assert [[u.name for u in g] for g in parallel_groups(plain)] == [["u0"], ["u1", "u2"], ["u3"]]


@pytest.mark.parametrize("scheme", ["w4g32", "w8a8"])
def test_sequential_gptq_on_statistics_equals_replayed_calls(scheme):
    """Bit for bit: the statistics path (grouped capture, 3 re-runs of the layer) and the stored
    calls (loop-path capture, each unit's calls replayed with its earlier stages quantized)."""
    from models.deepseek_v4.quant_module import iter_block_ptq_units, set_quant_enabled

    block, units, x, ids = _layer(torch.float32, scheme=None if scheme == "w4g32" else load_scheme(scheme))
    twin, third = copy.deepcopy(block), copy.deepcopy(block)
    twin_units = list(iter_block_ptq_units(twin, 1, TARGETS))
    recipe = parse_algo("gptq")
    assert not recipe.needs().calls                 # sequential GPTQ stores no call now
    col, _ = _collect(block, units, x, ids, grouped=True)
    col.release()
    captured = {u.name: col.stats(u.name) for u in units}
    set_quant_enabled(block, True)
    log: list = []
    rs = run_recipe_on_units(units, {}, recipe, device=torch.device("cpu"), seed=0, hessians=captured,
                             recollect=_rerun(block, x, ids, log))
    # downstream first: the experts' w2 (one re-run for all of them and the shared expert), then
    # the attention's stages 1 and 2
    assert len(log) == 3
    assert set(log[0]) == {u.name for u in units[1:]} and all(v == {"w2"} for v in log[0].values())
    assert log[1] == {units[0].name: {"wq_b", "indexer.wq_b"}} and log[2] == {units[0].name: {"wo_b"}}
    assert rs[0].stats["gptq"]["recollect_forwards"] == 3 and rs[0].stats["gptq"]["hessian"] == "sequential"
    # the last reader consumed the capture's Hessians (freed as solved)
    assert all(ls.H is None for st in captured.values() for ls in st.values())
    twin.ffn.grouped = False
    calls, _ = capture_unit_io(twin_units, lambda: _forward(twin, x, ids))
    set_quant_enabled(twin, True)
    rt = run_recipe_on_units(twin_units, calls, recipe, device=torch.device("cpu"), seed=0, guard=False)
    assert rt[0].stats["gptq"]["hessian"] == "sequential, replayed calls"
    assert units_params_equal(units, twin_units) > 20
    # the sequential Hessians are not the float ones: sequential=false gives other weights
    third_units = list(iter_block_ptq_units(third, 1, TARGETS))
    c3, _ = _collect(third, third_units, x, ids, grouped=True)
    set_quant_enabled(third, True)
    run_recipe_on_units(third_units, {}, parse_algo("gptq:sequential=false"), device=torch.device("cpu"), seed=0,
                        hessians={u.name: c3.stats(u.name) for u in third_units})
    with pytest.raises(AssertionError):
        units_params_equal(units, third_units)


def test_sequential_on_statistics_without_a_rerun_says_so():
    block, units, x, ids = _layer(torch.float32)
    col, _ = _collect(block, units, x, ids, grouped=True)
    from models.deepseek_v4.quant_module import set_quant_enabled

    set_quant_enabled(block, True)
    with pytest.raises(RecipeError, match="recollect"):
        run_recipe_on_units(units, {}, parse_algo("gptq"), device=torch.device("cpu"), seed=0,
                            hessians={u.name: col.stats(u.name) for u in units})


def test_workflow_sequential_gptq_stores_no_calls_and_equals_stored_calls(tiny_adapter, tmp_path, monkeypatch):
    """run_blockwise_ptq with ``gptq``: no call captured, the layer re-run once per later stage,
    parameters equal to those of stored calls (bit for bit), also in several Hessian passes."""
    import amct_ext.pipeline.capture_modes as wf   # where the capture modes call these
    from amct_ext.algorithms.hessians import estimated_hessian_bytes

    calib = load_calib_windows(tiny_adapter, PTQ)
    recipe = parse_algo("gptq")
    scheme = QuantScheme.from_dict(W4G32)
    spec = PtqSpec(scheme, TARGETS, PTQ, recipe=recipe, guard=False)
    run_blockwise_ptq(tiny_adapter, spec, tmp_path / "calls", layers=range(1, 2), calib_windows=calib,
                      runtime=PtqRuntime(statistics=False))

    def no_calls(*a, **k):
        raise AssertionError("the statistics path must not capture calls")

    monkeypatch.setattr(wf, "capture_unit_io", no_calls)
    timer = PhaseTimer(sample_host=False)
    res = run_blockwise_ptq(tiny_adapter, spec, tmp_path / "stats", layers=range(1, 2), calib_windows=calib,
                            runtime=PtqRuntime(phases=timer))
    solve = [r for r in timer.records if r.name == "solve:recipe"]
    # the re-runs are reported on the solve phase (bench_ptq: recollect_seconds)
    assert len(solve) == 1 and solve[0].tags["recollect_forwards"] == 3 and solve[0].tags["recollect_seconds"] > 0
    block = tiny_adapter.block(1, device="cpu")
    tiny_adapter.quantize_block(block, scheme, TARGETS)
    expert = next(u for u in tiny_adapter.iter_ptq_units(block, 1, TARGETS) if u.kind == "expert")
    many = run_blockwise_ptq(tiny_adapter, spec, tmp_path / "many", layers=range(1, 2), calib_windows=calib,
                             runtime=PtqRuntime(hessian_memory_bytes=2 * estimated_hessian_bytes(expert)))
    pa = saved_params(tmp_path / "calls")
    for other in ("stats", "many"):
        assert_same_saved_params(pa, saved_params(tmp_path / other), other)
    assert all(u.n_calls == 0 for u in res.units)
    assert res.units[0].stats["gptq"]["recollect_forwards"] == 3
    assert [u.loss_after for u in res.units] == [u.loss_after for u in many.units]


def test_float_gptq_over_all_tokens_gives_each_stage_its_own_hessian():
    """``sequential=false,all_tokens=true`` replays stored calls: every stage's Hessian from one
    float replay, each stage its own (wo_b reads wo_a's output, not qr, though both are 32 wide
    here). all_tokens concerns routed experts only, so the attention equals the float GPTQ's."""
    from models.deepseek_v4.quant_module import iter_block_ptq_units, set_quant_enabled

    block, units, x, ids = _layer(torch.float32)
    twin = copy.deepcopy(block)
    twin_units = list(iter_block_ptq_units(twin, 1, TARGETS))
    for b, us in ((block, units), (twin, twin_units)):
        b.ffn.grouped = False
    calls, _ = capture_unit_io(units, lambda: _forward(block, x, ids))
    calls_t, _ = capture_unit_io(twin_units, lambda: _forward(twin, x, ids))
    set_quant_enabled(block, True)
    set_quant_enabled(twin, True)
    ra = run_recipe_on_units(units[:1], calls, parse_algo("gptq:sequential=false:all_tokens=true"),
                             device=torch.device("cpu"), seed=0, guard=False)
    rb = run_recipe_on_units(twin_units[:1], calls_t, parse_algo("gptq:sequential=false"),
                             device=torch.device("cpu"), seed=0, guard=False)
    assert ra[0].stats["gptq"]["hessian"] == "replayed calls" and rb[0].stats["gptq"]["hessian"] == "float"
    assert units_params_equal(units[:1], twin_units[:1]) >= 4


def test_a_resumed_layer_solves_its_remaining_units_as_an_uninterrupted_run(tiny_adapter, tmp_path):
    """--propagate quant, sequential GPTQ: a layer whose attention an earlier run finished (its
    experts not) solves the experts to the uninterrupted run's bits. The finished attention is
    loaded only after the solve: loaded before, its GPTQ weights fed the experts' re-run
    (casebook i24-sq4)."""
    import shutil

    calib = load_calib_windows(tiny_adapter, PTQ)
    spec = PtqSpec(QuantScheme.from_dict(W4G32), TARGETS, PTQ, recipe=parse_algo("gptq"), propagate="quant",
                   guard=False)
    kw = dict(layers=range(1, 2), calib_windows=calib)
    run_blockwise_ptq(tiny_adapter, spec, tmp_path / "ref", **kw)
    shutil.copytree(tmp_path / "ref", tmp_path / "cut")
    experts = sorted((tmp_path / "cut" / PARAMS_DIR).glob("layer_1_ffn_*.pt"))
    assert len(experts) > 3
    for p in experts:
        p.unlink()
    again = run_blockwise_ptq(tiny_adapter, spec, tmp_path / "cut", **kw)
    assert sum(u.resumed for u in again.units) == 1        # the attention
    assert_same_saved_params(saved_params(tmp_path / "ref"), saved_params(tmp_path / "cut"))


def test_a_rerun_that_misses_rows_is_refused():
    """A re-collection with fewer rows than the capture (a re-run stopped before a second call of
    a unit's module) is a clear error naming the leaf, not a thinner Hessian."""
    from amct_ext.errors import AmctError
    from models.deepseek_v4.quant_module import set_quant_enabled

    block, units, x, ids = _layer(torch.float32)
    col, _ = _collect(block, units, x, ids, grouped=True)
    col.release()
    set_quant_enabled(block, True)
    real = _rerun(block, x, ids, [])

    def short(us, leaves):
        stats = real(us, leaves)
        for st in stats.values():
            for ls in st.values():
                ls.n -= 1
        return stats
    with pytest.raises(AmctError, match=r"re-run gave .*w2 \d+ rows, the capture \d+"):
        run_recipe_on_units(units, {}, parse_algo("gptq"), device=torch.device("cpu"), seed=0,
                            hessians={u.name: col.stats(u.name) for u in units}, recollect=short)
