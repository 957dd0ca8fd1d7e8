"""A layer's input stream is freed once the next layer's inputs exist (casebook i34-8).

At V4-Flash size one calibration stream is 8 GiB of host memory (128 x 2048 tokens, 4 hyper-
connection copies of 4096 bf16). The split loop once kept the embedded stream referenced for the
whole run (the run object held it), and the host-memory bound of a real-size layer failed by
5 GiB (benchmarks/results/block-rounding.md). Here: weak references to the embedded stream's
tensors must be dead when layer 1 is built, whether layer 0 is quantized (float or quant
propagation, with or without the block stage's second stream) or only a float predecessor.
"""
import gc
import weakref

import pytest

from amct_ext.base import PtqConfig
from amct_ext.pipeline import workflow
from amct_ext.pipeline.ptq_spec import PtqSpec
from amct_ext.pipeline.workflow import load_calib_windows, run_blockwise_ptq
from amct_ext.quant.schemes import load_scheme

PTQ = PtqConfig(epochs=1, lr=5e-3, n_samples=2, seq_len=32, batch_size=1, seed=0)
TARGETS = ["attn-linear", "moe"]

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {  # name: (layers quantized, scheme, recipe, propagate)
    "quantized-float": (range(0, 2), "w8a8", "rtn", "float"),
    "quantized-blockround-quant": (range(0, 2), "w4a16", "blockround:iters=1:batch=1", "quant"),
    "float-predecessor": (range(1, 2), "w8a8", "rtn", "float"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_embedded_stream_is_freed_before_layer_1_is_built(tiny_adapter, tmp_path, monkeypatch, case):
    layers, scheme, recipe, propagate = CASES[case]
    refs: list[weakref.ref] = []
    alive_at_layer_1: list[int] = []

    real_embed = workflow.embed_stream

    def embed(*args, **kwargs):
        stream = real_embed(*args, **kwargs)
        refs.extend(weakref.ref(t) for t in stream.hidden)
        return stream

    real_block = tiny_adapter.block

    def block(i, *args, **kwargs):
        if i == 1:
            gc.collect()
            alive_at_layer_1.append(sum(r() is not None for r in refs))
        return real_block(i, *args, **kwargs)

    monkeypatch.setattr(workflow, "embed_stream", embed)
    monkeypatch.setattr(tiny_adapter, "block", block)
    calib = load_calib_windows(tiny_adapter, PTQ)
    spec = PtqSpec(load_scheme(scheme), TARGETS, PTQ, recipe=recipe, propagate=propagate)
    run_blockwise_ptq(tiny_adapter, spec, tmp_path / "out", layers=layers, calib_windows=calib)
    assert refs, "the run embedded no stream (the test patches the wrong function)"
    assert alive_at_layer_1, "layer 1 was never built"
    assert alive_at_layer_1[0] == 0, (f"{alive_at_layer_1[0]} of the embedded stream's {len(refs)} tensors "
                                      "are still referenced when layer 1 is built")
