"""Block-wise rounding's grouped expert path (issue 34): the routed experts' rounding state
stacked chunk by chunk (``LeafStack``), their fake-quant weights by one op a chunk and their
projections by grouped GEMMs -- the same function, and the same gradients, as every expert run as
its own module.

- float64: the MoE's output and every expert's offset and clip gradient equal the per-expert
  reference (a leak of one expert's state into another's -- a chunk bound off by one, a
  neighbour's clip -- changes some expert's gradient and fails it);
- one expert's offset moved changes the rows of exactly the tokens routed to it;
- whole block-rounding runs, grouped and per expert, end in the same state (float64);
- chunking changes no number (fp32, CPU: bit for bit);
- the stacked state is views: each leaf reads what the stack holds, the fold and the saved
  parameters see it.
"""
from __future__ import annotations

import copy

import pytest
import torch

from amct_ext.algorithms.base import BlockData
from amct_ext.algorithms.block_rounding import BlockRound
from amct_ext.quant.schemes import QuantScheme
from models.deepseek_v4.quant_module import iter_block_ptq_units, quantize_block
from models.deepseek_v4.tiny import random_tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

SCHEMES = {
    "w3-g16": {"format": "int", "bits": 3, "symmetric": False, "granularity": "group", "group_size": 16},
    "w4-channel": {"format": "int", "bits": 4, "symmetric": False, "granularity": "channel"},
    "w4-sym-g32": {"format": "int", "bits": 4, "symmetric": True, "granularity": "group", "group_size": 32},
}


def _scheme(name: str) -> QuantScheme:
    return QuantScheme.from_dict({"name": name, "weight": SCHEMES[name], "input": None, "cache": None})


def _block(dtype=torch.float64, scheme="w3-g16", layer=3, seed=0):
    """A quantized tiny layer (hash-routed layer 0 or score-routed layer 3) and its inputs."""
    model = random_tiny_model(seed, dtype=dtype)
    block = quantize_block(model.layers[layer], _scheme(scheme), ["moe"])
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 24, 4, 64, generator=g).to(dtype)
    ids = torch.randint(2, 512, (2, 24), generator=g)
    return block, x, ids


def _random_state(block, seed=3):
    """Non-trivial offsets and clips on every routed expert's leaves (as after some steps)."""
    g = torch.Generator().manual_seed(seed)
    for e in block.ffn.experts:
        for lin in (e.w1, e.w3, e.w2):
            wq = lin.weight_quantizer
            wq.init_round_offset(lin.weight)
            wq.init_clip(lin.weight)
            with torch.no_grad():
                wq.round_offset.copy_(torch.rand(wq.round_offset.shape, generator=g) - 0.5)
                wq.clip.copy_(0.7 + 0.3 * torch.rand(wq.clip.shape, generator=g))


def _leaf_grads(block):
    out = {}
    for k, e in enumerate(block.ffn.experts):
        for name in ("w1", "w3", "w2"):
            wq = getattr(e, name).weight_quantizer
            out[(k, name)] = (wq.round_offset.grad, wq.clip.grad)
    return out


def _per_expert_grads(block, x, ids, target):
    for e in block.ffn.experts:
        for lin in (e.w1, e.w3, e.w2):
            lin.weight_quantizer.round_offset.requires_grad_(True)
            lin.weight_quantizer.clip.requires_grad_(True)
    block.ffn.grouped = False
    y = block.ffn(x[:, :, 0], ids)
    (y - target).square().sum().backward()
    return y.detach(), _leaf_grads(block)


