"""Bounded-memory capture (capture.CallSink / SpillCalls / CaptureStore) and sharded PTQ
(workflow.PtqRuntime): both must change how PTQ runs, never what it computes."""
import pytest
import torch

from amct_ext.base import PtqConfig
from amct_ext.errors import DataError
from amct_ext.pipeline.capture import CaptureStore, SpillCalls, StoreCalls, UnitCall, call_nbytes, capture_unit_io
from amct_ext.io.io_utils import safe_torch_load
from amct_ext.quant.schemes import load_scheme
from amct_ext.pipeline.ptq_spec import PtqSpec
from amct_ext.pipeline.workflow import PARAMS_DIR, SCRATCH_DIR, PtqRuntime, load_calib_windows, run_blockwise_ptq

TARGETS = ["attn-linear", "moe"]
PTQ = PtqConfig(epochs=1, lr=5e-3, n_samples=2, seq_len=48, batch_size=1, seed=0)
# the learned-clip algorithm: a recipe that replays every captured call
LEGACY = "learned_clip:epochs=1:lr=5e-3"
LAYERS = range(1, 2)      # tiny layer 1: ratio 4 with an indexer, hash routing (layer 0 runs float)

pytestmark = pytest.mark.usefixtures("one_thread")


def _call(k: int) -> UnitCall:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + k
    # two views of one buffer, a nested dict, scalars and None: what hooks can see
    return UnitCall((base[:2], base[1:], k), {"w": {"s": torch.tensor([k], dtype=torch.int64)}, "m": None,
                                              "f": 0.5, "flag": True}, (base * 2, [base.sum()]))


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b and type(a) is type(b)


def test_spill_round_trip_in_chunks(tmp_path):
    calls = [_call(k) for k in range(7)]
    sink = SpillCalls(tmp_path / "u", chunk_bytes=2 * call_nbytes(calls[0]))
    for c in calls:
        sink.add(c)
    got = sink.result()
    assert len(sink.chunks) == 4                       # 2 + 2 + 2 + 1 calls
    assert len(got) == 7
    for a, b in zip(calls, got):                       # iteration, capture order
        assert _same((a.args, a.kwargs, a.output), (b.args, b.kwargs, b.output))
    assert _same(got[5].output, calls[5].output) and _same(got[-1].args, calls[6].args)
    assert list(got) and list(got)                     # re-iterable (the solver makes several passes)
    assert [p.name for p in (tmp_path / "u").iterdir()] == [SpillCalls.DATA_FILE]   # one file, 4 chunks
    sink.discard()
    assert not (tmp_path / "u").exists()


def test_spill_round_trips_every_dtype_and_layout(tmp_path):
    """Raw bytes on disk: bf16, bool, int8, 0-dim, empty and non-contiguous views come back equal
    (every tensor aligned for its dtype view)."""
    w = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    odd = [torch.tensor([1, -2, 3], dtype=torch.int8), torch.tensor([True, False]), w.bfloat16().t(),
           torch.empty(0, 4), torch.tensor(2.5, dtype=torch.float64), w[:, 1::2], torch.ones(3, dtype=torch.float16)]
    calls = [UnitCall(tuple(odd[k:]), {"i": k}, odd[k]) for k in range(len(odd))]
    sink = SpillCalls(tmp_path / "u", chunk_bytes=None)
    for k, c in enumerate(calls):
        sink.add(c)
        if k % 3 == 2:
            sink.flush()
    got = sink.result()
    assert len(sink.chunks) == 3 and len(got) == len(calls)
    for a, b in zip(calls, got):
        assert _same((a.args, a.kwargs, a.output), (b.args, b.kwargs, b.output))
    data = tmp_path / "u" / SpillCalls.DATA_FILE
    data.write_bytes(data.read_bytes()[:-8])          # the scratch file cut short under the run
    with pytest.raises(DataError, match="calls.bin: .* bytes at offset"):
        list(got)
    sink.discard()


def test_capture_store_keeps_a_budget_then_spills(tmp_path):
    per = call_nbytes(_call(0))
    # a write buffer of two calls shared by both sinks
    store = CaptureStore(memory_bytes=3 * per, scratch_dir=tmp_path / "scratch", chunk_bytes=2 * per)
    a, b = store.sink("a"), store.sink("b")
    for k in range(2):
        a.add(_call(k))
    for k in range(3):
        b.add(_call(10 + k))      # only the first fits: b spills from its second call on
    assert store.in_memory == 3 * per and store.pending == 2 * per and not b.spill.chunks
    a.add(_call(2))               # a spills too now (budget used), order kept; the full buffer is written first
    assert len(b.spill.chunks) == 1 and store.pending == per
    # kept + waiting: never more than the budget and the buffer
    assert store.peak_in_memory == 5 * per and store.spilled_bytes == 3 * per
    ra, rb = a.result(), b.result()
    assert store.pending == 0
    assert [int(c.args[2]) for c in ra] == [0, 1, 2] and [int(c.args[2]) for c in rb] == [10, 11, 12]
    a.discard()
    assert store.in_memory == per            # b's one in-memory call
    b.discard()
    store.cleanup()
    assert store.in_memory == 0 and not (tmp_path / "scratch").exists()


