"""``BandedAttention`` (the sparse attention's own backward, models/deepseek_v4/banded_attention.py)
against autograd through the plain torch ops it replaces.

The model takes it under autograd on the fast-path devices only (CUDA), so here the choice is
forced by patching ``modeling.fast_paths_enabled`` for ``_use_banded_backward`` alone; the inputs
are the attention's real ones on the tiny model (window only, ratio 4 with the indexer's picks,
ratio 8 causal entries), with a sequence that pads the last query block."""

import pytest
import torch

import models.deepseek_v4.modeling as modeling
from models.deepseek_v4.banded_attention import BandedAttention
from models.deepseek_v4.tiny import random_tiny_model
from tests.test_fused_attention import CASES, CAUSAL_RATIO, _inputs

pytestmark = pytest.mark.usefixtures("one_thread")


def _attention(layer: int, dtype: torch.dtype):
    attn = random_tiny_model(0, dtype=dtype).layers[layer].attn
    if attn.ratio > 4:
        attn.ratio = CAUSAL_RATIO
    attn.attn_sink.requires_grad_(False)
    return attn


def _run(attn, inputs, banded: bool, monkeypatch) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """(output, gradients of q, kv, comp_kv) of a weighted sum of the output, through the banded
    Function (``banded``) or autograd through the plain ops."""
    q, kv, comp_kv, comp_idx = (t.detach().clone().requires_grad_(t.is_floating_point()) if t is not None else None
                                for t in inputs)
    with monkeypatch.context() as m:
        m.setattr(modeling, "fast_paths_enabled", lambda device: banded)
        assert attn._use_banded_backward(q, kv, comp_kv) is banded
        out = attn.sparse_attention(q, kv, comp_kv, comp_idx)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(out.dtype)
    (out * weights).sum().backward()
    return out.detach(), [None if t is None else t.grad for t in (q, kv, comp_kv)]


@pytest.mark.parametrize("layer, bsz, seqlen", CASES)
def test_gradients_equal_autograd_through_the_plain_ops_in_float64(layer, bsz, seqlen, monkeypatch):
    attn = _attention(layer, torch.float64)
    inputs = [None if t is None else (t.double() if t.is_floating_point() else t)
              for t in _inputs(attn, bsz, seqlen, seed=layer)]
    out_ref, grads_ref = _run(attn, inputs, False, monkeypatch)
    out, grads = _run(attn, inputs, True, monkeypatch)
    assert torch.equal(out, out_ref)
    for name, g, r in zip(("q", "kv", "comp_kv"), grads, grads_ref):
        if r is None:
            assert g is None and inputs[2] is None, name
            continue
        assert g is not None and g.shape == r.shape, name
        scale = r.abs().max().item()
        assert scale > 0, name
        assert (g - r).abs().max().item() <= 1e-12 * scale, name


@pytest.mark.parametrize("layer, bsz, seqlen", CASES)
def test_bf16_forward_is_bit_for_bit_and_gradients_as_close_to_float64(layer, bsz, seqlen, monkeypatch):
    """In bf16 the forward is the plain path's to the bit; the gradients differ from autograd's
    only by rounding: each path is no further from the float64 gradient than twice the other's
    distance plus a bf16 step."""
    attn64 = _attention(layer, torch.float64)
    inputs64 = [None if t is None else (t.double() if t.is_floating_point() else t)
                for t in _inputs(attn64, bsz, seqlen, seed=layer)]
    _, exact = _run(attn64, inputs64, False, monkeypatch)
    attn = _attention(layer, torch.bfloat16)
    attn.attn_sink.data = attn64.attn_sink.data.float()
    inputs = [None if t is None else (t.bfloat16() if t.is_floating_point() else t) for t in inputs64]
    out_ref, grads_ref = _run(attn, inputs, False, monkeypatch)
    out, grads = _run(attn, inputs, True, monkeypatch)
    assert torch.equal(out, out_ref)
    for name, g, r, e in zip(("q", "kv", "comp_kv"), grads, grads_ref, exact):
        if e is None:
            continue
        err_banded = (g.double() - e).abs().max().item()
        err_plain = (r.double() - e).abs().max().item()
        assert err_banded <= 2 * err_plain + 2 ** -8 * e.abs().max().item(), (name, err_banded, err_plain)


def test_not_taken_where_it_would_be_wrong(monkeypatch):
    """A sink that learns, a hooked product, or no autograd: the plain path."""
    attn = _attention(1, torch.float64)
    q, kv, comp_kv, _ = _inputs(attn, 1, 9, seed=1)
    q.requires_grad_(True)
    monkeypatch.setattr(modeling, "fast_paths_enabled", lambda device: True)
    assert attn._use_banded_backward(q, kv, comp_kv)
    with torch.no_grad():
        assert not attn._use_banded_backward(q, kv, comp_kv)
    attn.attn_sink.requires_grad_(True)
    assert not attn._use_banded_backward(q, kv, comp_kv)
    attn.attn_sink.requires_grad_(False)
    handle = attn.qk_matmul.register_forward_hook(lambda *a: None)
    assert not attn._use_banded_backward(q, kv, comp_kv)
    handle.remove()
    assert attn._use_banded_backward(q, kv, comp_kv)
    with pytest.raises(ValueError, match="sink must be frozen"):
        BandedAttention.apply(torch.zeros(1, 1, 2, 16, requires_grad=True), torch.zeros(1, 1, 4, 16), None,
                              torch.ones(1, 1, 2, 1, 4, dtype=torch.bool), None, torch.zeros(1, requires_grad=True), 1.0)


def test_a_block_tunes_through_the_banded_attention(monkeypatch):
    """A whole decoder block (ratio 4: window, indexer picks, compressor) under autograd, its sink
    frozen as in the block stage: the attention takes ``BandedAttention``, and every attention
    weight's gradient equals autograd's through the plain ops. The block's fp32 islands (compressor,
    hc ends) keep fp32 even in a float64 model, so the bound is fp32's (2e-6 relative, as the hc ends'
    block test), not the 1e-12 of the attention alone above."""
    model = random_tiny_model(0, dtype=torch.float64)
    block = model.layers[1]
    assert block.attn.ratio == 4
    block.attn.attn_sink.requires_grad_(False)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 37, block.hc_mult, model.config.dim, generator=g, dtype=torch.float64)
    ids = torch.randint(0, model.config.vocab_size, (2, 37), generator=g)
    cot = torch.randn(x.shape, generator=g, dtype=torch.float64)
    calls = []
    real_apply = BandedAttention.apply

    def counted(*args):
        calls.append(1)
        return real_apply(*args)

    grads = {}
    for banded in (False, True):
        block.zero_grad(set_to_none=True)
        with monkeypatch.context() as m:
            m.setattr(modeling, "fast_paths_enabled", lambda device: banded)
            m.setattr(BandedAttention, "apply", counted)
            (block(x, input_ids=ids) * cot).sum().backward()
        grads[banded] = {n: p.grad.clone() for n, p in block.attn.named_parameters() if p.grad is not None}
    assert len(calls) == 1
    assert sorted(grads[True]) == sorted(grads[False]) and "wq_b.weight" in grads[True] and "wkv.weight" in grads[True]
    for name, r in grads[False].items():
        assert (grads[True][name] - r).abs().max().item() <= 2e-6 * r.abs().max().item(), name
