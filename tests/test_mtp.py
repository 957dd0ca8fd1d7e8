"""Issue 23.6: the MTP layer quantized like a decoder layer (calibrated on the main model's hidden
states), exported with the run's parameters, and its cost in report.json.

The tiny asset's MTP layer has e_proj / h_proj / norms only, so these tests use a copy whose
mtp.0 is complete and random (tests/export_helpers.with_complete_mtp): its top-1 accuracy on
t+2 is meaningless, the agreement with the float MTP still measures the quantization."""
from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors import safe_open

from tests.export_helpers import REPO, TINY, tensor_layout, with_complete_mtp

sys.path.insert(0, str(REPO / "tools"))
pytestmark = pytest.mark.usefixtures("one_thread")
SEQ = 64


def test_top1_stats_against_a_loop():
    from amct_ext.pipeline.mtp_eval import top1_stats

    # by hand: f and q agree at 0-3 and 5; f is right at 0, 1, 2, 5, 6, q at 0, 1, 2, 4, 5, 7
    f = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    q = torch.tensor([[1, 2, 3, 4], [0, 6, 0, 0]])
    y = torch.tensor([[1, 2, 3, 0], [0, 6, 7, 0]])
    s = top1_stats(f.reshape(-1), q.reshape(-1), y.reshape(-1))
    assert s["positions"] == 8
    assert s["top1_agreement"] == 5 / 8
    assert s["top1_accuracy"] == {"float": 5 / 8, "quant": 6 / 8}
    # and against a loop on random ids
    g = torch.Generator().manual_seed(3)
    f, q, y = (torch.randint(0, 3, (41,), generator=g) for _ in range(3))
    agree = acc_f = acc_q = 0
    for a, b, t in zip(f.tolist(), q.tolist(), y.tolist()):
        agree += a == b
        acc_f += a == t
        acc_q += b == t
    s = top1_stats(f, q, y)
    assert s["positions"] == 41
    assert s["top1_agreement"] == agree / 41
    assert s["top1_accuracy"] == {"float": acc_f / 41, "quant": acc_q / 41}
    with pytest.raises(ValueError, match="shapes"):
        top1_stats(f, q[:-1], y)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return with_complete_mtp(TINY, tmp_path_factory.mktemp("mtp-src"), own_head=False)


