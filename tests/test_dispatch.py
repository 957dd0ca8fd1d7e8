import pytest
import torch
from torch import nn

from amct_ext.runtime.dispatch import build_layer_device_map as _build_map
from amct_ext.runtime.dispatch import classify as _classify
from amct_ext.runtime.dispatch import dispatch_layer, resolve_device_for, undispatch_layer
from models.deepseek_v4.adapter import V4_PLACEMENT


def build_layer_device_map(names, devices):
    """The placement rule on V4's unit names (the adapter's LayerPlacement)."""
    return _build_map(names, devices, V4_PLACEMENT)


def classify(name):
    return _classify(name, V4_PLACEMENT)

N_EXPERTS = 6


def layer_names(n_experts=N_EXPERTS, indexer=True):
    names = ["attn_norm", "ffn_norm", "hc_attn_fn", "hc_ffn_fn", "attn", "attn.wq_a", "attn.wkv",
             "attn.compressor", "attn.compressor.wkv", "ffn", "ffn.gate", "ffn.shared_experts",
             "ffn.shared_experts.w1", "ffn.experts"]
    if indexer:
        names += ["attn.indexer", "attn.indexer.wq_b", "attn.indexer.compressor"]
    for e in range(n_experts):
        names += [f"ffn.experts.{e}", f"ffn.experts.{e}.w1", f"ffn.experts.{e}.w2"]
    return names


def devs(n):
    return [f"cuda:{i}" for i in range(n)]


D = torch.device


def expert_devices(m, n_experts=N_EXPERTS):
    return [m[f"ffn.experts.{e}"] for e in range(n_experts)]


def check_consistent(m, n_experts=N_EXPERTS):
    # submodules follow their unit
    for e in range(n_experts):
        assert m[f"ffn.experts.{e}.w1"] == m[f"ffn.experts.{e}.w2"] == m[f"ffn.experts.{e}"]
    assert m["attn.wq_a"] == m["attn.compressor.wkv"] == m["attn"]
    if "attn.indexer" in m:
        assert m["attn.indexer.wq_b"] == m["attn.indexer.compressor"] == m["attn.indexer"]
    for stem in ("", "attn_norm", "ffn_norm", "hc_attn_fn", "ffn", "ffn.gate",
                 "ffn.shared_experts", "ffn.shared_experts.w1", "ffn.experts"):
        assert m[stem] == m[""]


def test_classify():
    assert classify("attn_norm") == "stem"          # not "attn."
    assert classify("attn") == classify("attn.wq_a") == "attn"
    assert classify("attn.indexer.compressor.wkv") == "attn_side"      # V4's indexer: the attention's side unit
    assert classify("ffn.experts.3.w1") == "expert"
    assert classify("ffn.experts") == classify("ffn.shared_experts.w1") == "stem"


def test_map_one_device():
    m = build_layer_device_map(layer_names(), devs(1))
    assert set(m.values()) == {D("cuda:0")}
    assert set(m) == set(layer_names()) | {""}


def test_map_two_devices():
    m = build_layer_device_map(layer_names(), devs(2))
    check_consistent(m)
    assert m[""] == D("cuda:0")
    assert m["attn"] == m["attn.indexer"] == D("cuda:1")
    assert expert_devices(m) == [D(f"cuda:{i % 2}") for i in range(N_EXPERTS)]


def test_map_three_devices():
    m = build_layer_device_map(layer_names(), devs(3))
    check_consistent(m)
    assert (m[""], m["attn"], m["attn.indexer"]) == (D("cuda:0"), D("cuda:1"), D("cuda:2"))
    assert expert_devices(m) == [D(f"cuda:{i % 3}") for i in range(N_EXPERTS)]
    # without an indexer the third device is left for the experts
    m = build_layer_device_map(layer_names(indexer=False), devs(3))
    check_consistent(m)
    assert expert_devices(m) == [D("cuda:2")] * N_EXPERTS


def test_map_eight_devices():
    m = build_layer_device_map(layer_names(), devs(8))
    check_consistent(m)
    assert (m[""], m["attn"], m["attn.indexer"]) == (D("cuda:0"), D("cuda:1"), D("cuda:2"))
    assert expert_devices(m) == [D(f"cuda:{3 + i % 5}") for i in range(N_EXPERTS)]
    m = build_layer_device_map(layer_names(indexer=False), devs(8))
    assert expert_devices(m) == [D(f"cuda:{2 + i}") for i in range(N_EXPERTS)]


@pytest.mark.parametrize("n", range(1, 9))
@pytest.mark.parametrize("indexer", [True, False])
def test_every_device_used(n, indexer):
    m = build_layer_device_map(layer_names(n_experts=8, indexer=indexer), devs(n))
    assert set(m.values()) == {D(d) for d in devs(n)}


def test_expert_round_robin_is_numeric_order():
    names = [f"ffn.experts.{e}" for e in (10, 2, 1)]
    m = build_layer_device_map(names, devs(4))  # no attn/indexer: reserved = stem, attn slot
    assert [m[f"ffn.experts.{e}"] for e in (1, 2, 10)] == [D("cuda:2"), D("cuda:3"), D("cuda:2")]


