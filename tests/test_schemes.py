"""TensorSpec validation, built-in schemes, scheme files, fingerprints, quant targets."""
import json
import sys

import pytest

from amct_ext.errors import AmctError, QuantConfigError
from amct_ext.quant.schemes import (QuantScheme, TargetScheme, TensorSpec, builtin_schemes, load_scheme,
                              parse_targets, spec_targets)

EXPECTED_BUILTINS = {"w8a8", "w4a16-g128", "w4a8", "fp8", "mxfp8", "mxfp4", "kv8", "kv8-fp8", "w3a16-g128", "w4a16", "w2a16-g64"}


# ---------------------------------------------------------------------------- TensorSpec
@pytest.mark.parametrize("kwargs,field", [
    (dict(format="int4"), "format"),
    (dict(format="int", bits=9, granularity="channel"), "bits"),
    (dict(format="int", bits=1, granularity="channel"), "bits"),
    (dict(format="int", bits=True, granularity="channel"), "bits"),
    (dict(format="int", granularity="channel"), "bits"),
    (dict(format="fp8", bits=4, granularity="tensor"), "bits"),
    (dict(format="int", bits=8, granularity="row"), "granularity"),
    (dict(format="int", bits=8), "granularity"),
    (dict(format="int", bits=4, granularity="group"), "group_size"),
    (dict(format="int", bits=4, granularity="channel", group_size=128), "group_size"),
    (dict(format="mxfp4", granularity="channel"), "granularity"),
    (dict(format="mxfp8", group_size=16), "group_size"),
    (dict(format="fp8", granularity="tensor", symmetric=False), "symmetric"),
    (dict(format="int", bits=8, granularity="token", dynamic=False), "dynamic"),
    (dict(format="fp8", granularity="block", block_size=(128,)), "block_size"),
    (dict(format="fp8", granularity="tensor", block_size=(128, 128)), "block_size"),
])
def test_spec_validation_names_field(kwargs, field):
    with pytest.raises(QuantConfigError, match=f"TensorSpec.{field}") as ei:
        TensorSpec(**kwargs)
    assert isinstance(ei.value, AmctError)


def test_spec_defaults_and_identity():
    assert TensorSpec("mxfp4") == TensorSpec("mxfp4", 4, True, "group", 32, None, True)
    assert TensorSpec("fp8", granularity="block").block_size == (128, 128)
    assert TensorSpec("int", 8, True, "token").dynamic is True
    assert TensorSpec("int", 8, True, "tensor").dynamic is False
    assert TensorSpec("int", 16, True, "channel").is_identity and TensorSpec("none").is_identity
    assert not TensorSpec("int", 2, False, "tensor").is_identity
    assert TargetScheme(weight=TensorSpec("none"), input=TensorSpec("int", 16, True, "token")).is_identity


def test_spec_from_dict_errors_name_place_and_key():
    with pytest.raises(QuantConfigError, match=r"here: unknown key\(s\) bit\b"):
        TensorSpec.from_dict({"format": "int", "bit": 8}, "here")
    s = TensorSpec.from_dict({"format": "fp8", "granularity": "block", "block_size": [64, 128]})
    assert s.block_size == (64, 128) and TensorSpec.from_dict(s.to_dict()) == s


# ------------------------------------------------------------------------------ built-ins
def test_builtins_load_and_have_expected_specs():
    assert EXPECTED_BUILTINS <= set(builtin_schemes())
    for name in builtin_schemes():
        s = load_scheme(name)
        assert s.name == name and len(s.fingerprint()) == 64
    w8a8 = load_scheme("w8a8")
    for t in ("attn-linear", "moe"):
        assert w8a8.target(t).weight == TensorSpec("int", 8, True, "channel")
        assert w8a8.target(t).input == TensorSpec("int", 8, True, "token", dynamic=True)
    w4 = load_scheme("w4a16-g128").target("moe")
    assert (w4.weight.bits, w4.weight.group_size, w4.input) == (4, 128, None)
    assert load_scheme("w4a8").target("attn-linear").input.bits == 8
    fp8 = load_scheme("fp8")
    assert fp8.target("moe").weight.format == "fp8" and fp8.target("moe").input.granularity == "token"
    assert load_scheme("mxfp4").target("moe").weight == TensorSpec("mxfp4")
    assert load_scheme("mxfp8").target("attn-linear").input == TensorSpec("mxfp8")
    kv8 = load_scheme("kv8")
    assert kv8.cache.bits == 8 and kv8.target("attn-linear").is_identity
    assert load_scheme("kv8-fp8").cache.format == "fp8"


def test_unknown_scheme_lists_builtins():
    with pytest.raises(QuantConfigError, match="w8a8") as ei:
        load_scheme("w3a3")
    assert "w4a16-g128" in str(ei.value) and "mxfp4" in str(ei.value)
    with pytest.raises(QuantConfigError, match="does not exist"):
        load_scheme("/nonexistent/scheme.json")


def test_fingerprint_stable_and_discriminating(tmp_path):
    fps = {n: load_scheme(n).fingerprint() for n in builtin_schemes()}
    assert len(set(fps.values())) == len(fps)
    assert load_scheme("w8a8").fingerprint() == fps["w8a8"]
    # A renamed copy (also with a different description) does the same thing: same fingerprint.
    d = load_scheme("w8a8").to_dict()
    d["name"], d["description"] = "mine", "copy"
    p = tmp_path / "mine.json"
    p.write_text(json.dumps(d))
    mine = load_scheme(p)
    assert mine.name == "mine" and mine.fingerprint() == fps["w8a8"]
    assert mine.targets == load_scheme("w8a8").targets