def _stacked_grads(block, x, ids, target, chunk_bytes):
    stacks = block.ffn.attach_leaf_stacks(learn_clip=True, clip_min=0.5, chunk_bytes=chunk_bytes, recompute=True)
    assert len(stacks) == 2 and len(stacks[0].bounds) > 1, "several chunks are what this test is about"
    for st in stacks:
        for p in st.params():
            p.requires_grad_(True)
    y = block.ffn(x[:, :, 0], ids)
    (y - target).square().sum().backward()
    grads = {}
    s13, s2 = stacks
    inter = s2.weight.shape[-1]
    for st, names in ((s13, (("w1", 0), ("w3", inter))), (s2, (("w2", 0),))):
        for k, (e0, e1) in enumerate(st.bounds):
            for e in range(e0, e1):
                for name, r0 in names:
                    rows = inter if name != "w2" else st.weight.shape[1]
                    gv = st.offsets[k].grad[e - e0, r0:r0 + rows]
                    gc = st.clips[k].grad[e - e0, r0:r0 + rows]
                    grads[(e, name)] = (gv, gc)
    block.ffn.detach_leaf_stacks()
    return y.detach(), grads


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("layer", [0, 3])
def test_stacked_experts_equal_the_per_expert_modules_with_gradients(scheme, layer):
    block, x, ids = _block(scheme=scheme, layer=layer)
    _random_state(block)
    other = copy.deepcopy(block)
    target = torch.randn(x.shape[0], x.shape[1], 64, dtype=x.dtype, generator=torch.Generator().manual_seed(9))
    y_ref, g_ref = _per_expert_grads(block, x, ids, target)
    # about 3 experts a chunk: chunk bounds inside the 8 experts
    expert_bytes = sum(getattr(other.ffn.experts[0], n).weight.numel() for n in ("w1", "w3", "w2")) * 4
    y, g = _stacked_grads(other, x, ids, target, chunk_bytes=3 * expert_bytes)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    routed = 0
    for key, (gv_ref, gc_ref) in g_ref.items():
        gv, gc = g[key]
        if gv_ref is None:       # no token reached the expert: nothing to learn, in both paths
            assert not gv.any() and not gc.any(), key
            continue
        routed += 1
        torch.testing.assert_close(gv, gv_ref, rtol=1e-10, atol=1e-12, msg=f"offset gradient of {key}")
        torch.testing.assert_close(gc, gc_ref, rtol=1e-10, atol=1e-12, msg=f"clip gradient of {key}")
    assert routed >= 12, routed


def test_one_experts_offset_moves_only_its_tokens():
    """A leak of expert e's state into another expert's rows shows here as well: moving e's
    offsets changes the output of exactly the tokens routed to e."""
    block, x, ids = _block()
    flat = x[:, :, 0].reshape(-1, 64)
    with torch.no_grad():
        _, indices = block.ffn.gate(flat, ids.reshape(-1))
        stacks = block.ffn.attach_leaf_stacks(learn_clip=True, clip_min=0.5, chunk_bytes=1, recompute=False)
        base = block.ffn(x[:, :, 0], ids).reshape(-1, 64)
        for e in (1, 5):
            k = next(k for k, (a, b) in enumerate(stacks[0].bounds) if a <= e < b)
            saved = stacks[0].offsets[k].clone()
            stacks[0].offsets[k][e - stacks[0].bounds[k][0]] += 0.45
            moved = block.ffn(x[:, :, 0], ids).reshape(-1, 64)
            stacks[0].offsets[k].copy_(saved)
            changed = (moved != base).any(dim=-1)
            routed = (indices == e).any(dim=-1)
            assert routed.any()
            assert torch.equal(changed, routed), e
        block.ffn.detach_leaf_stacks()


def _expert_bytes(block) -> int:
    return sum(getattr(block.ffn.experts[0], n).weight.numel() for n in ("w1", "w3", "w2")) * 4


def block_data(block, x, ids) -> tuple[list, BlockData]:
    """(units, BlockData) of layer 3 on the samples ``x`` (one a row), its targets the float
    layer's outputs."""
    units = list(iter_block_ptq_units(block, 3, ["moe"]))
    from models.deepseek_v4.quant_module import set_quant_enabled
    with torch.no_grad():
        set_quant_enabled(block, False)
        samples = [(x[i:i + 1], {"start_pos": 0, "input_ids": ids[i:i + 1]}) for i in range(x.shape[0])]
        targets = [block(s, st["start_pos"], st["input_ids"]) for s, st in samples]
        set_quant_enabled(block, True)
    return units, BlockData(units=units, inputs=[s for s, _ in samples], states=[st for _, st in samples],
                            targets=targets, forward=lambda xx, st: block(xx, st["start_pos"], st["input_ids"]),
                            seed=5, layer_idx=3, block=block)


