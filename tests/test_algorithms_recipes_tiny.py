"""The default recipe on the trained tiny V4 (assets/tiny-v4), shrunk for CI: w3a16-g128 on
attn-linear + moe of layer 1 only (ratio 4: attention with compressor and indexer, routed and
shared experts; the other layers float), 8 calibration windows x 256 of valid.txt, the first 24
test windows x 256.

Measured on this protocol (2026-12-02, 2-core CPU, fp32, 1 thread): RTN 288.574; the default
recipe (hclip,gptq: sequential GPTQ on capture statistics, propagate quant) 284.371, -1.46 %.
The test demands a cut of at least MIN_GAIN = 0.6 %, under half the effect: a recipe that stops
helping (a GPTQ / clip / guard regression) fails it."""
from __future__ import annotations

import pytest
import torch

from amct_ext.algorithms.recipe import default_recipe, parse_algo
from amct_ext.base import EvalConfig, PtqConfig, RunConfig
from amct_ext.quant.schemes import load_scheme
from amct_ext.pipeline.ptq_spec import PtqSpec
from amct_ext.pipeline.workflow import PARAMS_DIR, evaluate_blockwise, load_calib_windows, load_eval_windows, run_blockwise_ptq
from models.deepseek_v4.adapter import DeepseekV4Adapter
from tests.conftest import REPO

pytestmark = pytest.mark.usefixtures("one_thread")
TRAINED = REPO / "assets" / "tiny-v4"
SCHEME = "w3a16-g128"
MIN_GAIN = 0.006         # PPL(default) <= (1 - MIN_GAIN) * PPL(RTN)
LAYERS = range(1, 2)     # layer 1 (ratio 4: compressor + indexer, every unit kind); others float
SEQ, CALIB, EVAL_WINDOWS = 256, 8, 24


def test_default_recipe_beats_rtn_at_3_bits(tmp_path, wiki_test_raw):
    adapter = DeepseekV4Adapter(RunConfig(model_path=TRAINED, device="cpu", dtype=torch.float32, progress=False))
    ecfg = EvalConfig(seq_len=SEQ, max_windows=EVAL_WINDOWS, batch_size=8, data_path=wiki_test_raw)
    windows = load_eval_windows(adapter, ecfg)
    scheme, targets = load_scheme(SCHEME), ["attn-linear", "moe"]
    cfg = PtqConfig(n_samples=CALIB, seq_len=SEQ, batch_size=1, seed=0)
    calib = load_calib_windows(adapter, cfg)
    algo, propagate = default_recipe(SCHEME)
    run_blockwise_ptq(adapter, PtqSpec(scheme, targets, cfg, recipe=parse_algo(algo), propagate=propagate),
                      tmp_path, calib_windows=calib, layers=LAYERS)
    rtn = evaluate_blockwise(adapter, windows, ecfg, "rtn", scheme=scheme, targets=targets, layers=LAYERS).ppl
    ptq = evaluate_blockwise(adapter, windows, ecfg, "ptq", scheme=scheme, targets=targets, layers=LAYERS,
                             params_dir=tmp_path / PARAMS_DIR).ppl
    print(f"\n{SCHEME} {algo}@{propagate}: RTN {rtn:.3f}, default {ptq:.3f} ({100 * (ptq / rtn - 1):+.2f} %)")
    assert ptq <= (1 - MIN_GAIN) * rtn
