"""benchmarks/bench_sharded.py --smoke: the sharded build (3 'devices') equals the one-device build."""
import json
import sys

from tests.conftest import REPO


def test_sharded_smoke(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_sharded

    out = tmp_path / "r.json"
    assert bench_sharded.main(["--smoke", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["agreement"]["bit_identical"]
    assert set(r["placement_bytes"]) == {"stem (norms, hc, gate, shared expert)", "attention", "indexer", "routed experts"}
