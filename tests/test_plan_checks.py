"""Nothing late (issue 36, item 2) and the plan's part of nothing silent (item 1): every defect
below is refused by the job plan in one `error:` line, exit 2, before any perplexity or output --
not when the run reaches the layer. Each case is built on a copy of a checkpoint the tests write
(tests/conftest.py); the helpers rewrite one shard, the index or config.json."""
import json
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import run_ptq  # noqa: E402

FAST = ["--calib-samples", "2", "--seq-len", "32", "--eval-windows", "2", "--quiet", "--no-eval-ppl"]
INDEX = "model.safetensors.index.json"


# ----------------------------------------------------------------------------- helpers
def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def index_of(ckpt: Path) -> dict:
    return json.loads((ckpt / INDEX).read_text())


def write_index(ckpt: Path, idx: dict) -> None:
    (ckpt / INDEX).write_text(json.dumps(idx))


def rewrite_shard(ckpt: Path, key: str, change) -> str:
    """Load the shard holding ``key``, ``change(tensors)`` in place, save it; returns the shard."""
    shard = index_of(ckpt)["weight_map"][key]
    tensors = load_file(ckpt / shard)
    change(tensors)
    save_file(tensors, ckpt / shard, metadata={"format": "pt"})
    return shard


def edit_config(ckpt: Path, **fields) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(fields)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def refused(capsys, ckpt: Path, out: Path, match: str, extra=()) -> str:
    code = run_ptq.main(["--model", "tiny", "--model-path", str(ckpt), "--output-dir", str(out), *FAST, *extra])
    cap = capsys.readouterr()
    err = cap.err.strip().splitlines()
    assert code == 2, (code, cap.err[-800:])
    assert len(err) == 1 and err[0].startswith("error: ") and match in err[0], err
    assert "ppl[" not in cap.out and "plan:" not in cap.out      # before the plan's end, before any work
    assert not (out / "ptq_params").exists() and not (out / "report.json").exists()
    return err[0]


def planned(ckpt: Path, out: Path, extra=()):
    """The plan of a job on ``ckpt`` (in-process, nothing run)."""
    from amct_ext.data import CALIB_DEFAULT, EVAL_DEFAULT
    from amct_ext.pipeline.job import PtqOptions, ResolvedPaths, build_job
    from models.deepseek_v4.plan import DeepseekV4PlanSpec

    opts = PtqOptions(output_dir=str(out), scheme="w8a8", calib_samples=2, seq_len=32, batch_size=1,
                      eval_batch_size=1, dtype="bf16", **dict(extra))
    return build_job(opts, DeepseekV4PlanSpec(), ResolvedPaths(ckpt, CALIB_DEFAULT, EVAL_DEFAULT))


# ----------------------------------------------------------------------------- shard headers
def test_truncated_shard_is_refused_by_the_plan(tiny_ckpt, tmp_path, capsys):
    ckpt = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    shard = sorted(set(index_of(ckpt)["weight_map"].values()))[-1]
    size = (ckpt / shard).stat().st_size
    os.truncate(ckpt / shard, size - 100)
    line = refused(capsys, ckpt, tmp_path / "out", f"shard file {shard!r}")
    assert "truncated: 100 bytes missing" in line, line


def test_garbage_header_is_refused_by_the_plan(tiny_ckpt, tmp_path, capsys):
    ckpt = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    shard = sorted(set(index_of(ckpt)["weight_map"].values()))[0]
    with open(ckpt / shard, "r+b") as f:       # the length intact, the JSON turned to garbage
        f.seek(8)
        f.write(b"\xfe\x01garbage" * 4)
    line = refused(capsys, ckpt, tmp_path / "out", f"shard file {shard!r}: the header is not JSON")
    assert "re-download" in line
    with open(ckpt / shard, "r+b") as f:       # a header length beyond the file
        f.write(struct.pack("<Q", 1 << 40))
    refused(capsys, ckpt, tmp_path / "out", "header length 1099511627776 is absurd")


