"""Capture statistics instead of calls (algorithms/hessians.py): the Hessians equal the ones
from stored calls, the grouped MoE path gives the per-expert loop's Hessians, the float layer
output is unchanged, and GPTQ on the statistics equals GPTQ on stored calls."""
import copy

import pytest
import torch

from amct_ext.algorithms.gptq import _quant_off, _replay, _Target
from amct_ext.algorithms.hessians import HessianCollector, quant_leaves
from amct_ext.algorithms.recipe import parse_algo
from amct_ext.algorithms.runner import run_recipe_on_units
from amct_ext.base import PtqConfig
from amct_ext.pipeline.capture import capture_unit_io
from amct_ext.io.io_utils import safe_torch_load
from amct_ext.quant.schemes import QuantScheme, load_scheme
from amct_ext.pipeline.ptq_spec import PtqSpec
from amct_ext.pipeline.workflow import PARAMS_DIR, PtqRuntime, load_calib_windows, run_blockwise_ptq

pytestmark = pytest.mark.usefixtures("one_thread")

TARGETS = ["attn-linear", "moe"]
W4G32 = {"name": "w4g32", "weight": {"format": "int", "bits": 4, "symmetric": False,
                                      "granularity": "group", "group_size": 32}}


def _layer(dtype, layer=1, scheme=None):
    """Tiny layer 1 (ratio 4: compressor + indexer, hash routing), quantized, quantization off;
    its float input for 2 samples."""
    from models.deepseek_v4.quant_module import iter_block_ptq_units, quantize_block, set_quant_enabled
    from models.deepseek_v4.tiny import random_tiny_model

    model = random_tiny_model(0, dtype=dtype)
    ids = torch.randint(2, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = model.layers[0](model.embed_tokens(ids), 0, ids)
    block = model.layers[layer]
    block.ffn.pack_experts()
    scheme = scheme or QuantScheme.from_dict(W4G32)
    block = quantize_block(block, scheme, TARGETS)
    set_quant_enabled(block, False)
    units = list(iter_block_ptq_units(block, layer, TARGETS))
    return block, units, x, ids


def _forward(block, x, ids):
    with torch.no_grad():
        return [block(x[i:i + 1], 0, ids[i:i + 1]) for i in range(x.shape[0])]


def _collect(block, units, x, ids, grouped: bool):
    block.ffn.grouped = grouped
    col = HessianCollector(units).attach(block)
    try:
        out = _forward(block, x, ids)
    finally:
        col.detach()
    return col, out


def units_params_equal(units_a, units_b) -> int:
    """Assert two sets of solved units export the same parameters, bit for bit; returns how many
    replaced weights (or codes) they hold."""
    replaced = 0
    for a, b in zip(units_a, units_b):
        pa, pb = a.module.export_ptq_params(), b.module.export_ptq_params()
        assert pa.keys() == pb.keys(), a.name
        for k in pa:
            assert torch.equal(pa[k], pb[k]), (a.name, k)
        replaced += sum(k.endswith((".weight", ".weight_codes")) for k in pa)
    return replaced


def saved_params(out) -> dict:
    """Every unit file a run wrote under OUT/ptq_params, by file name."""
    return {p.name: safe_torch_load(p) for p in sorted((out / PARAMS_DIR).glob("*.pt"))}


def assert_same_saved_params(pa: dict, pb: dict, what="") -> None:
    """Two runs' saved parameters: the same files, the same keys, bit for bit."""
    assert pa.keys() == pb.keys() and len(pa) > 3, what
    for name in pa:
        assert pa[name].keys() == pb[name].keys(), (what, name)
        for k in pa[name]:
            assert torch.equal(pa[name][k], pb[name][k]), (what, name, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_capture_hessians_equal_the_loop_and_the_output_is_unchanged(dtype):
    block, units, x, ids = _layer(dtype)
    plain_loop = (setattr(block.ffn, "grouped", False), _forward(block, x, ids))[1]   # today's capture
    loop, out_loop = _collect(block, units, x, ids, grouped=False)
    grouped, out_grouped = _collect(block, units, x, ids, grouped=True)
    assert loop.host_reads == 0 and grouped.host_reads == 2     # the grouped path really ran, 1 read / sample
    for a, b, c in zip(plain_loop, out_loop, out_grouped):
        assert torch.equal(a, b) and torch.equal(a, c)          # the next layer's float input, bit for bit
    n_checked = 0
    for u in units:
        sl, sg = loop.stats(u.name), grouped.stats(u.name)
        assert sl.keys() == sg.keys(), u.name
        for leaf in sl:
            assert sl[leaf].n == sg[leaf].n
            if sl[leaf].n:
                torch.testing.assert_close(sg[leaf].H, sl[leaf].H, rtol=1e-6, atol=1e-6)
                n_checked += 1
    experts = [u for u in units if u.kind == "expert"]
    # w1 / w3 share one statistic (one stacked Hessian on the grouped path)
    assert all(grouped.stats(u.name)["w1"] is grouped.stats(u.name)["w3"] for u in experts)
    assert n_checked > 3 * len(experts) // 2


def test_capture_hessians_equal_those_from_stored_calls():
    """Oracle: each leaf's ``sum x^T x`` from a replay of the STORED calls (loop path capture,
    today's) through GPTQ's own accumulator with quantization off; for the routed experts' w1 also
    directly from the stored input rows."""
    block, units, x, ids = _layer(torch.float32)
    block.ffn.grouped = False
    calls, _ = capture_unit_io(units, lambda: _forward(block, x, ids))
    col, _ = _collect(block, units, x, ids, grouped=True)
    checked = 0
    for u in units:
        st = col.stats(u.name)
        for name, leaf in quant_leaves(u.module):
            t = _Target(name, leaf)
            if t.groups:   # wo_a: no module call; its input o is what grouped_output receives
                cls_fn = type(u.module).grouped_output
                u.module.grouped_output = lambda o, m=u.module, t=t, f=cls_fn: (t.add(o, torch.device("cpu")),
                                                                               f(m, o))[1]
                h = type("R", (), {"remove": lambda self, m=u.module: m.__dict__.pop("grouped_output")})()
            else:
                h = t.leaf.register_forward_pre_hook(lambda _m, a, t=t: t.add(a[0], torch.device("cpu")))
            try:
                with torch.no_grad():
                    for c in calls[u.name]:
                        u.module(*c.args, **c.kwargs)
            finally:
                h.remove()
            if t.n == 0:
                assert name not in st or st[name].n == 0
                continue
            assert st[name].n == t.n, (u.name, name)
            torch.testing.assert_close(st[name].H, t.H, rtol=1e-5, atol=1e-5)
            checked += 1
        if u.kind == "expert" and calls[u.name]:
            X = torch.cat([c.args[0].reshape(-1, c.args[0].shape[-1]) for c in calls[u.name]])
            torch.testing.assert_close(st["w1"].H[0], X.T @ X, rtol=1e-5, atol=1e-4)
    assert checked > 20


def test_gptq_on_statistics_equals_gptq_on_stored_calls():
    """Same parameters, bit for bit: the statistics path (Hessians from the layer's grouped
    forward) and the stored-calls path (calls captured on the loop path, replayed float)."""
    block, units, x, ids = _layer(torch.float32)
    twin = copy.deepcopy(block)
    from models.deepseek_v4.quant_module import iter_block_ptq_units, set_quant_enabled

    twin_units = list(iter_block_ptq_units(twin, 1, TARGETS))
    recipe = parse_algo("gptq:sequential=false")
    assert not recipe.needs().calls
    col, _ = _collect(block, units, x, ids, grouped=True)
    set_quant_enabled(block, True)
    rs = run_recipe_on_units(units, {}, recipe, device=torch.device("cpu"), seed=0,
                             hessians={u.name: col.stats(u.name) for u in units})
    twin.ffn.grouped = False
    calls, _ = capture_unit_io(twin_units, lambda: _forward(twin, x, ids))
    set_quant_enabled(twin, True)
    rt = run_recipe_on_units(twin_units, calls, recipe, device=torch.device("cpu"), seed=0, guard=False)
    assert units_params_equal(units, twin_units) > 20
    # the exact Hessian losses: GPTQ never above RTN per unit, and below it on the whole layer
    assert all(r.loss_after <= r.loss_before for r in rs if r.loss_before is not None)
    assert sum(r.loss_after for r in rs if r.loss_after) < 0.9 * sum(r.loss_before for r in rs if r.loss_before)
    # and the Hessian loss of a unit is the exact output error of its leaves with float inputs
    r0 = rs[0]
    assert r0.kind == "attn" and r0.n_calls == 0 and "hessian" in r0.stats["loss"]
    assert [r.name for r in rt] == [r.name for r in rs]


def test_hessian_loss_is_the_exact_leaf_output_error():
    from amct_ext.algorithms.runner import hessian_leaf_errors

    block, units, x, ids = _layer(torch.float32)
    col, _ = _collect(block, units, x, ids, grouped=True)
    u = next(u for u in units if u.kind == "shared_expert")
    errs = hessian_leaf_errors(u, col.stats(u.name))
    block.ffn.grouped = False
    calls, _ = capture_unit_io([u], lambda: _forward(block, x, ids))
    leaf = u.module.w1
    X = torch.cat([c.args[0].reshape(-1, c.args[0].shape[-1]) for c in calls[u.name]]).double()
    dW = (leaf.weight_quantizer(leaf.weight) - leaf.weight).double()
    direct = (X @ dW.T).square().sum()
    torch.testing.assert_close(errs["w1"][0].double(), direct, rtol=1e-4, atol=0)
    assert errs["w1"][1] == X.shape[0] * leaf.weight.shape[0]


PTQ = PtqConfig(epochs=1, lr=5e-3, n_samples=2, seq_len=48, batch_size=1, seed=0)


def test_workflow_stores_no_calls_for_a_statistics_recipe(tiny_adapter, tmp_path, monkeypatch):
    """run_blockwise_ptq with gptq:sequential=false: no call is captured (capture_unit_io is never
    reached) and the parameters equal those of the same recipe on stored calls."""
    import amct_ext.pipeline.capture_modes as wf   # where the capture modes call these

    calib = load_calib_windows(tiny_adapter, PTQ)
    recipe = parse_algo("gptq:sequential=false")
    ref = run_blockwise_ptq(tiny_adapter, PtqSpec(load_scheme("w8a8"), TARGETS, PTQ, recipe=recipe, guard=False),
                            tmp_path / "calls", layers=range(1, 2), calib_windows=calib,
                            runtime=PtqRuntime(statistics=False))

    def no_calls(*a, **k):
        raise AssertionError("the statistics path must not capture calls")

    monkeypatch.setattr(wf, "capture_unit_io", no_calls)
    res = run_blockwise_ptq(tiny_adapter, PtqSpec(load_scheme("w8a8"), TARGETS, PTQ, recipe=recipe, guard=False),
                            tmp_path / "stats", layers=range(1, 2), calib_windows=calib)
    assert_same_saved_params(saved_params(tmp_path / "calls"), saved_params(tmp_path / "stats"))
    assert len(res.units) == len(ref.units)
    assert all(u.n_calls == 0 for u in res.units)


def test_hessian_passes_plan_from_the_end_of_the_forward_order():
    """The experts' Hessian bytes are counted exactly (w1 / w3 share one); passes fit the budget,
    are filled from the end of the forward order (attention, upstream of the MoE, comes last)
    and keep every unit once, in order."""
    from amct_ext.algorithms.hessians import estimated_hessian_bytes, plan_hessian_passes

    block, units, x, ids = _layer(torch.float32)
    col, _ = _collect(block, units, x, ids, grouped=True)
    for u in units:
        if u.kind in ("expert", "shared_expert"):
            got = sum(4 * ls.H.numel() for ls in {id(v): v for v in col.stats(u.name).values()}.values())
            assert estimated_hessian_bytes(u) == got, u.name
    col.free()
    one = estimated_hessian_bytes(units[1])
    budget = 3 * one
    passes = plan_hessian_passes(units, budget)
    assert [u.name for p in passes[::-1] for u in p] == [u.name for u in units]
    assert passes[-1][0].kind == "attn" and len(passes) > 2
    assert all(sum(estimated_hessian_bytes(u) for u in p) <= budget for p in passes if len(p) > 1)
    assert plan_hessian_passes(units, None) == [units]


def test_workflow_in_several_hessian_passes_equals_one_pass(tiny_adapter, tmp_path, monkeypatch):
    """A Hessian budget that splits the layer into passes gives bit-identical parameters: each
    pass sees the float function upstream of its units (attention last, experts parallel)."""
    import amct_ext.algorithms.hessians as hs
    from amct_ext.algorithms.hessians import estimated_hessian_bytes

    planned = []
    real_plan = hs.plan_hessian_passes
    monkeypatch.setattr(hs, "plan_hessian_passes", lambda u, b: planned.append(real_plan(u, b)) or planned[-1])

    calib = load_calib_windows(tiny_adapter, PTQ)
    recipe = parse_algo("gptq:sequential=false")
    one = run_blockwise_ptq(tiny_adapter, PtqSpec(load_scheme("w8a8"), TARGETS, PTQ, recipe=recipe, guard=False),
                            tmp_path / "one", layers=range(1, 2), calib_windows=calib,
                            runtime=PtqRuntime(hessian_memory_bytes=1 << 40))
    block = tiny_adapter.block(1, device="cpu")
    tiny_adapter.quantize_block(block, load_scheme("w8a8"), TARGETS)
    expert = next(u for u in tiny_adapter.iter_ptq_units(block, 1, TARGETS) if u.kind == "expert")
    kept = []
    real_forward = tiny_adapter.do_block_forward

    def forward(*a, **k):
        kept.append(k.get("keep_outputs", True))
        out = real_forward(*a, **k)
        assert kept[-1] or out == []
        return out

    monkeypatch.setattr(tiny_adapter, "do_block_forward", forward)
    many = run_blockwise_ptq(tiny_adapter, PtqSpec(load_scheme("w8a8"), TARGETS, PTQ, recipe=recipe, guard=False),
                             tmp_path / "many", layers=range(1, 2), calib_windows=calib,
                             runtime=PtqRuntime(hessian_memory_bytes=2 * estimated_hessian_bytes(expert)))
    assert_same_saved_params(saved_params(tmp_path / "one"), saved_params(tmp_path / "many"))
    assert [u.loss_after for u in one.units] == [u.loss_after for u in many.units]
    assert [len(p) for p in planned] == [1, len(planned[1])] and len(planned[1]) >= 3
    # later passes drop their output (it is pass 0's again): no second host copy of the layer's
    assert kept.count(False) == len(planned[1]) - 1


def test_rtn_skips_hessians_that_would_need_extra_passes(tiny_adapter, tmp_path, monkeypatch):
    """RTN reads no statistic: under a budget that would split the layer, it runs the one float
    forward without Hessians (losses not measured) and saves what it saves with them."""
    import amct_ext.algorithms.hessians as hs

    calib = load_calib_windows(tiny_adapter, PTQ)
    recipe = parse_algo("rtn")
    assert not recipe.needs().statistics and parse_algo("rtn,gptq:sequential=false").needs().statistics
    full = run_blockwise_ptq(tiny_adapter, PtqSpec(load_scheme("w8a8"), TARGETS, PTQ, recipe=recipe),
                             tmp_path / "full", layers=range(1, 2), calib_windows=calib)
    made = []
    monkeypatch.setattr(hs, "HessianCollector", lambda *a, **k: made.append(1) or (_ for _ in ()).throw(
        AssertionError("no Hessians for RTN under a splitting budget")))
    tight = run_blockwise_ptq(tiny_adapter, PtqSpec(load_scheme("w8a8"), TARGETS, PTQ, recipe=recipe),
                              tmp_path / "tight", layers=range(1, 2), calib_windows=calib,
                              runtime=PtqRuntime(hessian_memory_bytes=1))
    assert not made
    assert all(u.loss_before is not None for u in full.units)
    assert all(u.loss_before is None and u.loss_after is None for u in tight.units)
    assert_same_saved_params(saved_params(tmp_path / "full"), saved_params(tmp_path / "tight"))
    assert PtqRuntime(hessian_memory_bytes=123).hessian_budget(torch.device("cpu")) == 123
    assert PtqRuntime().hessian_budget(torch.device("cpu")) is None      # no budget on the host


def test_an_in_place_weight_edit_never_reaches_a_later_build(tiny_adapter):
    """GPTQ writes weights in place; a host-built layer's plain (fp32 island) tensors used to share
    memory with the open shard, so the next build of the layer saw the quantized weights
    (casebook/statistics-path.md-1)."""
    b1 = tiny_adapter.block(1, device="cpu")
    w = b1.attn.compressor.wkv.weight
    assert w.dtype == torch.float32
    before = w.detach().clone()
    with torch.no_grad():
        w.zero_()
    b2 = tiny_adapter.block(1, device="cpu")
    assert torch.equal(b2.attn.compressor.wkv.weight, before)


@pytest.mark.parametrize("like, budget_gib, expert_gib, n_passes", [
    ("v4-pro", 34.4, 87.0, 3),      # RESULTS §0.5: the H200 run's budget, 3 passes, attention last
    ("v4-flash", 50.0, 20.0, 1),    # a V4-Flash layer on the H200: one pass (21.3 GiB with attention)
])
def test_real_size_hessian_plan(like, budget_gib, expert_gib, n_passes):
    """The pass plan of a real-size layer (built on the meta device: shapes only): the experts'
    Hessian bytes and the number of passes quoted in RESULTS §0.5 / casebook i15b-5."""
    import json

    from amct_ext.algorithms.hessians import estimated_hessian_bytes, plan_hessian_passes
    from models.deepseek_v4.configuration import DeepseekV4Config
    from models.deepseek_v4.loading import empty_block
    from models.deepseek_v4.quant_module import iter_block_ptq_units, quantize_block
    from models.deepseek_v4.synthetic import base_config_dict

    cfg = DeepseekV4Config(**json.loads(json.dumps(base_config_dict(like))))
    block = quantize_block(empty_block(cfg, 0), load_scheme("w8a8"), TARGETS)
    units = list(iter_block_ptq_units(block, 0, TARGETS))
    experts = sum(estimated_hessian_bytes(u) for u in units if u.kind == "expert")
    assert experts == pytest.approx(expert_gib * 2 ** 30, rel=0.01)
    passes = plan_hessian_passes(units, int(budget_gib * 2 ** 30))
    assert len(passes) == n_passes and passes[-1][0].kind == "attn"
    assert sum(len(p) for p in passes) == len(units) == cfg.n_routed_experts + 2


def test_an_interrupted_multi_pass_layer_resumes_at_its_next_pass(tiny_adapter, tmp_path, monkeypatch):
    """Each pass's units are written when the pass is solved: a run stopped while the second
    pass collects keeps the first pass's units, and the rerun solves only the rest, to the
    uninterrupted run's bits."""
    import amct_ext.pipeline.capture_modes as wf   # where the capture modes call these
    from amct_ext.algorithms.hessians import estimated_hessian_bytes

    calib = load_calib_windows(tiny_adapter, PTQ)
    recipe = parse_algo("gptq:sequential=false")
    block = tiny_adapter.block(1, device="cpu")
    tiny_adapter.quantize_block(block, load_scheme("w8a8"), TARGETS)
    expert = next(u for u in tiny_adapter.iter_ptq_units(block, 1, TARGETS) if u.kind == "expert")
    runtime = PtqRuntime(hessian_memory_bytes=2 * estimated_hessian_bytes(expert))
    spec = PtqSpec(load_scheme("w8a8"), TARGETS, PTQ, recipe=recipe, guard=False)
    kw = dict(layers=range(1, 2), calib_windows=calib, runtime=runtime)
    ref = run_blockwise_ptq(tiny_adapter, spec, tmp_path / "ref", **kw)

    class Stop(Exception):
        pass

    real_collect = wf._collect_hessians
    first_pass = []

    def stop_at_the_second_pass(adapter, block, calib, units, keep_output=True):
        if first_pass:
            raise Stop
        first_pass.extend(u.name for u in units)
        return real_collect(adapter, block, calib, units, keep_output)

    monkeypatch.setattr(wf, "_collect_hessians", stop_at_the_second_pass)
    with pytest.raises(Stop):
        run_blockwise_ptq(tiny_adapter, spec, tmp_path / "cut", **kw)
    monkeypatch.setattr(wf, "_collect_hessians", real_collect)
    kept = sorted(p.name for p in (tmp_path / "cut" / PARAMS_DIR).glob("*.pt"))
    assert len(kept) == len(first_pass) >= 1
    again = run_blockwise_ptq(tiny_adapter, spec, tmp_path / "cut", **kw)
    assert sum(u.resumed for u in again.units) == len(first_pass) and len(again.units) == len(ref.units)
    assert_same_saved_params(saved_params(tmp_path / "ref"), saved_params(tmp_path / "cut"))