def test_capture_unit_io_feeds_statistics_sinks():
    """A sink that only folds statistics (what GPTQ's Hessian needs) stores nothing."""
    class Gram(StoreCalls.__mro__[1]):     # capture.CallSink
        def __init__(self):
            self.h, self.n = None, 0

        def add(self, call):
            x = call.args[0].reshape(-1, call.args[0].shape[-1]).double()
            self.h = x.T @ x if self.h is None else self.h + x.T @ x
            self.n += x.shape[0]

        def result(self):
            return self.h, self.n

    lin = torch.nn.Linear(4, 3)
    xs = [torch.randn(5, 4), torch.randn(2, 4)]
    out, _ = capture_unit_io({"lin": lin}, lambda: [lin(x) for x in xs], sinks={"lin": Gram()})
    h, n = out["lin"]
    x = torch.cat(xs).double()
    assert n == 7 and torch.allclose(h, x.T @ x)


def _params(out) -> dict:
    pdir = out / PARAMS_DIR
    return {p.name: safe_torch_load(p) for p in sorted(pdir.glob("*.pt"))}


def _equal_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for k in a[name]:
            assert torch.equal(a[name][k], b[name][k]), (name, k)


@pytest.fixture(scope="module")
def calib(tiny_adapter):
    return load_calib_windows(tiny_adapter, PTQ)


@pytest.fixture(scope="module")
def reference(tiny_adapter, calib, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    res = run_blockwise_ptq(tiny_adapter, PtqSpec(load_scheme("w8a8"), TARGETS, PTQ, recipe=LEGACY),
                            out, layers=LAYERS, calib_windows=calib)
    return out, res


def test_spilled_capture_gives_identical_parameters(tiny_adapter, calib, reference, tmp_path):
    ref_out, ref = reference
    budget = ref.memory.capture_memory_peak_bytes // 3     # a third in memory, the rest on disk
    buffer = budget // 2        # larger than any one call of the layer (one larger call would wait alone)
    seen_scratch = []

    def peek(_r):
        seen_scratch.append(any(p.is_file() for p in (tmp_path / SCRATCH_DIR).rglob("*")))

    res = run_blockwise_ptq(tiny_adapter, PtqSpec(load_scheme("w8a8"), TARGETS, PTQ, recipe=LEGACY),
                            tmp_path, layers=LAYERS, calib_windows=calib,
                            runtime=PtqRuntime(capture_memory_bytes=budget, capture_buffer_bytes=buffer,
                                               on_unit_done=peek))
    # kept + waiting to be written (the default 256 MiB buffer would hold this whole layer)
    assert 0 < res.memory.capture_memory_peak_bytes <= budget + buffer
    assert res.memory.capture_spilled_bytes >= ref.memory.capture_memory_peak_bytes - budget
    assert any(seen_scratch)                                # calls really were read back from disk
    assert not (tmp_path / SCRATCH_DIR).exists() or not any((tmp_path / SCRATCH_DIR).rglob("*"))
    _equal_params(_params(ref_out), _params(tmp_path))
    assert [u.loss_after for u in res.units] == [u.loss_after for u in ref.units]


def test_sharded_ptq_solves_each_unit_where_it_lives(tiny_adapter, calib, reference, tmp_path, monkeypatch):
    """Three CPU "devices" cpu:0..2 (distinct torch.device values, so the dispatch hooks are
    real): layer 1 has an indexer, so stem cpu:0, attention cpu:1, indexer cpu:2 and the 8
    routed experts round-robin over all three (dispatch.py's rule)."""
    from amct_ext.algorithms.learned_clip import LearnedClip

    ref_out, _ = reference
    where = {}
    real = LearnedClip.apply

    def spy(self, unit, data, ctx):
        where[unit.name] = str(ctx.device)
        return real(self, unit, data, ctx)

    monkeypatch.setattr(LearnedClip, "apply", spy)
    built = []
    real_block = tiny_adapter.block
    monkeypatch.setattr(tiny_adapter, "block", lambda i, sharded=False, device=None:
                        built.append(sharded) or real_block(i, sharded=sharded, device=device))
    tiny_adapter.run.shard_devices = ["cpu:0", "cpu:1", "cpu:2"]
    try:
        run_blockwise_ptq(tiny_adapter, PtqSpec(load_scheme("w8a8"), TARGETS, PTQ, recipe=LEGACY),
                          tmp_path, layers=LAYERS, calib_windows=calib, runtime=PtqRuntime(sharded=True))
    finally:
        tiny_adapter.run.shard_devices = None
    assert built == [True, True]
    expected = {"layers.1.attn": "cpu:1", "layers.1.ffn.shared_experts": "cpu:0"}
    expected.update({f"layers.1.ffn.experts.{e}": f"cpu:{e % 3}" for e in range(8)})
    assert where == expected
    _equal_params(_params(ref_out), _params(tmp_path))


def test_quantized_sharded_layer_is_really_quantized(tiny_adapter):
    """Casebook i15-1: wrappers built from a module whose dispatch hook had been removed ran the
    float forward. Distinct CPU 'devices' give the layer real hooks; its RTN output must equal
    the staged RTN layer's and differ from the float layer's."""
    scheme = load_scheme("w8a8")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 40, 4, 64, generator=gen)
    ids = torch.randint(0, 500, (1, 40), generator=gen)
    staged = tiny_adapter.block(1)
    with torch.no_grad():
        y_float = staged(x, 0, ids)
        tiny_adapter.quantize_block(staged, scheme, TARGETS)
        y_rtn = staged(x, 0, ids)
    tiny_adapter.run.shard_devices = ["cpu:0", "cpu:1", "cpu:2"]
    try:
        sharded = tiny_adapter.block(1, sharded=True)
        assert hasattr(sharded.attn, "_hf_hook")
        tiny_adapter.quantize_block(sharded, scheme, TARGETS)
        with torch.no_grad():
            y_sharded = sharded(x, 0, ids)
    finally:
        tiny_adapter.run.shard_devices = None
    assert not torch.equal(y_rtn, y_float)
    assert torch.equal(y_sharded, y_rtn)


