"""No silent result (issue 36, item 1) and the resume half of nothing late (item 2): a finished
output folder resumed with other weights of the same layout (a fine-tune, weights changed in
place) redoes the first changed layer and every later one, naming the layer and tensor; a
truncated or damaged unit file is solved again; a folder in use by another run is refused at once.
The oracle of each redo is a fresh run on the same checkpoint: bit-identical unit files."""
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from amct_ext.algorithms.recipe import parse_algo
from amct_ext.base import PtqConfig, RunConfig
from amct_ext.io.io_utils import safe_torch_load
from amct_ext.pipeline.ptq_spec import PtqSpec
from amct_ext.pipeline.run_folder import FolderInUseError, RunFolder, unit_file_problem
from amct_ext.pipeline.workflow import PARAMS_DIR, run_blockwise_ptq
from amct_ext.quant.schemes import load_scheme
from models.deepseek_v4.adapter import DeepseekV4Adapter
from tests.conftest import WIKI_VALID

REPO = Path(__file__).resolve().parents[1]
INDEX = "model.safetensors.index.json"
TARGETS = ["attn-linear"]
LAYERS = range(0, 4)


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    text = tmp_path_factory.mktemp("calib") / "calib.txt"
    text.write_text("".join(WIKI_VALID.read_text(encoding="utf-8").splitlines(True)[:120]), encoding="utf-8")
    cfg = PtqConfig(n_samples=2, seq_len=32, batch_size=1, seed=0, calib_path=text)
    # GPTQ: a unit's result depends on its layer's inputs, so a change upstream must redo it
    return PtqSpec(load_scheme("w8a8"), TARGETS, cfg, recipe=parse_algo("gptq"), propagate="float")


def adapter_of(path: Path) -> DeepseekV4Adapter:
    return DeepseekV4Adapter(RunConfig(path, device="cpu", dtype=torch.float32, progress=False))


def run(path: Path, spec, out: Path):
    a = adapter_of(path)
    try:
        return run_blockwise_ptq(a, spec, out, layers=LAYERS, extra_layers=False)
    finally:
        a.close()


def perturb(ckpt: Path, key: str, factor: float = 1.0625) -> None:
    """The same layout, other values: ``key`` scaled in its shard (the index and config unchanged)."""
    shard = json.loads((ckpt / INDEX).read_text())["weight_map"][key]
    tensors = load_file(ckpt / shard)
    tensors[key] = (tensors[key].float() * factor).to(tensors[key].dtype)
    save_file(tensors, ckpt / shard, metadata={"format": "pt"})


def unit_files(out: Path) -> dict[str, dict]:
    return {p.name: safe_torch_load(p) for p in sorted((out / PARAMS_DIR).glob("*.pt"))}


def same_units(a: Path, b: Path) -> bool:
    ua, ub = unit_files(a), unit_files(b)
    return ua.keys() == ub.keys() and all(ua[n].keys() == ub[n].keys() and
                                          all(torch.equal(ua[n][k], ub[n][k]) for k in ua[n]) for n in ua)


@pytest.fixture(scope="module")
def finished(tiny_ckpt, spec, tmp_path_factory, one_thread):
    """A finished run on a copy of the tiny checkpoint (A)."""
    root = tmp_path_factory.mktemp("finished")
    a = root / "A"
    shutil.copytree(tiny_ckpt, a)
    run(a, spec, root / "run-A")
    return a, root / "run-A"


def test_finetune_resumed_into_a_finished_folder_is_redone_from_the_first_changed_layer(finished, spec, tmp_path,
                                                                                        capsys, one_thread):
    a, run_a = finished
    b = tmp_path / "B"                         # a "fine-tune": the same layout, layer 2 changed
    shutil.copytree(a, b)
    key = "layers.2.attn.wq_b.weight"
    perturb(b, key)
    assert (a / INDEX).read_bytes() == (b / INDEX).read_bytes()          # what meta.json hashes: equal
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    out = tmp_path / "resumed"
    shutil.copytree(run_a, out)
    capsys.readouterr()
    res = run(b, spec, out)
    err = capsys.readouterr().err
    assert f"layer 2's weights changed since this run started ({key})" in err, err
    assert "layer 3: the embedding or an earlier layer's weights changed" in err, err
    assert err.count("warning:") == 2, err
    by_layer = {}
    for u in res.units:
        by_layer.setdefault(u.layer, set()).add(u.resumed)
    assert by_layer == {0: {True}, 1: {True}, 2: {False}, 3: {False}}, by_layer
    fresh = tmp_path / "fresh-B"
    run(b, spec, fresh)
    assert same_units(out, fresh)                # the resumed folder holds B's result, bit for bit
    assert not same_units(out, run_a)            # (and it is not A's: the change mattered)


def test_weights_changed_in_place_are_noticed(finished, spec, tmp_path, capsys, one_thread):
    a0, run_a = finished
    a = tmp_path / "A"
    shutil.copytree(a0, a)
    out = tmp_path / "run"
    shutil.copytree(run_a, out)
    perturb(a, "layers.0.attn.wkv.weight")      # the same folder, a shard rewritten in place
    capsys.readouterr()
    res = run(a, spec, out)
    err = capsys.readouterr().err
    assert "layer 0's weights changed since this run started (layers.0.attn.wkv.weight)" in err, err
    assert not any(u.resumed for u in res.units)
    fresh = tmp_path / "fresh"
    run(a, spec, fresh)
    assert same_units(out, fresh)
    # the embedding feeds every layer: a changed stem redoes layer 0 on, named as inputs that changed
    perturb(a, "embed.weight")
    capsys.readouterr()
    res = run(a, spec, out)
    err = capsys.readouterr().err
    assert "layer 0: the embedding or an earlier layer's weights changed" in err, err
    assert not any(u.resumed for u in res.units)
    # unchanged now: a rerun resumes every unit and says nothing
    res = run(a, spec, out)
    assert all(u.resumed for u in res.units) and "warning:" not in capsys.readouterr().err


