"""How vllm-ascend builds and loads DeepSeek-V4 from a ModelSlim v1 ("ascend") checkpoint.

Read from ``vllm-project/vllm-ascend`` at commit 182b75e (2026-08-22), Atlas A2 / A3 devices
(910B / 910C; the A5 = Ascend 950 paths differ where noted). Paths are relative to
``vllm_ascend/``; ``model.py`` / ``mtp.py`` / ``compressor.py`` / ``indexer.py`` live in
``models/deepseek_v4/``. casebook/vllm-ascend.md has the prose.

One rule per leaf (the module owning one exported weight, named relative to its decoder block:
``attn.wq_a``, ``ffn.experts.3.w1``); first full match wins:

- ``built``: "quant" -- built with the checkpoint's quant config, so vllm-ascend looks the module up
  in quant_model_description.json (a missing entry is a KeyError, modelslim_config.py:469);
  "float" -- built with ``quant_config=None``: a plain float ``weight`` and nothing else (no
  description lookup; a ``weight_scale`` beside it has no parameter: KeyError in load_weights,
  model.py:1256);
- ``types``: the description types its kernels run there (FLOAT always means the unquantized
  method, modelslim_config.py:802). A module whose kernel consumes the raw ``.weight`` with no
  scale runs FLOAT only, whatever the quant config says.

The exporter (amct_ext/export/ascend.py) writes a leaf quantized only when its type is allowed
here; otherwise as a float weight (the exact fake-quant weight when the run quantized it
weight-only), and refuses when the run also quantized the leaf's input (that would be served
in bf16: not what the run evaluated). tests/test_vllm_ascend_mapping.py replays the loader on the
export independently of this table.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

ENGINE = "vllm-ascend (182b75e, A2/A3)"
W8A8, W4A8, FLOAT = "W8A8_DYNAMIC", "W4A8_DYNAMIC", "FLOAT"


@dataclass(frozen=True)
class AscendLeafRule:
    pattern: str            # leaf name relative to the block, full match
    built: str              # "quant" | "float"
    types: frozenset[str]   # description types vllm-ascend runs there
    source: str             # vllm_ascend file:line
    why: str = ""           # why only FLOAT, when it is

    def matches(self, leaf: str) -> bool:
        return re.fullmatch(self.pattern, leaf) is not None


_LINEAR = frozenset({FLOAT, W8A8})          # (W8A8_DYNAMIC, 'linear'): methods/w8a8_dynamic.py:51
_MOE = frozenset({FLOAT, W8A8, W4A8})       # (.., 'moe'): methods/w8a8_dynamic.py:165, methods/w4a8.py:36

RULES: tuple[AscendLeafRule, ...] = (
    AscendLeafRule(r"attn\.(wq_a|wq_b|wkv)", "quant", _LINEAR, "model.py:474-500; attention/dsa_v1.py:1244-1296"),
    AscendLeafRule(r"attn\.wo_a", "quant", frozenset({FLOAT}), "model.py:503-509; attention/dsa_v1.py:1172-1180",
                   "runs wo_a as a bf16 batch matmul of wo_a.weight with scale=None (npu_transpose_batchmatmul); "
                   "only A5 takes an FP8-MX wo_a"),
    AscendLeafRule(r"attn\.wo_b", "quant", _LINEAR, "model.py:511-517; attention/dsa_v1.py:1181"),
    AscendLeafRule(r"attn\.(indexer\.)?compressor\.(wkv|wgate)", "quant", frozenset({FLOAT}),
                   "compressor.py:125-139,212-216",
                   "passes compressor.wkv/wgate.weight to the fused compressor kernel with no scale"),
    AscendLeafRule(r"attn\.indexer\.wq_b", "quant", _LINEAR, "indexer.py:270-276,438-476"),
    AscendLeafRule(r"attn\.indexer\.weights_proj", "float", frozenset({FLOAT}), "indexer.py:284-290",
                   "builds indexer.weights_proj with quant_config=None"),
    AscendLeafRule(r"ffn\.gate", "float", frozenset({FLOAT}), "model.py:279-281",
                   "builds the router gate with quant_config=None"),
    # w1 / w3 load into one MergedColumnParallelLinear gate_up_proj (model.py:220-227,
    # modelslim_config.py:143-146): both shards must carry the same type (modelslim_config.py:455-462)
    AscendLeafRule(r"ffn\.shared_experts\.w[123]", "quant", _LINEAR, "model.py:301-313,220-236",
                   "has no W4A8_DYNAMIC method for a linear (methods/registry.py: W4A8_DYNAMIC is 'moe' only)"),
    # the routed experts are one FusedMoE; its type is expert 0's w1 / w3 / w2 (the packed mapping
    # 'experts' -> experts.0.gate_proj/up_proj/down_proj, modelslim_config.py:143-146,452-462)
    AscendLeafRule(r"ffn\.experts\.\d+\.w[123]", "quant", _MOE, "model.py:335-354; methods/w4a8.py:114-127"),
)


def rule_for(leaf: str) -> AscendLeafRule | None:
    return next((r for r in RULES if r.matches(leaf)), None)


#: the W4A8_DYNAMIC MoE method refuses a description with group_size > 0 (methods/w4a8.py:114-127)
W4A8_PER_CHANNEL_ONLY = "methods/w4a8.py:114-127"
#: the V4 renaming of description keys (attn -> self_attn, w1 -> gate_proj, ...) runs only when the
#: description has 'hc_head_fn' (modelslim_config.py:966); without it every lookup by vLLM name misses
DESCRIPTION_NEEDS = ("hc_head_fn",)
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