def _run_blockround(block, x, ids, grouped: bool, steps=12, **knobs):
    """BlockRound on the layer, its input/target samples made here (the float layer's outputs)."""
    units, data = block_data(block, x, ids)
    stats = BlockRound(iters=steps, lr=0.02, batch=1, eval_every=3, fold_grid=False, grouped=grouped,
                       chunk_gb=3 * _expert_bytes(block) / 2 ** 30, **knobs).apply_block(data)   # 3 experts a chunk
    state = {}
    for u in units:
        for lname, lin in u.module.named_modules():
            wq = getattr(lin, "weight_quantizer", None)
            if wq is not None and wq.round_offset is not None:
                state[f"{u.name}.{lname}.v"] = wq.round_offset.detach().clone()
            if wq is not None and wq.clip is not None:
                state[f"{u.name}.{lname}.c"] = wq.clip.detach().clone()
    return stats, state


def test_grouped_blockround_steps_equal_the_per_expert_steps():
    block, x, ids = _block(layer=3)
    other = copy.deepcopy(block)
    s_ref, ref = _run_blockround(block, x, ids, grouped=False)
    s_grp, grp = _run_blockround(other, x, ids, grouped=True)
    first = next(iter(s_ref.values()))
    assert first["layer_loss_after"] < first["layer_loss_before"]       # it learned something
    for name in s_ref:
        assert s_grp[name]["layer_loss_after"] == pytest.approx(s_ref[name]["layer_loss_after"], rel=1e-12)
        assert s_grp[name]["best_step"] == s_ref[name]["best_step"]
    assert ref.keys() == grp.keys() and len(ref) > 20
    for key in ref:
        torch.testing.assert_close(grp[key], ref[key], rtol=0, atol=1e-12, msg=key)


@torch.no_grad()
def test_chunking_changes_no_number():
    """fp32 on the CPU: the grouped GEMM and the fake-quant per chunk or all at once, bit for bit."""
    block, x, ids = _block(dtype=torch.float32)
    _random_state(block)
    outs = []
    for chunk_bytes in (1, 10 ** 12):
        block.ffn.attach_leaf_stacks(learn_clip=True, clip_min=0.5, chunk_bytes=chunk_bytes, recompute=False)
        outs.append(block.ffn(x[:, :, 0], ids))
        block.ffn.detach_leaf_stacks()
    assert torch.equal(outs[0], outs[1])


def test_held_chunks_are_the_first_that_fit():
    from amct_ext.quant.leaf_stack import held_chunks

    bounds = [(0, 3), (3, 6), (6, 8)]
    assert held_chunks(bounds, 10, 0) == frozenset()
    assert held_chunks(bounds, 10, 29) == frozenset()            # the first chunk needs 30
    assert held_chunks(bounds, 10, 30) == frozenset({0})
    assert held_chunks(bounds, 10, 79) == frozenset({0, 1})
    assert held_chunks(bounds, 10, 80) == frozenset({0, 1, 2})


def test_held_and_recomputed_chunks_give_the_same_gradients(monkeypatch):
    """Some chunks held (``hold_bytes``: no checkpointing), the rest recomputed: the MoE output
    and every expert's offset and clip gradient equal the per-expert reference (float64), and
    exactly the chunks not held go through the checkpoint."""
    import models.deepseek_v4.quant_module as qm

    checkpointed = []

    def counting(fn, *args, **kw):
        checkpointed.append(fn.args[0])      # the chunk index bound by route_stacked
        return torch.utils.checkpoint.checkpoint(fn, *args, **kw)
    monkeypatch.setattr(qm, "checkpoint", counting)
    block, x, ids = _block()
    _random_state(block)
    other = copy.deepcopy(block)
    target = torch.randn(x.shape[0], x.shape[1], 64, dtype=x.dtype, generator=torch.Generator().manual_seed(9))
    y_ref, g_ref = _per_expert_grads(block, x, ids, target)
    chunk = 3 * _expert_bytes(other) // 4 * 8          # 3 experts' float64 weights: one chunk held
    orig = other.ffn.attach_leaf_stacks

    def attach(**kw):
        stacks = orig(**kw, hold_bytes=chunk)
        held = other.ffn._leaf_stacks[2]
        assert held == frozenset({0}) and len(stacks[0].bounds) == 3, (held, stacks[0].bounds)
        return stacks
    other.ffn.attach_leaf_stacks = attach
    y, g = _stacked_grads(other, x, ids, target, chunk_bytes=3 * _expert_bytes(other))
    assert checkpointed == [1, 2], checkpointed
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    for key, (gv_ref, gc_ref) in g_ref.items():
        gv, gc = g[key]
        if gv_ref is None:
            assert not gv.any() and not gc.any(), key
            continue
        torch.testing.assert_close(gv, gv_ref, rtol=1e-10, atol=1e-12, msg=f"offset gradient of {key}")
        torch.testing.assert_close(gc, gc_ref, rtol=1e-10, atol=1e-12, msg=f"clip gradient of {key}")