def test_truncated_or_damaged_unit_file_is_solved_again(finished, spec, tmp_path, capsys, one_thread):
    a, run_a = finished
    out = tmp_path / "run"
    shutil.copytree(run_a, out)
    pdir = out / PARAMS_DIR
    cut, flipped = pdir / "layer_1_attn.pt", pdir / "layer_3_attn.pt"
    os.truncate(cut, cut.stat().st_size // 2)
    data = bytearray(flipped.read_bytes())
    z = __import__("zipfile").ZipFile(flipped)
    big = max(z.infolist(), key=lambda i: i.file_size)
    at = big.header_offset + 30 + len(big.filename.encode()) + len(big.extra) + big.file_size // 2
    data[at] ^= 0x55                            # one byte inside the largest tensor's data
    flipped.write_bytes(bytes(data))
    assert "truncated" in unit_file_problem(cut) and "CRC" in unit_file_problem(flipped)
    capsys.readouterr()
    res = run(a, spec, out)
    err = capsys.readouterr().err
    assert f"{cut}: unreadable unit file" in err and f"{flipped}: unit file damaged" in err, err
    assert sorted(u.name for u in res.units if not u.resumed) == ["layers.1.attn", "layers.3.attn"]
    assert same_units(out, run_a)               # solved again: the very same parameters


def test_second_run_on_a_folder_in_use_is_refused_at_once(tiny_ckpt, tmp_path, capsys):
    sys.path.insert(0, str(REPO / "tools"))
    import run_ptq

    out = tmp_path / "out"
    argv = ["--model", "tiny", "--model-path", str(tiny_ckpt), "--output-dir", str(out), "--quiet",
            "--calib-samples", "2", "--seq-len", "32", "--eval-windows", "1", "--eval-ppl",
            "--start-layer", "0", "--end-layer", "1", "--quant-target", "attn-linear"]
    holder = RunFolder(out).lock()              # "another run" holds it (a flock of its own)
    try:
        with pytest.raises(FolderInUseError):
            RunFolder(out).lock()
        code = run_ptq.main(argv)
        cap = capsys.readouterr()
        lines = cap.err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "is in use by another run" in lines[0], cap.err
        assert f"pid {os.getpid()}" in lines[0]
        assert "ppl[" not in cap.out and not (out / PARAMS_DIR).exists()   # before any perplexity
    finally:
        holder.unlock()
    assert run_ptq.main([*argv, "--no-eval-ppl"]) == 0           # free again: the run goes through
    RunFolder(out).lock().unlock()             # and it let go of the folder when it ended


def test_weights_digest_equals_an_independent_hash(tiny_ckpt_fp8):
    """Per-tensor digests of layer 1 (FP8 / FP4 codes and scales as stored) against sha256 of the
    bytes safetensors itself returns for each tensor."""
    from amct_ext.io.checkpoint import CheckpointReader
    from amct_ext.io.weights_digest import WeightsDigest, weight_groups

    with CheckpointReader(tiny_ckpt_fp8) as r:
        groups = weight_groups(r.weight_map, [("layer 0", "layers.0."), ("layer 1", "layers.1.")])
        with WeightsDigest(r.root, r.weight_map, groups) as d:
            got = d.get("layer 1")
        keys = [k for k in r.keys() if k.startswith("layers.1.")]
        assert sorted(got.tensors) == sorted(keys) and len(keys) > 50
        dtypes = set()
        for k in keys:
            with safe_open(str(r.root / r.weight_map[k]), framework="pt") as f:
                t = f.get_tensor(k)
                sl = f.get_slice(k)
                dtype, shape = sl.get_dtype(), sl.get_shape()
            dtypes.add(dtype)
            raw = t.contiguous().view(torch.uint8).numpy().tobytes()
            want = hashlib.sha256(f"{k}|{dtype}|{list(shape)}|".encode() + raw).hexdigest()
            assert got.tensors[k] == want, k
        assert {"F8_E4M3", "F8_E8M0", "BF16"} <= dtypes or {"F8_E4M3", "F8_E8M0"} <= dtypes, dtypes
        chain0 = d.get("layer 0").chain
        assert got.chain == hashlib.sha256(f"{chain0}|{got.own}".encode()).hexdigest()


def test_the_digest_stem_leaves_out_the_models_extra_layers(tiny_adapter, tmp_path):
    """The stem group of the weights digest holds the keys outside every layer: the decoder
    layers' and the extra layers' the adapter declares (``extra_layers``, V4: ``mtp.{j}.*``),
    whether or not the run builds them (the tiny asset's incomplete MTP layer is never built)."""
    from amct_ext.io.weights_digest import weight_groups
    from amct_ext.pipeline.resume_guard import ResumeGuard

    wm = {"embed.weight": "a", "layers.0.x": "a", "mtp.0.e_proj.weight": "a", "head.weight": "a"}
    assert weight_groups(wm, [("layer 0", "layers.0.")], ("mtp.",))[0] == ("stem", ["embed.weight", "head.weight"])
    guard = ResumeGuard(tiny_adapter, tmp_path, [0])
    try:
        name, stem = guard.digest.groups[0]
    finally:
        guard.digest.close()
    assert name == "stem" and "embed.weight" in stem
    assert any(k.startswith("mtp.") for k in tiny_adapter.reader.weight_map)
    assert not any(k.startswith(("mtp.", "layers.")) for k in stem)
