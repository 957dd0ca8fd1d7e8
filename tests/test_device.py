import re
import statistics
import os
import time
from pathlib import Path

import pytest
import torch

from amct_ext.runtime import device as D
from amct_ext.errors import AmctError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(D, "_npu_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_detect_backend_priority(monkeypatch, cpu_only):
    assert D.detect_backend() == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert D.detect_backend() == "cuda"
    monkeypatch.setattr(D, "_npu_available", lambda: True)
    assert D.detect_backend() == "npu"  # npu wins over cuda


def test_npu_probe_is_safe_without_torch_npu():
    # torch_npu is not installed here: the probe must say False, not raise.
    D._npu_available.cache_clear()
    try:
        import torch_npu  # noqa: F401
    except Exception:
        assert D._npu_available() is False


def test_resolve_device_cpu_and_auto(cpu_only):
    assert D.resolve_device("cpu") == torch.device("cpu")
    assert D.resolve_device("auto") == torch.device("cpu")
    assert D.resolve_device(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.parametrize("pref", ["cuda", "cuda:1", "npu", "npu:0"])
def test_resolve_device_unavailable_names_backend(cpu_only, pref):
    backend = pref.split(":")[0]
    with pytest.raises(AmctError, match=backend):
        D.resolve_device(pref)


def test_resolve_device_bad_strings(cpu_only):
    with pytest.raises(AmctError, match="tpu"):
        D.resolve_device("tpu")
    with pytest.raises(AmctError, match="index"):
        D.resolve_device("cuda:x")


def test_resolve_device_index_checked(monkeypatch):
    monkeypatch.setattr(D, "_npu_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert D.resolve_device("cuda:1") == torch.device("cuda", 1)
    assert D.resolve_device("auto", index=1) == torch.device("cuda", 1)
    with pytest.raises(AmctError, match="only 2 cuda"):
        D.resolve_device("cuda:2")
    assert D.device_list("cuda") == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_counts_and_noops_on_cpu(cpu_only):
    assert D.device_count("cpu") == 1
    assert D.device_count() == 1
    assert D.device_count("cuda") == 0
    assert D.device_list() == [torch.device("cpu")]
    for fn in (D.empty_cache, D.synchronize, D.reset_peak_memory):
        assert fn("cpu") is None


def test_cpu_memory_is_process_rss_in_bytes():
    """In a fresh process: inside the suite the allocator may serve the 64 MiB from pages an
    earlier test freed (RSS then hardly moves: casebook T5)."""
    import subprocess
    import sys

    code = """
import torch
from amct_ext.runtime import device as D
before = D.memory_allocated("cpu")
x = torch.ones(16 * 2**20)  # 64 MiB, touched
after = D.memory_allocated("cpu")
peak = D.peak_memory_bytes("cpu")
assert before > 10 * 2**20, before  # a python+torch process is tens of MiB: bytes, not KiB
assert after - before > 32 * 2**20, (before, after)
assert peak >= after * 0.9, (peak, after)  # peak RSS (sampled by the kernel) bounds the current RSS
print("ok")
"""
    repo = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(repo)})
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_elapsed_ms_cpu_counts_and_times():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.005)

    times = D.elapsed_ms(fn, "cpu", repeats=4, warmup=2)
    assert len(times) == 4 and len(calls) == 6
    assert statistics.median(times) >= 4.5
    with pytest.raises(AmctError):
        D.elapsed_ms(fn, "cpu", repeats=0)


def test_timer_cpu():
    with D.Timer("cpu") as t:
        time.sleep(0.003)
    assert t.ms >= 2.5


def test_only_device_py_touches_accelerator_modules():
    # Architecture rule: torch.npu / torch.cuda appear only in amct_ext/runtime/device.py.
    pat = re.compile(r"torch\.(cuda|npu)\b|import torch_npu")
    offenders = []
    for folder in ("amct_ext", "models", "tools"):
        for f in (REPO / folder).rglob("*.py") if (REPO / folder).is_dir() else []:
            if f == REPO / "amct_ext" / "runtime" / "device.py":
                continue
            if pat.search(f.read_text(errors="ignore")):
                offenders.append(str(f.relative_to(REPO)))
    assert offenders == []


def test_device_guard_sets_the_current_device_for_kernel_launches(monkeypatch):
    """Triton launches on the current device; a sharded layer's tensors may live elsewhere
    (casebook S11). cpu and index-less devices need no guard."""
    import contextlib

    from amct_ext.runtime import device as D

    entered = []

    class FakeAccel:
        @staticmethod
        @contextlib.contextmanager
        def device(dev):
            entered.append(dev)
            yield

    monkeypatch.setattr(D, "_accel_module", lambda backend: FakeAccel)
    with D.device_guard("cuda:1"):
        pass
    with D.device_guard("cpu"):
        pass
    with D.device_guard("cuda"):
        pass
    assert entered == [torch.device("cuda:1")]


def test_graphed_forward_is_eager_where_it_cannot_replay(monkeypatch):
    """GraphedForward replays only on CUDA, without hooks, with the switches on; everywhere else it
    is the module call itself (the replay's bit-identity is checked on the GPU by bench_layer)."""
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    g = D.GraphedForward(lin, "cpu")
    assert not g.enabled
    with torch.no_grad():
        assert torch.equal(g(x), lin(x)) and g(x).shape == (2, 3)
    assert not g.graphs
    assert D.GraphedForward(lin, "cuda").enabled
    handle = lin.register_forward_hook(lambda *a: None)
    assert not D.GraphedForward(torch.nn.Sequential(lin), "cuda").enabled   # a hook would be skipped
    handle.remove()
    monkeypatch.setenv(D.GRAPHS_ENV, "0")
    assert not D.GraphedForward(lin, "cuda").enabled
    monkeypatch.setenv(D.GRAPHS_ENV, "1")
    monkeypatch.setenv(D.FAST_PATHS_ENV, "0")
    assert not D.GraphedForward(lin, "cuda").enabled
    # one signature per input shape / dtype and non-tensor argument
    s1 = D.GraphedForward._signature(x, {"input_ids": torch.zeros(2, 4, dtype=torch.long)})
    s2 = D.GraphedForward._signature(x[:1], {"input_ids": torch.zeros(1, 4, dtype=torch.long)})
    assert s1 != s2 and s1 == D.GraphedForward._signature(x.clone(), {"input_ids": torch.ones(2, 4, dtype=torch.long)})


def test_cpu_peak_is_the_process_own_not_its_parents():
    """A child started by a process holding 1.5 GB reports its own peak, not the parent's: Linux's
    ``ru_maxrss`` keeps the parent's high-water mark across fork + exec (casebook F-maxrss), so a
    small job launched from pytest or a benchmark driver read as large as its launcher."""
    import subprocess
    import sys

    held = bytearray(1536 * 2 ** 20)
    for i in range(0, len(held), 4096):      # touch every page: resident in this process
        held[i] = 1
    code = ("import sys; sys.path.insert(0, %r); from amct_ext.runtime import device as D; "
            "print(D.peak_memory_bytes('cpu'))" % str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    child_peak = int(out.stdout.strip().splitlines()[-1])
    assert 0 < child_peak < len(held) / 2, child_peak
    del held
