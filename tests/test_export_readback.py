"""Read-back: the exported model's float PPL is the PTQ PPL of the run it came from (same windows),
for compressed-tensors (w8a8, w4a16-g128, w4a8, mxfp4) and Ascend (w8a8); the CLI flow of the
issue (run_ptq --export, export.py --from, run_ptq --model-path EXPORTED --no-ptq --eval-ppl);
load_checkpoint_model on an export."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.export_helpers import REPO, TINY

sys.path.insert(0, str(REPO / "tools"))
pytestmark = pytest.mark.usefixtures("one_thread")

SEQ = 64


LAYERS = range(1, 2)   # PTQ on one layer (ratio 4: attention, compressor, indexer, experts) keeps it fast


@pytest.fixture(scope="module")
def texts(tmp_path_factory, wiki_test_raw):
    """Short prefixes of the evaluation and calibration texts (tokenizing the whole files would
    dominate these tests); the same windows serve the PTQ evaluation and the read-back."""
    from amct_ext.pipeline.calibration import DEFAULT_CALIBRATION_PATH

    d = tmp_path_factory.mktemp("texts")
    (d / "eval.raw").write_text(wiki_test_raw.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    (d / "calib.txt").write_text(DEFAULT_CALIBRATION_PATH.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    return d / "eval.raw", d / "calib.txt"


@pytest.fixture(scope="module")
def windows(texts):
    from amct_ext.base import EvalConfig, RunConfig
    from amct_ext.pipeline.workflow import load_eval_windows
    from models.deepseek_v4.adapter import DeepseekV4Adapter

    cfg = EvalConfig(seq_len=SEQ, max_windows=2, batch_size=2, data_path=texts[0])
    with DeepseekV4Adapter(RunConfig(TINY, device="cpu", dtype=torch.float32, progress=False)) as a:
        return load_eval_windows(a, cfg), cfg


def _adapter(path):
    from amct_ext.base import RunConfig
    from models.deepseek_v4.adapter import DeepseekV4Adapter

    return DeepseekV4Adapter(RunConfig(path, device="cpu", dtype=torch.float32, progress=False))


@pytest.fixture(scope="module")
def ptq_runs(tmp_path_factory, windows, texts):
    """scheme -> (run folder, PTQ PPL): one PTQ run per scheme, shared by both formats."""
    from amct_ext.base import PtqConfig
    from amct_ext.quant.schemes import load_scheme
    from amct_ext.pipeline.ptq_spec import PtqSpec
    from amct_ext.pipeline.workflow import PARAMS_DIR, evaluate_blockwise, run_blockwise_ptq

    win, ecfg = windows
    cache = {}

    def get(scheme):
        if scheme not in cache:
            sch, targets = load_scheme(scheme), ["attn-linear", "moe"]
            run = tmp_path_factory.mktemp(f"run-{scheme}")
            with _adapter(TINY) as a:
                # one calibration window, one epoch: the clips move (the export must carry them)
                cfg = PtqConfig(epochs=1, lr=5e-3, n_samples=1, seq_len=SEQ, calib_path=texts[1])
                run_blockwise_ptq(a, PtqSpec(sch, targets, cfg, recipe="learned_clip:epochs=1:lr=5e-3"), run,
                                  layers=LAYERS)
                cache[scheme] = run, evaluate_blockwise(a, win, ecfg, "ptq", scheme=sch, targets=targets,
                                                        layers=LAYERS, params_dir=run / PARAMS_DIR).ppl
        return cache[scheme]
    return get


@pytest.mark.parametrize("scheme,fmt", [("w8a8", "compressed-tensors"), ("w4a16-g128", "compressed-tensors"),
                                        ("w4a8", "compressed-tensors"), ("mxfp4", "compressed-tensors"),
                                        ("w8a8", "ascend")])
def test_exported_float_ppl_is_the_ptq_ppl(tmp_path, windows, ptq_runs, scheme, fmt):
    from amct_ext.export.engine import ServeOptions
    from amct_ext.export.exporter import ExportConfig, export_checkpoint, resolve_run
    from amct_ext.pipeline.workflow import evaluate_blockwise

    win, ecfg = windows
    run, ptq = ptq_runs(scheme)
    sch2, targets2, pdir = resolve_run(run, TINY, None, None)
    # w4a8 int is served by vLLM's CPU build only; mxfp4 with its activations by no vLLM build
    # (the CUDA kernels drop them): its export is storage for this tool's read-back (casebook i36e-1, i36e-2)
    serve = {"w4a8": {"serve": ServeOptions(build="cpu")}, "mxfp4": {"serve_check": False}}.get(scheme, {})
    export_checkpoint(ExportConfig(model_path=TINY, out_dir=tmp_path / "e", format=fmt, scheme=sch2, targets=targets2,
                                   params_dir=pdir, device="cpu", **(serve if fmt == "compressed-tensors" else {})))
    with _adapter(tmp_path / "e") as b:
        assert b.exported is not None and b.exported.format == fmt
        exported = evaluate_blockwise(b, win, ecfg, "float").ppl
        assert b.exported.layers == {1}
    assert abs(exported - ptq) <= 1e-4 * ptq, (exported, ptq)
    if scheme != "mxfp4":   # MX scales have no clip; elsewhere the export must carry learned clips
        from amct_ext.io.io_utils import safe_torch_load

        clips = [v for p in pdir.glob("layer_1_*.pt") for k, v in safe_torch_load(p).items() if k.endswith(".clip")]
        assert clips and any(bool((c < 1).any()) for c in clips)


def test_cli_flow_and_load_checkpoint_model(tmp_path, texts, capsys):
    import export as export_tool
    import run_ptq

    from models.deepseek_v4.loading import load_checkpoint_model

    fast = ["--calib-samples", "1", "--seq-len", str(SEQ), "--eval-windows", "2", "--epochs", "1", "--quiet",
            "--eval-data", str(texts[0]), "--calib-data", str(texts[1]), "--eval-batch-size", "2"]
    old = torch.get_num_threads()
    try:
        assert run_ptq.main(["--model", "tiny-trained", "--scheme", "w4a16-g128", "--output-dir", str(tmp_path / "R"),
                             "--start-layer", "2", "--end-layer", "3", "--export", "compressed-tensors", *fast]) == 0
        assert export_tool.main(["--model", "tiny-trained", "--from", str(tmp_path / "R"), "--format",
                                 "compressed-tensors", "--out", str(tmp_path / "E"), "--quiet"]) == 0
        assert run_ptq.main(["--model", "tiny-trained", "--model-path", str(tmp_path / "E"), "--no-ptq",
                             "--eval-ppl", "--output-dir", str(tmp_path / "V"), *fast]) == 0
        # PTQ on an exported checkpoint is refused (its weights are already on the grid)
        assert run_ptq.main(["--model", "tiny-trained", "--model-path", str(tmp_path / "E"),
                             "--output-dir", str(tmp_path / "W"), *fast]) == 2
    finally:
        torch.set_num_threads(old)
    assert "exported quantized checkpoint" in capsys.readouterr().err
    r = json.loads((tmp_path / "R" / "report.json").read_text())
    v = json.loads((tmp_path / "V" / "report.json").read_text())
    assert v["ppl"]["float"] == pytest.approx(r["ppl"]["quant"], rel=1e-4)
    assert v["ppl"]["rtn"] is None
    # run_ptq --export and export.py --from wrote the same checkpoint
    e1, e2 = tmp_path / "R" / "export-compressed-tensors", tmp_path / "E"
    i1 = json.loads((e1 / "model.safetensors.index.json").read_text())
    assert i1 == json.loads((e2 / "model.safetensors.index.json").read_text())
    for shard in set(i1["weight_map"].values()):
        assert (e1 / shard).read_bytes() == (e2 / shard).read_bytes()
    cfg = json.loads((e2 / "config.json").read_text())
    assert cfg["quantization_config"]["format"] == "pack-quantized" and cfg["amct_export"]["from_params"]
    assert (e2 / "tokenizer.json").is_file() and any(k.startswith("mtp.0.") for k in i1["weight_map"])
    # the whole model loads; w4a16 declares no activation quantization, so no wrapper is added
    from amct_ext.quant.quant_linear import QuantLinear

    model, account = load_checkpoint_model(e2, return_account=True)
    assert not account.unexpected and account.skipped   # mtp kept in the file, skipped by the forward
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


def test_a_float_leaf_of_a_quantized_target_keeps_a_float_input(tmp_path):
    """An Ascend description that leaves a leaf of a quantized target FLOAT (msModelSlim keeps
    ``wo_b`` FLOAT while wq_a / wkv / wq_b are W8A8_DYNAMIC) is read back with that leaf's input
    unquantized, as vllm-ascend runs it; the W8A8 leaves keep their dynamic int8 inputs."""
    import shutil

    from amct_ext.export.readback import exported_quant
    from models.deepseek_v4.loading import apply_exported_activations, load_config
    from models.deepseek_v4.modeling import Block

    shutil.copy(TINY / "config.json", tmp_path / "config.json")
    desc = {f"layers.1.attn.{m}.weight": "W8A8_DYNAMIC" for m in ("wq_a", "wkv", "wq_b", "indexer.wq_b")}
    desc.update({"layers.1.attn.wo_b.weight": "FLOAT", "layers.1.ffn.shared_experts.w2.weight": "FLOAT",
                 "layers.1.ffn.experts.0.w1.weight": "W4A8_DYNAMIC"})
    (tmp_path / "quant_model_description.json").write_text(json.dumps(desc))
    ex = exported_quant(tmp_path)
    assert ex.targets == ["attn-linear", "moe"]
    assert ex.float_weights == {"layers.1.attn.wo_b.weight", "layers.1.ffn.shared_experts.w2.weight"}
    block = apply_exported_activations(Block(1, load_config(TINY), torch.float32), ex, 1)
    quantized = {n[: -len(".input_quantizer")] for n, m in block.named_modules()
                 if n.endswith(".input_quantizer") and not m.is_identity}
    assert {"attn.wq_a", "attn.wkv", "attn.wq_b", "attn.indexer.wq_b", "ffn.experts.0.w1",
            "ffn.shared_experts.w1"} <= quantized
    assert "attn.wo_b" not in quantized and "ffn.shared_experts.w2" not in quantized
    with torch.no_grad():   # the block was built uninitialised
        block.attn.wo_b.weight.normal_()
    x = torch.randn(3, block.attn.wo_b.in_features) * 10
    assert torch.equal(block.attn.wo_b(x), torch.nn.functional.linear(x, block.attn.wo_b.weight))


def test_experts_tuned_in_turns_export_and_read_back_to_their_ppl(tmp_path, windows, texts):
    """blockround in turns (casebook i34-17) ends with every expert folded into a fixed grid from
    its codes: the compressed-tensors export of that layer reads back to the PTQ perplexity."""
    from amct_ext.base import PtqConfig
    from amct_ext.export.exporter import ExportConfig, export_checkpoint, resolve_run
    from amct_ext.pipeline.ptq_spec import PtqSpec
    from amct_ext.pipeline.workflow import PARAMS_DIR, evaluate_blockwise, run_blockwise_ptq
    from amct_ext.quant.schemes import load_scheme

    win, ecfg = windows
    sch, targets, run = load_scheme("w4a16-g128"), ["attn-linear", "moe"], tmp_path / "run"
    with _adapter(TINY) as a:
        cfg = PtqConfig(epochs=1, lr=5e-3, n_samples=2, seq_len=SEQ, calib_path=texts[1])
        recipe = "blockround:keep_best=false:iters=8:lr=0.02:turns=2"
        res = run_blockwise_ptq(a, PtqSpec(sch, targets, cfg, recipe=recipe), run, layers=LAYERS)
        ptq = evaluate_blockwise(a, win, ecfg, "ptq", scheme=sch, targets=targets, layers=LAYERS,
                                 params_dir=run / PARAMS_DIR).ppl
    stats = [u.stats["blockround"] for u in res.units if ".experts." in u.name]
    assert stats and all(s["turns"] == 2 and s["folded_leaves"] == 3 for s in stats)
    sch2, targets2, pdir = resolve_run(run, TINY, None, None)
    export_checkpoint(ExportConfig(model_path=TINY, out_dir=tmp_path / "e", format="compressed-tensors", scheme=sch2,
                                   targets=targets2, params_dir=pdir, device="cpu"))
    with _adapter(tmp_path / "e") as b:
        exported = evaluate_blockwise(b, win, ecfg, "float").ppl
    assert abs(exported - ptq) <= 1e-4 * ptq, (exported, ptq)
