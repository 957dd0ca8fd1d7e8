"""Bit packing of the export formats: round trips, and agreement with compressed-tensors' packer."""
import pytest
import torch

from amct_ext.quant.packing import (pack_int4_rows, pack_int32, pack_int32_dim0, unpack_int4_rows, unpack_int32,
                                     unpack_int32_dim0)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("cols", [32, 40, 128])
def test_int32_round_trip_and_library_agreement(bits, cols):
    g = torch.Generator().manual_seed(bits * 1000 + cols)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = torch.randint(lo, hi + 1, (6, cols), generator=g, dtype=torch.int64).to(torch.int8)
    codes[0, :2] = torch.tensor([lo, hi], dtype=torch.int8)   # the extremes
    packed = pack_int32(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (6, -(-cols * bits // 32))
    assert torch.equal(unpack_int32(packed, bits, cols), codes)
    assert torch.equal(unpack_int32_dim0(pack_int32_dim0(codes.t().contiguous(), bits), bits, cols), codes.t())
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    assert torch.equal(helpers.pack_to_int32(codes, bits), packed)
    assert torch.equal(helpers.pack_to_int32(codes.t().contiguous(), bits, packed_dim=0),
                       pack_int32_dim0(codes.t().contiguous(), bits))


def test_int4_rows_layout():
    codes = torch.tensor([[1, -8], [7, -1], [0, 3], [-2, 5]], dtype=torch.int8)
    packed = pack_int4_rows(codes)
    # row 0 low nibble, row 1 high nibble: 1 | 7<<4 = 0x71; -8 (0x8) | -1 (0xF)<<4 = 0xF8
    assert packed.view(torch.uint8)[0].tolist() == [0x71, 0xF8]
    assert torch.equal(unpack_int4_rows(packed), codes)
    with pytest.raises(Exception, match="outside"):
        pack_int4_rows(torch.tensor([[8], [0]], dtype=torch.int8))
