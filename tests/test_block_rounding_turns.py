"""Block-wise rounding with the routed experts in turns (``blockround:turns``; expert_turns.py).

Where a layer's experts and their offsets do not fit the device at once (V4-Pro), one turn's
experts are tuned while every other expert runs at its fake-quant value decoded from integer
codes. What must hold: the codes decode to the fake-quant weights bit for bit; the layer's
forward from codes equals the per-expert fake-quant forward, inside a turn too, gradients
included; the end state is folded into fixed grids that reproduce the MSE the stage reports;
a layer that did not improve goes back to its start."""
from __future__ import annotations

import copy

import pytest
import torch

from amct_ext.algorithms.base import BlockData
from amct_ext.algorithms.block_rounding import BlockRound, _LayerLoss
from amct_ext.errors import ConfigError
from amct_ext.quant import formats
from amct_ext.quant.schemes import TensorSpec
from amct_ext.quant.stack_codes import StackCodes
from models.deepseek_v4.expert_turns import turn_bounds

from tests.test_grouped_block_rounding import _block, _expert_bytes, _random_state, block_data

pytestmark = pytest.mark.usefixtures("one_thread")

SPECS = [TensorSpec("int", 4, True, "group", 32), TensorSpec("int", 3, False, "group", 16),
         TensorSpec("int", 4, False, "channel"), TensorSpec("int", 2, False, "group", 16),
         TensorSpec("int", 8, True, "channel")]


