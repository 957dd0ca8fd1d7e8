"""benchmarks/results/release-testbed.md quotes only what benchmarks/results/release-testbed.json
holds (the table `benchmarks/release_testbed.py --table` prints); each JSON cell carries the command
that reproduces it (`--check NAME` reruns it)."""
from tests.conftest import REPO, load_script

MD = REPO / "benchmarks" / "results" / "release-testbed.md"


def test_the_table_is_the_json():
    tool = load_script("benchmarks/release_testbed.py")
    data = tool.load()
    assert "float" in data and len(data) > 1
    for name, cell in data.items():
        assert tool.cell_args(name)                                    # a known cell
        assert cell["command"].startswith("python tools/run_ptq.py --model tiny-trained-release")
        assert cell["eval"]["windows"] == tool.WINDOWS and cell["cpu"]
    assert tool.check_md(MD, data) == []
    assert tool.table(data) in (REPO / "benchmarks" / "RESULTS.md").read_text()     # RESULTS §3.1 quotes it


def test_a_changed_quote_is_caught(tmp_path):
    tool = load_script("benchmarks/release_testbed.py")
    data = tool.load()
    name = next(k for k in data if k != "float")
    bad = tmp_path / "x.md"
    text = MD.read_text()
    quoted = f"{data[name]['ppl']:.3f}"
    assert quoted in text
    bad.write_text(text.replace(quoted, f"{data[name]['ppl'] + 0.01:.3f}"))
    assert tool.check_md(bad, data)
