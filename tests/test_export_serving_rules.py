"""Issue 36.4: the export's engine profiles know vLLM's GPU build (and vllm-ascend's TP rules).

Each rule is checked both ways -- refused (one line naming the module or tensor, the engine and
the flag, before anything is written) and accepted (with the build or flag that makes it
servable) -- with the rules' sources in benchmarks/results/export-engine-rules.md and casebook
export.md i36e-1..6:

- W4A8 int (int4 weights x int8 inputs): no CUDA kernel for the experts, another function on the
  linears; served by vLLM's CPU build (``--vllm-build cpu``).
- MX with activation quantization: vLLM's CUDA kernels below SM100 drop the activations;
  refused unless ``--mx-weight-only``, which describes the MX groups weight-only and says so.
- 2- / 3-bit experts: only vLLM's optional Humming kernels load them (``--allow-humming``).
- ``--tensor-parallel N``: every dim the engine splits divides by N and each rank's slice holds
  whole groups / blocks; the metadata lists the servable sizes.
"""
from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from amct_ext.errors import AmctError
from tests.export_helpers import TINY

pytestmark = pytest.mark.usefixtures("one_thread")
CONFIGS = Path(__file__).resolve().parents[1] / "models" / "deepseek_v4" / "configs"
W2_G64 = "w2a16-g64"


def _cfg(out: Path, scheme, targets=("attn-linear", "moe"), model=TINY, **serve):
    from amct_ext.export.engine import ServeOptions
    from amct_ext.export.exporter import ExportConfig
    from amct_ext.quant.schemes import load_scheme

    return ExportConfig(model_path=model, out_dir=out, format="compressed-tensors", scheme=load_scheme(scheme),
                        targets=list(targets), device="cpu", serve=ServeOptions(**serve))


def _refused(cfg, match: str) -> str:
    """check() (the plan's call) refuses in one line and nothing is written."""
    with pytest.raises(AmctError, match=match) as e:
        cfg.check()
    assert not Path(cfg.out_dir).exists()
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ----------------------------------------------------------------------------- W4A8 int
def test_w4a8_experts_refused_for_the_gpu_build_with_the_reason(tmp_path):
    msg = _refused(_cfg(tmp_path / "o", "w4a8", ["moe"]),
                   r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]: vLLM 0\.33 \(CUDA build\) has no CUDA kernel for "
                   r"W4A8 int experts")
    assert "only supported on CPU platforms" in msg and "--vllm-build cpu" in msg
    # the attention linears too: SM90 would run FP8 activations, other GPUs none
    msg = _refused(_cfg(tmp_path / "a", "w4a8", ["attn-linear"]), r"^layers\.0\.attn\.\w+: vLLM .*W4A8 int linears")
    assert "--vllm-build cpu" in msg


def test_w4a8_accepted_for_the_cpu_build(tmp_path):
    """vLLM's CPU build runs W4A8 int (its CPU_INT4 backend); the export says which build."""
    from amct_ext.export.exporter import export_checkpoint

    cfg = _cfg(tmp_path / "o", "w4a8", ["attn-linear"], build="cpu")
    cfg.check()
    export_checkpoint(cfg)
    meta = json.loads((tmp_path / "o" / "config.json").read_text())["amct_export"]
    assert meta["engine"].startswith("vLLM CPU build") and meta["serving"]["build"] == "cpu"
    _cfg(tmp_path / "m", "w4a8", ["moe"], build="cpu").check()


# ----------------------------------------------------------------------------- MX
@pytest.mark.parametrize("scheme", ["mxfp8", "mxfp4"])
def test_mx_activation_quantization_refused_for_the_gpu_build(tmp_path, scheme):
    msg = _refused(_cfg(tmp_path / "o", scheme, ["attn-linear"]),
                   r"^layers\.0\.attn\.\w+: vLLM 0\.33 \(CUDA build\) serves MX weights with weight-only")
    assert "--mx-weight-only" in msg