def test_ptq_builds_layers_on_the_compute_device(tiny_adapter, calib, reference, tmp_path, monkeypatch):
    """Casebook i15-3: a host-staged layer cost ~3x its size in host RSS on the H200. Every layer
    (float predecessors too) is built where it runs; the result does not change."""
    ref_out, _ = reference
    built = []
    real_block = tiny_adapter.block
    monkeypatch.setattr(tiny_adapter, "block", lambda i, sharded=False, device=None:
                        built.append((i, sharded, device)) or real_block(i, sharded=sharded, device=device))
    run_blockwise_ptq(tiny_adapter, PtqSpec(load_scheme("w8a8"), TARGETS, PTQ, recipe=LEGACY),
                      tmp_path, layers=LAYERS, calib_windows=calib)
    assert built == [(0, False, tiny_adapter.device), (1, False, tiny_adapter.device)]
    _equal_params(_params(ref_out), _params(tmp_path))


@pytest.fixture(scope="module")
def recipe_reference(tiny_adapter, calib, tmp_path_factory):
    """GPTQ (grouped over experts, sequential stages) on one device from STORED calls (the
    statistics path off: GPTQ alone would re-run the layer instead, tests/
    test_gptq_sequential_statistics.py; a sharded layer always stores calls), everything in memory."""
    from amct_ext.algorithms.recipe import resolve_recipe

    recipe = resolve_recipe("gptq")
    out = tmp_path_factory.mktemp("recipe-ref")
    res = run_blockwise_ptq(tiny_adapter, PtqSpec(load_scheme("w8a8"), TARGETS, PTQ, recipe=recipe),
                            out, layers=LAYERS, calib_windows=calib, runtime=PtqRuntime(statistics=False))
    assert all(u.n_calls > 0 for u in res.units if u.kind == "attn")
    return recipe, out, res


def test_sharded_recipe_run_equals_one_device(tiny_adapter, calib, recipe_reference, tmp_path):
    """A recipe on a sharded layer runs once per device holding units, each group on its own
    device; same parameters as on one device."""
    recipe, ref_out, ref = recipe_reference
    tiny_adapter.run.shard_devices = ["cpu:0", "cpu:1", "cpu:2"]
    try:
        sh = run_blockwise_ptq(tiny_adapter, PtqSpec(load_scheme("w8a8"), TARGETS, PTQ, recipe=recipe), tmp_path,
                               layers=LAYERS, calib_windows=calib, runtime=PtqRuntime(sharded=True))
    finally:
        tiny_adapter.run.shard_devices = None
    assert [u.name for u in sh.units] == [u.name for u in ref.units]
    _equal_params(_params(ref_out), _params(tmp_path))


def test_recipe_run_reads_spilled_calls_lazily(tiny_adapter, calib, recipe_reference, tmp_path, monkeypatch):
    """With a capture budget the recipe gets the spilled calls as a lazily read sequence
    (algorithms.base.UnitData keeps it) and learns the same parameters."""
    from amct_ext.algorithms import base as algo_base
    from amct_ext.pipeline.capture import SpilledCalls

    recipe, ref_out, ref = recipe_reference
    kept = []
    real_init = algo_base.UnitData.__init__

    def spy(self, calls=None, **kw):
        real_init(self, calls, **kw)
        kept.append(isinstance(self.calls, SpilledCalls))

    monkeypatch.setattr(algo_base.UnitData, "__init__", spy)
    spill = run_blockwise_ptq(tiny_adapter, PtqSpec(load_scheme("w8a8"), TARGETS, PTQ, recipe=recipe), tmp_path,
                              layers=LAYERS, calib_windows=calib,
                              runtime=PtqRuntime(capture_memory_bytes=0, statistics=False))
    assert spill.memory.capture_spilled_bytes > 0 and kept and all(kept)
    _equal_params(_params(ref_out), _params(tmp_path))
    assert [u.loss_after for u in spill.units] == [u.loss_after for u in ref.units]
