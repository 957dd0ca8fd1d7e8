"""benchmarks/bench_export.py --smoke: runs end to end and reports its floors (figures: the H200 run)."""
import importlib
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def test_bench_export_smoke(tmp_path, capsys):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    bench = importlib.import_module("bench_export")
    out = tmp_path / "r.json"
    assert bench.main(["--smoke", "--json", str(out)]) == 0
    assert "IO floor" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert res["disk"]["write_bytes_per_s"] > 0 and res["disk"]["read_bytes_per_s"] > 0
    assert res["export"]["bytes_read"] > 0 and res["export"]["bytes_written"] > 0
    assert res["io_floor_s"] > 0 and res["time_over_floor"] > 0
    assert res["largest_layer"]["stored_bytes"] > 0 and res["host_rss"]["peak_bytes"] >= res["host_rss"]["before_bytes"]
    assert res["export"]["extra_layers"] == "mtp.0: copied"
