"""WeightQuantizer, ActivationQuantizer, QuantLinear, QuantizedMatmul, QuantGatedMLP."""
import pytest
import torch
import torch.nn.functional as Fn
from torch import nn

from amct_ext.quant import formats
from amct_ext.errors import QuantConfigError
from amct_ext.quant.quant_linear import QuantGatedMLP, QuantizedMatmul, QuantLinear
from amct_ext.quant.quantizers import ActivationQuantizer, NotCalibratedError, WeightQuantizer
from amct_ext.quant.schemes import TensorSpec

W8 = TensorSpec("int", 8, True, "channel")
W4G = TensorSpec("int", 4, False, "group", group_size=32)
A8 = TensorSpec("int", 8, True, "token")
STATIC_T = TensorSpec("int", 8, True, "tensor", dynamic=False)
STATIC_C = TensorSpec("fp8", granularity="channel", dynamic=False)


def _linear(dtype=torch.float32, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(64, 48, bias=bias).to(dtype)


# ----------------------------------------------------------------------- WeightQuantizer
def test_weight_quantizer_identity_and_forward():
    w = torch.randn(16, 64)
    assert WeightQuantizer(None)(w) is w
    assert WeightQuantizer(TensorSpec("int", 16, True, "channel"))(w) is w
    wq = WeightQuantizer(W4G)
    assert torch.equal(wq(w), formats.fake_quant(w, W4G))
    assert wq.clip is None and wq.ptq_params() == {}


@pytest.mark.parametrize("spec,shape", [(W8, (16,)), (W4G, (16, 2)), (TensorSpec("fp8", granularity="tensor"), ()),
                                        (TensorSpec("fp8", granularity="block", block_size=(8, 32)), (2, 2))])
def test_clip_shape_learning_and_gradient(spec, shape):
    w = torch.randn(16, 64)
    wq = WeightQuantizer(spec)
    params = wq.enable_learning(w)
    assert len(params) == 1 and params[0] is wq.clip
    assert tuple(wq.clip.shape) == shape and bool((wq.clip == 1).all()) and wq.clip.requires_grad
    ((wq(w) - w) ** 2).sum().backward()
    assert wq.clip.grad is not None and wq.clip.grad.abs().sum() > 0


def test_clip_outside_range_is_clamped_but_keeps_gradient():
    w = torch.randn(16, 64)
    wq = WeightQuantizer(W8)
    wq.enable_learning(w)
    with torch.no_grad():
        wq.clip.fill_(1.3)  # an optimizer overshoot
    out = wq(w)
    assert torch.equal(out.detach(), formats.fake_quant(w, W8))  # behaves as clip = 1
    out.sum().backward()
    assert wq.clip.grad is not None  # straight-through: can come back into range
    assert bool((wq.ptq_params()["clip"] == 1).all())


def test_ptq_params_round_trip_and_errors():
    w = torch.randn(16, 64)
    a = WeightQuantizer(W4G)
    a.init_clip(w)
    with torch.no_grad():
        a.clip.uniform_(0.5, 1.0)
    b = WeightQuantizer(W4G)
    b.load_ptq_params(a.ptq_params(), w)
    assert torch.equal(a(w), b(w)) and not torch.equal(b(w), WeightQuantizer(W4G)(w))
    with pytest.raises(QuantConfigError, match="shape"):
        b.load_ptq_params({"clip": torch.ones(3)})
    with pytest.raises(QuantConfigError, match=r"\(0, 1\]"):
        b.load_ptq_params({"clip": torch.zeros(16, 2)})
    with pytest.raises(QuantConfigError, match="unknown"):
        b.load_ptq_params({"offset": torch.ones(1)})  # "scale" is a fixed-grid key now


def test_mx_weights_are_not_learnable():
    wq = WeightQuantizer(TensorSpec("mxfp4"))
    assert not wq.learnable and wq.enable_learning(torch.randn(8, 64)) == []


@pytest.mark.parametrize("spec", [W8, W4G, TensorSpec("fp8", granularity="block"), TensorSpec("mxfp8"), TensorSpec("mxfp4")],
                         ids=lambda s: f"{s.format}-{s.granularity}")
def test_weight_export_matches_forward(spec):
    w = torch.randn(32, 128)
    wq = WeightQuantizer(spec)
    d = wq.export(w)
    assert "qweight" in d and d["qweight"].shape == w.shape
    d2 = dict(d)
    d2["q"] = d2.pop("qweight")
    assert torch.equal(formats.dequantize(d2, spec), wq(w))


# ------------------------------------------------------------------- ActivationQuantizer
def test_activation_off_and_observe_return_the_same_object():
    x = torch.randn(2, 5, 64)
    aq = ActivationQuantizer(A8)
    assert aq.mode == "off" and aq(x) is x
    aq.mode = "observe"
    assert aq(x) is x
    assert ActivationQuantizer(None, mode="quant")(x) is x


def test_observe_records_running_range():
    aq = ActivationQuantizer(STATIC_T, mode="observe")
    aq(torch.tensor([[1.0, -2.0]]))
    aq(torch.tensor([[3.0, -0.5]]))
    assert aq.running_min.item() == -2.0 and aq.running_max.item() == 3.0
    ac = ActivationQuantizer(STATIC_C, mode="observe")
    ac(torch.tensor([[[1.0, -2.0, 0.0]], [[4.0, 1.0, -1.0]]]))
    assert ac.running_min.tolist() == [1.0, -2.0, -1.0] and ac.running_max.tolist() == [4.0, 1.0, 0.0]
    with pytest.raises(QuantConfigError, match="channels"):
        ac(torch.randn(2, 4))
    assert "running_min" not in ac.state_dict()  # checkpoint keys stay the model's


def test_static_quant_uses_observed_range_and_needs_it():
    aq = ActivationQuantizer(STATIC_T, mode="quant")
    with pytest.raises(NotCalibratedError, match="observe"):
        aq(torch.randn(3, 8))
    aq.mode = "observe"
    aq(torch.tensor([[-1.27, 1.27]]))
    aq.mode = "quant"
    x = torch.tensor([[0.5, 5.0]])
    torch.testing.assert_close(aq(x), torch.tensor([[0.5, 1.27]]))  # static: saturates at 1.27
    exported = aq.export()
    torch.testing.assert_close(exported["scale"], torch.tensor(0.01))
    fresh = ActivationQuantizer(STATIC_T, mode="quant")
    fresh.load_ptq_params(aq.ptq_params())
    assert torch.equal(fresh(x), aq(x))


def test_dynamic_quant_matches_formats():
    x = torch.randn(2, 7, 64) * 3
    aq = ActivationQuantizer(A8, mode="quant")
    out = aq(x)
    assert torch.equal(out, formats.fake_quant(x, A8)) and not torch.equal(out, x)
    mx = ActivationQuantizer(TensorSpec("mxfp4"), mode="quant")
    assert torch.equal(mx(x), formats.fake_quant_mxfp4(x))


def test_activation_spec_and_mode_validation():
    with pytest.raises(QuantConfigError, match="token"):
        ActivationQuantizer(TensorSpec("int", 8, True, "channel", dynamic=True))
    with pytest.raises(QuantConfigError, match="static"):
        ActivationQuantizer(TensorSpec("int", 8, True, "group", group_size=32, dynamic=False))
    with pytest.raises(QuantConfigError, match="mode"):
        ActivationQuantizer(A8).mode = "calibrate"


# --------------------------------------------------------------------------- QuantLinear
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_quant_linear_off_is_bit_identical_and_shares_params(dtype, bias):
    lin = _linear(dtype, bias)
    ql = QuantLinear.from_linear(lin, None, None)
    assert ql.weight is lin.weight and ql.bias is lin.bias and ql.weight.dtype == dtype
    x = torch.randn(3, 5, 64, dtype=dtype)
    assert torch.equal(ql(x), lin(x))
    ql.eval()
    with torch.no_grad():
        assert torch.equal(ql(x), lin(x))
    # input quantizer present but off: still identical
    ql2 = QuantLinear.from_linear(lin, None, A8)
    assert torch.equal(ql2(x), lin(x))


def test_quant_linear_forward_math_and_dtype():
    lin = _linear(torch.bfloat16)
    ql = QuantLinear.from_linear(lin, W4G, A8)
    ql.input_quantizer.mode = "quant"
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    expected = Fn.linear(formats.fake_quant(x, A8), formats.fake_quant(lin.weight, W4G), lin.bias)
    out = ql(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert lin.weight.dtype == torch.bfloat16


def test_quant_linear_weight_cache(monkeypatch):
    lin = _linear()
    ql = QuantLinear.from_linear(lin, W8, None).eval()
    calls = []
    real = formats.fake_quant
    monkeypatch.setattr(formats, "fake_quant", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(2, 64)
    with torch.no_grad():
        y1 = ql(x)
        y2 = ql(x)
        assert len(calls) == 1 and torch.equal(y1, y2)
        lin.weight.mul_(2.0)  # in-place update bumps the version counter
        y3 = ql(x)
        assert len(calls) == 2 and not torch.equal(y3, y1)
        ql.weight_quantizer.init_clip(lin.weight)
        ql.load_ptq_params({"weight_quantizer.clip": torch.full((48,), 0.5)})
        y4 = ql(x)
        assert len(calls) == 3 and not torch.equal(y4, y3)
        ql.weight.data.copy_(torch.zeros_like(ql.weight))  # bypasses the version counter
        ql.invalidate_cache()
        assert torch.equal(ql(x), lin.bias.expand(2, 48))
    ql.train()
    with torch.no_grad():
        ql(x)
        ql(x)
    assert len(calls) == 6  # training mode: no cache


def test_quant_linear_learning_gradient_and_ptq_params():
    lin = _linear()
    lin.weight.requires_grad_(False)
    ql = QuantLinear.from_linear(lin, W8, STATIC_T).eval()
    params = ql.weight_quantizer.enable_learning(ql.weight)
    x = torch.randn(8, 64)
    ql.input_quantizer.mode = "observe"
    ql(x)
    ql.input_quantizer.mode = "quant"
    ((ql(x) - lin(x)) ** 2).mean().backward()
    assert params[0].grad is not None and params[0].grad.abs().sum() > 0
    saved = ql.export_ptq_params()
    assert set(saved) == {"weight_quantizer.clip", "input_quantizer.running_min", "input_quantizer.running_max"}
    other = QuantLinear.from_linear(lin, W8, STATIC_T).eval()
    other.input_quantizer.mode = "quant"
    other.load_ptq_params(saved)
    with torch.no_grad():
        assert torch.equal(other(x), ql(x))
    with pytest.raises(QuantConfigError, match="unknown"):
        other.load_ptq_params({"bogus.clip": torch.ones(1)})
    exp = ql.export()
    assert {"qweight", "scale", "bias", "input_scale"} <= set(exp) and exp["qweight"].dtype == torch.int8


def test_quant_linear_rejects_bad_group_size_early():
    with pytest.raises(formats.QuantInputError, match=r"\(48, 64\)"):
        QuantLinear.from_linear(_linear(), TensorSpec("int", 4, True, "group", group_size=128))


# ------------------------------------------------------------------------ QuantizedMatmul
def test_quantized_matmul_off_identical_and_quant():
    a, b = torch.randn(2, 3, 5, 64), torch.randn(3, 64, 7)  # broadcasting batch dims
    qm = QuantizedMatmul(A8, A8)
    assert torch.equal(qm(a, b), torch.matmul(a, b))
    k = torch.randn(2, 3, 7, 64)
    assert torch.equal(qm(a, k, transpose_b=True), torch.matmul(a, k.transpose(-1, -2)))
    assert torch.equal(qm.einsum("bhqd,bhkd->bhqk", a, k), torch.einsum("bhqd,bhkd->bhqk", a, k))
    qm.set_mode("quant")
    expected = torch.matmul(formats.fake_quant(a, A8), formats.fake_quant(k, A8).transpose(-1, -2))
    assert torch.equal(qm(a, k, transpose_b=True), expected)
    assert torch.equal(qm.einsum("bhqd,bhkd->bhqk", a, k),
                       torch.einsum("bhqd,bhkd->bhqk", formats.fake_quant(a, A8), formats.fake_quant(k, A8)))


# ------------------------------------------------------------------------- QuantGatedMLP
class _MLP(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.hidden_size, self.intermediate_size = 64, 96
        self.gate_proj = nn.Linear(64, 96, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(64, 96, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(96, 64, bias=False, dtype=dtype)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _Expert(nn.Module):  # DeepSeek naming: w1 gate, w3 up, w2 down
    def __init__(self):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(64, 32, bias=False), nn.Linear(64, 32, bias=False), nn.Linear(32, 64, bias=False)
        self.act_fn = Fn.silu


class _QuantExpert(QuantGatedMLP):
    PROJECTIONS = {"gate": "w1", "up": "w3", "down": "w2"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_mlp_off_identical_and_shares_params(dtype):
    torch.manual_seed(0)
    mlp = _MLP(dtype)
    q = QuantGatedMLP(mlp)
    x = torch.randn(4, 64, dtype=dtype)
    assert torch.equal(q(x), mlp(x))
    assert q.gate_proj.weight is mlp.gate_proj.weight and q.down_proj.weight.dtype == dtype
    assert (q.hidden_size, q.intermediate_size) == (64, 96)
    assert set(dict(q.named_parameters())) == set(dict(mlp.named_parameters()))


def test_gated_mlp_quant_and_subclass_names():
    torch.manual_seed(0)
    mlp = _MLP()
    q = QuantGatedMLP(mlp, weight_spec={"gate": W8, "up": W8, "down": W4G})
    x = torch.randn(4, 64)
    g = Fn.linear(x, formats.fake_quant(mlp.gate_proj.weight, W8))
    u = Fn.linear(x, formats.fake_quant(mlp.up_proj.weight, W8))
    expected = Fn.linear(Fn.silu(g) * u, formats.fake_quant(mlp.down_proj.weight, W4G))
    assert torch.equal(q(x), expected)
    e = _Expert()
    qe = _QuantExpert(e, W8)
    assert set(dict(qe.named_parameters())) == {"w1.weight", "w2.weight", "w3.weight"}
    assert (qe.hidden_size, qe.intermediate_size) == (64, 32)
    qe_off = _QuantExpert(e)
    assert torch.equal(qe_off(x), e.w2(Fn.silu(e.w1(x)) * e.w3(x)))
    with pytest.raises(QuantConfigError, match="gate_proj"):
        QuantGatedMLP(e)