def test_file_overrides_per_target(tmp_path):
    p = tmp_path / "s.json"
    p.write_text(json.dumps({
        "name": "custom",
        "weight": {"format": "int", "bits": 8, "granularity": "channel"},
        "input": {"format": "int", "bits": 8, "granularity": "token"},
        "targets": {"moe": {"weight": {"format": "int", "bits": 4, "granularity": "group", "group_size": 64},
                            "input": None}},
    }))
    s = load_scheme(str(p))
    assert s.target("attn-linear").weight.bits == 8 and s.target("attn-linear").input is not None
    assert s.target("moe").weight.group_size == 64 and s.target("moe").input is None
    assert s.cache is None and not s.quantizes("attn-cache")
    assert s.fingerprint() != load_scheme("w8a8").fingerprint()


@pytest.mark.parametrize("doc,match", [
    ({"weight": None}, "'name' is required"),
    ({"name": "x", "weights": {}}, r"unknown key\(s\) weights"),
    ({"name": "x", "targets": {"mlp": {}}}, "MoE"),
    ({"name": "x", "weight": {"format": "int", "bits": 12, "granularity": "channel"}}, "weight: TensorSpec.bits"),
    ({"name": "x", "targets": {"moe": {"input": {"format": "mxfp4", "granularity": "token"}}}}, "targets.moe.input"),
])
def test_bad_files_are_reported(tmp_path, doc, match):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(QuantConfigError, match=match):
        load_scheme(p)


def test_invalid_json_names_line(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text('{"name": "x",\n "weight": }')
    with pytest.raises(QuantConfigError, match="line 2"):
        load_scheme(p)


def test_yaml_scheme(tmp_path, monkeypatch):
    p = tmp_path / "s.yaml"
    p.write_text("name: y8\nweight: {format: int, bits: 8, granularity: channel}\ninput: null\n")
    try:
        import yaml  # noqa: F401
        assert load_scheme(p).target("moe").weight.bits == 8
    except ImportError:
        pass
    monkeypatch.setitem(sys.modules, "yaml", None)  # simulate PyYAML missing
    with pytest.raises(QuantConfigError, match="PyYAML"):
        load_scheme(p)


def test_check_targets_refuses_idle_targets():
    kv8 = load_scheme("kv8")
    assert kv8.check_targets("attn-cache") == ["attn-cache"]
    with pytest.raises(QuantConfigError, match="quantizes nothing for target.*attn-linear"):
        kv8.check_targets("attn-linear,attn-cache")
    with pytest.raises(QuantConfigError, match="attn-cache"):
        load_scheme("w4a16-g128").check_targets(["moe", "attn-cache"])


def test_scheme_round_trips_through_dict():
    for name in builtin_schemes():
        s = load_scheme(name)
        again = QuantScheme.from_dict(s.to_dict())
        assert again == s and again.fingerprint() == s.fingerprint()


# ------------------------------------------------------------------------------- targets
def test_parse_targets():
    assert parse_targets("moe, attn-linear") == ["attn-linear", "moe"]
    assert parse_targets(["attn-cache", "moe", "moe"]) == ["attn-cache", "moe"]
    assert parse_targets("ATTN-LINEAR,") == ["attn-linear"]
    with pytest.raises(QuantConfigError, match="DeepSeek-V4 has MoE layers, use 'moe'"):
        parse_targets("attn-linear,mlp")
    with pytest.raises(QuantConfigError, match="valid: attn-linear, attn-linear-all, attn-cache, moe"):
        parse_targets("attn")
    # the wider attention set uses attn-linear's specs and excludes attn-linear
    assert parse_targets("moe,attn-linear-all") == ["attn-linear-all", "moe"]
    assert spec_targets(["attn-linear-all", "attn-cache"]) == ["attn-linear", "attn-cache"]
    with pytest.raises(QuantConfigError, match="attn-linear and attn-linear-all exclude each other"):
        parse_targets("attn-linear,attn-linear-all")
    w8 = load_scheme("w8a8")
    assert w8.target("attn-linear-all") == w8.target("attn-linear")
    with pytest.raises(QuantConfigError, match="no quant target"):
        parse_targets(" , ")


def test_wider_targets_come_from_the_model_binding():
    """amct_ext/ names no wider target: V4's attn-linear-all exists because its binding declares
    it (ModelBinding.wider_targets, registered with the binding); without it the name is unknown."""
    from amct_ext.quant import schemes
    from models.deepseek_v4.binding import V4_BINDING

    assert schemes.wider_targets() == V4_BINDING.wider_targets == {"attn-linear-all": "attn-linear"}
    saved = dict(schemes._WIDER)
    try:
        schemes._WIDER.clear()
        assert schemes.valid_targets() == schemes.BASE_TARGETS
        with pytest.raises(QuantConfigError, match="unknown quant target 'attn-linear-all'"):
            parse_targets("attn-linear-all")
        schemes.register_wider_target("moe-all", "moe")
        assert schemes.valid_targets() == ("attn-linear", "attn-cache", "moe", "moe-all")
        assert spec_targets(["moe-all"]) == ["moe"]
        with pytest.raises(QuantConfigError, match="moe and moe-all exclude each other"):
            parse_targets("moe-all,moe")
        with pytest.raises(QuantConfigError, match="must widen one of attn-linear, moe"):
            schemes.register_wider_target("cache-all", "attn-cache")
    finally:
        schemes._WIDER.clear()
        schemes._WIDER.update(saved)
    assert schemes.valid_targets() == ("attn-linear", "attn-linear-all", "attn-cache", "moe")