def test_mx_weight_only_says_what_is_served(tmp_path):
    """--mx-weight-only: the tensors are those of the storage-only export, the MX groups are
    described without input activations, and the metadata names them."""
    from amct_ext.export.exporter import export_checkpoint
    from amct_ext.io.checkpoint import CheckpointReader

    export_checkpoint(_cfg(tmp_path / "wo", "mxfp8", mx_weight_only=True))
    ref = _cfg(tmp_path / "raw", "mxfp8")
    ref.serve_check = False                       # what the run did, unfiltered
    export_checkpoint(ref)
    got = json.loads((tmp_path / "wo" / "config.json").read_text())
    raw = json.loads((tmp_path / "raw" / "config.json").read_text())
    groups = got["quantization_config"]["config_groups"]
    assert {g: groups[g]["input_activations"] for g in groups} == {"attn-linear": None, "moe": None}
    assert all(raw["quantization_config"]["config_groups"][g]["input_activations"] for g in groups)
    assert got["amct_export"]["serving"]["served_weight_only"] == ["attn-linear", "moe"]
    with CheckpointReader(tmp_path / "wo") as a, CheckpointReader(tmp_path / "raw") as b:
        for key in ("layers.1.attn.wq_a.weight", "layers.1.ffn.experts.2.w2.weight_scale"):
            assert a.get_raw(key).equal(b.get_raw(key)), key
    # our own read-back now evaluates what vLLM serves: weight-only
    from amct_ext.export.readback import exported_quant

    assert exported_quant(tmp_path / "wo").targets == []
    assert exported_quant(tmp_path / "raw").targets == ["attn-linear", "moe"]


# ----------------------------------------------------------------------------- Humming
@pytest.mark.parametrize("scheme", [W2_G64, "w3a16-g128"])
def test_two_and_three_bit_experts_need_humming(tmp_path, scheme):
    msg = _refused(_cfg(tmp_path / "o", scheme, ["moe"]),
                   r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]: vLLM .* int experts only through its optional "
                   r"Humming kernels")
    assert "--allow-humming" in msg
    _cfg(tmp_path / "h", scheme, ["moe"], allow_humming=True).check()        # acknowledged
    _cfg(tmp_path / "l", scheme, ["attn-linear"]).check()                     # linears: not Humming's


def test_four_bit_experts_need_nothing(tmp_path):
    _cfg(tmp_path / "o", "w4a16-g128", ["moe"]).check()
    _cfg(tmp_path / "p", "w8a8", ["attn-linear", "moe"]).check()


# ----------------------------------------------------------------------------- tensor parallel
def _layout(shape, spec):
    from amct_ext.export.tensor_parallel import LeafLayout
    from amct_ext.quant.schemes import TensorSpec

    return LeafLayout("x", "layers.0.x", shape, None if spec is None else TensorSpec.from_dict(spec))


G128 = {"format": "int", "bits": 4, "symmetric": False, "granularity": "group", "group_size": 128}
BLOCK = {"format": "fp8", "granularity": "block", "block_size": [128, 128]}


@pytest.mark.parametrize("shape,spec,dim,tp,fails", [
    ((4096, 2048), G128, "in", 16, False),          # 2048 / 16 = 128: whole groups
    ((4096, 2048), G128, "in", 32, True),           # 64 per rank: half a group
    ((4096, 3072), G128, "in", 16, True),           # 3072 % 128 == 0, yet 192 per rank is not
    ((4096, 3072), G128, "out", 16, False),         # groups run along the input dim only
    ((4096, 3072), None, "in", 16, False),          # a float weight splits anywhere N divides
    ((4096, 3072), None, "in", 5, True),            # ... and nowhere else
    ((3072, 4096), BLOCK, "out", 16, True),         # FP8 blocks bind the output dim too
    ((4096, 128), {"format": "mxfp8"}, "in", 4, False),  # 32 per rank: one MX block
    ((4096, 96), {"format": "mxfp8"}, "in", 2, True),    # 48 per rank: MX needs 32s
])
def test_shard_arithmetic(shape, spec, dim, tp, fails):
    from amct_ext.export.tensor_parallel import ShardRule, first_failure

    why = first_failure([_layout(shape, spec)], [ShardRule("x", dim, "src")], tp)
    assert (why is not None) == fails, why


