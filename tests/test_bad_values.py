"""Issue 36.3: malformed values, text files that are not UTF-8 and absurd sizes are one `error:`
line naming the field, file or flag (exit 2, no traceback, before any perplexity), and the
audit's unclear messages say what is wrong (casebook/no-traceback.md i36t-4..10)."""
import json
import math
import pickle
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import run_ptq  # noqa: E402

from amct_ext.data import CALIB_DEFAULT  # noqa: E402
from amct_ext.errors import AmctError, ConfigError, DataError  # noqa: E402

FAST = ["--calib-samples", "2", "--seq-len", "32", "--eval-windows", "2", "--quiet"]


def refused(capsys, argv, match: str, out: Path) -> str:
    code = run_ptq.main(argv)
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert code == 2, (code, cap.err[-800:])
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err
    assert "Traceback" not in cap.err and "ppl[" not in cap.out       # before any perplexity
    assert not (out / "ptq_params").exists() and not (out / "report.json").exists()
    return err[0]


@pytest.fixture()
def tiny(tiny_ckpt, tmp_path):
    out = tmp_path / "out"
    return out, ["--model", "tiny", "--model-path", str(tiny_ckpt), "--output-dir", str(out), *FAST]


def ckpt_copy(tiny_ckpt, root: Path, name: str, **config) -> Path:
    d = root / name
    shutil.copytree(tiny_ckpt, d)
    if config:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(config)
        (d / "config.json").write_text(json.dumps(cfg))
    return d


# ----------------------------------------------------------------------------- text files
def test_binary_and_utf16_text_named_with_the_encoding_problem(tiny, tmp_path, capsys):
    out, argv = tiny
    binary = tmp_path / "calib.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    line = refused(capsys, [*argv, "--calib-data", str(binary)], f"--calib-data {binary}: not UTF-8 text", out)
    assert "byte 0x80 at offset 128" in line and "NUL bytes" in line
    text = CALIB_DEFAULT.read_text(encoding="utf-8")[:20000]
    u16 = tmp_path / "calib16.txt"
    u16.write_text(text, encoding="utf-16")
    line = refused(capsys, [*argv, "--calib-data", str(u16)], f"--calib-data {u16}: not UTF-8 text", out)
    assert "UTF-16 (little-endian byte-order mark); save it as UTF-8" in line
    line = refused(capsys, [*argv, "--eval-data", str(u16)], f"--eval-data {u16}: not UTF-8 text", out)


def test_utf8_check_reads_in_chunks_and_finds_nul(tmp_path, monkeypatch):
    from amct_ext.pipeline import text_files

    monkeypatch.setattr(text_files, "CHUNK", 3)      # every 2-byte character split across two chunks
    f = tmp_path / "t.txt"
    f.write_text("é" * 50 + " word\n", encoding="utf-8")
    text_files.check_utf8_text(f, "--calib-data")
    f.write_bytes("é".encode() * 4 + b"ab\x00cd")
    with pytest.raises(DataError, match=r"--calib-data .*t.txt: a NUL byte at offset 10"):
        text_files.check_utf8_text(f, "--calib-data")
    f.write_bytes("abc".encode() + "é".encode()[:1])  # cut inside its last character
    with pytest.raises(DataError, match="ends inside a character"):
        text_files.check_utf8_text(f, "--calib-data")


def test_calibration_text_too_short_for_its_windows(tmp_path):
    """60 words, 87 tokens, 8 x 32 windows: each token drawn 2.9 times (> 2): refused, naming the
    file, the words it has and about the words it needs (independently: ceil(128 / (87 / 60)))."""
    from amct_ext.pipeline.text_files import MAX_REUSE, check_calibration_length

    words = CALIB_DEFAULT.read_text(encoding="utf-8").split()[1000:1060]
    f = tmp_path / "short.txt"
    f.write_text(" ".join(words))
    with pytest.raises(DataError) as e:
        check_calibration_length(f, 87, 8, 32)
    line = str(e.value)
    need_words = math.ceil(math.ceil(8 * 32 / 2) / (87 / 60))
    assert f"--calib-data {f}: 60 words (87 tokens)" in line and f"about {need_words} words" in line
    assert "drawn 2.9 times (at most 2)" in line and MAX_REUSE == 2
    check_calibration_length(f, 128, 8, 32)            # exactly twice on average: accepted


