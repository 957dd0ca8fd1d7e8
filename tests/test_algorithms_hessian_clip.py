"""hclip (algorithms/hessian_clip.py): clip factors chosen on each leaf's exact output error
``d H d^T`` from the capture's Hessians, no stored call. The choice equals a brute-force
reference and is never worse than RTN on the exact error; the routed experts batched equal one
by one in float64 and no expert's weight or Hessian reaches another's choice; wo_a's groups
each use their own Hessian; stored calls give the capture's result; the workflow stores no call."""
from __future__ import annotations

import copy
import itertools

import pytest
import torch

from amct_ext.algorithms import SolveContext, UnitData, parse_algo
from amct_ext.algorithms.hessian_clip import HessianClip, clip_grid, hessian_clip_choice
from amct_ext.algorithms.hessians import LeafStat
from amct_ext.algorithms.recipe import RecipeError
from amct_ext.pipeline.ptq_units import make_ptq_unit
from amct_ext.quant import formats
from amct_ext.quant.schemes import TensorSpec

pytestmark = pytest.mark.usefixtures("one_thread")

G16 = TensorSpec("int", 3, False, "group", 16)
CH4 = TensorSpec("int", 4, False, "channel")
FP8CH = TensorSpec("fp8", 8, True, "channel")


def _problem(R=10, C=48, n=300, seed=0):
    """A heavy-tailed weight [R, C] and a correlated Hessian sum x^T x [C, C] (float64)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(R, C, generator=g, dtype=torch.float64) ** 3
    X = torch.randn(n, C, generator=g, dtype=torch.float64) @ (torch.eye(C, dtype=torch.float64)
                                                            + 0.4 * torch.randn(C, C, generator=g, dtype=torch.float64))
    return W, X.T @ X


def _fq(W, spec, clip):
    return formats.fake_quant(W, spec, clip)


def _brute_force(W, H, spec, grid, grid_min):
    """An independent reference, loops over rows / groups / candidates. Group spec: per row and
    group the candidate of least d_g H_gg d_g^T (first of equals), then per row the choice only
    where its full row error is below RTN's. Channel: per row the candidate of least full row
    error d H d^T (first of equals)."""
    R, C = W.shape
    cands = clip_grid(grid, grid_min)
    shape = formats.scale_shape(W.shape, spec)
    rtn = _fq(W, spec, None)
    clip = torch.ones(shape, dtype=torch.float32)
    row_err = lambda d, r: float(d[r] @ H @ d[r])   # noqa: E731
    if spec.granularity == "group":
        gs = spec.group_size
        chosen = torch.ones(shape, dtype=torch.float32)
        for r, k in itertools.product(range(R), range(C // gs)):
            cols = slice(k * gs, (k + 1) * gs)
            best, best_e = 1.0, None
            for c in cands:
                d = (W - _fq(W, spec, torch.full(shape, c)))[r, cols]
                e = float(d @ H[cols, cols] @ d)
                if best_e is None or e < best_e:
                    best, best_e = c, e
            chosen[r, k] = best
        d_new, d_rtn = W - _fq(W, spec, chosen), W - rtn
        for r in range(R):
            if row_err(d_new, r) < row_err(d_rtn, r):
                clip[r] = chosen[r]
        return clip
    for r in range(R):
        best, best_e = 1.0, None
        for c in cands:
            e = row_err(W - _fq(W, spec, torch.full(shape, c)), r)
            if best_e is None or e < best_e:
                best, best_e = c, e
        clip[r] = best
    return clip


def _exact(W, H, spec, clip):
    d = W - _fq(W, spec, clip)
    return float(torch.einsum("rc,cd,rd->", d, H, d))


@pytest.mark.parametrize("spec,grid_min", [(G16, 0.4), (CH4, 0.4), (FP8CH, 0.9)],
                         ids=["int3-g16", "int4-channel", "fp8-channel"])
def test_choice_equals_brute_force_and_never_worse_than_rtn(spec, grid_min):
    """exact_top >= grid: every candidate scored exactly, the brute force's choice; the exact
    leaf error never above RTN's and below it on this heavy-tailed weight (fp8 gains only from
    factors near 1, which move the top binade's rounding: saturating the row's maximum costs more)."""
    W, H = _problem()
    ref = _brute_force(W, H, spec, grid=8, grid_min=grid_min)
    r = hessian_clip_choice(W[None], H[None, None], spec, None, grid=8, grid_min=grid_min, exact_top=8)
    assert torch.equal(r["clip"][0], ref)
    assert (ref < 1).any()                                  # the case exercises clipping
    e_rtn, e_new = _exact(W, H, spec, None), _exact(W, H, spec, r["clip"][0])
    assert r["incoming"][0].item() == pytest.approx(e_rtn, rel=1e-9)
    assert r["chosen"][0].item() == pytest.approx(e_new, rel=1e-9)
    assert e_new < e_rtn


@pytest.mark.parametrize("spec,grid_min", [(CH4, 0.5), (FP8CH, 0.9)], ids=["int4-channel", "fp8-channel"])
def test_per_channel_exact_top_is_never_worse_than_the_diagonal_choice(spec, grid_min):
    """The default exact_top (the incoming state + the 3 best on H's diagonal, scored exactly)
    is never above RTN on any row, nor above the diagonal proxy's own choice (clip's grid start
    with E[x^2] = diag H), nor below the brute force."""
    from amct_ext.algorithms.clipping import grid_clip

    W, H = _problem(R=16, seed=3)
    r = hessian_clip_choice(W[None], H[None, None], spec, None, grid=20, grid_min=grid_min)
    diag = grid_clip(W, spec, H.diagonal(), 20, grid_min)
    brute = _brute_force(W, H, spec, 20, grid_min)
    row = lambda clip: torch.einsum("rc,cd,rd->r", W - _fq(W, spec, clip), H, W - _fq(W, spec, clip))  # noqa: E731
    e, e_rtn, e_diag, e_brute = row(r["clip"][0]), row(None), row(diag), row(brute)
    assert (e <= e_rtn).all() and (e <= e_diag).all() and (e >= e_brute).all()
    assert (e < e_rtn).any()


def test_block_tiles_and_per_tensor_are_never_worse_than_rtn():
    W, H = _problem(R=12, C=48, seed=5)
    for spec in (TensorSpec("int", 4, False, "block", block_size=(5, 16)), TensorSpec("int", 4, True, "tensor"),
                 TensorSpec("fp8", 8, True, "block", block_size=(4, 16))):
        r = hessian_clip_choice(W[None], H[None, None], spec, None, grid=10, grid_min=0.5)
        clip = r["clip"][0].reshape(formats.scale_shape(W.shape, spec))
        assert _exact(W, H, spec, clip) <= _exact(W, H, spec, None), spec
        assert r["chosen"][0].item() == pytest.approx(_exact(W, H, spec, clip), rel=1e-9)


def test_wo_a_groups_each_use_their_own_hessian():
    """wo_a's layout (weight [G * R, C], one Hessian per output group): the joint choice equals
    each group solved alone, and a change of group 1's Hessian moves only group 1's rows."""
    W0, H0 = _problem(R=8, seed=1)
    W1, H1 = _problem(R=8, seed=2)
    W = torch.cat([W0, W1])[None]                               # [1, 16, C]
    H = torch.stack([H0, H1])[None]                             # [1, 2, C, C]
    joint = hessian_clip_choice(W, H, G16, None, grid=8)["clip"][0]
    a = hessian_clip_choice(W0[None], H0[None, None], G16, None, grid=8)["clip"][0]
    b = hessian_clip_choice(W1[None], H1[None, None], G16, None, grid=8)["clip"][0]
    assert torch.equal(joint, torch.cat([a, b]))
    assert not torch.equal(a, b)
    H2 = H.clone()
    H2[0, 1] = _problem(R=8, seed=9)[1]
    moved = hessian_clip_choice(W, H2, G16, None, grid=8)["clip"][0]
    assert torch.equal(moved[:8], joint[:8]) and not torch.equal(moved[8:], joint[8:])


# ----------------------------------------------------------------------------- routed experts
def _experts(n=6, seed=11, spec=G16, inter=48):
    """``n`` float64 quantized experts (32 -> ``inter`` -> 32) with capture-style statistics: w1 / w3
    share one LeafStat (a view into a stacked [n, 32, 32] Hessian, as the grouped capture makes
    it), w2 its own; expert 4 saw no token."""
    from models.deepseek_v4.modeling import Expert
    from models.deepseek_v4.quant_module import QuantV4Expert

    g = torch.Generator().manual_seed(seed)
    mods, stats = [], []
    stack1 = torch.zeros(n, 32, 32, dtype=torch.float64)
    for i in range(n):
        e = Expert(32, inter, 2.0, torch.float64)
        with torch.no_grad():
            for p in e.parameters():
                r = torch.randn(p.shape, generator=g, dtype=torch.float64)
                p.copy_(r ** 3 * 0.1 if i % 2 == 0 else r * 0.3)
        mods.append(QuantV4Expert(e, spec, None))
        if i == 4:
            stats.append({})
            continue
        x = torch.randn(20 + 5 * i, 32, generator=g, dtype=torch.float64) * (1 + torch.rand(32, generator=g,
                                                                                           dtype=torch.float64))
        h = torch.randn(20 + 5 * i, inter, generator=g, dtype=torch.float64)
        stack1[i] = x.T @ x
        s13 = LeafStat(H=stack1[i:i + 1], n=x.shape[0], leaves=["w1", "w3"])
        stats.append({"w1": s13, "w3": s13, "w2": LeafStat(H=(h.T @ h)[None], n=h.shape[0], leaves=["w2"])})
    return mods, stats


def _units(mods):
    return [make_ptq_unit("expert", f"layers.0.ffn.experts.{i}", 0, m) for i, m in enumerate(mods)]


def _clips(mods):
    return [{n: (None if getattr(m, n).weight_quantizer.clip is None else getattr(m, n).weight_quantizer.clip.detach().clone())
             for n in ("w1", "w2", "w3")} for m in mods]


def _run(mods, stats, chunk):
    algo = HessianClip(grid=10, expert_chunk=chunk)
    return algo.apply_group(_units(mods), [UnitData([], hessians=s) for s in stats], SolveContext())


@pytest.mark.parametrize("spec", [G16, CH4], ids=["int3-g16", "int4-channel"])
def test_batched_experts_equal_one_by_one(spec):
    """Chunks of 4 (two chunks, uneven) give the clips and losses of one expert at a time, bit
    for bit in float64; the expert without statistics keeps RTN (no clip)."""
    mods, stats = _experts(spec=spec)
    ref = copy.deepcopy(mods)
    rb = _run(mods, stats, 4)
    rl = [HessianClip(grid=10).apply(u, UnitData([], hessians=s), SolveContext()) for u, s in zip(_units(ref), stats)]
    cb, cl = _clips(mods), _clips(ref)
    assert cb[4] == cl[4] == {"w1": None, "w2": None, "w3": None}
    assert sorted(rb[4]["no_statistics"]) == ["w1", "w2", "w3"]
    changed = 0
    for i in range(len(mods)):
        assert rb[i] == rl[i], i
        for n in ("w1", "w2", "w3"):
            if i != 4:
                assert torch.equal(cb[i][n], cl[i][n]), (i, n)
                changed += bool((cb[i][n] < 1).any())
    assert changed >= 6                         # most leaves really clip: the comparison bites
    assert all(rb[i]["leaf_loss"][n] < rb[i]["incoming_loss"][n] for i in (0, 2) for n in ("w1", "w2", "w3"))


@pytest.mark.parametrize("what", ["weight", "hessian"])
def test_one_experts_weight_or_hessian_moves_only_its_own_choice(what):
    """Perturb expert 2 (its w1 weight, or its shared w1 / w3 Hessian): its clips change, every
    other expert's stay bit for bit (batched in one chunk: nothing leaks across the stack)."""
    mods, stats = _experts()
    base = _clips((_run(mods, stats, 8), mods)[1])
    mods2, stats2 = _experts()
    if what == "weight":
        with torch.no_grad():
            mods2[2].w1.weight.mul_(torch.linspace(0.3, 3.0, 32, dtype=torch.float64))
    else:
        H = stats2[2]["w1"].H
        H.copy_(H * torch.outer(torch.linspace(0.1, 4, 32), torch.linspace(0.1, 4, 32)).double())
    after = _clips((_run(mods2, stats2, 8), mods2)[1])
    for i in range(len(mods)):
        for n in ("w1", "w2", "w3"):
            same = (base[i][n] is None and after[i][n] is None) or torch.equal(base[i][n], after[i][n])
            if i != 2:
                assert same, (i, n)
    assert not torch.equal(base[2]["w1"], after[2]["w1"])
    if what == "hessian":
        assert not torch.equal(base[2]["w3"], after[2]["w3"])   # w3 reads the same input