def test_wrong_shape_is_refused_by_the_plan(tiny_ckpt, tmp_path, capsys):
    ckpt = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    key = "layers.2.attn.wq_a.weight"
    shard = rewrite_shard(ckpt, key, lambda t: t.__setitem__(key, torch.zeros(32, 48, dtype=t[key].dtype)))
    line = refused(capsys, ckpt, tmp_path / "out", f"tensor {key!r} in shard {shard!r} has shape [32, 48]")
    assert "config.json gives [32, 64]" in line, line


def test_config_disagreeing_with_stored_shapes_is_refused(tiny_ckpt, tmp_path, capsys):
    ckpt = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    edit_config(ckpt, q_lora_rank=48)          # the release stores q_lora_rank 32
    line = refused(capsys, ckpt, tmp_path / "out", "config.json gives [48, 64]")
    assert "layers.0.attn.wq_a.weight" in line and "has shape [32, 64]" in line, line


def test_wrong_dtype_is_refused_by_the_plan(tiny_ckpt, tmp_path, capsys):
    ckpt = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    key = "layers.1.ffn.gate.tid2eid"          # hash routing table: integers
    rewrite_shard(ckpt, key, lambda t: t.__setitem__(key, t[key].float()))
    refused(capsys, ckpt, tmp_path / "out", f"tensor {key!r}")
    line = refused(capsys, ckpt, tmp_path / "out", "is stored as F32, the model expects integer values")
    key2 = "layers.3.attn.wkv.weight"          # a float weight stored as integers
    ckpt2 = copy_ckpt(tiny_ckpt, tmp_path / "ckpt2")
    rewrite_shard(ckpt2, key2, lambda t: t.__setitem__(key2, t[key2].to(torch.int32)))
    line = refused(capsys, ckpt2, tmp_path / "out", f"tensor {key2!r}")
    assert "stored as I32, the model expects floating values" in line, line


def test_fp8_weight_without_scale_is_refused_by_the_plan(tiny_ckpt_fp8, tmp_path, capsys):
    ckpt = copy_ckpt(tiny_ckpt_fp8, tmp_path / "ckpt")
    idx = index_of(ckpt)
    key = "layers.2.attn.wq_b.weight"
    assert idx["weight_map"][key] and key[:-len(".weight")] + ".scale" in idx["weight_map"]
    idx["weight_map"].pop(key[:-len(".weight")] + ".scale")
    write_index(ckpt, idx)
    line = refused(capsys, ckpt, tmp_path / "out", f"tensor {key!r}")
    assert "FP8 weight without its companion 'layers.2.attn.wq_b.scale'" in line, line


def test_fp8_scale_of_the_wrong_shape_is_refused(tiny_ckpt_fp8, tmp_path, capsys):
    ckpt = copy_ckpt(tiny_ckpt_fp8, tmp_path / "ckpt")
    skey = "layers.1.attn.wo_b.scale"
    rewrite_shard(ckpt, skey, lambda t: t.__setitem__(skey, torch.cat([t[skey], t[skey]])))
    refused(capsys, ckpt, tmp_path / "out", "layers.1.attn.wo_b.weight")


def test_key_in_the_wrong_shard_is_refused_by_the_plan(tiny_ckpt, tmp_path, capsys):
    ckpt = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    idx = index_of(ckpt)
    key = "layers.3.ffn.experts.1.w2.weight"
    right = idx["weight_map"][key]
    wrong = next(s for s in sorted(set(idx["weight_map"].values())) if s != right)
    idx["weight_map"][key] = wrong
    write_index(ckpt, idx)
    line = refused(capsys, ckpt, tmp_path / "out", f"key {key!r} is mapped to shard {wrong!r}")
    assert f"it is in {right!r}" in line, line