def test_calibration_text_too_short_refused_by_the_run(tiny, tiny_ckpt, tmp_path, capsys):
    """60 words and windows of half their tokens: 8 windows draw each token 4 times."""
    from transformers import AutoTokenizer

    from amct_ext.pipeline.perplexity import encode_text

    out, argv = tiny
    f = tmp_path / "short.txt"
    f.write_text(" ".join(CALIB_DEFAULT.read_text(encoding="utf-8").split()[1000:1060]))
    n = len(encode_text(AutoTokenizer.from_pretrained(str(tiny_ckpt)), f.read_text(), add_special_tokens=False))
    refused(capsys, [*argv, "--calib-data", str(f), "--calib-samples", "8", "--seq-len", str(n // 2)],
            f"--calib-data {f}: 60 words ({n} tokens) are too short for 8 x {n // 2} calibration windows", out)


# ----------------------------------------------------------------------------- the checkpoint
def test_hash_routing_id_out_of_range_named_at_plan(tiny, tiny_ckpt, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    out, argv = tiny
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert cfg["num_hash_layers"] >= 1
    d = ckpt_copy(tiny_ckpt, tmp_path, "tid")
    key = "layers.0.ffn.gate.tid2eid"
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][key]
    sd = load_file(d / shard)
    table = sd[key].clone()
    table[7, 1] = cfg["n_routed_experts"]              # one past the last expert
    sd[key] = table
    save_file(sd, d / shard, metadata={"format": "pt"})
    argv = [a if a != str(tiny_ckpt) else str(d) for a in argv]
    line = refused(capsys, argv, f"{key}[7, 1] = {cfg['n_routed_experts']} is not an expert id", out)
    assert f"n_routed_experts={cfg['n_routed_experts']}" in line and "1 entries are out of range" in line


def test_vocab_size_below_the_tokenizers_names_both(tiny, tiny_ckpt, tmp_path, capsys):
    from amct_ext.pipeline.tokenizer import tokenizer_vocab_size

    out, argv = tiny
    d = ckpt_copy(tiny_ckpt, tmp_path, "vocab", vocab_size=100)
    n = tokenizer_vocab_size(tiny_ckpt)
    argv = [a if a != str(tiny_ckpt) else str(d) for a in argv]
    refused(capsys, argv, f"config.json: vocab_size=100 is smaller than the tokenizer's {n} token ids", out)


def test_missing_tokenizer_file_named(tiny, tiny_ckpt, tmp_path, capsys):
    out, argv = tiny
    d = ckpt_copy(tiny_ckpt, tmp_path, "notok")
    (d / "tokenizer.json").unlink()
    argv = [a if a != str(tiny_ckpt) else str(d) for a in argv]
    refused(capsys, argv, f"{d / 'tokenizer.json'}: not found", out)


def test_missing_tokenizer_is_refused_by_the_plan_itself(tiny_ckpt, tmp_path):
    """The plan names it (before the adapter, whose own loader names it too, is built)."""
    from amct_ext.pipeline.job import PtqOptions, ResolvedPaths, build_job
    from models.deepseek_v4.plan import DeepseekV4PlanSpec

    d = ckpt_copy(tiny_ckpt, tmp_path, "notok")
    (d / "tokenizer.json").unlink()
    opts = PtqOptions(output_dir=str(tmp_path / "o"), calib_samples=2, seq_len=32, batch_size=1, eval_batch_size=1,
                      dtype="bf16")
    with pytest.raises(DataError, match=re.escape(f"{d / 'tokenizer.json'}: not found")):
        build_job(opts, DeepseekV4PlanSpec(), ResolvedPaths(d, CALIB_DEFAULT))


@pytest.mark.parametrize("field,value,match", [
    ("hidden_size", "128", "field 'hidden_size' must be an integer, got '128' (str)"),
    ("compress_ratios", [0, "4", 0, 0, 0], "field 'compress_ratios[1]' must be an integer, got '4' (str)"),
    ("rope_scaling", "yarn", "field 'rope_scaling' must be an object (or null), got 'yarn' (str)"),
    ("rms_norm_eps", float("nan"), "field 'rms_norm_eps' must be a finite number, got nan (float)"),
    ("num_hidden_layers", 0, "field 'num_hidden_layers' (DeepseekV4Config.n_layers): must be a positive integer"),
])
def test_malformed_config_values_name_config_json_and_the_field(tiny, tiny_ckpt, tmp_path, capsys, field, value,
                                                                match):
    out, argv = tiny
    d = ckpt_copy(tiny_ckpt, tmp_path, "cfg", **{field: value})
    argv = [a if a != str(tiny_ckpt) else str(d) for a in argv]
    line = refused(capsys, argv, match, out)
    assert f"{d / 'config.json'}:" in line


def test_config_nested_too_deep_is_one_line(tiny, tiny_ckpt, tmp_path, capsys):
    out, argv = tiny
    d = ckpt_copy(tiny_ckpt, tmp_path, "deep")
    (d / "config.json").write_text('{"a":' * 100_000 + "1" + "}" * 100_000)
    argv = [a if a != str(tiny_ckpt) else str(d) for a in argv]
    refused(capsys, argv, f"{d / 'config.json'}: cannot read JSON (maximum recursion depth", out)


# ----------------------------------------------------------------------------- recipe and sizes
def test_recipe_nested_100000_deep_is_one_line(tiny, tmp_path, capsys):
    out, argv = tiny
    r = tmp_path / "deep.json"
    r.write_text("[" * 100_000 + "]" * 100_000)
    refused(capsys, [*argv, "--recipe", str(r)], f"--recipe {r}: invalid JSON (maximum recursion depth", out)


def test_absurd_grid_refused_with_the_field(tiny, tmp_path, capsys):
    out, argv = tiny
    # 10^12 is out of the value range the recipe check knows (amct_ext/algorithms/field_ranges.py),
    # which runs first; between that range and the size cap, the cap names its bound
    refused(capsys, [*argv, "--algo", "hclip:grid=1000000000000"],
            "--algo entry 0 (hclip): hclip.grid = 1000000000000: larger than", out)
    refused(capsys, [*argv, "--algo", "hclip:grid=5000"], "hclip.grid=5000 (--algo): at most 1024 candidates", out)
    r = tmp_path / "r.json"
    r.write_text(json.dumps({"recipe": [{"algo": "clip", "grid": 1025}]}))
    refused(capsys, [*argv, "--recipe", str(r)], f"clip.grid=1025 ({r}): at most 1024", out)


def test_grid_at_the_cap_is_planned(tiny_ckpt, tmp_path):
    from amct_ext.pipeline.job import PtqOptions, ResolvedPaths, build_job
    from models.deepseek_v4.plan import DeepseekV4PlanSpec

    opts = PtqOptions(output_dir=str(tmp_path / "o"), algo="hclip:grid=1024", calib_samples=2, seq_len=32,
                      batch_size=1, eval_batch_size=1, dtype="bf16")
    paths = ResolvedPaths(tiny_ckpt, CALIB_DEFAULT)
    assert build_job(opts, DeepseekV4PlanSpec(), paths).spec.recipe.algorithms[0].grid == 1024


def test_calibration_samples_beyond_host_memory(tiny, capsys):
    out, argv = tiny
    refused(capsys, [*argv, "--calib-samples", "1000000000"],
            "--calib-samples 1000000000 x --seq-len 32: the calibration hidden states", out)


def test_calibration_memory_bound_is_exact():
    """2 copies x samples x seq_len x values x bytes against the host's memory, at the boundary."""
    from amct_ext.pipeline.size_caps import check_calibration_memory

    need = 2 * 4 * 8 * 10 * 2
    check_calibration_memory(4, 8, 10, 2, host_bytes=need)
    with pytest.raises(ConfigError, match=r"--calib-samples 4 x --seq-len 8: .* 1280 bytes .*1279 bytes"):
        check_calibration_memory(4, 8, 10, 2, host_bytes=need - 1)


# ----------------------------------------------------------------------------- the unclear messages
def test_string_holdout_in_a_recipe_file_names_field_value_and_type(tiny, tmp_path, capsys):
    out, argv = tiny
    r = tmp_path / "r.json"
    r.write_text(json.dumps({"recipe": [{"algo": "rtn"}], "holdout": "0.5"}))
    line = refused(capsys, [*argv, "--recipe", str(r)], f"holdout='0.5' (str) in recipe file {r}", out)
    assert "--holdout" not in line
    refused(capsys, [*argv, "--holdout", "1.5"], "--holdout 1.5: the held-out share", out)


class Foreign:
    """A pickled object that weights_only loading must refuse."""


def test_pickle_refusal_is_one_line_naming_file_and_object(tmp_path):
    from amct_ext.io.io_utils import load_error_line, safe_torch_load

    p = tmp_path / "layer_0_attn.pt"
    with open(p, "wb") as f:
        torch.save({"w": torch.ones(2), "x": Foreign()}, f)
    with pytest.raises(AmctError) as e:
        safe_torch_load(p)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{p}: refused: it holds a Python object (")
    assert "Foreign" in line and "weights_only" in line and len(line) < 300
    assert load_error_line(pickle.UnpicklingError("x\n\tWeightsUnpickler error: Unsupported operand 149\nmore")) \
        == "not a plain tensor file (Unsupported operand 149)"


def test_pickle_refusal_of_a_run_folder_is_one_line(tiny_ckpt, tmp_path):
    """The unit loader (evaluation 'ptq', the export) passes the one line on."""
    from amct_ext.pipeline.workflow import load_unit_params

    class Unit:
        file_stem, name, module = "layer_0_attn", "layers.0.attn", None
    with open(tmp_path / "layer_0_attn.pt", "wb") as f:
        torch.save({"x": Foreign()}, f)
    with pytest.raises(DataError) as e:
        load_unit_params(Unit(), tmp_path)
    assert re.fullmatch(rf"{re.escape(str(tmp_path / 'layer_0_attn.pt'))}: refused: [^\n]*Foreign[^\n]*", str(e.value))