def test_map_requires_a_device():
    with pytest.raises(ValueError):
        build_layer_device_map(layer_names(), [])


# ----------------------------------------------------------------------------- dispatch
class Expert(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(d, h, bias=False), nn.Linear(h, d, bias=False), \
            nn.Linear(d, h, bias=False)

    def forward(self, x, weight=None):
        h = torch.nn.functional.silu(self.w1(x)) * self.w3(x)
        if weight is not None:
            h = h * weight
        return self.w2(h)


class Indexer(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.wq_b = nn.Linear(d, d)
        self.register_buffer("table", torch.linspace(0, 1, d))

    def forward(self, x):
        return torch.softmax(self.wq_b(x) + self.table, dim=-1)


class Attn(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.wq_a = nn.Linear(d, d)
        self.attn_sink = nn.Parameter(torch.randn(d))
        self.indexer = Indexer(d)

    def forward(self, x):
        return self.wq_a(x) * self.indexer(x) + self.attn_sink


class MoE(nn.Module):
    def __init__(self, d, n):
        super().__init__()
        self.gate = nn.Linear(d, n, bias=False)
        self.experts = nn.ModuleList(Expert(d, 2 * d) for _ in range(n))
        self.shared_experts = Expert(d, d)

    def forward(self, x):
        w = torch.softmax(self.gate(x), dim=-1)
        out = self.shared_experts(x)
        for e, ex in enumerate(self.experts):
            out = out + ex(x, weight=w[..., e:e + 1])
        return out


class Block(nn.Module):
    def __init__(self, d=16, n=N_EXPERTS):
        super().__init__()
        self.attn_norm = nn.LayerNorm(d)
        self.ffn_norm = nn.LayerNorm(d)
        self.hc_attn_fn = nn.Parameter(torch.randn(d))
        self.attn = Attn(d)
        self.ffn = MoE(d, n)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x)) * self.hc_attn_fn
        return x + self.ffn(self.ffn_norm(x))


@pytest.mark.parametrize("devices", [["cpu"], [f"cpu:{i}" for i in range(8)]])
def test_dispatch_outputs_bit_identical(devices):
    torch.manual_seed(0)
    blk = Block()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        ref = blk(x)
    params_before = {n: p for n, p in blk.named_parameters()}
    names = [n for n, _ in blk.named_modules() if n] + [n for n, _ in blk.named_parameters()]
    dmap = build_layer_device_map(names, devices)
    dispatch_layer(blk, dmap)
    with torch.no_grad():
        out = blk(x)
    assert torch.equal(out, ref)
    # Parameter objects survive placement (optimizers / quantizers may hold references)
    assert all(p is params_before[n] for n, p in blk.named_parameters())

    hooked = {n for n, m in blk.named_modules() if hasattr(m, "_hf_hook")}
    if len(devices) == 1:
        assert hooked == {""}
    else:
        # a hook wherever the device changes, each executing on the mapped device
        assert hooked == {"", "attn", "attn.indexer"} | {f"ffn.experts.{e}" for e in range(N_EXPERTS)}
        mods = dict(blk.named_modules())
        for n in hooked:
            assert mods[n]._hf_hook.execution_device == dmap[n]
            assert mods[n]._hf_hook.io_same_device == (n != "")
    undispatch_layer(blk)
    assert not any(hasattr(m, "_hf_hook") for m in blk.modules())
    with torch.no_grad():
        assert torch.equal(blk(x), ref)


def test_resolve_device_for_inherits_from_ancestor():
    m = {"": "cpu", "attn": "cuda:1"}
    assert resolve_device_for("attn.indexer.wq_b", m) == D("cuda:1")
    assert resolve_device_for("ffn.gate", m) == D("cpu")
    with pytest.raises(ValueError):
        resolve_device_for("x", {"attn": "cpu"})


def test_dispatch_moves_tensors_to_mapped_device():
    # 'meta' is a real second device type available on CPU-only machines: placement moves there.
    blk = Block()
    dmap = {"": "cpu", "ffn.experts.1": "meta"}
    dispatch_layer(blk, dmap)
    assert blk.ffn.experts[1].w1.weight.device.type == "meta"
    assert blk.ffn.experts[0].w1.weight.device.type == "cpu"
    assert blk.attn.indexer.table.device.type == "cpu"
    assert blk.ffn.experts[1]._hf_hook.execution_device == D("meta")


def test_island_linear_honours_an_accelerate_hook_on_the_linear():
    """The fp32-island fast path calls ``linear_fp32`` on the weight directly; a Linear with its
    own dispatch hook (placed on another device than its parent) must go through the hook."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    from models.deepseek_v4.modeling import Linear, island_linear

    class Recording(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            Recording.calls += 1
            return args, kwargs

    lin = Linear(8, 4, dtype=torch.float32)
    nn.init.normal_(lin.weight)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    plain = island_linear(lin, x)
    add_hook_to_module(lin, Recording())
    hooked = island_linear(lin, x)
    assert Recording.calls == 1
    assert hooked.dtype == torch.float32 and torch.allclose(hooked, plain, rtol=1e-6, atol=1e-6)
