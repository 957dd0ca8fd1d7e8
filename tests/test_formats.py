"""Properties of every fake-quant format: on the grid, idempotent, error <= half a step,
zeros stay zero, zero / constant blocks are safe, NaN / Inf refused, STE reaches clip."""
import math

import pytest
import torch

from amct_ext.quant import formats as F
from amct_ext.runtime.device_checks import deferred_checks
from amct_ext.errors import AmctError, QuantConfigError
from amct_ext.quant.schemes import TensorSpec

torch.manual_seed(0)

INT_SPECS = [
    TensorSpec("int", 8, True, "channel"),
    TensorSpec("int", 8, False, "channel"),
    TensorSpec("int", 4, True, "group", group_size=32),
    TensorSpec("int", 4, False, "group", group_size=64),
    TensorSpec("int", 2, False, "tensor"),
    TensorSpec("int", 3, True, "tensor"),
    TensorSpec("int", 8, True, "token"),
    TensorSpec("int", 6, False, "block", block_size=(16, 48)),
]
FP8_SPECS = [
    TensorSpec("fp8", granularity="tensor"),
    TensorSpec("fp8", granularity="channel"),
    TensorSpec("fp8", granularity="token"),
    TensorSpec("fp8", granularity="group", group_size=64),
    TensorSpec("fp8", granularity="block", block_size=(128, 128)),
]
MX = ["mxfp8", "mxfp4"]


def _sample(shape=(40, 192), seed=0):
    g = torch.Generator().manual_seed(seed)
    # Rows of very different magnitude, so per-row / per-block scales matter.
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape[:-1] + (1,), generator=g) * 2)
    x[..., 5] = 0.0  # exact zeros must survive
    return x


def expand_scale(scale, spec, shape):
    """Independent re-implementation of the scale layout: one value per element."""
    if spec.granularity == "tensor":
        return scale.expand(shape)
    if spec.granularity in ("channel", "token"):
        return scale.unsqueeze(-1).expand(shape)
    if spec.granularity == "group":
        return scale.repeat_interleave(spec.group_size, dim=-1)
    br, bc = spec.block_size
    s = scale.repeat_interleave(br, dim=-2).repeat_interleave(bc, dim=-1)
    return s[..., : shape[-2], : shape[-1]]


# ------------------------------------------------------------------------------- integer
@pytest.mark.parametrize("spec", INT_SPECS, ids=lambda s: f"int{s.bits}-{'sym' if s.symmetric else 'asym'}-{s.granularity}")
def test_int_properties(spec):
    x = _sample()
    xh = F.fake_quant(x, spec)
    q, scale, zp = F.quantize_int(x, spec)
    assert scale.shape == F.scale_shape(x.shape, spec)
    # fake_quant == dequantize(quantize), bit for bit
    assert torch.equal(F.dequantize_int(q, scale, zp, spec), xh)
    # codes in range
    if spec.symmetric:
        qmax = 2 ** (spec.bits - 1) - 1
        assert q.dtype == torch.int8 and int(q.min()) >= -qmax and int(q.max()) <= qmax
    else:
        assert q.dtype == torch.uint8 and int(q.max()) <= 2 ** spec.bits - 1
        assert zp.shape == scale.shape
    # on the grid: x_hat / scale (+ zp) is an integer
    s = expand_scale(scale, spec, x.shape)
    r = xh / s + (0 if zp is None else expand_scale(zp.float(), spec, x.shape))
    assert (r - r.round()).abs().max() < 1e-3
    # max error <= half a step (every value is inside its block's range)
    assert bool(((xh - x).abs() <= s / 2 * (1 + 1e-5) + 1e-30).all())
    # zeros stay zeros
    assert bool((xh[..., 5] == 0).all())
    # idempotent: same codes; symmetric even bit-identical values
    q2, scale2, _ = F.quantize_int(xh, spec)
    assert torch.equal(q2, q)
    if spec.symmetric:
        assert torch.equal(F.fake_quant(xh, spec), xh)
    else:  # the re-derived scale can differ in the last ulp
        torch.testing.assert_close(F.fake_quant(xh, spec), xh, rtol=1e-6, atol=0)


@pytest.mark.parametrize("symmetric", [True, False])
def test_int_zero_and_constant_blocks(symmetric):
    spec = TensorSpec("int", 4, symmetric, "group", group_size=32)
    x = torch.zeros(3, 64)
    x[1] = 2.5  # constant row
    x[2, 32:] = -7.0
    out = F.fake_quant(x, spec)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros(64))
    torch.testing.assert_close(out[1], x[1], rtol=1e-6, atol=0)
    torch.testing.assert_close(out[2], x[2], rtol=1e-6, atol=0)


