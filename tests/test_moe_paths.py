"""The grouped-GEMM expert path computes exactly what the per-expert reference loop computes."""
import copy

import pytest
import torch

from amct_ext.quant.schemes import QuantScheme, load_scheme
from models.deepseek_v4.quant_module import quantize_block, set_quant_enabled
from models.deepseek_v4.tiny import random_tiny_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_equals_loop(dtype):
    model = random_tiny_model(0, dtype=dtype)
    ids = torch.randint(2, 512, (2, 70), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loop = model(ids)
        for block in model.layers:
            block.ffn.pack_experts()
            assert block.ffn._packed is not None
        grouped = model(ids)
    assert torch.equal(loop, grouped)


@torch.no_grad()
def test_packing_follows_wrappers_and_moves():
    model = random_tiny_model(0, dtype=torch.bfloat16)
    block = model.layers[2]
    block.ffn.pack_experts()
    x = torch.randn(1, 20, 64, dtype=torch.bfloat16)
    assert block.ffn._can_group(x.view(-1, 64))
    static = QuantScheme.from_dict({
        "name": "w8a8-static", "weight": {"format": "int", "bits": 8, "granularity": "channel"},
        "input": {"format": "int", "bits": 8, "granularity": "tensor", "dynamic": False}, "cache": None})
    q = quantize_block(block, static, ["moe"])      # in place: the packed views stay shared
    assert not q.ffn._can_group(x.view(-1, 64))   # per-expert static input scales: loop path
    set_quant_enabled(q, False)
    assert q.ffn._can_group(x.view(-1, 64))       # quant off: float math again, grouped is exact
    other = model.layers[1]
    other.ffn.pack_experts()
    other.to(torch.float32)
    assert other.ffn._packed is None             # moved: packing dropped, loop path


def test_gradients_never_take_the_grouped_path():
    """The stacks are plain (detached) tensors: with gradients on, the loop path must run."""
    model = random_tiny_model(0, dtype=torch.float32)
    block = model.layers[3]
    block.ffn.pack_experts()
    x = torch.randn(1, 20, 4, 64)
    ids = torch.randint(2, 512, (1, 20))
    block(x, 0, ids).square().sum().backward()
    assert block.ffn.experts[0].w1.weight.grad is not None or block.ffn.experts[1].w1.weight.grad is not None
    q = quantize_block(block, load_scheme("w8a8"), ["moe"])
    params = [p for e in q.ffn.experts for p in e.ptq_parameters()]
    q(x, 0, ids).square().sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)


def _quantized_layer3(dtype, scheme: str, seed: int):
    """(ids, embedded x, layer 3 of a random tiny model packed and quantized at ``scheme``)."""
    model = random_tiny_model(0, dtype=dtype)
    ids = torch.randint(2, 512, (2, 70), generator=torch.Generator().manual_seed(seed))
    block = model.layers[3]
    block.ffn.pack_experts()
    return ids, model.embed_tokens(ids), quantize_block(copy.deepcopy(block), load_scheme(scheme), ["moe"])


