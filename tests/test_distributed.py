"""torchrun scale-out (amct_ext/pipeline/distributed.py): backend choice, cost model and layer split,
and the end-to-end contract on CPU with gloo over loopback -- two ranks give the very files and
PPLs of one process, a dead rank stops the job with a clear line, and a rerun resumes."""
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from amct_ext.runtime import device as devmod
from amct_ext.pipeline import distributed as dist
from models.deepseek_v4.cost import CostRates, v4_layer_cost
from amct_ext.errors import AmctError
from amct_ext.io.io_utils import safe_torch_load
from models.deepseek_v4.tiny import tiny_config
from amct_ext.pipeline.options import command_flags
from tests.conftest import library_job

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "run_ptq.py"
sys.path.insert(0, str(REPO / "tools"))

# 4 windows in batches of 2: two window batches flow through the perplexity pipeline (all 4
# layers); layers 0-1 (ratio 0 and ratio 4, hash-routed) are quantized, split over the 2 ranks
FAST_OPTIONS = dict(model="tiny", calib_samples=2, seq_len=64, eval_windows=4, eval_batch_size=2, epochs=1, quiet=True,
                    end_layer=2)
FAST = command_flags(**FAST_OPTIONS)      # the same job as tools/run_ptq.py flags (the torchrun ranks)


