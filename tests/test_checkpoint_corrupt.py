"""Garbage in a shard's data region (header intact) is named on load: tensor key + shard file
(issue 17, item 3), with one host read per load_prefix call."""
import json
import shutil
import struct

import pytest
import torch

from amct_ext.io import checkpoint as ckmod
from amct_ext.io.checkpoint import CheckpointReader
from amct_ext.errors import CheckpointError
from models.deepseek_v4.loading import load_block, load_checkpoint_model
from models.deepseek_v4.tiny import tiny_config


def corrupt(ckpt_dir, key, n_bytes=64, byte=0xFF):
    """Overwrite the first ``n_bytes`` of ``key``'s data with ``byte`` (0xFF: NaN in bf16 and in
    float8_e4m3fn), leaving the safetensors header untouched. Returns the shard's name."""
    shard = json.loads((ckpt_dir / "model.safetensors.index.json").read_text())["weight_map"][key]
    path = ckpt_dir / shard
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        start, end = header[key]["data_offsets"]
        f.seek(8 + n + start)
        f.write(bytes([byte]) * min(n_bytes, end - start))
    return shard


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_ckpt_fp8"])
def test_nan_in_data_region_names_tensor_and_shard(request, fixture, tmp_path):
    src = request.getfixturevalue(fixture)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    key = "layers.1.attn.wq_a.weight"     # bf16 in one fixture, FP8 block storage in the other
    shard = corrupt(ckpt, key)
    with CheckpointReader(ckpt) as reader:
        with pytest.raises(CheckpointError) as e:
            load_block(reader, tiny_config(), 1, dtype=torch.float32)
    msg = str(e.value)
    assert repr(key) in msg and repr(shard) in msg and "NaN or Inf" in msg, msg
    # a whole-model load says the same; the intact layers load fine
    with pytest.raises(CheckpointError, match="layers.1.attn.wq_a.weight"):
        load_checkpoint_model(ckpt, dtype=torch.float32)
    with CheckpointReader(ckpt) as reader:
        load_block(reader, tiny_config(), 0, dtype=torch.float32)


def test_inf_in_an_fp32_island_is_named(tiny_ckpt, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    with CheckpointReader(ckpt) as reader:
        fp32 = [k for k in reader.keys_under("layers.2.") if reader.stored_dtype(k) == "F32"]
    key = fp32[0]
    # 0x7F800000 little-endian: +Inf in fp32
    shard = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][key]
    with open(ckpt / shard, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        start, _ = json.loads(f.read(n))[key]["data_offsets"]
        f.seek(8 + n + start)
        f.write(struct.pack("<f", float("inf")))
    with CheckpointReader(ckpt) as reader:
        with pytest.raises(CheckpointError, match=repr(key)):
            reader.load_prefix("layers.2.")
        reader.load_prefix("layers.2.", check_finite=False)   # the check is what catches it


def test_one_host_read_per_load_call(tiny_ckpt, monkeypatch):
    reads = []
    real = ckmod.device_checks.raise_first
    monkeypatch.setattr(ckmod.device_checks, "raise_first", lambda checks: (reads.append(len(checks)), real(checks)))
    with CheckpointReader(tiny_ckpt) as reader:
        res = reader.load_prefix("layers.1.", dtype=torch.float32)
    n_float = sum(t.dtype.is_floating_point for t in res.tensors.values())
    assert n_float > 30
    # one raise_first call per load_prefix; its checks are grouped per (device, dtype), not per tensor
    assert len(reads) == 1 and reads[0] <= 2, reads