# ----------------------------------------------------------------------------- recipe rules
def test_options_needs_and_refusals():
    with pytest.raises(RecipeError, match="hclip.grid"):
        parse_algo("hclip:grid=1")
    with pytest.raises(RecipeError, match="hclip.exact_top"):
        parse_algo("hclip:exact_top=0")
    r = parse_algo("hclip,gptq:sequential=false")
    assert not r.needs().calls and r.needs().statistics
    assert not parse_algo("hclip,gptq").needs().calls          # sequential GPTQ re-runs the layer instead
    assert parse_algo("hclip,gptq:all_tokens=true").needs().calls and parse_algo("clip,gptq").needs().calls
    # after GPTQ / AutoRound wrote a grid or a weight, the float weight is gone: refused, naming the leaf
    for mark in ("fixed", "replaced"):
        mods, stats = _experts(n=2)
        lin = mods[1].w2
        if mark == "fixed":
            d = formats.quantize(lin.weight.detach(), G16)
            lin.weight_quantizer.set_fixed_qparams(lin.weight, d["scale"], d["zero_point"].float())
        else:
            lin.weight_replaced = True
        units, datas = _units(mods), [UnitData([], hessians=s) for s in stats]
        with pytest.raises(RecipeError, match=r"hclip: leaf 'w2' of layers.0.ffn.experts.1 .*before them"):
            HessianClip().apply_group(units, datas, SolveContext())


