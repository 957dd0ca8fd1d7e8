"""The streaming safetensors writer: same content as safetensors' own reader sees, for every dtype the
export writes, including tensors whose strides view(uint8) refuses (casebook/export.md, E3)."""
import torch
from safetensors.torch import load_file

from amct_ext.export.writer import ShardStream, save_streaming


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


def test_shard_stream_reads_back_and_grows_its_header(tmp_path):
    """Tensors streamed one at a time (big ones at once, small ones at the end), a header that
    outgrows its reserve, and a dtype the stream hands to safetensors' own writer."""
    g = torch.Generator().manual_seed(1)
    big = {f"layer.w{i}": torch.randint(-128, 127, (1024, 1024 + 8 * i), generator=g, dtype=torch.int8) for i in range(3)}
    small = {f"layer.{'x' * 200}.s{i}": torch.randn(3 + i, generator=g) for i in range(40)}   # long names
    for n_hint, extra in ((1, {}), (100, {}), (4, {"f4": torch.zeros(2, 4, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)})):
        path = tmp_path / f"s{n_hint}.safetensors"
        s = ShardStream(path, n_hint=n_hint, metadata={"format": "pt"})
        for k, v in {**big, **small, **extra}.items():
            s.add(k, v)
        s.close()
        back = load_file(str(path))
        assert set(back) == set(big) | set(small) | set(extra)
        for k, v in {**big, **small}.items():
            assert torch.equal(back[k], v), k
        assert set(s.layout) == set(back) and s.nbytes == sum(v.numel() * v.element_size() for v in back.values())