def test_shard_failure_is_one_line_naming_tensor_dim_n_and_group():
    from amct_ext.export.tensor_parallel import ShardRule, first_failure

    why = first_failure([_layout((4096, 3072), G128)], [ShardRule("x", "in", "src.py")], 16)
    assert why == ("layers.0.x: input dim 3072 / --tensor-parallel 16 = 192 per rank, not a multiple of its "
                   "group 128 (src.py)")


def _config_dir(tmp_path: Path, name: str, **overrides) -> Path:
    """A folder holding only a released config.json (the TP check reads no weights); fewer routed
    experts, whose count changes no shape, keep the meta build quick."""
    d = tmp_path / name
    d.mkdir()
    c = json.loads((CONFIGS / f"deepseek-v4-{name}.config.json").read_text())
    c.update({"n_routed_experts": 8, **overrides})
    (d / "config.json").write_text(json.dumps(c))
    return d


def _expected(config: dict, group: int | None, tp_candidates=(1, 2, 4, 8, 16)) -> list[int]:
    """Independent oracle from the config alone: heads and output groups divide by N, and every
    split dim (wq_b / wo_a rows, wo_b columns, expert and shared-expert intermediate) holds whole groups."""
    inter = config["moe_intermediate_size"]
    split_in = [config["o_groups"] * config["o_lora_rank"], inter, inter * config["n_shared_experts"]]
    split_out = [config["num_attention_heads"] * config["head_dim"], config["o_groups"] * config["o_lora_rank"], inter]
    out = []
    for tp in tp_candidates:
        ok = config["num_attention_heads"] % tp == 0 and config["o_groups"] % tp == 0
        ok = ok and all(d % tp == 0 for d in split_in + split_out)
        ok = ok and (group is None or all((d // tp) % group == 0 for d in split_in))
        if ok:
            out.append(tp)
    return out


@pytest.mark.parametrize("name,scheme,group", [("flash", "w4a16-g128", 128), ("pro", "w4a16-g128", 128),
                                               ("pro", "w4a16", None)])
def test_servable_sizes_at_real_size(tmp_path, name, scheme, group):
    """V4-Flash / V4-Pro geometry: Pro's 3072-wide expert rows hold whole 128-groups up to TP 8
    only (192 per rank at 16), per-channel weights up to 16; Flash stops at 8 (o_groups 8)."""
    from amct_ext.quant.schemes import load_scheme
    from models.deepseek_v4.serving import servable_tp_sizes, vllm_profile

    model = _config_dir(tmp_path, name)
    cfg = types.SimpleNamespace(model_path=model, scheme=load_scheme(scheme), targets=["attn-linear", "moe"])
    got = servable_tp_sizes(cfg, vllm_profile())
    assert got == _expected(json.loads((model / "config.json").read_text()), group)
    assert got == {"flash": [1, 2, 4, 8], "pro": [1, 2, 4, 8] if group else [1, 2, 4, 8, 16]}[name]


def test_tensor_parallel_refused_before_anything_is_written(tmp_path, capsys):
    """tools/export.py --tensor-parallel N on a layout whose shards split groups: exit 2, one
    line naming the tensor, its dim, N and the group; nothing written."""
    from tools import export as export_tool

    from models.deepseek_v4.tiny import make_tiny_checkpoint

    # 4 heads, 4 output groups: TP 4 passes the head rules, the experts' 256-wide rows do not
    model = make_tiny_checkpoint(tmp_path / "m", n_shards=1, hidden_size=128, head_dim=64, q_lora_rank=128,
                                 o_lora_rank=128, o_groups=4, moe_intermediate_size=256)
    code = export_tool.main(["--model", "tiny", "--model-path", str(model), "--scheme", "w4a16-g128",
                             "--format", "compressed-tensors", "--out", str(tmp_path / "o"), "--device", "cpu",
                             "--quiet", "--tensor-parallel", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: --tensor-parallel 4: vLLM 0.33 (CUDA build) cannot shard this export: ")
    assert "layers.0.ffn.experts.0.w2: input dim 256 / --tensor-parallel 4 = 64 per rank, not a multiple of " \
           "its group 128" in err[0]
    assert err[0].endswith("servable sizes: 1, 2")
    assert not (tmp_path / "o").exists()


def test_tensor_parallel_heads_rule_and_metadata(tmp_path):
    """The tiny asset (4 heads, 2 output groups, wo_b 2 x 64 = 128 wide): per-channel w8a8 serves
    at TP 1 and 2 (4 refused on o_groups); w4a16-g128 only at 1 (wo_b's 128 columns are one
    group). --tensor-parallel is recorded with the sizes."""
    from amct_ext.export.exporter import export_checkpoint

    _refused(_cfg(tmp_path / "r", "w8a8", tensor_parallel=4),
             r"^--tensor-parallel 4: vLLM .*config o_groups 2 does not divide by --tensor-parallel 4")
    _refused(_cfg(tmp_path / "g", "w4a16-g128", tensor_parallel=2),
             r"layers\.0\.attn\.wo_b: input dim 128 / --tensor-parallel 2 = 64 per rank, not a multiple of its "
             r"group 128 .*servable sizes: 1$")
    export_checkpoint(_cfg(tmp_path / "o", "w8a8", tensor_parallel=2))
    serving = json.loads((tmp_path / "o" / "config.json").read_text())["amct_export"]["serving"]
    assert serving == {"build": "gpu", "served_weight_only": [], "tensor_parallel_checked": 2,
                       "tensor_parallel_sizes": [1, 2]}
    export_checkpoint(_cfg(tmp_path / "w4", "w4a16-g128"))
    serving = json.loads((tmp_path / "w4" / "config.json").read_text())["amct_export"]["serving"]
    assert serving["tensor_parallel_checked"] is None and serving["tensor_parallel_sizes"] == [1]


def test_tensor_parallel_flag_values_refused_in_one_line():
    from amct_ext.export.engine import ServeOptions

    for bad in (0, -2, 1.5, True):
        with pytest.raises(AmctError, match=r"--tensor-parallel .*: must be an integer in \[1, 1024\]"):
            ServeOptions(tensor_parallel=bad)
    with pytest.raises(AmctError, match="--vllm-build 'tpu' is unknown"):
        ServeOptions(build="tpu")


# ----------------------------------------------------------------------------- vllm-ascend
def test_ascend_w4a8_experts_divide_sixteen_scale_bias_slices():
    """vllm-ascend's W4A8_DYNAMIC experts keep w2's scale_bias as 16 // TP slices per rank."""
    from amct_ext.quant.schemes import load_scheme
    from models.deepseek_v4.serving_ascend import w4a8_moe_tp

    w4a8_pc = load_scheme({"name": "w4a8-pc", "weight": {"format": "int", "bits": 4, "symmetric": True,
                                                         "granularity": "channel"},
                           "input": {"format": "int", "bits": 8, "symmetric": True, "granularity": "token",
                                     "dynamic": True}})
    cfg = types.SimpleNamespace(scheme=w4a8_pc, targets=["attn-linear", "moe"])
    assert [tp for tp in (1, 2, 3, 4, 6, 8, 16, 32) if w4a8_moe_tp(cfg, None, tp) is None] == [1, 2, 4, 8, 16]
    assert "w4a8.py" in w4a8_moe_tp(cfg, None, 32)
    w8 = types.SimpleNamespace(scheme=load_scheme("w8a8"), targets=["attn-linear", "moe"])
    assert w4a8_moe_tp(w8, None, 32) is None                     # W8A8_DYNAMIC experts: no such slices


def test_ascend_profile_checks_heads_and_groups(tmp_path):
    from amct_ext.quant.schemes import load_scheme
    from models.deepseek_v4.serving import servable_tp_sizes
    from models.deepseek_v4.serving_ascend import vllm_ascend_profile

    model = _config_dir(tmp_path, "flash")
    cfg = types.SimpleNamespace(model_path=model, scheme=load_scheme("w8a8"), targets=["attn-linear", "moe"])
    assert servable_tp_sizes(cfg, vllm_ascend_profile()) == [1, 2, 4, 8]      # o_groups 8