def test_mx_weights_have_nothing_to_clip():
    mods, stats = _experts(n=2, spec=TensorSpec("mxfp4"), inter=64)
    r = _run(mods, stats, 4)
    assert r[0]["choice"] == "incoming" and r[0]["reason"] == "nothing to clip"
    assert all(c is None for cl in _clips(mods) for c in cl.values())


# ----------------------------------------------------------------------------- a V4 layer
TARGETS = ["attn-linear", "moe"]
W4G32 = {"name": "w4g32", "weight": {"format": "int", "bits": 4, "symmetric": False,
                                      "granularity": "group", "group_size": 32}}


def _layer():
    """Tiny layer 1 (ratio 4: compressor + indexer), quantized w4 g32, quantization off; its
    float input for 2 samples (as tests/test_hessian_capture.py)."""
    from models.deepseek_v4.quant_module import iter_block_ptq_units, quantize_block, set_quant_enabled
    from models.deepseek_v4.tiny import random_tiny_model
    from amct_ext.quant.schemes import QuantScheme

    model = random_tiny_model(0, dtype=torch.float32)
    ids = torch.randint(2, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = model.layers[0](model.embed_tokens(ids), 0, ids)
    block = model.layers[1]
    block.ffn.pack_experts()
    block = quantize_block(block, QuantScheme.from_dict(W4G32), TARGETS)
    set_quant_enabled(block, False)
    return block, list(iter_block_ptq_units(block, 1, TARGETS)), x, ids


def test_stored_calls_give_the_capture_statistics_result():
    """With stored calls (a recipe that also replays them), hclip replays the float unit for its
    Hessians: the clips of every unit of a V4 layer equal those from the capture's statistics
    (grouped MoE path), up to the fp32 summation order of the two Hessians (compared on the
    exact errors, which must agree to 1e-4, and on >= 95 % of the clip factors)."""
    from amct_ext.algorithms.hessians import HessianCollector
    from amct_ext.pipeline.capture import capture_unit_io
    from models.deepseek_v4.quant_module import iter_block_ptq_units, set_quant_enabled

    block, units, x, ids = _layer()
    twin = copy.deepcopy(block)
    twin_units = list(iter_block_ptq_units(twin, 1, TARGETS))
    fwd = lambda b: [b(x[i:i + 1], 0, ids[i:i + 1]) for i in range(x.shape[0])]   # noqa: E731
    block.ffn.grouped = True
    col = HessianCollector(units).attach(block)
    with torch.no_grad():
        fwd(block)
    col.detach()
    twin.ffn.grouped = False
    with torch.no_grad():
        calls, _ = capture_unit_io(twin_units, lambda: fwd(twin))
    set_quant_enabled(block, True)
    set_quant_enabled(twin, True)
    algo = HessianClip()
    by_kind = lambda us: {k: [u for u in us if u.kind == k] for k in dict.fromkeys(u.kind for u in us)}  # noqa: E731
    ra, rb = [], []
    for (k, ua), ub in zip(by_kind(units).items(), by_kind(twin_units).values()):
        ra += algo.apply_group(ua, [UnitData([], hessians=col.stats(u.name)) for u in ua], SolveContext())
        rb += algo.apply_group(ub, [UnitData(calls.get(u.name, [])) for u in ub], SolveContext())
    n_eq = n_all = 0
    for a, b, sa, sb in zip(units, twin_units, ra, rb):
        assert sa["leaf_loss"].keys() == sb["leaf_loss"].keys(), a.name
        for leaf in sa["leaf_loss"]:
            assert sa["leaf_loss"][leaf] == pytest.approx(sb["leaf_loss"][leaf], rel=1e-4), (a.name, leaf)
        pa, pb = a.module.export_ptq_params(), b.module.export_ptq_params()
        assert pa.keys() == pb.keys()
        for key in pa:
            n_eq += int((pa[key] == pb[key]).sum())
            n_all += pa[key].numel()
    assert n_all > 100 and n_eq >= 0.95 * n_all


def test_workflow_stores_no_call_and_exports_the_clips(tiny_adapter, tmp_path):
    """run_blockwise_ptq with hclip,gptq:sequential=false on one tiny layer: the capture's own
    accounting records no stored call (capture_bytes 0, Hessians collected), hclip's clips reach
    GPTQ (the layer's loss below GPTQ alone's... or equal where the clip is 1), and the clip of
    hclip alone is what the parameter files hold."""
    from amct_ext.base import PtqConfig
    from amct_ext.io.io_utils import safe_torch_load
    from amct_ext.pipeline.phases import PhaseTimer
    from amct_ext.pipeline.ptq_spec import PtqSpec
    from amct_ext.pipeline.workflow import PARAMS_DIR, PtqRuntime, load_calib_windows, run_blockwise_ptq
    from amct_ext.quant.schemes import QuantScheme

    cfg = PtqConfig(epochs=1, lr=5e-3, n_samples=2, seq_len=48, batch_size=1, seed=0)
    calib = load_calib_windows(tiny_adapter, cfg)

    def run(algo, name):
        timer = PhaseTimer()
        res = run_blockwise_ptq(tiny_adapter, PtqSpec(QuantScheme.from_dict(W4G32), TARGETS, cfg,
                                                      recipe=parse_algo(algo), guard=False),
                                tmp_path / name, layers=range(1, 2), calib_windows=calib,
                                runtime=PtqRuntime(phases=timer))
        tags = {}
        for rec in timer.records:
            tags.update(rec.tags)
        return res, tags

    res, tags = run("hclip", "hclip")
    assert tags["capture_bytes"] == 0 and tags["hessian_bytes"] > 0
    assert all(u.n_calls == 0 for u in res.units)
    assert sum(u.loss_after for u in res.units if u.loss_after) < sum(u.loss_before for u in res.units if u.loss_before)
    params = {p.name: safe_torch_load(p) for p in (tmp_path / "hclip" / PARAMS_DIR).glob("*.pt")}
    clips = [v for p in params.values() for k, v in p.items() if k.endswith("weight_quantizer.clip")]
    assert clips and any((c < 1).any() for c in clips)
    _, tags_clip = run("clip:epochs=0", "clip")
    assert tags_clip["capture_bytes"] > 0          # the accounting sees stored calls where there are any


def test_coordinate_sweeps_equal_a_naive_descent_and_only_lower_the_error():
    """sweeps=2 on a group spec == a naive reference (per row, group by group, every candidate
    scored on the FULL row error d H d^T with the other groups as they are, strict improvement),
    starting from sweeps=0's choice; the exact error falls below it here."""
    W, H = _problem(R=4, C=48, seed=7)
    r0 = hessian_clip_choice(W[None], H[None, None], G16, None, grid=6, grid_min=0.5)
    r2 = hessian_clip_choice(W[None], H[None, None], G16, None, grid=6, grid_min=0.5, sweeps=2)
    ref = r0["clip"][0].clone()
    for _ in range(2):
        for k in range(48 // 16):
            for r in range(4):
                best_e = _exact(W[r:r + 1], H, G16, ref[r:r + 1])
                for c in clip_grid(6, 0.5):
                    trial = ref[r:r + 1].clone()
                    trial[0, k] = c
                    e = _exact(W[r:r + 1], H, G16, trial)
                    if e < best_e - 1e-9 * abs(best_e):
                        best_e, ref[r, k] = e, c
    assert torch.equal(r2["clip"][0], ref)
    assert r2["chosen"][0] < r0["chosen"][0]
    assert r2["chosen"][0].item() == pytest.approx(_exact(W, H, G16, r2["clip"][0]), rel=1e-9)


def test_per_channel_exact_top_equal_to_grid_scores_every_candidate():
    """exact_top = grid on a near rank-one Hessian (its diagonal ranks the factors unlike the
    exact error): still the brute force, since RTN (factor 1.0, the incoming state) takes no
    second slot among the exactly scored (found by search: a version that let 1.0 take one
    scored 2 of the 3 factors and missed the best here)."""
    g = torch.Generator().manual_seed(11)
    W = torch.randn(6, 16, generator=g, dtype=torch.float64) ** 3
    v = torch.randn(16, generator=g, dtype=torch.float64)
    H = torch.outer(v, v) * 50 + torch.diag(torch.rand(16, generator=g, dtype=torch.float64))
    r = hessian_clip_choice(W[None], H[None, None], CH4, None, grid=3, grid_min=0.5, exact_top=3)
    assert torch.equal(r["clip"][0], _brute_force(W, H, CH4, 3, 0.5))


def test_the_chunk_of_experts_fits_the_free_device_memory(monkeypatch):
    """A V4-Pro layer held in 60 GiB leaves about 6 GiB to hclip: 16 experts a chunk ran out
    there (casebook i34-24), so the chunk shrinks to what the free memory holds; with room, or on
    the CPU (no budget), it stays ``expert_chunk``. Which chunk runs does not change a result
    (test_batched_experts_equal_one_by_one)."""
    from amct_ext.runtime import device as devmod

    algo, gib = HessianClip(), 2 ** 30
    cuda = torch.device("cuda", 0)
    assert algo.fitting_chunk((3072, 7168), 0, torch.device("cpu")) == 16
    for total, held, shape, want in ((60, 53.7, (3072, 7168), 4),      # V4-Pro w1 / w3 in 60 GiB
                                     (60, 53.7, (7168, 3072), 6),      # V4-Pro w2: a narrower Hessian
                                     (60, 59.9, (3072, 7168), 1),      # never none
                                     (139.8, 40.0, (2048, 4096), 16)):  # V4-Flash on an H200: as before
        monkeypatch.setattr(devmod, "total_memory_bytes", lambda dev, _t=total: int(_t * gib))
        monkeypatch.setattr(devmod, "memory_allocated", lambda dev, _h=held: int(_h * gib))
        assert algo.fitting_chunk(shape, 0, cuda) == want, (total, held, shape)


@pytest.mark.parametrize("grouped", [True, False])
def test_running_out_of_device_memory_is_one_clear_error(monkeypatch, grouped, caplog):
    """torch's out-of-memory error inside an algorithm becomes one DeviceMemoryError naming the
    algorithm, the layer, the device and what to lower (H1, a V4-Pro layer in 60 GiB, ended in a
    torch traceback); the log names the project frame that ran out."""
    import logging

    from amct_ext.algorithms.runner import _apply_algorithm
    from amct_ext.errors import DeviceMemoryError

    mods, stats = _experts(spec=G16)
    units = _units(mods)
    datas = {u.name: UnitData([], hessians=s) for u, s in zip(units, stats)}
    ctxs = {u.name: SolveContext(layer_idx=7) for u in units}

    def no_memory(self, *a, **k):
        raise torch.OutOfMemoryError("stand-in: out of device memory")

    monkeypatch.setattr(HessianClip, "_solve_chunk", no_memory)
    algo = HessianClip(grid=10, expert_chunk=4)
    if not grouped:
        monkeypatch.setattr(HessianClip, "group_kinds", frozenset())
    with caplog.at_level(logging.WARNING), pytest.raises(DeviceMemoryError) as err:
        _apply_algorithm(algo, units, datas, ctxs, {u.name: {} for u in units}, {u.name: 0.0 for u in units})
    assert str(err.value).startswith("hclip, layer 7: out of device memory on cpu; lower hclip:expert_chunk (now 4;")
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert any("hclip layer 7: out of device memory in hessian_clip.py:" in r.getMessage() for r in caplog.records)


def test_the_experts_are_solved_in_the_fitting_chunks(monkeypatch):
    mods, stats = _experts(spec=G16)
    sizes, solve = [], HessianClip._solve_chunk

    def record(self, chunk, *a, **k):
        sizes.append(len(chunk))
        return solve(self, chunk, *a, **k)

    monkeypatch.setattr(HessianClip, "fitting_chunk", lambda self, shape, groups, dev: 2)
    monkeypatch.setattr(HessianClip, "_solve_chunk", record)
    _run(mods, stats, 4)
    assert sizes and max(sizes) == 2


def test_the_chunk_estimate_bounds_the_measured_working_set():
    """fitting_chunk's estimate of an expert's working set is at least what hclip held on V4-Pro's
    expert shapes, measured on the CPU (benchmarks/check_hclip_memory.py); the estimate is the one
    fitting_chunk divides by (HessianClip.expert_working_bytes), at the current WORK_COPIES."""
    import json
    from pathlib import Path

    rec = json.loads((Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "hclip_memory.json").read_text())
    assert {(r["rows"], r["cols"]) for r in rec["runs"].values()} == {(3072, 7168), (7168, 3072)}
    for r in rec["runs"].values():
        n, rows, cols = r["experts"], r["rows"], r["cols"]
        estimate = n * HessianClip.expert_working_bytes((rows, cols)) / 2 ** 30
        assert estimate >= r["working_gib"] > 0, r
