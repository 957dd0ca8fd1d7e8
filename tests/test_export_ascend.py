"""Ascend ModelSlim v1 export of assets/tiny-v4 against msModelSlim 26.1's own output layout
(tests/data/msmodelslim-26.1-tiny-v4), tensor by tensor: names, dtypes, shapes, description types.

Every difference is one of the explained, deliberate ones below; anything else fails.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from tests.export_helpers import REFERENCE, TINY, tensor_layout, with_complete_mtp

pytestmark = pytest.mark.usefixtures("one_thread")

# msModelSlim's DeepSeek-V4 recipes also exclude wo_a, the compressors' wkv / wgate and the indexer's
# weights_proj: vllm-ascend runs those float (models/deepseek_v4/serving_ascend.py), so an export
# without run parameters leaves them float too. wo_b it runs W8A8_DYNAMIC (a module call), so our
# 'attn-linear' target keeps it quantized.
EXTRA_QUANTIZED = re.compile(r"\.attn\.wo_b$")
# The MTP tensors of the asset (e_proj / h_proj / enorm / hnorm): msModelSlim drops them when its MTP
# switch is off; we never drop the MTP layer (they are copied as released).
MTP_KEPT = re.compile(r"^mtp\.0\.(e_proj|h_proj|enorm|hnorm)\.weight$")
# Our 'moe' target covers the shared expert too; msModelSlim's W4A8 recipe keeps it W8A8. vllm-ascend
# has no W4A8_DYNAMIC linear method, so the served export refuses an int4 shared expert
# (tests/test_vllm_ascend_mapping.py); this layout comparison exports with serve_check=False.
SHARED = re.compile(r"\.ffn\.shared_experts\.w[123]$")

W4A8_CHANNEL = {  # the precision recipe of msModelSlim's pro-w4a8 run, in our scheme language
    "name": "w4a8-channel", "description": "int8 attention, int4 per-channel experts, int8 per-token inputs",
    "weight": {"format": "int", "bits": 8, "symmetric": True, "granularity": "channel"},
    "input": {"format": "int", "bits": 8, "symmetric": True, "granularity": "token", "dynamic": True},
    "targets": {"moe": {"weight": {"format": "int", "bits": 4, "symmetric": True, "granularity": "channel"}}},
}


def _export(model_path, out, scheme, serve_check=True):
    from amct_ext.export.exporter import ExportConfig, export_checkpoint
    from amct_ext.quant.schemes import load_scheme

    cfg = ExportConfig(model_path=model_path, out_dir=out, format="ascend", scheme=load_scheme(scheme),
                       targets=["attn-linear", "moe"], device="cpu", dtype=torch.float32, serve_check=serve_check)
    return export_checkpoint(cfg)


def _load(folder):
    from amct_ext.export import ascend

    return tensor_layout(folder, ascend.INDEX_NAME), json.loads((folder / ascend.DESCRIPTION_NAME).read_text())


def _ref(name):
    return (json.loads((REFERENCE / name / "tensor_layout.json").read_text()),
            json.loads((REFERENCE / name / "quant_model_description.json").read_text()))


def _explained(key, ours, ref, dtype_ours, dtype_ref):
    """None when the difference at ``key`` is an explained one; else a description."""
    base = re.sub(r"\.(weight|weight_scale|weight_offset|scale_bias)$", "", key)
    if MTP_KEPT.match(key) and ref is None:
        return None
    if EXTRA_QUANTIZED.search(base):
        ref_w = dtype_ref.get(base + ".weight")
        out_f = ref_w["shape"][0]
        want = {"weight": {"dtype": "I8", "shape": ref_w["shape"]},
                "weight_scale": {"dtype": "F32", "shape": [out_f, 1]},
                "weight_offset": {"dtype": "F32", "shape": [out_f, 1]}}[key[len(base) + 1:]]
        return None if dtype_ours.get(key) == want and ours == "W8A8_DYNAMIC" else f"extra-quantized {key}: {dtype_ours.get(key)} {ours}"
    if SHARED.search(base) and ref == "W8A8_DYNAMIC" and ours == "W4A8_DYNAMIC":
        r, o = dtype_ref[key], dtype_ours[key]
        if key.endswith(".weight"):
            return None if o == {"dtype": "I8", "shape": [r["shape"][0] // 2, r["shape"][1]]} else f"shared {key}: {o}"
        return None if o == r else f"shared {key}: {o} vs {r}"
    return f"{key}: ours {dtype_ours.get(key)} {ours!r}, reference {dtype_ref.get(key)} {ref!r}"


@pytest.mark.parametrize("scheme,ref_name,serve_check", [("w8a8", "flash-w8a8", True),
                                                         (W4A8_CHANNEL, "pro-w4a8", False)])
def test_ascend_layout_matches_msmodelslim(tmp_path, scheme, ref_name, serve_check):
    _export(TINY, tmp_path / "out", scheme, serve_check)
    layout, desc = _load(tmp_path / "out")
    ref_layout, ref_desc = _ref(ref_name)
    for key in ("version", "model_quant_type", "group_size", "metadata"):
        assert desc[key] == ref_desc[key], key
    problems, same = [], 0
    for key in sorted(set(layout) | set(ref_layout)):
        if layout.get(key) == ref_layout.get(key) and desc.get(key) == ref_desc.get(key):
            same += 1
            continue
        why = _explained(key, desc.get(key), ref_desc.get(key), layout, ref_layout)
        if why:
            problems.append(why)
    assert not problems, problems[:10]
    # the bulk is identical: every routed expert (int8 or int4 rows + scale_bias), every FLOAT tensor
    assert same >= 380, same
    experts = [k for k in ref_layout if ".ffn.experts." in k]
    assert all(layout[k] == ref_layout[k] and desc[k] == ref_desc[k] for k in experts)
    assert desc["layers.0.ffn.gate.tid2eid"] == "FLOAT" and layout["layers.0.ffn.gate.tid2eid"]["dtype"] == "I32"
    # the description types every tensor, and nothing else
    assert {k for k, v in desc.items() if isinstance(v, str) and k not in ("version", "model_quant_type")} == set(layout)


def test_ascend_mtp_layer_quantized_like_msmodelslim(tmp_path):
    src = with_complete_mtp(TINY, tmp_path / "src")
    report = _export(src, tmp_path / "out", "w8a8")
    assert report.extra_layers == "mtp.0: quantized (RTN)"
    layout, desc = _load(tmp_path / "out")
    ref_layout, ref_desc = _ref("flash-w8a8-with-mtp")
    ref_mtp = {k for k in ref_layout if k.startswith("mtp.")}
    ours_mtp = {k for k in layout if k.startswith("mtp.")}
    # every MTP tensor msModelSlim writes, we write (plus the extra-quantized modules' scales)
    assert ref_mtp <= ours_mtp, sorted(ref_mtp - ours_mtp)[:5]
    for k in ref_mtp:
        if ref_desc[k] != "FLOAT":            # quantized: dtype, shape and type identical
            assert (layout[k], desc[k]) == (ref_layout[k], ref_desc[k]), k
        elif not EXTRA_QUANTIZED.search(re.sub(r"\.weight$", "", k)):
            # FLOAT: shape and type identical; the dtype is the source's (our synthetic MTP
            # stores hc_* in fp32, msModelSlim's source stored them bf16)
            assert layout[k]["shape"] == ref_layout[k]["shape"] and desc[k] == "FLOAT", k
    extra = ours_mtp - ref_mtp
    assert all(EXTRA_QUANTIZED.search(re.sub(r"\.(weight_scale|weight_offset)$", "", k)) for k in extra), sorted(extra)[:5]
