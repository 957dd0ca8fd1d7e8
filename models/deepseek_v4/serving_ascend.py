"""How vllm-ascend builds and loads DeepSeek-V4 from a ModelSlim v1 ("ascend") checkpoint.

Read from ``vllm-project/vllm-ascend`` at commit 182b75e (2026-08-22), Atlas A2 / A3 devices
(910B / 910C; the A5 = Ascend 950 paths differ where noted). Paths are relative to
``vllm_ascend/``; ``model.py`` / ``mtp.py`` / ``compressor.py`` / ``indexer.py`` live in
``models/deepseek_v4/``. casebook/vllm-ascend.md has the prose.

The rules are an ``amct_ext.export.engine.EngineProfile`` registered for the "ascend" export
format, one per leaf (the module owning one exported weight, named relative to its decoder block:
``attn.wq_a``, ``ffn.experts.3.w1``); first full match wins:

- quantized -- built with the checkpoint's quant config, so vllm-ascend looks the module up
  in quant_model_description.json (a missing entry is a KeyError, modelslim_config.py:469);
  "float" -- built with ``quant_config=None``: a plain float ``weight`` and nothing else (no
  description lookup; a ``weight_scale`` beside it has no parameter: KeyError in load_weights,
  model.py:1256);
- ``runs``: the description types its kernels run there (FLOAT always means the unquantized
  method, modelslim_config.py:802). A module whose kernel consumes the raw ``.weight`` with no
  scale runs FLOAT only, whatever the quant config says.

The exporter writes a leaf quantized only when its type is allowed here; otherwise as a float
weight (the exact fake-quant weight when the run quantized it weight-only), and refuses -- before
any layer is written (``serving.check_export``) -- when the leaf's input is quantized too (it would
be served in bf16: not what the run evaluated). Every ascend type quantizes the input, so for
``--format ascend`` a module the engine keeps float is either not selected by the targets
(``attn-linear`` leaves wo_a and the compressors out) or refused.
tests/test_vllm_ascend_mapping.py replays the loader on the export independently of this table.
"""
from __future__ import annotations

from functools import lru_cache

from amct_ext.export import engine
from amct_ext.quant.schemes import TensorSpec

ENGINE = "vllm-ascend (182b75e, A2/A3)"
W8A8, W4A8, FLOAT = "W8A8_DYNAMIC", "W4A8_DYNAMIC", "FLOAT"


def modelslim_type(weight: TensorSpec, act: TensorSpec | None) -> str | None:
    """The ModelSlim v1 type of a (weight, input) spec pair, None when it has none: symmetric int8
    per channel / int4 per channel or group weights with int8 per-token dynamic inputs."""
    int8_token = (act is not None and act.format == "int" and act.bits == 8 and act.symmetric
                  and act.granularity == "token" and act.dynamic)
    if not int8_token or weight.format != "int" or not weight.symmetric:
        return None
    if weight.bits == 8 and weight.granularity == "channel":
        return W8A8
    if weight.bits == 4 and weight.granularity in ("channel", "group"):
        return W4A8
    return None


def _runs(types: frozenset[str], why: str):
    """A FormatCheck: None when vllm-ascend runs the pair's type at the module, else why not."""
    def check(weight: TensorSpec, act: TensorSpec | None) -> str | None:
        typ = modelslim_type(weight, act)
        return None if typ in types else f"{why} (the run's is {typ or 'no ModelSlim type'})"
    return check


_LINEAR = frozenset({W8A8})          # (W8A8_DYNAMIC, 'linear'): methods/w8a8_dynamic.py:51
_MOE = frozenset({W8A8, W4A8})       # (.., 'moe'): methods/w8a8_dynamic.py:165, methods/w4a8.py:36
_NO_W4A8_LINEAR = "runs a linear only as W8A8_DYNAMIC (no W4A8_DYNAMIC 'linear' method, quantization/methods/registry)"
_RAW_WEIGHT = ("is built with the quant config but {what} consumes .weight with no scale, so it runs only "
               "FLOAT")