@pytest.mark.parametrize("scheme", ["w8a8", "fp8", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_fake_quant_equals_per_expert_loop(scheme, dtype):
    """Per-token input scales depend on the row alone, so quantizing all sorted rows at once and
    running the stacked fake-quant weights gives exactly the per-expert loop's result."""
    ids, x, q = _quantized_layer3(dtype, scheme, 2)
    with torch.no_grad():
        assert q.ffn._can_group(x.view(-1, 64))
        grouped = q(x, 0, ids)
        q.ffn._can_group = lambda flat: False
        loop = q(x, 0, ids)
    assert torch.equal(grouped, loop)


def test_grouped_path_holds_one_copy_of_the_fake_quant_experts():
    """The grouped path reads only its stacks: building them must not also fill every expert's
    QuantLinear cache, a second copy of all fake-quant expert weights (12.3 GiB on a V4-Flash
    layer; casebook i24-br3). The stacks are the very values quantized_weight() gives."""
    model = random_tiny_model(0, dtype=torch.bfloat16)
    ids = torch.randint(2, 512, (2, 70), generator=torch.Generator().manual_seed(3))
    x = model.embed_tokens(ids)
    block = model.layers[3]
    block.ffn.pack_experts()
    q = quantize_block(copy.deepcopy(block), load_scheme("w4a16"), ["moe"])
    q.eval()
    with torch.no_grad():
        assert q.ffn._can_group(x.view(-1, 64))
        q(x, 0, ids)
        leaves = [getattr(e, p) for e in q.ffn.experts for p in ("w1", "w3", "w2")]
        assert all(leaf._cached_weight is None for leaf in leaves)
        w13, w2 = q.ffn.grouped_weights()
        for k, e in enumerate(q.ffn.experts):
            assert torch.equal(w13[k], torch.cat((e.w1.quantized_weight(), e.w3.quantized_weight())))
            assert torch.equal(w2[k], e.w2.quantized_weight())


def test_backward_after_an_inference_mode_forward():
    """Cached tables (rope cos / sin, the Hadamard matrix, bf16 weight splits) first built under
    torch.inference_mode must still work in a later forward that autograd records (casebook S7)."""
    from models.deepseek_v4 import modeling

    modeling._rope_table.cache_clear()
    modeling._hadamard.cache_clear()
    model = random_tiny_model(0, dtype=torch.float32)
    ids = torch.randint(2, 512, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        model(ids)
    for p in model.parameters():
        p.requires_grad_(True)
    model(ids).square().mean().backward()
    assert model.layers[1].attn.wq_b.weight.grad is not None   # gradients flowed through rope


def test_grouped_path_never_syncs_with_the_host(monkeypatch):
    """No torch.bincount / .tolist() / .item() on the grouped path: on CUDA each is a host sync,
    which stalls the launches and makes the layer impossible to capture in a graph (casebook S12)."""
    model = random_tiny_model(0, dtype=torch.float32)
    for block in model.layers:
        block.ffn.pack_experts()
    ids = torch.randint(2, 512, (2, 40), generator=torch.Generator().manual_seed(2))

    def refuse(*args, **kwargs):
        raise AssertionError("host sync on the grouped MoE path")

    monkeypatch.setattr(torch, "bincount", refuse)
    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)
    with torch.no_grad():
        for block in model.layers:
            x = torch.randn(2, 40, block.ffn.dim)
            assert block.ffn._can_group(x.reshape(-1, block.ffn.dim))
            block.ffn(x, ids)


@pytest.mark.parametrize("scheme", ["w4a16", "w8a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_quant_experts_a_chunk_at_a_time_give_the_same_numbers(scheme, dtype, monkeypatch):
    """Where the experts' fake-quant stacks exceed the device budget (a V4-Pro layer: 47 GiB
    beside 53 GiB of weights; casebook i34-15) they are made a chunk of experts at a time, every
    forward, and dropped: the same numbers as the whole stacks and the per-expert loop, the whole
    stacks never built, and per-expert statistics (the Hessian observer) the same."""
    from models.deepseek_v4 import quant_module as qm

    ids, x, q = _quantized_layer3(dtype, scheme, 4)
    q.eval()
    with torch.no_grad():
        whole = q(x, 0, ids)
        assert q.ffn.grouped_chunks() is None
        per_expert = (3 * 64 * q.ffn.experts[0].w2.weight.shape[1]) * q.ffn.experts[0].w1.weight.element_size()
        monkeypatch.setattr(type(q.ffn), "stack_budget_bytes", lambda self, device: 3 * per_expert)
        monkeypatch.setattr(type(q.ffn), "CHUNK_BYTES", 3 * per_expert)
        sizes = []
        make = qm._fake_quant_stacks
        monkeypatch.setattr(qm, "_fake_quant_stacks", lambda experts: sizes.append(len(experts)) or make(experts))
        q.ffn._plan = None
        assert q.ffn._can_group(x.view(-1, 64))
        chunked = q(x, 0, ids)
        assert q.ffn._plan[4] is None and sizes and max(sizes) == 3       # never all 8 experts at once
        assert len(q.ffn.grouped_chunks()) == 3                             # 3 + 3 + 2 experts
        q.ffn._can_group = lambda flat: False
        loop = q(x, 0, ids)
    assert torch.equal(chunked, whole)
    assert torch.equal(chunked, loop)


def test_the_hessian_observer_sees_the_same_rows_when_chunked(monkeypatch):
    ids, x, q = _quantized_layer3(torch.float32, "w4a16", 5)
    q.eval()
    flat = x.mean(2).reshape(-1, 64)

    def observed():
        seen = []
        q.ffn.row_observer = lambda rows, proj, counts: seen.append((proj, rows.clone(), counts.clone()))
        q.ffn._plan = None
        with torch.no_grad():
            out = q.ffn(flat, ids.reshape(-1))
        del q.ffn.row_observer
        return out, seen

    whole, seen_whole = observed()
    per_expert = 3 * 64 * q.ffn.experts[0].w2.weight.shape[1] * 4
    monkeypatch.setattr(type(q.ffn), "stack_budget_bytes", lambda self, device: 2 * per_expert)
    monkeypatch.setattr(type(q.ffn), "CHUNK_BYTES", 2 * per_expert)
    chunked, seen_chunked = observed()
    assert q.ffn.grouped_chunks() is not None
    assert torch.equal(whole, chunked)
    assert [p for p, _, _ in seen_whole] == [p for p, _, _ in seen_chunked] == ["w1", "w2"]
    for (_, a, ca), (_, b, cb) in zip(seen_whole, seen_chunked):
        assert torch.equal(a, b) and torch.equal(ca, cb)