@pytest.fixture(scope="module")
def eval_raw(tmp_path_factory, wiki_test_raw):
    p = tmp_path_factory.mktemp("texts") / "eval.raw"
    p.write_text(wiki_test_raw.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def run(src, eval_raw, tmp_path_factory):
    """The main job (the library's entry point) on the last main layer with a calibrating
    algorithm (clip): the MTP layer follows."""
    from tests.conftest import library_job

    out = tmp_path_factory.mktemp("run") / "R"
    assert library_job(out, model="tiny-trained", model_path=str(src), scheme="w8a8", algo="clip", start_layer=3,
                       end_layer=4, calib_samples=1, seq_len=SEQ, eval_windows=2, epochs=1, quiet=True,
                       eval_data=str(eval_raw), eval_batch_size=2, ppl_modes="") is not None
    return out


def test_mtp_layer_is_calibrated_not_rtn(run):
    from amct_ext.io.io_utils import safe_torch_load

    pdir = run / "ptq_params"
    files = sorted(p.name for p in pdir.glob("layer_4_*.pt"))      # layer id n_layers + 0
    assert "layer_4_attn.pt" in files and "layer_4_ffn_shared_experts.pt" in files
    clips = [v for p in pdir.glob("layer_4_*.pt") for k, v in safe_torch_load(p).items() if k.endswith(".clip")]
    assert clips and any(bool((c < 1).any()) for c in clips)       # RTN's clip is 1 everywhere
    units = [u for u in json.loads((run / "report.json").read_text())["units"] if u["layer"] == 4]
    assert units and all(u["loss_after"] <= u["loss_before"] for u in units)
    assert any(u["loss_after"] < u["loss_before"] for u in units)


def test_report_has_the_mtp_cost(run):
    r = json.loads((run / "report.json").read_text())["mtp"]
    assert r["layer"] == "mtp.0" and r["quantized_with"] == "run parameters"
    assert r["positions"] == 2 * (SEQ - 2)          # 2 windows, S-2 positions with a t+2 target
    assert 0 <= r["top1_agreement"] <= 1 and set(r["top1_accuracy"]) == {"float", "quant"}
    assert "random" in r["note"]


def _mtp_tensors(folder, index):
    lay = tensor_layout(folder, index)
    idx = json.loads((folder / index).read_text())["weight_map"]
    out = {}
    for k in lay:
        if k.startswith("mtp.0.attn.wq_a.") or k.startswith("mtp.0.ffn.shared_experts.w2."):
            with safe_open(str(folder / idx[k]), "pt") as f:
                out[k] = f.get_tensor(k)
    return out


def test_export_writes_the_mtp_run_parameters(run, src, tmp_path):
    from amct_ext.export.exporter import ExportConfig, export_checkpoint, resolve_run

    sch, targets, pdir = resolve_run(run, src, None, None)
    common = dict(model_path=src, format="compressed-tensors", scheme=sch, targets=targets, device="cpu",
                  dtype=torch.float32)
    a = export_checkpoint(ExportConfig(out_dir=tmp_path / "from", params_dir=pdir, **common))
    b = export_checkpoint(ExportConfig(out_dir=tmp_path / "rtn", **common))
    assert a.extra_layers == "mtp.0: quantized (run parameters)" and b.extra_layers == "mtp.0: quantized (RTN)"
    ta = _mtp_tensors(tmp_path / "from", "model.safetensors.index.json")
    tb = _mtp_tensors(tmp_path / "rtn", "model.safetensors.index.json")
    assert set(ta) == set(tb) and any(k.endswith("weight_scale") for k in ta)
    assert any(not torch.equal(ta[k], tb[k]) for k in ta)         # the clips moved the scales


@torch.no_grad()
def test_mtp_inputs_and_logits_follow_the_formula(src, eval_raw):
    """adapter.mtp_block_inputs / mtp_logits against the formula computed here from the raw
    checkpoint tensors and the whole float model's last hidden state."""
    from amct_ext.base import EvalConfig, RunConfig
    from amct_ext.pipeline.workflow import embed_stream, load_eval_windows
    from models.deepseek_v4.adapter import DeepseekV4Adapter
    from models.deepseek_v4.loading import load_checkpoint_model

    def raw(key):
        idx = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
        with safe_open(str(src / idx[key]), "pt") as f:
            return f.get_tensor(key).float()

    def rms(x, w, eps):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * w

    model = load_checkpoint_model(src, torch.float32)
    cfg = model.config
    with DeepseekV4Adapter(RunConfig(src, device="cpu", dtype=torch.float32, progress=False)) as a:
        win = load_eval_windows(a, EvalConfig(seq_len=SEQ, max_windows=1, batch_size=1, data_path=eval_raw))
        st = embed_stream(a, win, 1)
        h = st.hidden
        for i in range(a.num_layers):
            blk = a.block(i, device="cpu")
            h = a.do_block_forward(blk, h, st.state)
        xs, sts = a.mtp_block_inputs(4, h, st.state)
        ids = win[:1]
        # the whole float model's last hidden state, layer by layer
        hh = model.embed_tokens(ids)
        for layer in model.layers:
            hh = layer(hh, 0, ids)
        torch.testing.assert_close(h[0], hh, rtol=0, atol=0)
        eps = cfg.norm_eps
        e = rms(model.embed(ids[:, 1:]).float(), raw("mtp.0.enorm.weight"), eps) @ raw("mtp.0.e_proj.weight").T
        x = e.unsqueeze(2) + rms(hh[:, :-1].float(), raw("mtp.0.hnorm.weight"), eps) @ raw("mtp.0.h_proj.weight").T
        torch.testing.assert_close(xs[0], x, rtol=1e-5, atol=1e-5)
        assert torch.equal(sts[0]["input_ids"], ids[:, 1:])
        y = a.block(4, device="cpu")(xs[0], 0, ids[:, 1:])
        got = a.mtp_logits(4, y)
        # hc head with the MTP's own hc_head_* and norm, then the main head (no mtp.0.head.weight)
        xf = y.flatten(-2).float()
        mix = (xf @ raw("mtp.0.hc_head_fn").T) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        pre = torch.sigmoid(mix * raw("mtp.0.hc_head_scale") + raw("mtp.0.hc_head_base")) + cfg.hc_eps
        z = (pre.unsqueeze(-1) * y.float()).sum(2)
        want = rms(z, raw("mtp.0.norm.weight"), eps) @ raw("head.weight").T
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert got.shape == (1, SEQ - 1, cfg.vocab_size)