#: vllm-ascend's W4A8_DYNAMIC MoE (ModelSlim): w2_scale_bias is [E, hidden, 16 // tp_size] and
#: "The current weight does not support moe part tp>16." (expert parallel: tp_size counts as 1)
W4A8_TP_SOURCE = "quantization/methods/w4a8.py:123-131,194"
#: the attention's per-rank counts n_heads // tp, o_groups // tp; wq_b / wo_a ColumnParallelLinear
#: (wq_b replicated under DSA context parallel), wo_b RowParallelLinear; shared experts
#: MergedColumnParallelLinear gate_up / RowParallelLinear down; routed experts one FusedMoE
ATTN_TP_SOURCE = "models/deepseek_v4/model.py:458-465,484-517"
MOE_TP_SOURCE = "models/deepseek_v4/model.py:220-236,335-354 (FusedMoE: intermediate / TP)"


def w4a8_moe_tp(cfg, config, tp: int) -> str | None:
    """W4A8_DYNAMIC experts carry w2's scale_bias as 16 partial sums: a rank takes 16 / TP of them."""
    if "moe" not in cfg.targets:
        return None
    ts = cfg.scheme.target("moe")
    if ts.weight is None or modelslim_type(ts.weight, ts.input) != W4A8:
        return None
    if tp > 16 or 16 % tp:
        return (f"W4A8_DYNAMIC experts store w2's scale_bias as 16 slices, which --tensor-parallel {tp} "
                f"does not divide ({W4A8_TP_SOURCE}; --enable-expert-parallel takes the experts out of TP)")
    return None


def vllm_ascend_profile(options: engine.ServeOptions | None = None) -> engine.EngineProfile:
    """vllm-ascend's profile; of ``options`` only the tensor-parallel size applies."""
    tp = None if options is None else options.tensor_parallel
    return _vllm_ascend_profile(engine.ServeOptions(tensor_parallel=tp))


@lru_cache(maxsize=None)
def _vllm_ascend_profile(options: engine.ServeOptions) -> engine.EngineProfile:
    R = engine.LeafRule
    rules = (
        R(r"attn\.(wq_a|wq_b|wkv)", True, "models/deepseek_v4/model.py:474-500; attention/dsa_v1.py:1244-1296",
          runs=_runs(_LINEAR, _NO_W4A8_LINEAR)),
        R(r"attn\.wo_a", True, "models/deepseek_v4/model.py:503-509; attention/dsa_v1.py:1172-1180",
          runs=_runs(frozenset(), _RAW_WEIGHT.format(what="the A2/A3 o_proj batch matmul (npu_transpose_batchmatmul, "
                                                       "scale=None; only A5 takes an FP8-MX wo_a)")),
          note="FLOAT only on A2/A3"),
        R(r"attn\.wo_b", True, "models/deepseek_v4/model.py:511-517; attention/dsa_v1.py:1181",
          runs=_runs(_LINEAR, _NO_W4A8_LINEAR)),
        R(r"attn\.(indexer\.)?compressor\.(wkv|wgate)", True, "models/deepseek_v4/compressor.py:125-139,212-216",
          runs=_runs(frozenset(), _RAW_WEIGHT.format(what="the fused compressor kernel")),
          note="quant_config=None on A5; FLOAT only, but listed in the description (the lookup happens)"),
        R(r"attn\.indexer\.wq_b", True, "models/deepseek_v4/indexer.py:270-276,438-476",
          runs=_runs(_LINEAR, _NO_W4A8_LINEAR)),
        R(r"attn\.indexer\.weights_proj", False, "models/deepseek_v4/indexer.py:284-290"),
        R(r"ffn\.gate", False, "models/deepseek_v4/model.py:279-281"),
        # w1 / w3 load into one MergedColumnParallelLinear gate_up_proj (model.py:220-227,
        # modelslim_config.py:143-146): both shards must carry the same type (modelslim_config.py:455-462)
        R(r"ffn\.shared_experts\.w[123]", True, "models/deepseek_v4/model.py:301-313,220-236",
          runs=_runs(_LINEAR, _NO_W4A8_LINEAR)),
        # the routed experts are one FusedMoE; its type is expert 0's w1 / w3 / w2 (the packed mapping
        # 'experts' -> experts.0.gate_proj/up_proj/down_proj, modelslim_config.py:143-146,452-462)
        R(r"ffn\.experts\.\d+\.w[123]", True, "models/deepseek_v4/model.py:335-354; quantization/methods/w4a8.py:114-127",
          runs=_runs(_MOE, "runs routed experts as W8A8_DYNAMIC or per-channel W4A8_DYNAMIC")),
    )
    from .serving import AVOID_LIMIT_FLAG, heads_and_groups_divide, v4_shard_rules

    params = (
        engine.ParamRule(r"ffn\.(experts\.\d+|shared_experts)\.up_limit",
                         "clamps the SwiGLU with one scalar swiglu_limit (SiluAndMulWithClamp; the FusedMoE gets "
                         "the same scalar), not the per-channel limit that w3 -> w2 smoothing leaves",
                         AVOID_LIMIT_FLAG, "models/deepseek_v4/model.py:239-240,308,347"),
    )
    return engine.EngineProfile(
        engine=ENGINE, export_format="ascend", leaf_rules=rules, param_rules=params,
        flag="pass --quant-target attn-linear (the modules vllm-ascend quantizes) and int8 weights where it "
             "has no int4 method",
        default_quantized=False,
        notes=("FLOAT modules are listed as FLOAT in quant_model_description.json",),
        facts={"ENGINE": ENGINE, "W4A8_PER_CHANNEL_ONLY": W4A8_PER_CHANNEL_ONLY,
               "DESCRIPTION_NEEDS": DESCRIPTION_NEEDS, "CACHE_SOURCE": CACHE_SOURCE,
               "INT32_TENSORS": INT32_TENSORS},
        tp_rules=v4_shard_rules(ATTN_TP_SOURCE, MOE_TP_SOURCE, "per-rank slices of the weight and its scales"),
        tp_checks=(heads_and_groups_divide(ATTN_TP_SOURCE), w4a8_moe_tp),
        options=options)


