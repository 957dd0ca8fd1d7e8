"""A layer's build holds one copy of its routed experts at its peak (casebook i34-14).

``load_block`` decodes every expert weight straight into the grouped-GEMM stacks
(``MoE.packed_slots`` + ``CheckpointReader.load_prefix(into=...)``). Before, it loaded the experts
as separate tensors and then packed them: the stacks were allocated while every decoded tensor was
still referenced, two copies at the peak (a V4-Pro layer: 100.6 GiB of device memory for 53.3 held).

The accounting here is of live tensor storage (every tensor the garbage collector sees, each
storage counted once), taken after the last experts' keys are decoded and wherever
``pack_experts`` ends."""
from __future__ import annotations

import gc

import pytest
import torch

from amct_ext.errors import CheckpointError
from amct_ext.io.checkpoint import CheckpointReader
from models.deepseek_v4 import loading
from models.deepseek_v4.modeling import MoE


def _live_storage_bytes() -> int:
    seen, total = set(), 0
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.device.type == "cpu" and not o.is_meta:
            st = o.untyped_storage()
            if st.data_ptr() not in seen and st.nbytes():
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


@pytest.fixture(scope="module")
def big_expert_ckpt(tmp_path_factory):
    """A one-layer tiny-shaped checkpoint whose experts dominate the layer (64 x 3 x 64 x 1024),
    stored as the release stores them (FP4 experts)."""
    from models.deepseek_v4.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("big-experts"), fmt="fp8", seed=0,
                                n_routed_experts=64, moe_intermediate_size=1024)


def _expert_bytes(block) -> int:
    return sum(p.numel() * p.element_size() for e in block.ffn.experts for p in e.parameters())


def test_the_build_holds_one_copy_of_the_experts_at_its_peak(big_expert_ckpt, monkeypatch):
    config = loading.load_config(big_expert_ckpt)
    reader = CheckpointReader(big_expert_ckpt)
    largest_decode = [0]
    samples = []
    load_one, pack = CheckpointReader._load_one, MoE.pack_experts

    def counted_load_one(self, key, *args, **kwargs):
        t = load_one(self, key, *args, **kwargs)
        largest_decode[0] = max(largest_decode[0], t.numel() * t.element_size())
        if ".experts.6" in key:     # the last experts (60-63) and 6: a scan costs ~60 ms
            samples.append(_live_storage_bytes())
        return t

    def counted_pack(self):
        pack(self)
        samples.append(_live_storage_bytes())

    monkeypatch.setattr(CheckpointReader, "_load_one", counted_load_one)
    monkeypatch.setattr(MoE, "pack_experts", counted_pack)
    gc.collect()
    base = _live_storage_bytes()
    block, _ = loading.load_block(reader, config, 0, torch.bfloat16, "cpu")
    gc.collect()
    held = _live_storage_bytes() - base
    experts = _expert_bytes(block)
    peak = max(samples) - base
    assert experts > 0.8 * held                      # the experts are what a copy would double
    # at most the layer plus one decoded tensor (float32 before its cast) and the shard maps
    # read so far; a second copy of the experts would add ``experts`` on top
    assert peak <= held + 2 * largest_decode[0] + 0.1 * experts, (peak, held, experts)


def test_experts_are_packed_as_they_load(big_expert_ckpt, monkeypatch):
    """Every expert weight a view of the stacks, equal to the same weight loaded unpacked, and
    the grouped path serves the forward; no packing copy after the load."""
    config = loading.load_config(big_expert_ckpt)
    reader = CheckpointReader(big_expert_ckpt)
    plain, _ = loading.load_block(reader, config, 0, torch.bfloat16, "cpu", pack_experts=False)

    def no_copy(self):
        raise AssertionError("load_block packed the experts by copying them after the load")

    monkeypatch.setattr(MoE, "pack_experts", no_copy)
    block, keys = loading.load_block(reader, config, 0, torch.bfloat16, "cpu")
    w13, w2, ptrs = block.ffn._packed
    inter = w2.shape[-1]
    for e, (ex, ref) in enumerate(zip(block.ffn.experts, plain.ffn.experts)):
        assert ex.w1.weight.data_ptr() == w13[e, :inter].data_ptr()
        assert ex.w3.weight.data_ptr() == w13[e, inter:].data_ptr()
        assert ex.w2.weight.data_ptr() == w2[e].data_ptr()
        for proj in ("w1", "w3", "w2"):
            assert torch.equal(getattr(ex, proj).weight, getattr(ref, proj).weight), (e, proj)
    assert [p.requires_grad for p in block.parameters()] == [p.requires_grad for p in plain.parameters()]
    assert any(k.endswith("ffn.experts.63.w2.weight") for k in keys)   # accounted as loaded
    x = torch.randn(1, 5, config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        assert block.ffn._can_group(x.view(-1, config.hidden_size))
        ids = torch.randint(0, config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(block.ffn(x, ids).float(), plain.ffn(x, ids).float(), rtol=2e-2, atol=2e-2)


def test_a_destination_of_another_shape_is_refused_naming_the_key(big_expert_ckpt):
    reader = CheckpointReader(big_expert_ckpt)
    dest = torch.empty(3, 3, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"layers\.0\.ffn\.experts\.0\.w1\.weight.*destination"):
        reader.load_prefix("layers.0.ffn.experts.0.", None, into={"w1.weight": dest})


def test_a_nan_decoded_into_a_destination_is_still_caught(big_expert_ckpt, monkeypatch):
    config = loading.load_config(big_expert_ckpt)
    reader = CheckpointReader(big_expert_ckpt)
    load_one = CheckpointReader._load_one

    def poisoned(self, key, *args, **kwargs):
        t = load_one(self, key, *args, **kwargs)
        if key == "layers.0.ffn.experts.5.w2.weight":
            t = t.clone()
            t[0, 0] = float("nan")
        return t

    monkeypatch.setattr(CheckpointReader, "_load_one", poisoned)
    with pytest.raises(CheckpointError, match=r"experts\.5\.w2\.weight.*NaN"):
        loading.load_block(reader, config, 0, torch.bfloat16, "cpu")
