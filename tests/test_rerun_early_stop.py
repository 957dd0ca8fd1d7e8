"""A layer re-run that ends each sample once the units it serves have returned
(``BaseModel.do_block_forward(stop_after=...)``, used by ``workflow.LayerRerun``): sequential
GPTQ's re-runs for the attention's later stages do not run the MoE after the attention (issue 24,
RESULTS §0.12). Oracle: the same statistics from the forward run to its end."""
import pytest
import torch
from torch import nn

from amct_ext.base import BaseModel, RunConfig
from amct_ext.pipeline.workflow import LayerRerun, Stream, _collect_hessians
from amct_ext.runtime import device as devmod, device_checks

from tests.test_hessian_capture import _layer

pytestmark = pytest.mark.usefixtures("one_thread")


class _Counting(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale, self.calls = scale, 0

    def forward(self, x):
        self.calls += 1
        return x * self.scale


class _Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = _Counting(2.0), _Counting(3.0), _Counting(5.0)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


class _Adapter:
    """Only the provided ``BaseModel.do_block_forward``, on a bare module (no model behind it)."""

    do_block_forward = BaseModel.do_block_forward

    def __init__(self):
        self.run = RunConfig("unused", device="cpu", progress=False)
        self.sample_state = None

    def block_device(self, block):
        return torch.device("cpu")


def test_a_sample_ends_once_every_named_module_has_returned():
    chain, ad = _Chain(), _Adapter()
    xs = [torch.ones(2), torch.ones(2), torch.ones(2)]
    assert ad.do_block_forward(chain, xs, keep_outputs=False, stop_after=[chain.a, chain.b]) == []
    # every sample ran a and b (all of them, not the first to return), none ran c
    assert (chain.a.calls, chain.b.calls, chain.c.calls) == (3, 3, 0)
    # the hooks are gone: a plain forward runs to its end
    out = ad.do_block_forward(chain, xs[:1])
    assert chain.c.calls == 1 and torch.equal(out[0], torch.full((2,), 30.0))
    # a named module the forward never calls: the sample runs to its end
    ad.do_block_forward(chain, xs[:1], keep_outputs=False, stop_after=[chain.a, nn.Linear(2, 2)])
    assert chain.c.calls == 2


def test_stop_after_refuses_kept_outputs_and_graphs():
    chain, ad = _Chain(), _Adapter()
    with pytest.raises(ValueError, match="stop_after needs keep_outputs=False"):
        ad.do_block_forward(chain, [torch.ones(2)], stop_after=[chain.a])
    with pytest.raises(ValueError, match="and no graph"):
        ad.do_block_forward(chain, [torch.ones(2)], keep_outputs=False, graphed=True, stop_after=[chain.a])


def test_the_hooks_are_removed_when_a_sample_fails():
    """An error inside a stopped sample propagates, and leaves no hook behind."""
    chain, ad = _Chain(), _Adapter()

    def boom(module, args):
        raise RuntimeError("bad sample")
    h = chain.b.register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="bad sample"):
        ad.do_block_forward(chain, [torch.ones(2)], keep_outputs=False, stop_after=[chain.a, chain.c])
    h.remove()
    assert not chain.a._forward_hooks and not chain.c._forward_hooks


def test_a_stopped_sample_still_reads_its_device_checks():
    """The quantizers' NaN/Inf flags are read when the sample's scope closes; a stop must not
    skip them (the stop is swallowed inside the checks' scope)."""
    chain, ad = _Chain(), _Adapter()

    def flag(module, args, out):
        device_checks.refuse_if(torch.tensor([1]), [ValueError("non-finite in a")])
    chain.a.register_forward_hook(flag)
    with pytest.raises(ValueError, match="non-finite in a"):
        ad.do_block_forward(chain, [torch.ones(2)], keep_outputs=False, stop_after=[chain.a])
    assert chain.b.calls == 0


def test_attention_rerun_skips_the_moe_and_equals_the_full_forward(tiny_adapter):
    """LayerRerun for the attention's stage-1 leaves on the tiny ratio-4 layer: the FFN is never
    entered, and the Hessians equal those of the forward run to the layer's end, bit for bit."""
    block, units, x, ids = _layer(torch.float32)
    attn = [u for u in units if u.kind == "attn"]
    want = {attn[0].name: {"wq_b", "indexer.wq_b"}}
    calib = Stream([x[i:i + 1] for i in range(2)], [{"start_pos": 0, "input_ids": ids[i:i + 1]} for i in range(2)])
    ffn_calls = []
    block.ffn.register_forward_pre_hook(lambda *a: ffn_calls.append(1))
    stats = LayerRerun(tiny_adapter, block, calib)(attn, want)[attn[0].name]
    assert ffn_calls == []
    from models.deepseek_v4.quant_module import set_quant_enabled
    set_quant_enabled(block, False)
    set_quant_enabled(attn[0].module, True)
    _, full, _ = _collect_hessians(tiny_adapter, block, calib, attn, keep_output=False, only=want)
    full = full[attn[0].name]
    assert len(ffn_calls) == 2 and sorted(stats) == sorted(full) == ["indexer.wq_b", "wq_b"]
    for leaf in stats:
        assert stats[leaf].n == full[leaf].n > 0 and torch.equal(stats[leaf].H, full[leaf].H), leaf


def test_to_host_keeps_a_host_tensor_as_it_is():
    t = torch.arange(4.0)
    assert devmod.to_host(t) is t


def test_phase_memory_counts_the_pinned_host_memory(monkeypatch):
    """Hidden states on pinned host memory (``to_host``) are mapped outside RssAnon: the phases'
    job-memory figure (host_anon_peak_bytes, the issue-24 host bound) adds the pinned allocator's
    bytes, or the bound would be checked blind to 16 GiB of V4-Flash hidden states."""
    from amct_ext.pipeline import phases

    base = phases.rss_anon_bytes()
    monkeypatch.setattr(devmod, "pinned_host_bytes", lambda: 5 * 2 ** 30)
    timer = phases.PhaseTimer(sample_host=False)
    with timer.phase("capture", layer=0):
        pass
    assert timer.records[0].host_anon_peak_bytes >= base + 5 * 2 ** 30

