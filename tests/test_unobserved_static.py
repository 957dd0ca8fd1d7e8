"""Static activation quantizers that no calibration data reached are counted (EvalResult /
PtqResult.unobserved_static, report.json "unobserved_static_quantizers", the CLI summary), never
silently left in float (issue 17, item 7). The count is checked against the routing of the float
reference model: experts that no calibration token is routed to."""
import json

import pytest
import torch

from amct_ext.base import EvalConfig, PtqConfig
from amct_ext.quant.quantizers import ActivationQuantizer
from amct_ext.quant.schemes import load_scheme
from amct_ext.pipeline.ptq_spec import PtqSpec
from amct_ext.pipeline.workflow import evaluate_blockwise, run_blockwise_ptq
from models.deepseek_v4.loading import load_checkpoint_model
from tests.conftest import WIKI_TEST_RAW

STATIC = {"name": "w8a8-static",
          "weight": {"format": "int", "bits": 8, "granularity": "channel"},
          "input": {"format": "int", "bits": 8, "granularity": "tensor", "dynamic": False}}
TARGETS = ["moe"]
pytestmark = pytest.mark.usefixtures("one_thread")


def expected_unobserved(adapter, tiny_ckpt, calib) -> int:
    """Experts with no routed calibration token (float model's gates) x static quantizers per expert."""
    model = load_checkpoint_model(tiny_ckpt, dtype=torch.float32)
    used = {i: set() for i in range(adapter.num_layers)}
    hooks = [model.layers[i].ffn.gate.register_forward_hook(
        lambda _, __, out, i=i: used[i].update(out[1].flatten().tolist())) for i in range(adapter.num_layers)]
    with torch.no_grad():
        for row in calib:
            model(row[None])
    for h in hooks:
        h.remove()
    block = adapter.block(0)
    adapter.quantize_block(block, load_scheme(STATIC), TARGETS)
    per_expert = sum(isinstance(m, ActivationQuantizer) and m.is_static for m in block.ffn.experts[0].modules())
    adapter.release_block(block)
    n_exp = adapter.config.n_routed_experts
    return per_expert * sum(n_exp - len(u) for u in used.values())


def test_unobserved_static_quantizers_are_counted(tiny_adapter, tiny_ckpt, tmp_path):
    calib = torch.randint(2, 512, (1, 3), generator=torch.Generator().manual_seed(0))  # 3 tokens, 8 experts
    expected = expected_unobserved(tiny_adapter, tiny_ckpt, calib)
    assert expected > 0
    cfg = EvalConfig(seq_len=16, max_windows=1, batch_size=1, data_path=WIKI_TEST_RAW)
    windows = torch.randint(2, 512, (1, 16), generator=torch.Generator().manual_seed(1))
    r = evaluate_blockwise(tiny_adapter, windows, cfg, "rtn", scheme=load_scheme(STATIC), targets=TARGETS,
                           calib_windows=calib)
    assert r.unobserved_static == expected
    spec = PtqSpec(load_scheme(STATIC), TARGETS, PtqConfig(epochs=0, n_samples=1, seq_len=3),
                   recipe="learned_clip:epochs=0")
    res = run_blockwise_ptq(tiny_adapter, spec, tmp_path, calib_windows=calib)
    assert res.unobserved_static == expected
    q = evaluate_blockwise(tiny_adapter, windows, cfg, "ptq", scheme=load_scheme(STATIC), targets=TARGETS,
                           params_dir=tmp_path / "ptq_params")
    assert q.unobserved_static == expected


def test_the_job_reports_them(tiny_ckpt, tmp_path, capsys):
    """The main job (library entry point, as the CLI runs it) counts and prints them."""
    from tests.conftest import library_job

    scheme = tmp_path / "static.json"
    scheme.write_text(json.dumps({**STATIC, "name": "w8a8-static"}))
    out = tmp_path / "out"
    report = library_job(out, model="tiny", model_path=str(tiny_ckpt), scheme=str(scheme), quant_target="moe",
                         calib_samples=1, seq_len=4, epochs=0, eval_windows=1, quiet=True)
    printed = capsys.readouterr().out
    assert report is not None
    counts = json.loads((out / "report.json").read_text())["unobserved_static_quantizers"]
    assert set(counts) == {"rtn", "ptq_calibration", "ptq"} and counts["rtn"] > 0
    assert counts["rtn"] == counts["ptq_calibration"] == counts["ptq"]
    assert f"left in float (no calibration data reached them): rtn {counts['rtn']}" in printed
