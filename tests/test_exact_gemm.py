"""The bf16 split behind the fast fp32-island GEMMs (amct_ext/runtime/exact_gemm.py) is exact, and the
fallback (CPU, autograd) is the plain fp32 GEMM, bit for bit."""
import pytest
import torch

from amct_ext.runtime.exact_gemm import SplitWeightCache, linear_fp32, matmul_fp32, split_bf16

pytestmark = pytest.mark.usefixtures("one_thread")


def test_split_is_exact_over_the_fp32_range():
    g = torch.Generator().manual_seed(0)
    mant = torch.rand(4096, generator=g) + 1                                 # full 24-bit significands
    expo = torch.randint(-100, 100, (4096,), generator=g).float()
    sign = torch.where(torch.rand(4096, generator=g) < 0.5, -1.0, 1.0)
    w = (sign * mant * torch.pow(2.0, expo)).float()
    w = torch.cat((w, torch.tensor([0.0, -0.0, 1.0, 3.3e38, -1e-30, 1 / 3])))
    parts = split_bf16(w)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3, w.numel())
    # summed in float64 the parts give w back exactly, and so does fp32 arithmetic hi + mid + lo
    assert torch.equal(parts.double().sum(0), w.double())
    assert torch.equal((parts[0].float() + parts[1].float()) + parts[2].float(), w)


def test_weights_beyond_bf16_range_are_refused_not_split():
    w = torch.tensor([[1.0, 3.4e38]])
    with pytest.raises(ValueError, match="exceeds the bf16 range"):
        split_bf16(w)
    assert SplitWeightCache().get(w) is None                                # linear_fp32: fp32 GEMM


def test_products_with_bf16_values_are_exact():
    """x (bf16) times each part has at most 16 significant bits: exact in fp32."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(257, generator=g).bfloat16()
    w = torch.randn(257, generator=g)
    for part in split_bf16(w):
        assert torch.equal((x.float() * part.float()).double(), x.double() * part.double())


def test_cpu_and_autograd_fall_back_to_the_fp32_gemm():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 7, 64, generator=g).bfloat16()
    w = torch.randn(24, 64, generator=g)
    assert torch.equal(linear_fp32(x, w, SplitWeightCache()), torch.nn.functional.linear(x.float(), w))
    a, b = torch.randn(2, 9, 16, generator=g).bfloat16(), torch.randn(2, 16, 5, generator=g).bfloat16()
    assert torch.equal(matmul_fp32(a, b), torch.bmm(a.float(), b.float()))
    wg = w.clone().requires_grad_(True)
    linear_fp32(x, wg).sum().backward()
    assert wg.grad is not None


def test_split_cache_follows_in_place_updates():
    w = torch.randn(8, 16)
    cache = SplitWeightCache()
    first = cache.get(w).clone()
    assert cache.get(w) is cache.get(w)                                     # reused while unchanged
    with torch.no_grad():
        w.mul_(2)
    assert torch.equal(cache.get(w).view(3, 8, 16).double().sum(0), w.double())
    assert not torch.equal(cache.get(w), first)


@pytest.mark.parametrize("d", [16, 128, 512])
def test_hadamard_is_one_magnitude_times_signs(d):
    """hadamard_rotate's fast path multiplies by the +-1 matrix and then by one fp32 magnitude:
    exact only if every entry of the cached H_d / sqrt(d) is that magnitude times its sign."""
    from models.deepseek_v4.modeling import _hadamard, _hadamard_signs

    signs, v = _hadamard_signs(d, "cpu")
    assert signs.dtype == torch.bfloat16 and set(signs.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(signs.float() * v, _hadamard(d, "cpu"))