@pytest.mark.parametrize("spec", SPECS, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_codes_decode_to_the_fake_quant_weights_bit_for_bit(spec, dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(3, 8, 64, generator=g) * 0.05).to(dtype)
    clip = 0.6 + 0.4 * torch.rand(formats.scale_shape(w.shape, spec), generator=g)
    off = torch.rand(w.shape, generator=g) - 0.5
    codes = StackCodes(tuple(w.shape), spec, torch.device("cpu"))
    for e in range(3):
        for r0, r1 in ((0, 5), (5, 8)):   # rows put in pieces, as w1 / w3 share a stack
            codes.put(e, (r0, r1), *formats.quantize_int(w[e, r0:r1], spec, clip[e, r0:r1], off[e, r0:r1]))
    assert torch.equal(codes.decode(0, 3, dtype), formats.fake_quant(w, spec, clip, off))
    assert torch.equal(codes.decode(1, 2, dtype), formats.fake_quant(w[1:2], spec, clip[1:2], off[1:2]))
    # two codes a byte where the grid fits a nibble
    assert codes.codes.numel() == w.numel() // (2 if spec.bits <= 4 else 1)


def test_turn_bounds_cover_the_experts_evenly():
    assert turn_bounds(8, 3) == [(0, 2), (2, 5), (5, 8)]
    assert turn_bounds(384, 9)[-1] == (341, 384) and len(turn_bounds(384, 9)) == 9
    assert turn_bounds(2, 5) == [(0, 1), (1, 2)]


def _ffn_out(block, x, ids):
    return block.ffn(x[:, :, 0], ids)


def test_the_layer_from_codes_equals_the_fake_quant_forward():
    """Before a turn every expert runs from its codes; inside turn 1 its experts run through the
    stacked state (the same offsets and clips) and the rest from codes: both equal the per-expert
    fake-quant forward, and turn 1's gradients equal the per-expert ones for those experts."""
    block, x, ids = _block(dtype=torch.float64, scheme="w3-g16", layer=3)
    _random_state(block)
    ref = copy.deepcopy(block)
    ref.ffn.grouped = False
    for e in ref.ffn.experts:
        for lin in (e.w1, e.w3, e.w2):
            lin.weight_quantizer.round_offset.requires_grad_(True)
    g = torch.Generator().manual_seed(9)
    target = torch.randn(x.shape[0], x.shape[1], x.shape[3], generator=g, dtype=torch.float64)
    y_ref = _ffn_out(ref, x, ids)
    (y_ref - target).square().sum().backward()

    moe = block.ffn
    assert moe.begin_leaf_turns(3) == 3
    with torch.no_grad():
        torch.testing.assert_close(_ffn_out(block, x, ids), y_ref.detach(), rtol=0, atol=1e-12)
    e0, e1 = moe.begin_leaf_turn(1)
    stacks = moe.attach_leaf_stacks(learn_clip=True, clip_min=0.5, chunk_bytes=_expert_bytes(block), recompute=True)
    for st in stacks:
        for v in st.offsets:
            v.requires_grad_(True)
    y = _ffn_out(block, x, ids)
    torch.testing.assert_close(y.detach(), y_ref.detach(), rtol=0, atol=1e-12)
    (y - target).square().sum().backward()
    s13, s2 = stacks
    inter = s2.weight.shape[-1]
    for k, (c0, c1) in enumerate(s13.bounds):
        for e in range(c0, c1):
            ex = ref.ffn.experts[e0 + e]
            torch.testing.assert_close(s13.offsets[k].grad[e - c0, :inter], ex.w1.weight_quantizer.round_offset.grad)
            torch.testing.assert_close(s13.offsets[k].grad[e - c0, inter:], ex.w3.weight_quantizer.round_offset.grad)
            torch.testing.assert_close(s2.offsets[k].grad[e - c0], ex.w2.weight_quantizer.round_offset.grad)
    moe.detach_leaf_stacks()
    moe.abort_leaf_turns()
    # aborted: every expert as it began (its own offsets and clips, its float weights)
    with torch.no_grad():
        assert torch.equal(_ffn_out(block, x, ids), _ffn_out(ref, x, ids))
    for a, b in zip(block.ffn.experts, ref.ffn.experts):
        assert torch.equal(a.w1.weight, b.w1.weight) and not a.w1.weight_quantizer.has_fixed_qparams


def test_a_turn_leaves_the_codes_of_the_other_experts_alone():
    block, _, _ = _block(dtype=torch.float32, scheme="w4-channel", layer=3)
    moe = block.ffn
    moe.begin_leaf_turns(2)
    turns = moe._turns
    before = turns.codes13.codes.clone(), turns.codes2.codes.clone()
    e0, e1 = moe.begin_leaf_turn(0)
    stacks = moe.attach_leaf_stacks(learn_clip=True, clip_min=0.5, chunk_bytes=1 << 30, recompute=True)
    with torch.no_grad():
        for st in stacks:
            st.offsets[0].fill_(0.49)   # every code of the turn moves
    moe.detach_leaf_stacks()
    moe.end_leaf_turn()
    for now, then in zip((turns.codes13.codes, turns.codes2.codes), before):
        assert torch.equal(now[e1:], then[e1:])
        assert not torch.equal(now[e0:e1], then[e0:e1])
    assert all(m > 0 for m in turns.moved[e0:e1]) and not any(turns.moved[e1:])
    moe.abort_leaf_turns()


def _joined(xs, states):
    """V4's concatenation of samples (the adapter's ``concat_samples``)."""
    return torch.cat(xs), {"start_pos": 0, "input_ids": torch.cat([st["input_ids"] for st in states])}


def _stage(block, x, ids, concat=None, **knobs):
    units, data = block_data(block, x, ids)
    data.concat = concat
    knobs = {"lr": 0.02, "batch": 1, "keep_best": False, "chunk_gb": 2 * _expert_bytes(block) / 2 ** 30, **knobs}
    algo = BlockRound(**knobs)
    return algo.apply_block(data), data, units


def _mse(data):
    with torch.no_grad():
        se = sum(float((data.forward(x, st) - t).square().sum()) for x, st, t in
                 zip(data.inputs, data.states, data.targets))
        return se / sum(t.numel() for t in data.targets)


def test_turns_end_folded_at_the_mse_they_report():
    block, x, ids = _block(dtype=torch.float32, scheme="w4-sym-g32", layer=3)
    whole = copy.deepcopy(block)
    stats, data, units = _stage(block, x, ids, iters=12, turns=3)
    s_whole, _, _ = _stage(whole, x, ids, iters=12, turns=1)
    first = next(iter(stats.values()))
    # the same start: every expert from its codes equals every expert's fake-quant forward
    assert first["layer_loss_before"] == next(iter(s_whole.values()))["layer_loss_before"]
    assert first["layer_loss_after"] < first["layer_loss_before"] and first["best_step"] == 12
    # the folded layer (fixed grids, weights replaced by the decoded codes) gives the reported MSE
    assert _mse(data) == pytest.approx(first["layer_loss_after"], rel=1e-6)
    for k, e in enumerate(block.ffn.experts):
        for lin in (e.w1, e.w3, e.w2):
            assert lin.weight_quantizer.has_fixed_qparams and lin.weight_replaced
        assert stats[f"layers.3.ffn.experts.{k}"]["folded_leaves"] == 3
    assert sum(stats[f"layers.3.ffn.experts.{k}"]["n_nonzero_offsets"] for k in range(8)) > 0


def test_turns_that_did_not_improve_leave_the_layer_as_it_began(monkeypatch):
    block, x, ids = _block(dtype=torch.float32, scheme="w4-sym-g32", layer=3)
    start = copy.deepcopy(block)
    losses = iter([1.0, 2.0])   # start, end: the end is worse
    monkeypatch.setattr(_LayerLoss, "full_mse", lambda self: next(losses))
    stats, data, _ = _stage(block, x, ids, iters=6, turns=2)
    assert next(iter(stats.values()))["best_step"] == 0
    for a, b in zip(block.ffn.experts, start.ffn.experts):
        for n in ("w1", "w3", "w2"):
            la, lb = getattr(a, n), getattr(b, n)
            assert torch.equal(la.weight, lb.weight) and not la.weight_quantizer.has_fixed_qparams
            assert torch.equal(la.quantized_weight(), lb.quantized_weight())
            assert not la.weight_on_grid()   # float weights: the fake-quant path
    # the other units back at their start; the state the stage created is the identity (clip 1, offset 0)
    before = dict(start.named_parameters())
    for name, p in block.named_parameters():
        if name in before:
            assert torch.equal(p, before[name]), name
        else:
            assert bool((p == (1.0 if name.endswith("clip") else 0.0)).all()), name


def test_turn_settings_refused_and_counted(monkeypatch):
    with pytest.raises(ConfigError, match="fold_grid"):
        BlockRound(turns=2, fold_grid=False, keep_best=False).check()
    with pytest.raises(ConfigError, match="keep_best"):
        BlockRound(turns=2).check()
    block, _, _ = _block(dtype=torch.float32, scheme="w4-channel", layer=3)
    data = BlockData(units=[], inputs=[], states=[], targets=[], forward=None, device=torch.device("cpu"),
                     seed=0, layer_idx=3, block=block)
    algo = BlockRound(keep_best=False, offset_dtype="float16")
    need = block.ffn.leaf_turn_bytes(torch.float16)
    assert need == 8 * _expert_bytes(block) // 4 * (4 + 2)
    assert algo.turns_for(data) == 1                     # the CPU: no device budget
    from amct_ext.runtime import device as devmod
    monkeypatch.setattr(devmod, "total_memory_bytes", lambda dev: int(need / 0.42) + 1)
    assert algo.turns_for(data) == 1                     # fits WHOLE_SHARE
    monkeypatch.setattr(devmod, "total_memory_bytes", lambda dev: need)
    assert algo.turns_for(data) == 7                     # ceil(1 / 0.15)
    assert BlockRound(turns=4).turns_for(data) == 4
    with pytest.raises(ConfigError, match="keep_best=false"):
        BlockRound().turns_for(data)
    # the counts results §1b quotes for a V4-Pro layer (25.43 G expert weights, bf16 + float16)
    from models.deepseek_v4.quant_module import QuantV4MoE

    monkeypatch.setattr(QuantV4MoE, "leaf_turn_bytes", lambda self, dtype: 25433210880 * 4)
    for gib, turns, lean in ((139.8, 5, False), (79.2, 8, True), (60, 11, True)):
        monkeypatch.setattr(devmod, "total_memory_bytes", lambda dev, _g=gib: int(_g * 2 ** 30))
        assert algo.turns_for(data) == turns, gib
        # where the device cannot hold the experts' weights and offsets even once: the setting
        # measured in 60 GiB (results §1b); an explicit count of turns keeps the recipe's own
        got = algo.settings_for(data, turns)
        assert (got.micro_batch, got.recompute_units, got.chunk_gb) == ((2, True, 1.0) if lean else (0, False, 2.0)), gib
        assert BlockRound(keep_best=False, turns=turns).settings_for(data, turns).micro_batch == 0
    assert BlockRound(keep_best=False, micro_batch=4, chunk_gb=0.5).settings_for(data, 11).micro_batch == 4
    assert BlockRound(keep_best=False, micro_batch=4, chunk_gb=0.5).settings_for(data, 11).chunk_gb == 0.5


def test_few_steps_a_turn_are_warned(caplog):
    """Each expert takes iters / turns steps: at 3 a turn a V4-Pro layer ended worse than it began
    (results §1b, P3), at 9 better (P1, P2). Under 9 the run says so, naming the setting."""
    import logging

    block, x, ids = _block(dtype=torch.float32, scheme="w4-sym-g32", layer=3)
    for iters, warned in ((35, True), (36, False)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            _stage(copy.deepcopy(block), x, ids, iters=iters, turns=4)
        said = [r.getMessage() for r in caplog.records if "steps over 4 turns" in r.getMessage()]
        assert bool(said) == warned, (iters, said)
        assert not said or f"{iters} steps over 4 turns leave each expert 8;" in said[0] and "blockround:iters" in said[0]


def test_the_default_takes_the_lean_setting_where_the_device_needs_it(monkeypatch):
    """turns=0 on a device that cannot hold the experts' weights and offsets once runs what the
    recipe with that setting written out runs, to the bit (statistics and every leaf's state)."""
    from amct_ext.runtime import device as devmod

    block, x, ids = _block(dtype=torch.float32, scheme="w4-sym-g32", layer=3)
    x, ids = torch.cat([x] * 2), torch.cat([ids] * 2)
    need = block.ffn.leaf_turn_bytes(torch.float16)
    monkeypatch.setattr(devmod, "total_memory_bytes", lambda dev: need - 1)
    ran = []
    run = BlockRound._apply_in_turns

    def spy(self, data, per_unit, leaves, n_turns):
        ran.append((n_turns, self.micro_batch, self.recompute_units, self.chunk_gb))
        return run(self, data, per_unit, leaves, n_turns)

    monkeypatch.setattr(BlockRound, "_apply_in_turns", spy)
    chunk = 2 * _expert_bytes(block) / 2 ** 30
    auto = copy.deepcopy(block)
    got, _, _ = _stage(auto, x, ids, iters=8, offset_dtype="float16", chunk_gb=chunk)
    written = copy.deepcopy(block)
    want, _, _ = _stage(written, x, ids, iters=8, offset_dtype="float16", chunk_gb=chunk, turns=7, micro_batch=2,
                        recompute_units=True)
    assert ran == [(7, 2, True, chunk), (7, 2, True, chunk)]
    _same_stats(got, want)
    for (name, a), (_, b) in zip(auto.named_parameters(), written.named_parameters()):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(auto.named_buffers(), written.named_buffers()):
        assert torch.equal(a, b), name


def test_the_stacks_the_layer_was_built_with_are_freed_during_the_turns(monkeypatch):
    """The turns save device memory only if nothing keeps the experts' original stacks alive (the
    V4-Pro run that held them through the stage's own lists of leaves and frozen parameters ran
    out of memory at 76 GiB): at each turn no live tensor may use their storage."""
    import gc

    from models.deepseek_v4.quant_module import QuantV4MoE

    block, x, ids = _block(dtype=torch.float32, scheme="w4-sym-g32", layer=3)
    w13, _ = block.ffn._packed_quant_weights()
    storage = (w13.untyped_storage().data_ptr(), w13.untyped_storage().nbytes())
    del w13

    def alive() -> bool:
        gc.collect()
        return any(isinstance(o, torch.Tensor) and (o.untyped_storage().data_ptr(), o.untyped_storage().nbytes())
                   == storage for o in gc.get_objects())

    assert alive()
    seen = []
    begin = QuantV4MoE.begin_leaf_turn

    def check_then_begin(self, j):
        seen.append(alive())
        return begin(self, j)

    monkeypatch.setattr(QuantV4MoE, "begin_leaf_turn", check_then_begin)
    _stage(block, x, ids, iters=4, turns=2)
    assert seen == [False, False]


def test_an_error_inside_the_turns_is_the_one_reported(monkeypatch):
    """An out-of-memory error inside a turn: restoring the layer must not raise a second error
    over it (the experts then stay on the host; the layer is discarded with the error)."""
    from amct_ext.errors import DeviceMemoryError
    from models.deepseek_v4.expert_turns import ExpertTurns

    block, x, ids = _block(dtype=torch.float32, scheme="w4-sym-g32", layer=3)

    def no_memory(self, *a, **k):
        raise torch.OutOfMemoryError("stand-in: out of device memory")

    monkeypatch.setattr(_LayerLoss, "group_error", no_memory)
    monkeypatch.setattr(ExpertTurns, "finish", no_memory)
    with pytest.raises(DeviceMemoryError, match="blockround, layer 3: out of device memory"):
        _stage(block, x, ids, iters=4, turns=2)


def test_where_the_memory_ran_out_is_logged(monkeypatch, caplog):
    """The reported error replaces torch's traceback: the log names the project frame that ran out
    (the V4-Pro run that ran out after its 100 steps said only 'out of device memory')."""
    import logging

    from amct_ext.errors import DeviceMemoryError
    from models.deepseek_v4.expert_turns import ExpertTurns

    block, x, ids = _block(dtype=torch.float32, scheme="w4-sym-g32", layer=3)

    def no_memory(self, keep):
        raise torch.OutOfMemoryError("stand-in: out of device memory")

    monkeypatch.setattr(ExpertTurns, "finish", no_memory)
    with caplog.at_level(logging.WARNING), pytest.raises(DeviceMemoryError):
        _stage(block, x, ids, iters=4, turns=2)
    # the innermost frame of the project's code (the stand-in lives in this test file)
    assert any("out of device memory in quant_module.py:" in r.getMessage() and "(end_leaf_turns)" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_the_other_units_are_settled_before_the_experts_come_back(monkeypatch):
    """A V4-Pro layer's 47 GiB of float experts come back to the device at the end of the turns:
    by then the other units' offsets must be folded and gone (casebook i34-20: they, the last
    batch and the attention's fold beside the experts ran a 60-GiB budget out after 100 steps).
    The results are those of settling them after (test_turns_end_folded_at_the_mse_they_report)."""
    from models.deepseek_v4.expert_turns import ExpertTurns

    block, x, ids = _block(dtype=torch.float32, scheme="w4-sym-g32", layer=3)
    others = [m for name, m in block.named_modules() if hasattr(m, "weight_quantizer") and ".experts." not in
              f".{name}." and m.weight_quantizer.roundable]
    assert others
    seen = []
    finish = ExpertTurns.finish

    def check_then_finish(self, keep):
        seen.append([(m.weight_quantizer.round_offset is None, getattr(m, "weight_replaced", False)) for m in others])
        return finish(self, keep)

    monkeypatch.setattr(ExpertTurns, "finish", check_then_finish)
    stats, _, _ = _stage(block, x, ids, iters=6, turns=2)
    assert next(iter(stats.values()))["best_step"] == 6   # kept: the folds happened
    assert len(seen) == 1 and all(gone and folded for gone, folded in seen[0]), seen
    units, _ = block_data(copy.deepcopy(block), x, ids)
    assert list(stats) == [u.name for u in units]   # every unit, in the units' order


def _storages() -> dict[int, int]:
    """{data_ptr: nbytes} of every live tensor's storage."""
    import gc

    gc.collect()
    return {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes() for o in gc.get_objects()
            if isinstance(o, torch.Tensor) and not o.is_meta}


@pytest.mark.parametrize("keep", [True, False])
def test_nothing_of_the_turns_stays_when_the_experts_come_back(monkeypatch, keep):
    """When every expert's float weights come back to the device (a V4-Pro layer: 47.4 GiB into
    60), nothing else of the stage may still be there (casebook i34-21: the codes, the start
    clips, the other units' offsets and the last turn's stack, through a loop variable, held
    about 10 GiB and ran the P2 run out). At that moment every tensor made since the stage began
    is the layer's own state (its weights, clips and fixed grids) or one of its targets."""
    from models.deepseek_v4.expert_turns import ExpertTurns
    from models.deepseek_v4.quant_module import QuantV4MoE

    block, x, ids = _block(dtype=torch.float32, scheme="w4-sym-g32", layer=3)
    _random_state(block)   # a start state of offsets and clips (as after hclip) for the turns to keep
    x, ids = torch.cat([x] * 4), torch.cat([ids] * 4)   # 8 samples: turns of several steps
    # the code's own lazy caches (lru_cache'd tables) made before: a stage on a copy
    knobs = dict(iters=8, turns=4, offset_dtype="float16", micro_batch=2, recompute_units=True,
                 chunk_gb=2 * _expert_bytes(block) / 2 ** 30)
    _stage(copy.deepcopy(block), x, ids, **knobs)
    seen = {}
    bind = QuantV4MoE._bind_stacks

    def look_then_bind(self, w13, w2, copy=False):
        if "finish" in seen and "back" not in seen:   # the float weights, back from the host
            seen["back"] = {k: n for k, n in _storages().items()
                            if k not in (w13.untyped_storage().data_ptr(), w2.untyped_storage().data_ptr())}
        return bind(self, w13, w2, copy=copy)

    finish = ExpertTurns.finish

    def mark_then_finish(self, keep):
        seen["finish"] = True
        return finish(self, keep)

    monkeypatch.setattr(QuantV4MoE, "_bind_stacks", look_then_bind)
    monkeypatch.setattr(ExpertTurns, "finish", mark_then_finish)
    if not keep:   # the end no better than the start
        monkeypatch.setattr(_LayerLoss, "full_mse", lambda self: 1.0)
    before = _storages()
    start = {t.untyped_storage().data_ptr() for e in block.ffn.experts for lin in (e.w1, e.w3, e.w2)
             for t in (lin.weight_quantizer.clip, lin.weight_quantizer.round_offset)}
    stats, data, _ = _stage(block, x, ids, **knobs)
    assert next(iter(stats.values()))["folded_leaves"] == (3 if keep else 0)
    # the layer's own state now (weights, clips, grids of every module) and the targets
    layer = {t.untyped_storage().data_ptr() for m in block.modules()
             for t in [*m._parameters.values(), *m._buffers.values(), *vars(m).values()] if isinstance(t, torch.Tensor)}
    layer |= {t.untyped_storage().data_ptr() for t in data.targets}
    stray = {k: n for k, n in seen["back"].items() if k not in before and k not in layer}
    # the experts' fixed grids wait on the host by design (in this test the host is the device)
    grids = [t.numel() * t.element_size() for e in block.ffn.experts for lin in (e.w1, e.w3, e.w2)
             for t in (lin.weight_quantizer.fixed_scale, lin.weight_quantizer.fixed_zero_point) if t is not None]
    assert sum(stray.values()) <= sum(grids) and all(n <= max(grids, default=0) for n in stray.values()), stray
    if keep:   # the experts' start state (clips, offsets), replaced by their grids, is gone too
        assert not start & set(seen["back"])



def test_memory_knobs_change_no_number_in_turns():
    """``recompute_units`` moves intermediates, in turns as in one turn: the same numbers (float64)."""
    block, x, ids = _block(dtype=torch.float64, scheme="w4-sym-g32", layer=3)
    other = copy.deepcopy(block)
    plain, _, _ = _stage(block, x, ids, iters=6, turns=2)
    knobs, _, _ = _stage(other, x, ids, iters=6, turns=2, recompute_units=True)
    assert plain == knobs
    for a, b in zip(block.ffn.experts, other.ffn.experts):
        assert torch.equal(a.w1.weight, b.w1.weight) and torch.equal(a.w2.weight, b.w2.weight)


def test_a_batch_in_parts_takes_the_whole_batchs_steps():
    """``micro_batch``: a step's batch split into parts whose gradients add up before the step
    (the offsets then step after the last part, not inside the backward): float64, the same
    end state as the batch in one forward, the experts' offsets, clips and the other units' state."""
    block, x, ids = _block(dtype=torch.float64, scheme="w3-g16", layer=3)
    other = copy.deepcopy(block)
    whole, _, _ = _stage(block, x, ids, concat=_joined, iters=6, turns=2, batch=2)
    parts, _, _ = _stage(other, x, ids, concat=_joined, iters=6, turns=2, batch=2, micro_batch=1)
    first = next(iter(whole.values()))
    assert first["best_step"] == 6 and first["layer_loss_after"] < first["layer_loss_before"]
    _same_stats(parts, whole)
    for (na, a), (nb, b) in zip(block.named_parameters(), other.named_parameters()):
        assert na == nb and torch.equal(a, b), na
    with pytest.raises(ConfigError, match="micro_batch"):
        BlockRound(turns=1, micro_batch=2).check()


def _same_stats(a: dict, b: dict) -> None:
    """The same statistics; the MSEs to fp32 summation order (the errors are summed in fp32)."""
    assert a.keys() == b.keys()
    for name in a:
        for k, v in a[name].items():
            assert (v == pytest.approx(b[name][k], rel=1e-6)) if isinstance(v, float) else v == b[name][k], (name, k)


@pytest.mark.parametrize("turns", [1, 2])
def test_samples_that_cannot_join_take_one_step_a_batch(turns):
    """Samples that do not concatenate run one forward each, so the stacked offsets' fake-quant
    is made once a sample: their SignSGD step must still come once a batch, on the batch's
    gradient (casebook i34-19), in one turn and in turns. Float64: the same end state as the
    joined batch."""
    block, x, ids = _block(dtype=torch.float64, scheme="w3-g16", layer=3)
    other = copy.deepcopy(block)
    knobs = {"iters": 6, "batch": 2, "turns": turns, **({"fold_grid": False} if turns == 1 else {})}
    joined, _, _ = _stage(block, x, ids, concat=_joined, **knobs)
    apart, _, _ = _stage(other, x, ids, **knobs)
    assert next(iter(joined.values()))["layer_loss_after"] < next(iter(joined.values()))["layer_loss_before"]
    _same_stats(apart, joined)
    for (na, a), (nb, b) in zip(block.named_parameters(), other.named_parameters()):
        assert na == nb and torch.equal(a, b), na


def test_experts_folded_by_the_turns_run_on_their_weights_with_the_same_numbers():
    """After the turns every expert's weight is its decoded codes, checked to quantize back to
    itself on its fixed grid: the quantized MoE then runs on the packed weights themselves (no
    fake-quant pass, no copy; a V4-Pro layer's propagate remade 47 GiB of them every forward),
    and the layer gives the fake-quant path's output bit for bit. Any change of a weight lapses it."""
    from amct_ext.quant.quant_linear import QuantLinear

    block, x, ids = _block(dtype=torch.float32, scheme="w3-g16", layer=3)
    stats, data, _ = _stage(block, x, ids, iters=6, turns=2)
    assert next(iter(stats.values()))["best_step"] == 6   # kept: folded
    moe = block.ffn
    leaves = [getattr(e, p) for e in moe.experts for p in ("w1", "w3", "w2")]
    assert all(lin.weight_on_grid() for lin in leaves)
    with torch.no_grad():
        on_grid = [data.forward(xx, st) for xx, st in zip(data.inputs, data.states)]
        plan = moe._plan
        assert plan is not None and plan[4] is not None and plan[4][0] is moe._packed[0]   # the weights themselves
        for lin in leaves:   # the fake-quant path: the marks dropped
            lin._on_grid_key = None
            lin.invalidate_cache()
        plain = [data.forward(xx, st) for xx, st in zip(data.inputs, data.states)]
        assert moe._plan[4][0] is not moe._packed[0]
    assert all(torch.equal(a, b) for a, b in zip(on_grid, plain))
    for m in leaves:
        m.mark_on_grid()
    lin = leaves[4]
    with torch.no_grad():   # an in-place change lapses the mark: the plan goes back to fake-quant
        lin.weight.add_(lin.weight_quantizer.fixed_scale.repeat_interleave(16, dim=-1) * 0.3)
        lin.invalidate_cache()
        data.forward(data.inputs[0], data.states[0])
    assert not lin.weight_on_grid() and moe._plan[4][0] is not moe._packed[0]
    lin.mark_on_grid()
    lin.weight_quantizer.set_fixed_qparams(lin.weight, lin.weight_quantizer.fixed_scale * 2,
                                           lin.weight_quantizer.fixed_zero_point)
    assert not lin.weight_on_grid()   # another grid
    assert QuantLinear._on_grid_key is None   # marks live on instances


def _on_release_grid(block) -> None:
    """The routed experts' weights as built from a released checkpoint: on the FP4 grid (random
    values through the project's own checkpoint codec)."""
    from amct_ext.io.storage_formats import decode_fp4, encode_fp4

    with torch.no_grad():
        for e in block.ffn.experts:
            for lin in (e.w1, e.w3, e.w2):
                w = lin.weight
                w.copy_(decode_fp4(*encode_fp4(w.float()), dtype=w.dtype))


@pytest.mark.parametrize("keep", [True, False])
def test_experts_parked_in_the_release_format_tune_as_in_their_own_dtype(monkeypatch, keep):
    """A layer built from the release parks its experts' float weights on the host as MXFP4 codes
    (12.6 GiB for a V4-Pro layer, not 47.4): the turns must end bit for bit where they end with
    the weights parked in their own dtype, the kept fold and the start state alike; and when the
    float stacks come back, nothing of the turns (codes, parked weights) is left on the device."""
    from amct_ext.io import host_stack
    from models.deepseek_v4.expert_turns import ExpertTurns

    block, x, ids = _block(dtype=torch.float32, scheme="w4-sym-g32", layer=3)
    _on_release_grid(block)
    _random_state(block)
    if not keep:
        monkeypatch.setattr(_LayerLoss, "full_mse", lambda self: 1.0)
    parked, at_fill = [], []
    init, fill = host_stack.HostStack.__init__, ExpertTurns._fill

    def record(self, x, *a, **k):
        init(self, x, *a, **k)
        parked.append(self.compact)

    def look(self, w, source):   # the float stacks are on the device: what else is held there
        at_fill.append((self.codes13, self.codes2, self.host13, self.host2))
        return fill(self, w, source)

    monkeypatch.setattr(host_stack.HostStack, "__init__", record)
    monkeypatch.setattr(ExpertTurns, "_fill", look)
    own = copy.deepcopy(block)
    got, _, _ = _stage(block, x, ids, iters=6, turns=3)
    assert parked == [True, True]            # both stacks (w13, w2) in the release format
    assert at_fill == [(None, None, None, None)] * 2
    monkeypatch.setattr(host_stack, "encode_exact", lambda x: None)
    parked.clear()
    want, _, _ = _stage(own, x, ids, iters=6, turns=3)
    assert parked == [False, False]
    _same_stats(got, want)
    assert next(iter(got.values()))["best_step"] == (6 if keep else 0)
    other = dict(own.named_modules())
    experts = 0
    for name, a in block.named_modules():
        b = other[name]
        for (na, ta), (nb, tb) in zip(a.named_parameters(recurse=False), b.named_parameters(recurse=False)):
            assert na == nb and torch.equal(ta, tb), (name, na)
        if getattr(a, "weight_quantizer", None) is not None:
            assert torch.equal(a.quantized_weight(), b.quantized_weight()), name
            if ".experts." in name:
                experts += 1
                assert a.weight_quantizer.has_fixed_qparams == b.weight_quantizer.has_fixed_qparams == keep, name
    assert experts == 3 * len(block.ffn.experts)


@pytest.mark.parametrize("release", [True, False])
def test_the_parked_bytes_the_run_reports(release):
    """The log's host figure (``QuantV4MoE.parked_bytes``): 17/32 of a byte a weight parked in the
    release's format, the dtype's own size otherwise."""
    block, _, _ = _block(dtype=torch.float32, scheme="w4-channel", layer=3)
    if release:
        _on_release_grid(block)
    n = sum(getattr(e, p).weight.numel() for e in block.ffn.experts for p in ("w1", "w3", "w2"))
    block.ffn.begin_leaf_turns(2)
    assert block.ffn.parked_bytes() == (n * 17 // 32 if release else n * 4)
    block.ffn.abort_leaf_turns()