def test_intact_checkpoints_pass_every_header_check(tiny_ckpt, tiny_ckpt_fp8, tmp_path):
    """The oracle side of each refusal: the untouched bf16 and FP8/FP4 checkpoints are planned, every
    skeleton tensor checked (210 logical tensors of the tiny: stem + 4 layers)."""
    from amct_ext.io.checkpoint import CheckpointReader
    from models.deepseek_v4.plan import DeepseekV4PlanSpec

    for ckpt in (tiny_ckpt, tiny_ckpt_fp8):
        spec = DeepseekV4PlanSpec()
        cfg = spec.read_config(ckpt)
        ck = spec.check_checkpoint(ckpt, cfg)
        with CheckpointReader(ckpt) as r:
            n_main = len([k for k in r.keys() if not k.startswith("mtp.") and not k.endswith(".scale")])
        assert ck["headers_checked"] == n_main == len(spec.expected_tensors(cfg)), (ck, n_main)
        planned(ckpt, tmp_path / "o")


# ----------------------------------------------------------------------------- layers, recipe
def test_config_with_fewer_layers_is_refused_or_needs_the_flag(tiny_ckpt, tmp_path, capsys):
    ckpt = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    edit_config(ckpt, num_hidden_layers=3)
    line = refused(capsys, ckpt, tmp_path / "out", "num_hidden_layers=3 but the checkpoint holds 4 layers")
    assert "--allow-fewer-layers" in line
    job = planned(ckpt, tmp_path / "o", {"allow_fewer_layers": True})   # said on purpose: a 3-layer job
    assert job.model.n_layers == 3 and job.output.layers == range(0, 3)


def test_nan_learning_rate_in_a_recipe_file_is_refused_by_the_plan(tiny_ckpt, tmp_path, capsys):
    for algo, field, value, why in (("clip", "lr", float("nan"), "= nan: must be a finite number"),
                                    ("autoround", "lr", float("inf"), "= inf: must be a finite number"),
                                    ("blockround", "iters", 10 ** 9, "= 1000000000: larger than 1e+06")):
        f = tmp_path / f"{algo}.json"
        f.write_text(json.dumps({"recipe": [{"algo": algo, field: value}]}))   # json writes NaN / Infinity
        line = refused(capsys, tiny_ckpt, tmp_path / "out", f"{algo}.{field} {why}", ["--recipe", str(f)])
        assert str(f) in line, line
    # negative values: each algorithm's own check names them first; the generic rule is the backstop
    from amct_ext.algorithms.field_ranges import check_field_ranges
    from amct_ext.algorithms.hessian_clip import HessianClip

    assert check_field_ranges(HessianClip(sweeps=-1), "r.json") == "r.json: hclip.sweeps = -1: must be >= 0"
    assert check_field_ranges(HessianClip(), "r.json") is None


# ----------------------------------------------------------------------------- links
def test_link_out_of_the_checkpoint_is_refused(tiny_ckpt, tmp_path, capsys):
    ckpt = copy_ckpt(tiny_ckpt, tmp_path / "ckpt")
    secret = tmp_path / "elsewhere" / "generation_config.json"
    secret.parent.mkdir()
    secret.write_text('{"secret": 1}')
    (ckpt / "generation_config.json").symlink_to(secret)
    line = refused(capsys, ckpt, tmp_path / "out", "generation_config.json")
    assert "outside the checkpoint folder" in line, line
    # the export's own plan refuses it too, before anything is written
    from amct_ext.errors import AmctError
    from amct_ext.export.job import ExportRequest, export_config

    with pytest.raises(AmctError, match="outside the checkpoint folder"):
        export_config(ExportRequest(model_path=ckpt, out_dir=tmp_path / "exp", format="compressed-tensors",
                                    scheme="w8a8"), say=lambda s: None)
    assert not (tmp_path / "exp").exists()
    # and the copy itself goes through the same check
    from amct_ext.io.links import checked_file

    with pytest.raises(AmctError, match="generation_config.json"):
        checked_file(ckpt, "generation_config.json", "side file")