def test_memory_knobs_change_no_number():
    """``hold_gb`` (expert chunks held, not recomputed) and ``recompute_units=False`` (attention
    and shared expert held): the same end state as recomputing everything, bit for bit (fp32,
    CPU), and the knobs stay out of the run folder's fingerprint."""
    block, x, ids = _block(dtype=torch.float32)
    runs = []
    for knobs in ({}, {"hold_gb": 4 * _expert_bytes(block) / 2 ** 30, "recompute_units": False}):
        runs.append(_run_blockround(copy.deepcopy(block), x, ids, grouped=True, **knobs))
    (s0, a), (s1, b) = runs
    assert a.keys() == b.keys() and len(a) > 20
    for key in a:
        assert torch.equal(a[key], b[key]), key
    for name in s0:
        assert s0[name]["layer_loss_after"] == s1[name]["layer_loss_after"]
    assert BlockRound(hold_gb=3.0, recompute_units=False).settings() == BlockRound().settings()


@torch.no_grad()
def test_leaves_are_views_of_the_stacks():
    """Every leaf's own offset and clip ARE its slice of its chunk (3 experts a chunk): bound from
    the leaf's state, moved with the chunk, and the leaf's own fake-quant weight is the chunk's."""
    block, x, ids = _block()
    _random_state(block)
    before = {(k, n): (getattr(e, n).weight_quantizer.round_offset.clone(), getattr(e, n).weight_quantizer.clip.clone())
              for k, e in enumerate(block.ffn.experts) for n in ("w1", "w3", "w2")}
    s13, s2 = block.ffn.attach_leaf_stacks(learn_clip=True, clip_min=0.5, chunk_bytes=3 * _expert_bytes(block),
                                           recompute=False)
    assert len(s13.bounds) == 3
    inter = s2.weight.shape[-1]
    for st in (s13, s2):
        for v in st.offsets:
            v.add_(0.01)
    for st, names in ((s13, (("w1", 0, inter), ("w3", inter, 2 * inter))), (s2, (("w2", 0, None),))):
        for k, (e0, e1) in enumerate(st.bounds):
            fq = st.fake_quant(k)
            for e in range(e0, e1):
                for name, r0, r1 in names:
                    lin = getattr(block.ffn.experts[e], name)
                    wq = lin.weight_quantizer
                    v0, c0 = before[(e, name)]
                    assert torch.equal(wq.round_offset, st.offsets[k][e - e0, r0:r1]), (e, name)
                    assert torch.equal(wq.round_offset, v0 + 0.01), (e, name)
                    assert torch.equal(wq.clip, st.clips[k][e - e0, r0:r1]) and torch.equal(wq.clip, c0), (e, name)
                    assert torch.equal(fq[e - e0, r0:r1], wq(lin.weight)), (e, name)
    block.ffn.detach_leaf_stacks()


def test_out_of_device_memory_is_one_clear_error(monkeypatch):
    """A step that runs out of device memory (a V4-Pro layer on one H200, casebook i34-6) ends in
    one DeviceMemoryError naming the layer and the learnable state's size, not a torch traceback;
    the MoE is back on its usual paths afterwards."""
    import models.deepseek_v4.quant_module as qm
    from amct_ext.errors import DeviceMemoryError

    block, x, ids = _block(dtype=torch.float32, layer=3)
    real = qm.grouped_linear

    def short_of_memory(*args, **kwargs):
        if torch.is_grad_enabled():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(qm, "grouped_linear", short_of_memory)
    with pytest.raises(DeviceMemoryError, match=r"blockround, layer 3: out of device memory .* learnable state alone is"):
        _run_blockround(block, x, ids, grouped=True, steps=2)
    assert block.ffn._leaf_stacks is None
