"""The streaming safetensors writer: same content as safetensors' own reader sees, for every dtype the
export writes, including tensors whose strides view(uint8) refuses (casebook i14, E3)."""
import torch
from safetensors.torch import load_file

from amct_ext.export.writer import save_streaming


def test_streaming_file_reads_back(tmp_path):
    g = torch.Generator().manual_seed(0)
    t = {
        "int8": torch.randint(-128, 127, (5, 7), generator=g, dtype=torch.int8),
        "packed": torch.randint(-2**31, 2**31 - 1, (3, 4), generator=g, dtype=torch.int32),
        "shape": torch.tensor([256, 128]),
        "bf16": torch.randn(3, 2, generator=g).bfloat16(),
        "fp8": torch.randn(4, 4, generator=g).to(torch.float8_e4m3fn),
        "e8m0": torch.tensor([1.0, 0.5]).to(torch.float8_e8m0fnu),
        "scalar": torch.tensor(3.0),
        "empty": torch.zeros(0, 3),
        # [out, 1] column of a wider tensor and a 1-element tensor with stride 4: both "contiguous"
        "column": torch.randn(3, 8, generator=g).as_strided((3, 1), (8, 8)),
        "one": torch.randn(8, generator=g).as_strided((1,), (4,)),
    }
    path = tmp_path / "x.safetensors"
    save_streaming(t, str(path), {"format": "pt"})
    back = load_file(str(path))
    assert set(back) == set(t)
    for k, v in t.items():
        w = back[k]
        assert w.dtype == v.dtype and w.shape == v.shape, k
        same = torch.equal(w.view(torch.uint8), v.contiguous().view(torch.uint8)) if v.element_size() == 1 and v.dim() \
            else torch.equal(w, v)
        assert same, k
