"""The export formats as objects (issue 37, amct_ext/export/export_format.py): each one's rules,
checked against the plain encoders of compressed_tensors.py / ascend.py and the file names the
readers look for."""
from __future__ import annotations

import pytest
import torch

from amct_ext.errors import ConfigError
from amct_ext.export import ascend, compressed_tensors as ct
from amct_ext.export.export_format import (FORMATS, AscendModelSlim, CompressedTensors, export_format,
                                           finished_export)
from amct_ext.quant import formats
from amct_ext.quant.schemes import load_scheme


def test_the_formats_and_a_bad_name():
    assert FORMATS == ("compressed-tensors", "ascend")     # the CLI's choices, in their order
    assert isinstance(export_format("ascend"), AscendModelSlim)
    assert isinstance(export_format("compressed-tensors"), CompressedTensors)
    with pytest.raises(ConfigError, match=r"--format 'gguf' is unknown; valid: compressed-tensors, ascend"):
        export_format("gguf")


def test_file_names_and_released_tensors():
    c, a = export_format("compressed-tensors"), export_format("ascend")
    assert (c.shard_stem, c.index_name) == ("model", "model.safetensors.index.json")
    assert (a.shard_stem, a.index_name) == (ascend.SHARD_STEM, ascend.INDEX_NAME)
    assert not c.decodes_released and a.decodes_released
    assert not c.adds_mtp_head() and a.adds_mtp_head()
    ids = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    # ascend stores tid2eid as int32 (as msModelSlim does) and never copies it file to file
    assert a.released_tensor("layers.0.ffn.gate.tid2eid", ids).dtype == torch.int32
    assert not a.copies_raw("layers.0.ffn.gate.tid2eid") and a.copies_raw("layers.0.attn.wq_a.weight")
    assert a.released_tensor("layers.0.attn.wq_a.weight", ids) is ids
    assert c.released_tensor("layers.0.ffn.gate.tid2eid", ids) is ids and c.copies_raw("layers.0.ffn.gate.tid2eid")
    assert c.released_quantization_config({"q": 1}, False) == {"q": 1}
    assert c.released_quantization_config({"q": 1}, True) is None
    assert a.released_quantization_config({"q": 1}, False) is None


def test_finished_export_sees_either_index(tmp_path):
    assert not finished_export(tmp_path)
    (tmp_path / ascend.INDEX_NAME).write_text("{}")
    assert finished_export(tmp_path)
    other = tmp_path / "ct"
    other.mkdir()
    (other / "model.safetensors.index.json").write_text("{}")
    assert finished_export(other)


def test_encode_weight_is_the_formats_own_encoder():
    torch.manual_seed(0)
    w = torch.randn(16, 32)
    scheme = load_scheme("w8a8")
    spec, act = scheme.target("attn-linear").weight, scheme.target("attn-linear").input
    from amct_ext.quant.quantizers import WeightQuantizer

    d = WeightQuantizer(spec).export(w)
    got, typ = export_format("compressed-tensors").encode_weight("x", spec, act, d, tuple(w.shape))
    want = ct.encode_weight("x", spec, act, d, tuple(w.shape))
    assert typ is None and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    fq = formats.dequantize({("q" if k == "qweight" else k): v for k, v in d.items()}, spec)
    got, typ = export_format("ascend").encode_weight("x", spec, act, d, tuple(w.shape))
    want, want_typ = ascend.encode_weight("x", spec, act, d, tuple(w.shape), fq)
    assert typ == want_typ and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_scheme_checks_are_the_formats_own():
    w4a8 = load_scheme("w4a8")
    export_format("compressed-tensors").check_scheme(w4a8, ["attn-linear", "moe"])
    with pytest.raises(Exception) as e:
        ascend.check_scheme(w4a8, ["attn-linear", "moe"])
    with pytest.raises(type(e.value), match="ascend export"):
        export_format("ascend").check_scheme(w4a8, ["attn-linear", "moe"])