def test_int_known_values():
    # int8 symmetric per-tensor: amax 127 -> scale 1 -> plain rounding, half to even
    x = torch.tensor([[127.0, -127.0, 2.5, 3.5, -0.4]])
    out = F.fake_quant_int(x, 8, granularity="tensor")
    assert out.tolist() == [[127.0, -127.0, 2.0, 4.0, -0.0]]
    # restricted symmetric range: nothing maps to -128
    q, _, _ = F.quantize_int(torch.tensor([[-1.0, 1.0, -0.999]]), TensorSpec("int", 8, True, "tensor"))
    assert int(q.min()) == -127
    # ... and clipped values saturate symmetrically (a full range would give -128 * scale)
    out = F.fake_quant_int(torch.tensor([[-1.0, 1.0]]), 8, granularity="tensor", clip=torch.tensor(0.5))
    assert out.tolist() == [[-0.5, 0.5]]
    # asymmetric 2-bit: range [0, 3] -> scale 1, zp 0, codes 0..3
    q, s, zp = F.quantize_int(torch.tensor([[0.0, 1.2, 2.0, 3.0]]), TensorSpec("int", 2, False, "tensor"))
    assert q.tolist() == [[0, 1, 2, 3]] and float(s) == 1.0 and int(zp) == 0


def test_group_size_not_dividing_names_shape():
    with pytest.raises(F.QuantInputError, match=r"\(4, 100\).*group size 64"):
        F.fake_quant(torch.randn(4, 100), TensorSpec("int", 4, True, "group", group_size=64))


def test_bf16_keeps_dtype_and_identity_returns_input():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    for spec in INT_SPECS[:2] + FP8_SPECS[:1] + [TensorSpec("mxfp4")]:
        assert F.fake_quant(x, spec).dtype == torch.bfloat16
    assert F.fake_quant(x, None) is x
    assert F.fake_quant(x, TensorSpec("int", 16, True, "channel")) is x
    assert F.fake_quant(x, TensorSpec("none")) is x


# ------------------------------------------------------------------------------- fp8 e4m3
def test_cast_e4m3_saturates_and_rounds_to_even():
    y = torch.tensor([448.0, 449.0, 1e6, -1e6, 1.0625, 1.1875, 2.0 ** -9 * 1.5, 2.0 ** -10])
    out = F.cast_e4m3(y).float()
    assert out.tolist() == [448.0, 448.0, 448.0, -448.0, 1.0, 1.25, 2.0 ** -8, 0.0]


@pytest.mark.parametrize("spec", FP8_SPECS, ids=lambda s: f"fp8-{s.granularity}")
def test_fp8_properties(spec):
    x = _sample((200, 320))  # 200 x 320: neither dim divisible by 128 -> padded blocks
    xh = F.fake_quant(x, spec)
    e, scale = F.quantize_fp8(x, spec)
    assert e.dtype == torch.float8_e4m3fn and e.shape == x.shape
    assert scale.shape == F.scale_shape(x.shape, spec)
    if spec.granularity == "block":
        assert scale.shape == (2, 3)
    assert torch.equal(F.dequantize_fp8(e, scale, spec), xh)
    s = expand_scale(scale, spec, x.shape)
    r = xh / s
    # on the grid: re-casting x_hat/scale moves it by at most the division's rounding
    assert ((F.cast_e4m3(r).float() - r).abs() <= r.abs() * 1e-6).all()
    assert r.abs().max() <= 448.0 * (1 + 1e-6)
    # error: half an ulp relative (3 mantissa bits) for normals, half the subnormal step else
    y = (x / s).abs()
    bound = torch.where(y >= 2.0 ** -6, x.abs() * 2.0 ** -4, s * 2.0 ** -10)
    assert bool(((xh - x).abs() <= bound * (1 + 1e-5) + 1e-30).all())
    assert bool((xh[..., 5] == 0).all())
    assert torch.equal(F.fake_quant(xh, spec), xh)


