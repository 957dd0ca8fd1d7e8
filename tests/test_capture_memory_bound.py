"""Issue 24.5: a call-replaying recipe's host memory is bounded by the capture budget + the
write buffer + the algorithm's working set, asserted on tiny layer 1 (attention with an
indexer, 8 routed experts, the shared expert) through the capture's own accounting
(``capture.CALL_METER``, ``CaptureStore.peak_in_memory``), and the bounded run learns exactly
what the unbounded one learns.

The working set of the batched clip / AutoRound: one expert chunk's calls stacked (clip: the
training and the judging copy; on a cpu device both are host memory, counted while their
per-call pieces wait to be concatenated too) and one chunk file read back.
"""
import pytest
import torch

from amct_ext.base import PtqConfig
from amct_ext.io.io_utils import safe_torch_load
from amct_ext.pipeline.capture import CALL_METER, CaptureStore, StoreCalls, UnitCall, call_nbytes
from amct_ext.pipeline.ptq_spec import PtqSpec
from amct_ext.pipeline.workflow import PARAMS_DIR, PtqRuntime, load_calib_windows, run_blockwise_ptq
from amct_ext.quant.schemes import load_scheme

TARGETS = ["attn-linear", "moe"]
# several windows, one a forward: every unit is called 6 times, the experts in between each other
PTQ = PtqConfig(epochs=1, lr=5e-3, n_samples=6, seq_len=48, batch_size=1, seed=0)
LAYERS = range(1, 2)
CHUNK = 2                     # experts per batched solve
# (scheme, recipe): the two batched call-replaying algorithms of the defaults (clip, AutoRound);
# per-channel weight grids, the tiny hidden size (64) has no room for groups of 128
RECIPES = {"clip": ("w4a16", f"clip:expert_chunk={CHUNK}:epochs=1:grid=4"),
           "autoround": ("w4a16", f"autoround:expert_chunk={CHUNK}:iters=4")}

pytestmark = pytest.mark.usefixtures("one_thread")


class _Recording(StoreCalls):
    """Keeps the calls in memory like the default sink and remembers their bytes after discard."""

    total = 0

    def add(self, call):
        super().add(call)
        self.total = self._bytes


def _params(out) -> dict:
    return {p.name: safe_torch_load(p) for p in sorted((out / PARAMS_DIR).glob("*.pt"))}


@pytest.fixture(scope="module")
def calib(tiny_adapter):
    return load_calib_windows(tiny_adapter, PTQ)


def _run(adapter, algo, calib, out, **runtime):
    scheme, recipe = RECIPES[algo]
    spec = PtqSpec(load_scheme(scheme), TARGETS, PTQ, recipe=recipe)
    return run_blockwise_ptq(adapter, spec, out, layers=LAYERS, calib_windows=calib, runtime=PtqRuntime(**runtime))


@pytest.mark.parametrize("algo", sorted(RECIPES))
def test_call_replaying_recipe_stays_within_budget_and_working_set(tiny_adapter, calib, tmp_path, algo):
    sinks: dict[str, _Recording] = {}
    live_before = CALL_METER.live
    ref = _run(tiny_adapter, algo, calib, tmp_path / "ref",
               make_sink=lambda u: sinks.setdefault(u.name, _Recording()))
    per_unit = {name: s.total for name, s in sinks.items()}
    total = sum(per_unit.values())
    experts = [per_unit[n] for n in sorted((n for n in per_unit if ".experts." in n),
                                           key=lambda n: int(n.rsplit(".", 1)[1]))]
    assert len(experts) == 8 and total > 0
    chunk_calls = max(sum(experts[i:i + CHUNK]) for i in range(0, len(experts), CHUNK))

    budget = total // 8           # an eighth of the layer's calls in memory, the rest spilled
    buffer = total // 16          # > any one call of this layer (a larger call would wait alone)
    working_set = 3 * chunk_calls + buffer   # stacked copies while built + one chunk file read back
    res = _run(tiny_adapter, algo, calib, tmp_path / "bounded", capture_memory_bytes=budget,
               capture_buffer_bytes=buffer)
    mem = res.memory
    assert mem.capture_spilled_bytes >= total - budget
    # the store: kept + waiting to be written
    assert 0 < mem.capture_memory_peak_bytes <= budget + buffer
    # everything alive at once over the capture and the solve
    assert mem.capture_memory_peak_bytes <= mem.call_memory_peak_bytes <= budget + buffer + working_set
    assert budget + buffer + working_set < total      # the bound is below "the whole layer in memory"
    assert CALL_METER.live == live_before          # nothing of the layer left behind

    a, b = _params(tmp_path / "ref"), _params(tmp_path / "bounded")
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for k in a[name]:
            assert torch.equal(a[name][k], b[name][k]), (name, k)
    assert [u.loss_after for u in res.units] == [u.loss_after for u in ref.units]
    # the unbounded run held the whole layer (its own accounting says so)
    assert ref.memory.call_memory_peak_bytes >= total


def _spilled(tmp_path, n=6):
    """``n`` calls of one unit, all spilled (budget 0), a write buffer of two calls."""
    gen = torch.Generator().manual_seed(0)
    calls = [UnitCall((torch.randn(5, 8, generator=gen).bfloat16(),), {}, torch.randn(5, 8, generator=gen))
             for _ in range(n)]
    store = CaptureStore(memory_bytes=0, scratch_dir=tmp_path, chunk_bytes=2 * call_nbytes(calls[0]))
    sink = store.sink("u")
    for c in calls:
        sink.add(c)
    return calls, sink.result(), store


def test_spilled_calls_split_and_scale_lazily(tmp_path):
    """The held-out split of spilled calls and AWQ's committed input scaling read nothing until
    a call is used, and give the eager lists' bits (capture.LazyCalls)."""
    from amct_ext.algorithms.base import SolveContext, UnitData
    from amct_ext.algorithms.smoothing import ScaledCalls, scaled_calls
    from amct_ext.pipeline.capture import LazyCalls

    calls, spilled, store = _spilled(tmp_path)
    per = call_nbytes(calls[0])
    del calls                                  # what the capture hands over: nothing in memory
    live = CALL_METER.live
    train, held = SolveContext(holdout=0.25).split(spilled)
    s = torch.linspace(0.5, 2.0, 8)
    scaled = UnitData(ScaledCalls(spilled, s))
    assert isinstance(train, LazyCalls) and isinstance(held, LazyCalls) and isinstance(scaled.calls, LazyCalls)
    assert (len(train), len(held)) == (4, 2) and CALL_METER.live == live     # nothing read yet
    eager = scaled_calls(list(spilled), s)
    for a, b in zip(eager, scaled.calls):
        assert torch.equal(a.args[0], b.args[0]) and torch.equal(a.output, b.output)
    assert [torch.equal(a.args[0], b.args[0]) for a, b in zip(eager[4:], scaled.calls[4:])] == [True, True]
    del eager, a, b
    assert CALL_METER.live == live
    # iterating holds one chunk file (two calls here) at a time, and the call the loop still holds
    peak0 = CALL_METER.peak
    CALL_METER.reset_peak()
    assert sum(1 for _ in train) == 4 and CALL_METER.peak - live <= 3 * per
    CALL_METER.peak = max(peak0, CALL_METER.peak)
    store.cleanup()
