"""Storage codecs checked against straightforward per-element reference decoders written here
from the format definitions (bit fields), independent of the vectorised implementation."""
import math

import pytest
import torch

from amct_ext.io import storage_formats as SF
from amct_ext.errors import CheckpointError


# ----------------------------------------------------------------------------- references
def ref_e4m3(byte: int) -> float:
    """float8_e4m3fn from its bits: 1 sign, 4 exponent (bias 7), 3 mantissa; no inf."""
    s = -1.0 if byte & 0x80 else 1.0
    e = (byte >> 3) & 0xF
    m = byte & 0x7
    if e == 0:
        return s * (m / 8) * 2.0 ** -6
    return s * (1 + m / 8) * 2.0 ** (e - 7)


def ref_e8m0(byte: int) -> float:
    return 2.0 ** (byte - 127)


def ref_e2m1(code: int) -> float:
    """e2m1 from its bits: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0."""
    s = -1.0 if code & 0x8 else 1.0
    e = (code >> 1) & 0x3
    m = code & 0x1
    if e == 0:
        return s * m * 0.5
    return s * (1 + m / 2) * 2.0 ** (e - 1)


def ref_decode_fp8(wbytes, scale_vals, block):
    out, cols = len(wbytes), len(wbytes[0])
    return [[ref_e4m3(wbytes[i][j]) * scale_vals[i // block][j // block] for j in range(cols)]
            for i in range(out)]


def ref_decode_fp4(pbytes, sbytes, block=32):
    res = []
    for i, row in enumerate(pbytes):
        r = []
        for j2, byte in enumerate(row):
            for j, code in ((2 * j2, byte & 0xF), (2 * j2 + 1, byte >> 4)):
                r.append(ref_e2m1(code) * ref_e8m0(sbytes[i][j // block]))
        res.append(r)
    return res


def random_e4m3_bytes(shape, gen):
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    b[(b & 0x7F) == 0x7F] = 0x38  # replace NaN encodings by 1.0
    return b.to(torch.uint8)


# ----------------------------------------------------------------------------- e8m0
def test_e8m0_exact_values_and_nan_rejected():
    b = torch.tensor([0, 1, 126, 127, 128, 254], dtype=torch.uint8)
    got = SF.e8m0_to_float32(b.view(torch.float8_e8m0fnu))
    assert got.dtype == torch.float32
    assert got.tolist() == [ref_e8m0(int(x)) for x in b]  # incl. the subnormal 2^-127
    with pytest.raises(CheckpointError, match="layers.0.x.scale.*NaN"):
        SF.e8m0_to_float32(torch.tensor([127, 255], dtype=torch.uint8), name="layers.0.x.scale")


def test_float_to_e8m0_rounding():
    x = torch.tensor([1.0, 1.5, 3.0, 4.0, 0.3, 2.0**-130])
    up = SF.e8m0_bytes(SF.float_to_e8m0(x, "up")).tolist()
    down = SF.e8m0_bytes(SF.float_to_e8m0(x, "down")).tolist()
    assert up == [127, 128, 129, 129, 126, 0]   # ceil(log2), clamped at 2^-127
    assert down == [127, 127, 128, 129, 125, 0]


# ----------------------------------------------------------------------------- FP8
@pytest.mark.parametrize("shape", [(130, 260), (256, 128), (5, 7)])
@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
def test_decode_fp8_matches_reference(shape, fmt):
    gen = torch.Generator().manual_seed(sum(shape))
    block = 128
    wb = random_e4m3_bytes(shape, gen)
    sshape = (math.ceil(shape[0] / block), math.ceil(shape[1] / block))
    if fmt == "ue8m0":
        sb = torch.randint(110, 140, sshape, generator=gen, dtype=torch.int32).to(torch.uint8)
        scale = sb.view(torch.float8_e8m0fnu)
        svals = [[ref_e8m0(int(v)) for v in row] for row in sb.tolist()]
    else:
        scale = torch.rand(sshape, generator=gen) + 0.01
        svals = scale.tolist()
    got = SF.decode_fp8_block(wb.view(torch.float8_e4m3fn), scale, block=block, dtype=torch.float32)
    want = torch.tensor(ref_decode_fp8(wb.tolist(), svals, block), dtype=torch.float32)
    assert got.shape == shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # default output dtype is bf16, and decoding "on a device" (cpu here) gives the same values
    got_bf16 = SF.decode_fp8_block(wb.view(torch.float8_e4m3fn), scale, device="cpu")
    assert got_bf16.dtype == torch.bfloat16
    assert torch.equal(got_bf16, want.to(torch.bfloat16))


def test_decode_fp8_rejects_bad_scale_shape_and_nan():
    w = torch.zeros(130, 10).to(torch.float8_e4m3fn)
    with pytest.raises(CheckpointError, match=r"w1\.weight.*\(2, 1\)"):
        SF.decode_fp8_block(w, torch.ones(1, 1), name="w1.weight")
    with pytest.raises(CheckpointError, match="NaN"):
        SF.decode_fp8_block(w, torch.full((2, 1), float("nan")))


@pytest.mark.parametrize("fmt", ["ue8m0", "fp32"])
def test_fp8_roundtrip_error_bound(fmt):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=gen) * torch.logspace(-3, 2, 300)  # wide dynamic range
    q, s = SF.encode_fp8_block(w, scale_fmt=fmt)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.shape == (2, 3)
    assert s.dtype == (torch.float8_e8m0fnu if fmt == "ue8m0" else torch.float32)
    sf = SF.scale_to_float32(s)
    amax = torch.nn.functional.pad(w.abs(), (0, 84, 0, 56)).view(2, 128, 3, 128).amax(dim=(1, 3))
    assert torch.all(sf * 448 >= amax)  # no overflow of the e4m3 range
    if fmt == "ue8m0":
        assert torch.all(sf * 448 < 2 * amax)  # rounded up by less than one octave
        assert torch.all(torch.log2(sf) == torch.log2(sf).round())
    d = SF.decode_fp8_block(q, s, dtype=torch.float32)
    s_el = sf.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    # e4m3: half-ulp relative error 2^-4 for normals, absolute 2^-10*scale in the subnormal range
    bound = w.abs() * 2**-4 + s_el * 2**-10
    assert torch.all((d - w).abs() <= bound * (1 + 1e-6))


def test_fp8_zero_block_gets_unit_scale():
    w = torch.zeros(128, 256)
    w[:, 128:] = 1.0
    q, s = SF.encode_fp8_block(w, scale_fmt="ue8m0")
    assert SF.e8m0_bytes(s).tolist() == [[127, 119]]  # 1.0 for the zero block; 2^ceil(log2(1/448)) = 2^-8
    assert torch.equal(SF.decode_fp8_block(q, s, dtype=torch.float32), w)


# ----------------------------------------------------------------------------- FP4
@pytest.mark.parametrize("out,cols", [(6, 64), (3, 80)])  # 80 = ragged last 32-block
def test_decode_fp4_matches_reference(out, cols):
    gen = torch.Generator().manual_seed(out * cols)
    pb = torch.randint(0, 256, (out, cols // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    sb = torch.randint(115, 140, (out, math.ceil(cols / 32)), generator=gen,
                       dtype=torch.int32).to(torch.uint8)
    want = torch.tensor(ref_decode_fp4(pb.tolist(), sb.tolist()), dtype=torch.float32)
    scale = sb.view(torch.float8_e8m0fnu)
    for stored in (pb.view(torch.int8), pb, pb.view(torch.float4_e2m1fn_x2)):
        got = SF.decode_fp4(stored, scale, dtype=torch.float32)
        assert got.shape == (out, cols)
        assert torch.equal(got, want), stored.dtype


def test_fp4_nibble_order_low_is_even_column():
    # byte 0x21: low nibble code 1 (0.5) -> column 0, high nibble code 2 (1.0) -> column 1
    # byte 0xF3: low nibble code 3 (1.5) -> column 2, high nibble code 0xF (-6) -> column 3
    packed = torch.tensor([[0x21, 0xF3] + [0] * 14], dtype=torch.uint8).view(torch.int8)
    scale = torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # x2
    got = SF.decode_fp4(packed, scale, dtype=torch.float32)
    assert got[0, :4].tolist() == [1.0, 2.0, 3.0, -12.0]
    assert torch.all(got[0, 4:] == 0)


def test_fp4_rounding_ties_to_even_and_saturation():
    # scaled values exactly between grid points go to the even code
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.9, -0.75, -5.0, 0.26, -0.1])
    codes = SF.float_to_fp4_codes(x).tolist()
    assert codes == [0, 2, 2, 4, 4, 6, 6, 7, 8 | 2, 8 | 6, 1, 0]
    # through encode: a block with amax 7.9 has exponent floor(log2 7.9) - 2 = 0 -> scale 1
    w = torch.zeros(1, 32)
    w[0, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.9])
    packed, s = SF.encode_fp4(w)
    assert SF.e8m0_bytes(s).tolist() == [[127]]
    d = SF.decode_fp4(packed, s, dtype=torch.float32)
    assert d[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


def test_fp4_scale_choice_ocp():
    w = torch.zeros(3, 64)
    w[0, 0], w[1, 5], w[2, 40] = 1.0, 0.7, 100.0   # floor(log2): 0, -1, 6
    _, s = SF.encode_fp4(w)
    assert SF.e8m0_bytes(s).tolist() == [[125, 0], [124, 0], [0, 131]]  # zero blocks -> 2^-127


def test_fp4_roundtrip_exact_on_grid_and_bounded():
    gen = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (8, 96), generator=gen)
    codes[:, ::32] = 7  # every block holds 6.0 so the chosen exponent equals the planted one
    exps = torch.randint(-5, 5, (8, 3), generator=gen)
    w = SF.fp4_codes_to_float(codes) * torch.exp2(exps.float()).repeat_interleave(32, 1)
    p, s = SF.encode_fp4(w)
    assert p.dtype == torch.int8 and p.shape == (8, 48) and s.shape == (8, 3)
    assert torch.equal(SF.decode_fp4(p, s, dtype=torch.float32), w)

    w = torch.randn(16, 100, generator=gen) * 3
    p, s = SF.encode_fp4(w)
    d = SF.decode_fp4(p, s, dtype=torch.float32)
    se = SF.e8m0_to_float32(s).repeat_interleave(32, 1)[:, :100]
    v = w.abs() / se  # scaled magnitude, < 8
    # half grid step: .25 below 2, .5 below 4, 1 up to 6, up to 2 when saturating
    half_step = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, torch.where(v <= 6, 1.0, 2.0)))
    assert torch.all((d - w).abs() <= half_step * se)


def test_decode_fp4_rejects_bad_scale():
    p = torch.zeros(4, 16, dtype=torch.int8)
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight.*\(4, 1\)"):
        SF.decode_fp4(p, torch.zeros(4, 2, dtype=torch.uint8), name="experts.0.w1.weight")
    with pytest.raises(CheckpointError, match="e8m0"):
        SF.decode_fp4(p, torch.ones(4, 1))
    with pytest.raises(CheckpointError, match="NaN"):
        SF.decode_fp4(p, torch.full((4, 1), 255, dtype=torch.uint8))


def test_encoders_reject_bad_input():
    with pytest.raises(ValueError):
        SF.encode_fp4(torch.zeros(2, 3))
    with pytest.raises(ValueError):
        SF.encode_fp8_block(torch.tensor([[float("nan")]]))
    with pytest.raises(ValueError):
        SF.encode_fp8_block(torch.zeros(2, 2), scale_fmt="e4m3")
