"""Export from AWQ / SmoothQuant / AutoRound runs (issue 25, item 6): the compressed-tensors export
read back computes the PTQ PPL of its run (1e-4), so what each recipe changes -- smoothing scales
folded into norms and weights, AutoRound's codes on a fixed grid -- reaches the checkpoint; and a
run whose w3 -> w2 smoothing left a per-channel SwiGLU limit (up_limit, which the export cannot
write) is refused before anything is written, never exported without it.

One layer (ratio 4: attention, compressor, indexer, experts), one calibration window, two
evaluation windows of 64 tokens: seconds per test."""
from __future__ import annotations

import pytest
import torch

from tests.export_helpers import TINY

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ = 64
LAYERS = range(1, 2)
TARGETS = ["attn-linear", "moe"]
#: smoothing pairs that export: attn_norm -> q_a / kv / ..., q_norm -> wq_b, wo_a -> wo_b (all
#: folded into weights the export writes); w3 -> w2 leaves up_limit (the refusal test below)
EXPORTABLE_PAIRS = "attn_norm,q_norm,wo_a"


@pytest.fixture(scope="module")
def texts(tmp_path_factory, wiki_test_raw):
    from amct_ext.pipeline.calibration import DEFAULT_CALIBRATION_PATH

    d = tmp_path_factory.mktemp("texts")
    (d / "eval.raw").write_text(wiki_test_raw.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    (d / "calib.txt").write_text(DEFAULT_CALIBRATION_PATH.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    return d / "eval.raw", d / "calib.txt"


def _adapter(path):
    from amct_ext.base import RunConfig
    from models.deepseek_v4.adapter import DeepseekV4Adapter

    return DeepseekV4Adapter(RunConfig(path, device="cpu", dtype=torch.float32, progress=False))


@pytest.fixture(scope="module")
def windows(texts):
    from amct_ext.base import EvalConfig
    from amct_ext.pipeline.workflow import load_eval_windows

    cfg = EvalConfig(seq_len=SEQ, max_windows=2, batch_size=2, data_path=texts[0])
    with _adapter(TINY) as a:
        return load_eval_windows(a, cfg), cfg


def _run(tmp_path, texts, windows, scheme_name, recipe_data):
    """(run folder, PTQ PPL, the run's smoothing / rounding stats) of one recipe on layer 1."""
    from amct_ext.algorithms.recipe import recipe_from_data
    from amct_ext.base import PtqConfig
    from amct_ext.pipeline.ptq_spec import PtqSpec
    from amct_ext.pipeline.workflow import PARAMS_DIR, evaluate_blockwise, run_blockwise_ptq
    from amct_ext.quant.schemes import load_scheme

    win, ecfg = windows
    scheme, run = load_scheme(scheme_name), tmp_path / "run"
    recipe = recipe_from_data(recipe_data, "test recipe")
    with _adapter(TINY) as a:
        spec = PtqSpec(scheme, TARGETS, PtqConfig(n_samples=1, seq_len=SEQ, calib_path=texts[1]), recipe=recipe,
                       propagate="float")
        res = run_blockwise_ptq(a, spec, run, layers=LAYERS)
        ppl = evaluate_blockwise(a, win, ecfg, "ptq", scheme=scheme, targets=TARGETS, layers=LAYERS,
                                 params_dir=run / PARAMS_DIR).ppl
    return run, ppl, res


def _export(run, out, fmt="compressed-tensors"):
    from amct_ext.export.exporter import ExportConfig, export_checkpoint, resolve_run

    scheme, targets, pdir = resolve_run(run, TINY, None, None)
    # the run's compute dtype, as export.py --from takes it from meta.json: smoothing's replaced
    # float weights are saved in it (an fp32 weight is refused by a bf16 layer, one line)
    export_checkpoint(ExportConfig(model_path=TINY, out_dir=out, format=fmt, scheme=scheme, targets=targets,
                                   params_dir=pdir, device="cpu", dtype=torch.float32))


def _readback_ppl(out, windows):
    from amct_ext.pipeline.workflow import evaluate_blockwise

    win, ecfg = windows
    with _adapter(out) as b:
        assert b.exported is not None and b.exported.layers == {1}
        return evaluate_blockwise(b, win, ecfg, "float").ppl


def _float_ppl(windows):
    from amct_ext.pipeline.workflow import evaluate_blockwise

    win, ecfg = windows
    with _adapter(TINY) as a:
        return evaluate_blockwise(a, win, ecfg, "float").ppl


@pytest.mark.parametrize("scheme,recipe", [
    ("w4a16-g128", [{"algo": "awq", "pairs": EXPORTABLE_PAIRS}]),
    ("w8a8", [{"algo": "smoothquant", "pairs": EXPORTABLE_PAIRS}, {"algo": "gptq"}]),
    ("w4a16-g128", [{"algo": "autoround", "iters": 20}]),
], ids=["awq", "smoothquant-gptq", "autoround"])
def test_export_of_a_recipe_run_reads_back_its_ptq_ppl(tmp_path, texts, windows, scheme, recipe):
    run, ptq, res = _run(tmp_path, texts, windows, scheme, recipe)
    _export(run, tmp_path / "e")
    exported = _readback_ppl(tmp_path / "e", windows)
    assert abs(exported - ptq) <= 1e-4 * ptq, (exported, ptq)
    # the recipe did something the export had to carry: PTQ is not float
    assert abs(ptq / _float_ppl(windows) - 1) > 1e-3


def test_export_of_the_w4a16_g128_default_reads_back_its_ptq_ppl(tmp_path, texts, windows):
    """w4a16-g128's default recipe (hclip's clips, then block-wise rounding's learned offsets, saved
    as codes on a fixed grid): the compressed-tensors checkpoint computes the PTQ model. What the
    export had to carry is also checked in the saved parameters: replaced weights with their fixed
    grid in every quantized leaf."""
    from amct_ext.algorithms.recipe import default_recipe, parse_algo, recipe_from_data
    from amct_ext.io.io_utils import safe_torch_load
    from amct_ext.pipeline.workflow import PARAMS_DIR
    from amct_ext.quant.schemes import load_scheme

    recipe = [{"algo": "hclip"}, {"algo": "blockround", "keep_best": False, "offset_dtype": "float16", "iters": 100}]
    algo, _ = default_recipe(load_scheme("w4a16-g128"))
    assert recipe_from_data(recipe, "t").settings() == parse_algo(algo).settings()   # it is today's default
    run, ptq, _ = _run(tmp_path, texts, windows, "w4a16-g128", recipe)
    _export(run, tmp_path / "e")
    exported = _readback_ppl(tmp_path / "e", windows)
    assert abs(exported - ptq) <= 1e-4 * ptq, (exported, ptq)
    keys = [k for p in (run / PARAMS_DIR).glob("layer_1_*.pt") for k in safe_torch_load(p)]
    coded = {k[: -len(".weight_codes")] for k in keys if k.endswith(".weight_codes")}
    scaled = {k[: -len(".weight_quantizer.scale")] for k in keys if k.endswith(".weight_quantizer.scale")}
    assert coded and coded == scaled, (sorted(coded), sorted(scaled))


def test_smoothing_that_leaves_a_per_channel_swiglu_limit_is_refused(tmp_path, texts, windows):
    """AWQ on w3 -> w2 replaces the experts' scalar clamp with a per-channel up_limit, which no
    checkpoint key carries: the export must refuse (naming up_limit and the flag that avoids it)
    before it writes a file -- never a checkpoint that computes something else (issue 25's repro:
    PTQ 1576.46 against 1573.00 read back)."""
    from amct_ext.errors import AmctError

    run, _, _ = _run(tmp_path, texts, windows, "w4a16-g128", [{"algo": "awq", "pairs": "w3"}])
    out = tmp_path / "e"
    with pytest.raises(AmctError, match="up_limit") as err:
        _export(run, out)
    assert "pairs" in str(err.value)
    assert not out.exists() or not any(out.rglob("*.safetensors"))
