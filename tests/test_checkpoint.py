import json
import logging
import os

import pytest
import torch
from safetensors.torch import save_file

from amct_ext.io import checkpoint as C
from amct_ext.io.checkpoint import CheckpointReader, iter_layer_prefixes
from amct_ext.errors import CheckpointError


# ----------------------------------------------------------------------------- fixtures
def _e8m0(bytes_: torch.Tensor) -> torch.Tensor:
    return bytes_.to(torch.uint8).view(torch.float8_e8m0fnu)


def make_tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    fp8_w = (torch.randn(200, 130, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    fp8_s = _e8m0(torch.randint(120, 132, (2, 2), generator=g))
    fp4_w = torch.randint(-128, 128, (16, 32), generator=g, dtype=torch.int32).to(torch.int8)
    fp4_s = _e8m0(torch.randint(120, 132, (16, 2), generator=g))
    shard_a = {
        "layers.0.attn.wq_a.weight": fp8_w,
        "layers.0.attn.wq_a.scale": fp8_s,
        "layers.0.attn_norm.weight": torch.rand(130, generator=g),            # fp32 island
        "layers.0.attn.attn_sink": torch.rand(4, generator=g),
    }
    shard_b = {
        "layers.0.ffn.experts.0.w1.weight": fp4_w,
        "layers.0.ffn.experts.0.w1.scale": fp4_s,
        "layers.0.ffn.gate.weight": torch.randn(4, 130, generator=g).to(torch.bfloat16),
        "layers.0.ffn.gate.tid2eid": torch.randint(0, 4, (50, 2), generator=g, dtype=torch.int32),
    }
    shard_c = {
        "layers.1.attn_norm.weight": torch.rand(130, generator=g),
        "embed.weight": torch.randn(50, 130, generator=g).to(torch.bfloat16),
        "mtp.0.attn_norm.weight": torch.rand(130, generator=g),
    }
    return {"a.safetensors": shard_a, "b.safetensors": shard_b, "c.safetensors": shard_c}


def write_ckpt(root, shards, extra_map=None):
    root.mkdir(parents=True, exist_ok=True)
    wm = {}
    for fname, tensors in shards.items():
        save_file(tensors, str(root / fname))
        wm.update({k: fname for k in tensors})
    wm.update(extra_map or {})
    (root / C.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return root


@pytest.fixture
def ckpt(tmp_path):
    shards = make_tensors()
    return write_ckpt(tmp_path / "ckpt", shards), shards


# ----------------------------------------------------------------------------- independent dequant
def ref_fp8(w, s, block=128):
    sv = torch.exp2(s.view(torch.uint8).float() - 127)
    out = w.float().clone()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * block:(i + 1) * block, j * block:(j + 1) * block] *= sv[i, j]
    return out


def ref_fp4(packed, s, block=32):
    lut = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    b = packed.view(torch.uint8).tolist()
    sb = s.view(torch.uint8).tolist()
    rows = []
    for i, row in enumerate(b):
        r = []
        for j2, byte in enumerate(row):
            for j, c in ((2 * j2, byte & 15), (2 * j2 + 1, byte >> 4)):
                v = lut[c & 7] * (-1 if c & 8 else 1)
                r.append(v * 2.0 ** (sb[i][j // block] - 127))
        rows.append(r)
    return torch.tensor(rows)


# ----------------------------------------------------------------------------- basics
def test_key_queries(ckpt):
    root, shards = ckpt
    with CheckpointReader(root) as r:
        assert set(r.keys()) == {k for s in shards.values() for k in s}
        assert r.has("embed.weight") and "embed.weight" in r and not r.has("nope")
        assert r.shard_of("layers.0.ffn.gate.weight") == "b.safetensors"
        assert set(r.keys_under("layers.0.attn")) == {
            "layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale", "layers.0.attn.attn_sink",
            "layers.0.attn_norm.weight"}
        assert r.shards_opened == []  # key queries read the index only
        raw = r.get_raw("layers.0.attn.wq_a.weight")
        assert raw.dtype == torch.float8_e4m3fn
        assert r.stored_dtype("layers.0.ffn.experts.0.w1.weight") == "I8"
        assert list(iter_layer_prefixes(r)) == ["layers.0.", "layers.1."]
        with pytest.raises(CheckpointError, match="'nope'.*not in"):
            r.shard_of("nope")
    assert r._handles == {}  # context manager closed the handles


def test_load_prefix_decodes_and_casts(ckpt):
    root, shards = ckpt
    a, b = shards["a.safetensors"], shards["b.safetensors"]
    with CheckpointReader(root) as r:
        res = r.load_prefix("layers.0.", dtype=torch.float32)
    t = res.tensors
    assert set(t) == {"attn.wq_a.weight", "attn_norm.weight", "attn.attn_sink",
                      "ffn.experts.0.w1.weight", "ffn.gate.weight", "ffn.gate.tid2eid"}
    assert sorted(res.loaded) == sorted(t)
    assert res.missing == res.unexpected == res.skipped == []
    assert torch.equal(t["attn.wq_a.weight"],
                       ref_fp8(a["layers.0.attn.wq_a.weight"], a["layers.0.attn.wq_a.scale"]))
    w1 = t["ffn.experts.0.w1.weight"]
    assert w1.shape == (16, 64)  # logical in = 2 * packed in
    assert torch.equal(w1, ref_fp4(b["layers.0.ffn.experts.0.w1.weight"],
                                   b["layers.0.ffn.experts.0.w1.scale"]))
    tid = t["ffn.gate.tid2eid"]
    assert tid.dtype == torch.int64 and torch.equal(tid, b["layers.0.ffn.gate.tid2eid"].long())


def test_default_bf16_and_target_dtype_callable(ckpt):
    root, shards = ckpt
    a = shards["a.safetensors"]

    def keep_fp32_norms(name, stored):
        return torch.float32 if name.endswith("norm.weight") else None

    with CheckpointReader(root) as r:
        res = r.load_prefix("layers.0.", target_dtype=keep_fp32_norms, device="cpu")
    t = res.tensors
    assert t["attn_norm.weight"].dtype == torch.float32
    assert torch.equal(t["attn_norm.weight"], a["layers.0.attn_norm.weight"])
    assert t["attn.attn_sink"].dtype == torch.bfloat16  # callable said None -> default dtype
    assert t["attn.wq_a.weight"].dtype == torch.bfloat16
    assert torch.equal(t["attn.wq_a.weight"],
                       ref_fp8(a["layers.0.attn.wq_a.weight"],
                               a["layers.0.attn.wq_a.scale"]).to(torch.bfloat16))


def test_expected_meta_state_dict_keeps_fp32_islands(ckpt):
    root, _ = ckpt
    expected = {
        "attn.wq_a.weight": torch.empty(200, 130, dtype=torch.bfloat16, device="meta"),
        "attn_norm.weight": torch.empty(130, dtype=torch.float32, device="meta"),
        "attn.attn_sink": ((4,), torch.float32),
        "ffn.experts.0.w1.weight": (16, 64),
        "ffn.gate.weight": torch.Size([4, 130]),
        "ffn.gate.tid2eid": ((50, 2), "int64"),
    }
    with CheckpointReader(root) as r:
        res = r.load_prefix("layers.0.", expected)
    t = res.tensors
    assert t["attn_norm.weight"].dtype == torch.float32
    assert t["attn.attn_sink"].dtype == torch.float32
    assert t["attn.wq_a.weight"].dtype == torch.bfloat16
    assert t["ffn.experts.0.w1.weight"].dtype == torch.bfloat16
    assert t["ffn.gate.tid2eid"].dtype == torch.int64
    assert res.unexpected == [] and res.missing == []


# ----------------------------------------------------------------------------- lazy shards
def test_prefix_load_opens_only_needed_shards(ckpt, monkeypatch):
    root, _ = ckpt
    opened = []
    real = C.safe_open
    monkeypatch.setattr(C, "safe_open", lambda path, *a, **k: (opened.append(os.path.basename(path)),
                                                              real(path, *a, **k))[1])
    os.remove(root / "c.safetensors")  # unrelated shard gone: layer 0 must still load
    with CheckpointReader(root) as r:
        res = r.load_prefix("layers.0.attn.")
        assert sorted(opened) == ["a.safetensors"]
        r.load_prefix("layers.0.")
        r.load_prefix("layers.0.")  # handles are cached: no re-open
        assert sorted(opened) == ["a.safetensors", "b.safetensors"]
        assert r.shards_opened == opened
        with pytest.raises(CheckpointError, match="c.safetensors.*missing"):
            r.load_prefix("layers.1.")
    assert sorted(res.tensors) == ["attn_sink", "wq_a.weight"]


# ----------------------------------------------------------------------------- safety
@pytest.mark.parametrize("bad", ["/etc/passwd", "../outside.safetensors", "sub/../../x.safetensors"])
def test_index_path_escape_refused(tmp_path, bad):
    root = write_ckpt(tmp_path / "ckpt", {"a.safetensors": {"x": torch.zeros(1)}},
                      extra_map={"evil.weight": bad})
    with pytest.raises(CheckpointError) as ei:
        CheckpointReader(root)
    msg = str(ei.value)
    assert "evil.weight" in msg and bad in msg


def test_symlink_escape_refused_but_inner_symlink_ok(tmp_path):
    outside = tmp_path / "outside.safetensors"
    save_file({"y": torch.zeros(1)}, str(outside))
    root = write_ckpt(tmp_path / "ckpt", {"a.safetensors": {"x": torch.ones(1)}},
                      extra_map={"evil.weight": "link.safetensors"})
    (root / "link.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"evil\.weight.*link\.safetensors.*outside"):
        CheckpointReader(root)
    # a symlink that stays inside the folder is fine
    root2 = write_ckpt(tmp_path / "ckpt2", {"a.safetensors": {"x": torch.ones(1)}},
                       extra_map={"x": "alias.safetensors"})
    (root2 / "alias.safetensors").symlink_to(root2 / "a.safetensors")
    with CheckpointReader(root2) as r:
        assert torch.equal(r.get_raw("x"), torch.ones(1))


def test_truncated_shard_names_file(ckpt):
    root, _ = ckpt
    f = root / "b.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with CheckpointReader(root) as r:
        r.load_prefix("layers.0.attn")  # other shard unaffected
        with pytest.raises(CheckpointError, match=r"b\.safetensors.*(corrupt|truncated)"):
            r.load_prefix("layers.0.ffn")


def test_bad_index_json(tmp_path):
    (tmp_path / C.INDEX_NAME).write_text("{not json")
    with pytest.raises(CheckpointError, match="index"):
        CheckpointReader(tmp_path)
    (tmp_path / C.INDEX_NAME).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="weight_map"):
        CheckpointReader(tmp_path)
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nowhere")


# ----------------------------------------------------------------------------- accounting
def _expected_layer0():
    return {"attn.wq_a.weight": (200, 130), "attn_norm.weight": (130,), "attn.attn_sink": (4,),
            "ffn.experts.0.w1.weight": (16, 64), "ffn.gate.weight": (4, 130),
            "ffn.gate.tid2eid": (50, 2)}


def test_missing_key_not_in_index(ckpt):
    root, _ = ckpt
    exp = _expected_layer0() | {"ffn.gate.bias": (4,)}
    with CheckpointReader(root) as r:
        with pytest.raises(CheckpointError, match=r"layers\.0\.ffn\.gate\.bias.*not in index"):
            r.load_prefix("layers.0.", exp)
        res = r.load_prefix("layers.0.", exp, strict=False)
    assert res.missing == ["ffn.gate.bias"] and "ffn.gate.weight" in res.tensors


def test_key_in_index_but_not_in_shard(ckpt):
    root, shards = ckpt
    write_ckpt(root, shards, extra_map={"layers.0.ffn.gate.bias": "b.safetensors"})
    exp = _expected_layer0() | {"ffn.gate.bias": (4,)}
    with CheckpointReader(root) as r:
        with pytest.raises(CheckpointError, match=r"layers\.0\.ffn\.gate\.bias.*b\.safetensors"):
            r.load_prefix("layers.0.", exp)


def test_shape_mismatch_names_tensor_and_shapes(ckpt):
    root, _ = ckpt
    exp = _expected_layer0() | {"ffn.experts.0.w1.weight": (16, 32)}
    with CheckpointReader(root) as r:
        with pytest.raises(CheckpointError,
                           match=r"layers\.0\.ffn\.experts\.0\.w1\.weight.*\[16, 32\].*\[16, 64\]"):
            r.load_prefix("layers.0.", exp)


def test_unsupported_dtype_names_tensor(tmp_path):
    root = write_ckpt(tmp_path, {"a.safetensors": {
        "layers.0.x.weight": torch.zeros(2, 2).to(torch.float8_e5m2),
        "layers.0.y.weight": torch.zeros(2, 2, dtype=torch.int8),            # int8 with no scale
        "layers.0.z.weight": torch.zeros(2, 2).to(torch.float8_e4m3fn),      # fp8 with no scale
    }})
    with CheckpointReader(root) as r:
        with pytest.raises(CheckpointError, match=r"layers\.0\.x\.weight.*float8_e5m2"):
            r.load_prefix("layers.0.x")
        with pytest.raises(CheckpointError, match=r"layers\.0\.y\.weight.*int8"):
            r.load_prefix("layers.0.y")
        with pytest.raises(CheckpointError, match=r"layers\.0\.z\.weight.*layers\.0\.z\.scale"):
            r.load_prefix("layers.0.z")


def test_nan_scale_through_reader_names_key(tmp_path):
    root = write_ckpt(tmp_path, {"a.safetensors": {
        "w.weight": torch.zeros(4, 4).to(torch.float8_e4m3fn),
        "w.scale": _e8m0(torch.tensor([[255]])),
    }})
    with CheckpointReader(root) as r, pytest.raises(CheckpointError, match=r"w\.weight.*NaN"):
        r.load_prefix("w.")


def test_mtp_skipped_and_unexpected_reported(ckpt, caplog):
    root, _ = ckpt
    with CheckpointReader(root) as r:
        assert r.load_prefix("").skipped == []          # the reader skips nothing unless told
        res = r.load_prefix("", skip_prefixes=("mtp.",))
        assert res.skipped == ["mtp.0.attn_norm.weight"]
        assert "mtp.0.attn_norm.weight" not in res.tensors
        # asking for the mtp prefix itself loads it
        assert "attn_norm.weight" in r.load_prefix("mtp.0.", skip_prefixes=("mtp.",)).tensors

        exp = _expected_layer0()
        del exp["attn.attn_sink"], exp["ffn.experts.0.w1.weight"]
        with caplog.at_level(logging.WARNING, logger="amct_ext.io.checkpoint"):
            res = r.load_prefix("layers.0.", exp)
    assert sorted(res.unexpected) == ["attn.attn_sink", "ffn.experts.0.w1.weight"]
    assert "attn.attn_sink" not in res.tensors
    assert "ffn.experts.0.w1.scale" not in res.unexpected  # consumed with its weight
    assert "layers.0.attn.attn_sink" in caplog.text


def test_strip_prefix_false_and_single_file(tmp_path):
    f = tmp_path / "model.safetensors"
    save_file({"layers.0.a": torch.ones(3), "layers.0.b": torch.zeros(2, dtype=torch.int64)}, str(f))
    for path in (tmp_path, f):
        with CheckpointReader(path) as r:
            res = r.load_prefix("layers.0.", {"layers.0.a": (3,), "layers.0.b": (2,)},
                                strip_prefix=False, dtype=torch.float16)
            assert res.tensors["layers.0.a"].dtype == torch.float16
            assert res.tensors["layers.0.b"].dtype == torch.int64
            assert r.shard_of("layers.0.a") == "model.safetensors"


def test_bf16_weight_with_scale_is_not_dequantized(tmp_path):
    # A `.scale` next to a non-quantized weight is an ordinary tensor, never silently consumed.
    root = write_ckpt(tmp_path, {"a.safetensors": {
        "n.weight": torch.ones(2, dtype=torch.bfloat16), "n.scale": torch.full((1,), 3.0)}})
    with CheckpointReader(root) as r:
        res = r.load_prefix("n.", dtype=torch.float32)
        assert sorted(res.tensors) == ["scale", "weight"]
        res = r.load_prefix("n.", {"weight": (2,)})
        assert res.unexpected == ["scale"]


def test_save_sharded_keeps_each_numbered_layer_in_one_shard(tmp_path):
    """The writer's default groups: a numbered layer (decoder ``layers.{i}``, a model's extra
    ``mtp.{j}``) stays in one shard; other keys group by their first name part. Named by no model."""
    import json

    from amct_ext.io.checkpoint_writer import layer_group, save_sharded

    assert [layer_group(k) for k in ("layers.3.attn.w.weight", "mtp.0.e_proj.weight", "draft.12.x",
                                     "embed.weight", "hc_head_fn", "norm.x.y")] == \
        ["layers.3", "mtp.0", "draft.12", "embed", "hc_head_fn", "norm"]
    tensors = {f"{g}.{i}.{n}": torch.zeros(64 * (i + 1)) for g in ("layers", "mtp") for i in range(3)
               for n in ("a", "b", "c")}
    tensors.update({"embed.weight": torch.zeros(500), "embed.extra": torch.zeros(1)})
    index = json.loads(save_sharded(tensors, tmp_path, n_shards=3).read_text())["weight_map"]
    for group in {layer_group(k) for k in tensors}:
        assert len({index[k] for k in tensors if layer_group(k) == group}) == 1, group
    assert len(set(index.values())) == 3