engine.register_profile("ascend", vllm_ascend_profile)

#: the W4A8_DYNAMIC MoE method refuses a description with group_size > 0 (methods/w4a8.py:114-127)
W4A8_PER_CHANNEL_ONLY = "methods/w4a8.py:114-127"
#: the V4 renaming of description keys (attn -> self_attn, w1 -> gate_proj, ...) runs only when the
#: description has 'hc_head_fn' (modelslim_config.py:966); without it every lookup by vLLM name misses
DESCRIPTION_NEEDS = ("hc_head_fn",)
#: released integer tables the ModelSlim layout holds as int32: the hash router's token -> expert
#: table, int64 in the release, int32 in msModelSlim 26.1's own output (tests/data/msmodelslim-26.1-tiny-v4)
INT32_TENSORS = ("tid2eid",)
#: the DSA attention caches are bf16 on A2/A3 (model.py:589-590); the C8 path is keyed on
#: '*.k_proj.kv_cache_scale' tensors (modelslim_config.py:1042-1052), which V4 does not have
CACHE_SOURCE = "model.py:589-590; quantization/modelslim_config.py:1042-1052"
#: the MTP draft's shared head is its own ParallelLMHead loaded from 'mtp.0.head.weight'
#: (mtp.py:44-49,319-320); vllm-ascend copies head.weight there only for the FP8 release
#: (mtp.py:290-295) and never shares the target's lm_head for method 'mtp'
#: (spec_decode/llm_base_proposer.py _maybe_share_lm_head)
MTP_HEAD_SOURCE = "models/deepseek_v4/mtp.py:44-49,290-295,319-320"
#: e_proj / h_proj are built with the quant config but no prefix (mtp.py:64-68): the lookup of
#: prefix '' is "skipped" as soon as any FLOAT '.weight' exists (modelslim_config.py:802), so
#: they are always float
MTP_PROJ_SOURCE = "models/deepseek_v4/mtp.py:64-68; quantization/modelslim_config.py:802"