# ----------------------------------------------------------------------------- small pieces
def test_backend_per_device_type():
    assert [devmod.dist_backend(t) for t in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
    with pytest.raises(AmctError, match="mps"):
        devmod.dist_backend("mps")
    assert devmod.local_rank_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(AmctError, match="LOCAL_RANK"):
        devmod.local_rank_device("cuda:1", 0)


def test_torchrun_environment():
    assert dist.env_from({}) is None
    assert dist.env_from({"RANK": "0", "WORLD_SIZE": "1"}) is None        # one worker: the plain code
    e = dist.env_from({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"})
    assert (e.rank, e.world_size, e.local_rank, e.is_main, e.is_last) == (3, 8, 1, False, False)
    with pytest.raises(dist.DistributedError, match="RANK=8"):
        dist.env_from({"RANK": "8", "WORLD_SIZE": "8"})
    with pytest.raises(dist.DistributedError, match=dist.TIMEOUT_ENV):
        dist.timeout_s({dist.TIMEOUT_ENV: "soon"})
    assert dist.timeout_s({}) == dist.DEFAULT_TIMEOUT_S


def test_quantized_propagation_is_refused_in_one_line():
    dist.check_propagate("float")
    dist.check_propagate(None)                # not given: the default, float
    with pytest.raises(dist.DistributedError) as info:
        dist.check_propagate("quant")
    msg = str(info.value)
    assert "\n" not in msg and "torchrun" in msg and "in parallel" in msg


def test_cost_model_follows_the_layer_kind():
    cfg = tiny_config()                      # compress ratios [0, 4, 128, 4]
    cost = [v4_layer_cost(cfg, i, ["attn-linear", "moe"], 128 * 2048, 2) for i in range(4)]
    # same experts: ratio 4 (compressor + indexer) > ratio 128 (compressor) > ratio 0
    assert cost[1].solve_s > cost[2].solve_s > cost[0].solve_s
    assert cost[1].float_s > cost[0].float_s
    assert cost[1].solve_s == cost[3].solve_s          # hash vs score routing: the same units
    more = v4_layer_cost(tiny_config(n_routed_experts=16), 0, ["attn-linear", "moe"], 128 * 2048, 2)
    assert more.solve_s > cost[0].solve_s + 7 * CostRates().unit_overhead_s   # 8 more units
    attn_only = v4_layer_cost(cfg, 0, ["attn-linear"], 128 * 2048, 2)
    assert attn_only.solve_s < cost[0].solve_s and attn_only.float_s == cost[0].float_s


def _brute_force(layers, costs, n_ranks, prefix, use):
    """The best max rank time over every way to cut ``layers`` into n_ranks contiguous ranges."""
    n, best = len(layers), float("inf")
    for cuts in itertools.combinations_with_replacement(range(n + 1), n_ranks - 1):
        b = [0, *cuts, n]
        ranges = [range(layers.start + b[r], layers.start + b[r + 1]) for r in range(n_ranks)]
        best = min(best, max(dist.rank_times(layers, costs, ranges, prefix=prefix, use=use)))
    return best


@pytest.mark.parametrize("prefix,use", [(True, "ptq"), (False, "float")])
def test_partition_is_optimal_and_contiguous(prefix, use):
    rng = random.Random(0)
    for trial in range(40):
        n_layers = rng.randint(1, 9)
        costs = [dist.LayerCost(rng.uniform(0.1, 2), rng.uniform(0.5, 30)) for _ in range(n_layers)]
        start = rng.randint(0, n_layers - 1)
        layers = range(start, n_layers)
        n_ranks = rng.randint(1, 5)
        ranges = dist.partition_layers(layers, costs, n_ranks, prefix=prefix, use=use)
        assert len(ranges) == n_ranks
        assert [i for r in ranges for i in r] == list(layers)           # contiguous, in order, all covered
        got = max(dist.rank_times(layers, costs, ranges, prefix=prefix, use=use))
        assert got == pytest.approx(_brute_force(layers, costs, n_ranks, prefix, use), rel=1e-9), trial


def test_partition_shapes():
    flat = [dist.LayerCost(1.0, 9.0)] * 8
    assert dist.partition_layers(range(8), flat, 2, prefix=False) == [range(0, 4), range(4, 8)]
    # recomputing the prefix costs the later ranks: they get fewer layers
    heavy_float = [dist.LayerCost(5.0, 5.0)] * 8
    assert dist.partition_layers(range(8), heavy_float, 2) == [range(0, 5), range(5, 8)]
    # more ranks than layers: some ranks get an empty range
    many = dist.partition_layers(range(2, 4), flat, 4)
    assert sorted(len(r) for r in many) == [0, 0, 1, 1] and [i for r in many for i in r] == [2, 3]
    # an expensive layer gets a rank of its own
    costs = [dist.LayerCost(0.0, 1.0)] * 3 + [dist.LayerCost(0.0, 10.0)]
    assert dist.partition_layers(range(4), costs, 2, prefix=False) == [range(0, 3), range(3, 4)]


# ----------------------------------------------------------------------------- end to end
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args, env_extra=None, nproc=2, tool=TOOL):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"     # loopback only
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(tool), *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _pt_files(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: safe_torch_load(p) for p in sorted((out / "ptq_params").glob("*.pt"))}


@pytest.fixture(scope="module")
def one_process(tiny_ckpt, wiki_test_raw, tmp_path_factory):
    """The reference: the same job in one process (the library's entry point in this
    interpreter, 1 thread)."""
    out = tmp_path_factory.mktemp("one-process")
    assert library_job(out, **FAST_OPTIONS, model_path=str(tiny_ckpt), eval_data=str(wiki_test_raw)) is not None
    return out


def test_rank_death_stops_the_job_then_two_ranks_resume_to_the_one_process_bits(one_process, tiny_ckpt,
                                                                                 wiki_test_raw, tmp_path):
    """(1) rank 1 dies hard after 3 units (recompute boundary): rank 0 is stopped within a bound,
    with one clear line; (2) the rerun (send boundary, pipelined PPL) skips the finished units;
    (3) every tensor of every .pt file and every PPL equals the one-process run."""
    out = tmp_path / "out"
    common = [*FAST, "--model-path", str(tiny_ckpt), "--eval-data", str(wiki_test_raw), "--output-dir", str(out)]
    proc = _torchrun([*common, "--no-eval-ppl"], {dist.DIE_AFTER_ENV: "3"})
    died_at = []
    err_lines = []

    def read_err():
        for line in proc.stderr:
            err_lines.append(line)
            if "exiting hard" in line and not died_at:
                died_at.append(time.monotonic())

    reader = threading.Thread(target=read_err)
    reader.start()
    proc.wait(timeout=120)
    ended = time.monotonic()
    reader.join()
    proc.stdout.close()
    err = "".join(err_lines)
    assert proc.returncode != 0
    assert died_at, err[-3000:]
    assert ended - died_at[0] < 30, f"the job took {ended - died_at[0]:.1f} s to stop after rank 1 died"
    # rank 0 ends in one line: torchrun's SIGTERM if it was solving, or the failed gloo collective
    # if it was already waiting in the final gather (both happen, depending on timing)
    lines = [ln for ln in err.splitlines() if ln.startswith("error: rank 0")]
    assert len(lines) == 1, err[-3000:]
    assert ("stopped by torchrun" in lines[0] or "another rank stopped or is unreachable" in lines[0])
    assert "rerun the same command to resume" in lines[0]
    assert "exitcode  : 17" in err                              # torchrun names the rank that failed first
    assert not (out / "report.json").exists()
    done = set(_pt_files(out))
    assert len(done) >= 3                                       # rank 1's three units at least

    proc = _torchrun([*common, "--boundary", "send"])
    stdout, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    # the finished units were skipped, not solved again
    assert sum(u["resumed"] for u in report["units"]) == len(done) and len(report["units"]) == 2 * 10
    d = report["distributed"]
    assert (d["world_size"], d["boundary"], d["ptq_ranges"]) == (2, "send", [[0, 1], [1, 2]])
    assert len(d["ptq_rank_seconds"]) == 2 and all(t > 0 for t in d["ptq_rank_seconds"])

    ref = json.loads((one_process / "report.json").read_text())
    assert report["ppl"] == ref["ppl"]                         # float, rtn and quant: the same floats
    want, got = _pt_files(one_process), _pt_files(out)
    assert sorted(want) == sorted(got) and len(want) == 20
    for name in want:
        assert want[name].keys() == got[name].keys(), name
        for k in want[name]:
            assert torch.equal(want[name][k], got[name][k]), (name, k)
    assert (one_process / "ptq_params" / "meta.json").read_text() == (out / "ptq_params" / "meta.json").read_text()


def test_watchdog_flags_a_silent_peer_and_ignores_finished_ones():
    """Fake clock, in-process store: a peer whose counter stops for > stale_s is reported once;
    one that marked itself done is not; a broken store is a failure too."""
    from torch.distributed import HashStore

    store, now, dead = HashStore(), [0.0], []
    clock = lambda: now[0]   # noqa: E731
    w0 = dist.Watchdog(store, 0, 3, stale_s=10, on_dead=dead.append, clock=clock)
    w1 = dist.Watchdog(store, 1, 3, stale_s=10, on_dead=dead.append, clock=clock)
    w2 = dist.Watchdog(store, 2, 3, stale_s=10, on_dead=dead.append, clock=clock)
    for t in range(0, 30, 5):          # everybody alive: no alarm over 30 s
        now[0] = float(t)
        assert w0.step() and w1.step() and w2.step()
    w2.finish()                        # rank 2 is done: silence from it is fine
    alive_until = None
    for t in range(30, 100, 5):        # rank 1 dies after its beat at t=25: only rank 0 keeps beating
        now[0] = float(t)
        if not w0.step():
            break
        alive_until = t
    # its last change was seen at t=30; stale after > 10 s: reported at t=45, not before
    assert alive_until == 40 and now[0] == 45
    assert dead == ["rank 1 gave no sign of life for 15 s (> AMCT_DIST_HEARTBEAT_S=10): its process died or is frozen"]

    class Broken:
        def set(self, *a):
            raise RuntimeError("Connection reset by peer\nmore")

    dead.clear()
    assert not dist.Watchdog(Broken(), 0, 2, on_dead=dead.append).step()
    assert dead == ["the job's store is unreachable (RuntimeError: Connection reset by peer)"]


def test_export_hook_runs_one_range_in_one_process():
    seen = []
    assert dist.run_layer_ranges(None, range(2, 6), [dist.LayerCost(1, 0)] * 6,
                                 lambda rg: seen.append(rg) or len(rg)) == [4]
    assert seen == [range(2, 6)]


def test_export_over_two_ranks_writes_the_one_process_files(tiny_ckpt, tmp_path):
    """torchrun tools/export.py: each rank exports a cost-balanced range of the decoder layers
    (rank 1 into OUT/.rank1, taken over by rank 0), rank 0 the stem, MTP and index. Every file
    must be byte-identical to the one-process export of the same command."""
    import export as export_tool

    args = ["--model", "tiny", "--model-path", str(tiny_ckpt), "--scheme", "w8a8", "--format", "compressed-tensors",
            "--device", "cpu", "--quiet"]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert export_tool.main([*args, "--out", str(tmp_path / "one")]) == 0
    finally:
        torch.set_num_threads(old)
    from models.deepseek_v4.loading import load_config

    config = load_config(tiny_ckpt)
    n = int(config.n_layers)
    costs = [v4_layer_cost(config, i, ["attn-linear", "moe"], 1, 0) for i in range(n)]
    ranges = dist.partition_layers(range(n), costs, 2, prefix=False, use="float")
    assert len(ranges[0]) and len(ranges[1])     # both ranks really export layers
    proc = _torchrun([*args, "--out", str(tmp_path / "two")], tool=REPO / "tools" / "export.py")
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-2000:]
    one = {p.relative_to(tmp_path / "one"): p.read_bytes() for p in sorted((tmp_path / "one").rglob("*")) if p.is_file()}
    two = {p.relative_to(tmp_path / "two"): p.read_bytes() for p in sorted((tmp_path / "two").rglob("*")) if p.is_file()}
    assert sorted(one) == sorted(two)          # no staging folder or state file left behind
    assert [k for k in one if one[k] != two[k]] == []
    assert any(str(k).startswith("model-") for k in one) and any(k.name == "model.safetensors.index.json" for k in one)