def test_fp8_zero_and_constant_blocks():
    x = torch.zeros(130, 128)  # 130 rows: the last 128x128 block is mostly padding
    x[:, 0] = 3.0
    for spec in FP8_SPECS:
        out = F.fake_quant(x, spec)
        assert torch.isfinite(out).all() and torch.equal(out[:, 1:], torch.zeros(130, 127))
        torch.testing.assert_close(out[:, 0], x[:, 0], rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------- MX
def _nearest_even_e2m1(v: float) -> float:
    """Brute force: nearest e2m1 value, ties to the even code (mantissa bit 0)."""
    a = min(abs(v), 6.0)
    vals = F.E2M1_VALUES
    d = [abs(a - m) for m in vals]
    best = min(d)
    cands = [i for i, di in enumerate(d) if di == best]
    i = cands[0] if len(cands) == 1 else next(i for i in cands if i % 2 == 0)
    return math.copysign(vals[i], v)


def test_e2m1_rounding_matches_brute_force():
    grid = torch.arange(-7.0, 7.0 + 1e-9, 0.0625)  # contains every midpoint
    out = F.round_e2m1(grid)
    expected = torch.tensor([_nearest_even_e2m1(float(v)) for v in grid])
    assert torch.equal(out, expected)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert F.round_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_e2m1_codes_round_trip():
    codes = torch.arange(16, dtype=torch.uint8)
    vals = F.e2m1_decode(codes)
    assert vals[:8].tolist() == list(F.E2M1_VALUES)
    assert torch.equal(vals[8:], -vals[:8])
    re = F.e2m1_encode(vals)
    expected = codes.clone()
    expected[8] = 0  # -0 encodes as +0
    assert torch.equal(re, expected)


@pytest.mark.parametrize("elem", MX)
def test_mx_properties(elem):
    x = _sample((24, 256))
    xh = F.fake_quant(x, TensorSpec(elem))
    assert torch.equal(F.fake_quant_mx(x, elem), xh)
    q, e8 = F.quantize_mx(x, elem)
    assert e8.dtype == torch.uint8 and e8.shape == (24, 8)
    assert torch.equal(F.dequantize_mx(q, e8, elem), xh)
    scale = torch.exp2(e8.float() - 127).repeat_interleave(32, -1)
    # spec: shared_exp = floor(log2(amax_block)) - emax
    amax = x.reshape(24, 8, 32).abs().amax(-1)
    exp = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax))))
    assert torch.equal(e8.float() - 127, exp - F.MX_EMAX[elem])
    r = xh / scale  # exact: power-of-two scale
    rq = F.cast_e4m3(r).float() if elem == "mxfp8" else F.round_e2m1(r)
    assert torch.equal(rq, r)
    emax_val = 448.0 if elem == "mxfp8" else 6.0
    mant_bits, min_normal = (3, 2.0 ** -6) if elem == "mxfp8" else (1, 1.0)
    y = (x / scale).abs()
    in_range = y <= emax_val
    bound = torch.where(y >= min_normal, x.abs() * 2.0 ** -(mant_bits + 1),
                        scale * (2.0 ** -10 if elem == "mxfp8" else 0.25))
    err = (xh - x).abs()
    assert bool((err[in_range] <= bound[in_range] * (1 + 1e-6)).all())
    # saturated values land on the max magnitude
    assert bool((xh[~in_range].abs() == (emax_val * scale)[~in_range]).all())
    assert bool((xh[..., 5] == 0).all())
    assert torch.equal(F.fake_quant_mx(xh, elem), xh)


def test_mx_known_block_and_zero_block():
    x = torch.zeros(2, 32)
    x[1, 0], x[1, 1], x[1, 2] = 1.0, 0.3, -5.0  # amax 5 -> floor(log2 5) = 2 -> exp 0 for e2m1
    q, e8 = F.quantize_mx(x, "mxfp4")
    assert e8.tolist() == [[127], [127]]
    out = F.fake_quant_mx(x, "mxfp4")
    assert torch.equal(out[0], torch.zeros(32))
    assert out[1, :3].tolist() == [1.0, 0.5, -4.0]  # 0.3 -> 0.5, -5 tie -> -4 (even)
    out8 = F.fake_quant_mx(torch.full((1, 32), 7.0), "mxfp8")
    assert torch.equal(out8, torch.full((1, 32), 7.0))


def test_mx_needs_blocks_of_32():
    with pytest.raises(F.QuantInputError, match=r"\(2, 48\)"):
        F.fake_quant_mx(torch.randn(2, 48), "mxfp4")
    with pytest.raises(QuantConfigError):
        F.fake_quant_mx(torch.randn(2, 64), "mxfp6")


# --------------------------------------------------------------------------- errors, STE
ALL_SPECS = INT_SPECS + FP8_SPECS + [TensorSpec("mxfp8"), TensorSpec("mxfp4")]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: f"{s.format}-{s.granularity}")
def test_non_finite_is_refused(spec, bad):
    x = torch.randn(32, 128)
    x[3, 7] = bad
    with pytest.raises(F.NonFiniteInputError, match="NaN or Inf") as ei:
        F.fake_quant(x, spec)
    assert isinstance(ei.value, AmctError) and isinstance(ei.value, ValueError)
    with pytest.raises(F.NonFiniteInputError):
        F.quantize(x, spec)


