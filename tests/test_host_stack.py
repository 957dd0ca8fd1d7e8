"""The experts' float weights parked on the host (``io/host_stack.py``): in the release's own
MXFP4 format where every value is on its grid, else as they are; given back byte for byte."""
from __future__ import annotations

import pytest
import torch

from amct_ext.io.storage_formats import decode_fp4, encode_fp4
from amct_ext.io.host_stack import HostStack, encode_exact


def _release_like(n_exp=5, rows=6, cols=96, dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """A stack as built from a released checkpoint: random weights through the project's own FP4
    checkpoint codec (scales over a wide range), with a few negative zeros (code 8) among them."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_exp * rows, cols, generator=g) * torch.exp2(torch.randint(-30, 8, (n_exp * rows, 1), generator=g).float())
    packed, scale = encode_fp4(w)
    u = packed.view(torch.uint8).clone()
    u[0, 0] = 0x88          # -0, -0
    u[3, 5] = (u[3, 5] & 0xF0) | 0x8
    return decode_fp4(u.view(torch.int8), scale, dtype).reshape(n_exp, rows, cols)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("chunk", [6 * 96, 2 * 6 * 96, 1 << 26])
def test_release_fp4_experts_are_parked_in_their_own_format(dtype, chunk):
    x = _release_like(dtype=dtype)
    assert bool((torch.signbit(x) & (x == 0)).any())            # negative zeros present
    hs = HostStack(x, chunk_elems=chunk)
    assert hs.compact and hs.nbytes() == x.numel() * 17 // 32    # half a byte a value + a byte per 32
    assert hs.codes.device.type == "cpu" and hs.scales.device.type == "cpu"
    assert torch.equal(_bytes(hs.slice_to(0, 5, "cpu")), _bytes(x))
    assert torch.equal(_bytes(hs.slice_to(2, 4, "cpu")), _bytes(x[2:4]))
    assert hs.slice_to(1, 3, "cpu").dtype == dtype


def test_a_block_whose_values_use_a_larger_scale_is_still_on_the_grid():
    """The release's encoder may have picked a scale above the codec's (a block whose largest
    value is 0.5 or 1.5 of it): the codec's smaller scale still holds every value."""
    vals = torch.tensor([0.5, -0.5, 1.0, 0.0, 1.5] + [0.5] * 27) * 2.0 ** -9
    x = torch.stack([vals, vals * 4]).reshape(1, 2, 32).to(torch.bfloat16)
    enc = encode_exact(x)
    assert enc is not None and torch.equal(_bytes(HostStack(x).slice_to(0, 1, "cpu")), _bytes(x))


@pytest.mark.parametrize("case", ["random", "one_off_grid_in_the_last_chunk", "nan", "inf", "below_e8m0", "ragged"])
def test_weights_off_the_grid_are_parked_as_they_are(case):
    x = _release_like(dtype=torch.float32)
    if case == "random":
        x = torch.randn(5, 6, 96)
    elif case == "one_off_grid_in_the_last_chunk":
        x[4, 5, 95] = 0.3
    elif case == "nan":
        x[2, 0, 0] = float("nan")
    elif case == "inf":
        x[2, 0, 0] = float("inf")
    elif case == "below_e8m0":
        x[1, 1, :32] = 6 * 2.0 ** -140                               # 2^-142 per step: past e8m0
    else:
        x = x[..., :80].contiguous()                                 # not whole blocks of 32
    hs = HostStack(x, chunk_elems=6 * 96)
    assert not hs.compact and hs.codes is None and hs.nbytes() == x.numel() * 4
    assert torch.equal(_bytes(hs.slice_to(0, 5, "cpu")), _bytes(x))
    assert encode_exact(x) is None


def test_the_parked_copy_does_not_share_the_original():
    for x in (_release_like(), torch.randn(2, 3, 64)):
        hs = HostStack(x)
        before = hs.slice_to(0, 1, "cpu").clone()
        x.zero_()
        assert torch.equal(hs.slice_to(0, 1, "cpu"), before)