def hub_layout(src: Path, root: Path, repo: str = "models--org--tiny") -> Path:
    """``src`` as huggingface_hub caches it: blobs/<sha256> and snapshots/<rev>/<name> -> ../../blobs/<sha>."""
    import hashlib

    blobs, snap = root / repo / "blobs", root / repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for p in sorted(src.iterdir()):
        sha = hashlib.sha256(p.read_bytes()).hexdigest()
        shutil.copyfile(p, blobs / sha)
        (snap / p.name).symlink_to(Path("..") / ".." / "blobs" / sha)
    return snap


def test_hub_cache_layout_is_accepted(tiny_ckpt, tmp_path):
    from amct_ext.io.checkpoint import CheckpointReader
    from models.deepseek_v4.loading import load_block, load_config

    snap = hub_layout(tiny_ckpt, tmp_path / "hub")
    assert all((snap / n).is_symlink() for n in os.listdir(snap))
    job = planned(snap, tmp_path / "o")
    assert job.model.n_layers == 4 and job.checkpoint.shards == 2
    with CheckpointReader(snap) as r, CheckpointReader(tiny_ckpt) as ref:   # the same tensors as the plain copy
        a, _ = load_block(r, load_config(snap), 2, dtype=torch.float32)
        b, _ = load_block(ref, load_config(tiny_ckpt), 2, dtype=torch.float32)
        for (ka, ta), (kb, tb) in zip(a.state_dict().items(), b.state_dict().items()):
            assert ka == kb and torch.equal(ta, tb), ka


def test_hub_link_into_another_repository_is_refused(tiny_ckpt, tmp_path, capsys):
    snap = hub_layout(tiny_ckpt, tmp_path / "hub")
    other = tmp_path / "hub" / "models--someone--else" / "blobs"
    other.mkdir(parents=True)
    victim = snap / "config.json"
    target = other / "cfg"
    shutil.copyfile(victim, target)
    victim.unlink()
    victim.symlink_to(Path("..") / ".." / ".." / "models--someone--else" / "blobs" / "cfg")
    line = refused(capsys, snap, tmp_path / "out", "config.json")
    assert "outside the checkpoint folder" in line, line


def test_stored_shapes_of_packed_fp4_and_fp8(tmp_path):
    """The header rules against what the loader decodes (``CheckpointReader._load_one``): F4 keeps
    its (logical) shape, int8-packed FP4 doubles its columns, FP8 needs a 128-block scale."""
    from amct_ext.io.checkpoint import CheckpointReader
    from amct_ext.io.shard_headers import read_header, stored_logical
    from amct_ext.io.storage_formats import encode_fp4, encode_fp8_block

    w = torch.randn(64, 96)
    packed, s4 = encode_fp4(w)
    w8, s8 = encode_fp8_block(torch.randn(130, 256))
    f = tmp_path / "model.safetensors"
    save_file({"a.weight": packed.clone().view(torch.float4_e2m1fn_x2), "a.scale": s4.clone(), "b.weight": packed,
               "b.scale": s4, "c.weight": w8, "c.scale": s8}, f)
    h = read_header(f).tensors
    with CheckpointReader(f) as r:
        for k in ("a", "b", "c"):
            got, is_int = stored_logical(f"{k}.weight", h[f"{k}.weight"], h[f"{k}.scale"], "model.safetensors")
            loaded = r.load_prefix(f"{k}.", dtype=torch.float32, check_finite=False).tensors["weight"]
            assert got == tuple(loaded.shape) and not is_int, (k, got, loaded.shape)
    assert h["a.weight"].dtype == "F4" and h["b.weight"].dtype in ("I8", "U8")
    with pytest.raises(Exception, match="needs a scale of shape"):
        stored_logical("c.weight", h["c.weight"], h["a.scale"], "model.safetensors")