def test_quantizers_in_a_deferred_scope_never_sync_and_the_first_bad_call_is_named(monkeypatch):
    """Inside ``device_checks.deferred_checks`` no quantizer reads its NaN/Inf flag back to the host
    (one sync per quantizer made the eager w8a8 layer launch-bound, casebook S14); the scope's end
    raises for the first offending call, and a clean scope returns normally."""
    spec = TensorSpec("int", 8, True, "token", dynamic=True)
    good, bad_small, bad_big = torch.randn(4, 64), torch.randn(3, 32), torch.randn(5, 16)
    bad_small[0, 1] = float("nan")
    bad_big[2, 3] = float("inf")

    def no_sync(*args, **kwargs):
        raise AssertionError("host sync inside a deferred scope")

    with pytest.raises(F.NonFiniteInputError, match=r"shape \(3, 32\)"):
        with deferred_checks():
            with monkeypatch.context() as m:
                for name in ("item", "tolist", "__bool__", "__int__"):
                    m.setattr(torch.Tensor, name, no_sync)
                F.fake_quant(good, spec)
                out = F.fake_quant(bad_small, spec)   # no error yet: the flag stays on the device
                F.fake_quant(bad_big, TensorSpec("fp8", granularity="channel"))
            assert torch.isnan(out).any()
    with deferred_checks():
        y = F.fake_quant(good, spec)
    assert torch.equal(y, F.fake_quant(good, spec))
    with pytest.raises(F.NonFiniteInputError):        # outside a scope: refused at the call
        F.fake_quant(bad_small, spec)


@pytest.mark.parametrize("spec", [TensorSpec("int", 4, True, "channel"), TensorSpec("int", 4, False, "group", group_size=32),
                                  TensorSpec("fp8", granularity="channel")], ids=["int-sym", "int-asym", "fp8"])
def test_ste_gradient_reaches_clip(spec):
    w = torch.randn(8, 64)
    clip = torch.full(tuple(F.scale_shape(w.shape, spec)), 0.9, requires_grad=True)
    loss = ((F.fake_quant(w, spec, clip) - w) ** 2).sum()
    loss.backward()
    assert clip.grad is not None and clip.grad.abs().sum() > 0
    # clip really moves the range: a smaller clip saturates the largest values
    small = F.fake_quant(w, spec, torch.full_like(clip, 0.5).detach())
    assert small.abs().max() < F.fake_quant(w, spec).abs().max()


@pytest.mark.parametrize("spec", [TensorSpec("int", 4, True, "channel"), TensorSpec("int", 4, False, "channel"),
                                  TensorSpec("fp8", granularity="channel"), TensorSpec("mxfp4")],
                         ids=["int-sym", "int-asym", "fp8", "mxfp4"])
def test_ste_rounding_passes_gradient_to_input(spec):
    x = torch.randn(4, 64)
    if spec.is_mx:  # block amax 6 -> scale 1, nothing saturates (saturation has zero gradient)
        x = x.clamp(-5.9, 5.9)
        x[:, ::32] = 6.0
    x.requires_grad_(True)
    F.fake_quant(x, spec).sum().backward()
    # Straight-through rounding: d x_hat / d x == 1 for in-range elements. The per-row
    # extremes also feed the scale, so they are left out.
    keep = torch.ones_like(x, dtype=torch.bool)
    keep.scatter_(1, x.detach().argmax(1, keepdim=True), False)
    keep.scatter_(1, x.detach().argmin(1, keepdim=True), False)
    torch.testing.assert_close(x.grad[keep], torch.ones(int(keep.sum())))


def test_clip_out_of_range_or_bad_shape():
    spec = TensorSpec("int", 8, True, "channel")
    with pytest.raises(F.QuantInputError, match=r"\(0, 1\]"):
        F.fake_quant(torch.randn(4, 8), spec, torch.full((4,), 1.5))
    with pytest.raises(F.QuantInputError, match="broadcast"):
        F.fake_quant(torch.randn(4, 8), spec, torch.ones(3))


def test_static_range_quant():
    spec = TensorSpec("int", 8, True, "tensor", dynamic=False)
    x = torch.tensor([[-2.0, 0.5, 1.0, 4.0]])
    out = F.fake_quant_from_range(x, spec, torch.tensor(-1.27), torch.tensor(1.27))
    torch.testing.assert_close(out, torch.tensor([[-1.27, 0.5, 1.0, 1.27]]))  # outside range saturates
    fp = TensorSpec("fp8", granularity="channel", dynamic=False)
    out = F.fake_quant_from_range(x, fp, torch.zeros(4), torch.tensor([1.0, 1.0, 1.0, 448.0]))
    assert out[0, 0] == -1.0 and out[0, 3] == 4.0
