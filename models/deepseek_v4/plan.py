"""What the job plan (``amct_ext.pipeline.job``) needs to know about DeepSeek-V4, answered from
config.json, the checkpoint index and meta-device skeletons -- no tensor data is read.

The framework asks; this module answers (``DeepseekV4PlanSpec``):
- ``read_config``: config.json with every field that changes the computation present
  (``adapter.REQUIRED_CONFIG_FIELDS``: a missing one is refused, never filled with another
  model's value);
- ``check_checkpoint``: every key of every layer and of the stem in the index, every shard
  file present;
- ``check_scheme``: every targeted weight's shape against the scheme (group size divides...),
  the error naming the module;
- ``unit_stems``: the parameter files a finished layer has (export refuses incomplete layers);
- ``unexportable_smoothing`` / ``planned_params``: smoothing pairs whose result (``up_limit``) the
  serving engines cannot represent, as the unit parameters the exporter's check refuses.

Layers of one kind (compress ratio, hash or score routing) share their structure, so one meta
skeleton per kind serves every layer of that kind (V4-Flash: 43 layers, 4 kinds, ~1 s).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

from amct_ext.errors import AmctError, CheckpointError, QuantConfigError


#: The default recipes from the release (issue 35.3), where they differ from the bf16 testbed's
#: (amct_ext/algorithms/recipe.py DEFAULT_RECIPES). Chosen by that file's rule on the release testbed
#: (tiny-trained-release: whole test split, mean over calibration seeds 0-2, one AMD CPU; runs in
#: benchmarks/results/release-testbed-w8a8.json):
#: - w8a8: gptq:sequential=false 302.844 against RTN 302.876 (hclip 302.864, smoothquant on the
#:   exportable pairs 302.874); from bf16 weights RTN stays ahead (303.844 against GPTQ's 303.854).
#:   Every gap is inside the seed spread (0.03 %); 16.8 s a V4-Flash layer (H200, RESULTS §2).
RELEASE_DEFAULTS: dict[str, tuple[str, str]] = {"w8a8": ("gptq:sequential=false", "float")}


def _kind(config, i: int) -> tuple[int, bool]:
    """Layers of one kind have the same tensors (names relative to the layer) and shapes."""
    return int(config.compress_ratios[i]), i < int(config.n_hash_layers)


class DeepseekV4PlanSpec:
    """The DeepSeek-V4 answers to the plan's questions (see the module docstring)."""

    name = "DeepSeek-V4"

    def __init__(self) -> None:
        self._keys_of_kind: dict[tuple[int, bool], list[str]] = {}

    # ------------------------------------------------------------------ config
    def read_config(self, model_path: Path):
        from .adapter import check_config_fields
        from .loading import load_config

        from .routing_table import check_hash_routing

        check_config_fields(model_path)
        config = load_config(model_path)
        check_hash_routing(Path(model_path), config)   # an expert id out of range: named now, not in a forward
        return config

    def n_layers(self, config) -> int:
        return int(config.n_layers)

    # ------------------------------------------------------------------ the weights' source
    def source_defaults(self, model_path: Path) -> tuple[str, dict[str, tuple[str, str]]]:
        """(what the weights are, {built-in scheme: (algo, propagate)}): the default recipes that
        differ for a released checkpoint (FP8 e4m3 blocks on the attention and shared expert, FP4
        experts: ``quantization_config.quant_method`` "fp8"), else ("", {}). Reads config.json
        only; an unreadable one gives ("", {}) here and is named by ``read_config`` in its turn."""
        try:
            cfg = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
            method = (cfg.get("quantization_config") or {}).get("quant_method")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError, RecursionError):
            return "", {}
        return ("released FP8 / FP4 weights", dict(RELEASE_DEFAULTS)) if method == "fp8" else ("", {})

    # ------------------------------------------------------------------ meta skeletons
    def _representatives(self, config, layers: Sequence[int]) -> dict[tuple[int, bool], int]:
        reps: dict[tuple[int, bool], int] = {}
        for i in layers:
            reps.setdefault(_kind(config, i), i)
        return reps

    def _keys(self, config, i: int) -> list[str]:
        """Checkpoint names of layer ``i``'s tensors (relative to ``layers.{i}.``)."""
        from .loading import empty_block

        kind = _kind(config, i)
        if kind not in self._keys_of_kind:
            self._keys_of_kind[kind] = list(empty_block(config, i, torch.bfloat16).state_dict())
        return self._keys_of_kind[kind]

    def _quantized_meta_block(self, config, i: int, scheme, targets: Sequence[str]):
        from . import quant_module
        from .loading import empty_block

        block = empty_block(config, i, torch.bfloat16)
        quant_module.quantize_block(block, scheme, list(targets))
        return block

    # ------------------------------------------------------------------ checkpoint
    def check_checkpoint(self, model_path: Path, config) -> dict[str, Any]:
        """Index against the skeleton: every layer's and the stem's keys, every shard present."""
        from amct_ext.export.readback import group_parts
        from amct_ext.io.checkpoint import CheckpointReader
        from amct_ext.pipeline.plan_checks import check_checkpoint_headers

        from .loading import TOP_LEVEL_PREFIXES

        reader = CheckpointReader(model_path)   # the index only (single-file: its header)
        try:
            keys = reader.keys()
            where = reader.index_path or (Path(model_path) / "model.safetensors")
            logical = set(keys) | set(group_parts(keys))
            for shard in sorted(set(reader.weight_map.values())):
                if not (reader.root / shard).is_file():
                    key = next(k for k, s in reader.weight_map.items() if s == shard)
                    raise CheckpointError(f"{where}: shard file {shard!r} (holding {key!r} and others) is missing")
            for prefix in TOP_LEVEL_PREFIXES:
                if not any(k.startswith(prefix) for k in keys):
                    raise CheckpointError(f"{where}: no key under {prefix!r} (the embedding / head / final norm)")
            n = self.n_layers(config)
            for i in range(n):
                missing = [f"layers.{i}.{k}" for k in self._keys(config, i) if f"layers.{i}.{k}" not in logical]
                if missing:
                    more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
                    raise CheckpointError(f"{where}: layer {i} lacks key {missing[0]!r}{more}; the checkpoint is "
                                          "incomplete (re-download it)")
            # every shard's header (no data): dtypes, shapes, scales, keys in their shards, file sizes
            checked = check_checkpoint_headers(reader, self.expected_tensors(config, exported=set(group_parts(keys))),
                                               str(where))
            return {"keys": len(keys), "shards": len(set(reader.weight_map.values())), "layers": n,
                    "checkpoint_layers": len(reader.layer_indices()), "headers_checked": checked}
        finally:
            reader.close()

    def expected_tensors(self, config, exported: set[str] = frozenset()) -> dict[str, tuple]:
        """{checkpoint key: (shape, dtype)} of the stem and every layer, from meta skeletons (one
        per layer kind); the logical names of an export's grouped parts (``exported``) are left
        out (their storage is the export's, read back by ``export.readback``)."""
        import copy

        from .loading import build_skeleton, empty_block

        stem_cfg = copy.copy(config)
        stem_cfg.n_layers = 0      # the stem alone: embed, norm, head, hc_head_*
        out = {k: (tuple(t.shape), t.dtype) for k, t in build_skeleton(stem_cfg).state_dict().items()}
        by_kind: dict[tuple[int, bool], dict[str, tuple]] = {}
        for i in range(self.n_layers(config)):
            kind = _kind(config, i)
            if kind not in by_kind:
                by_kind[kind] = {k: (tuple(t.shape), t.dtype) for k, t in empty_block(config, i).state_dict().items()}
            out.update({f"layers.{i}.{k}": v for k, v in by_kind[kind].items()})
        return {k: v for k, v in out.items() if k not in exported}

    # ------------------------------------------------------------------ scheme x shapes
    def check_scheme(self, config, scheme, targets: Sequence[str], layers: Sequence[int]) -> dict[int, int]:
        """Every targeted weight of one layer per kind against the scheme; returns
        {layer: units} for ``layers``."""
        from . import quant_module

        units_of_kind: dict[tuple[int, bool], int] = {}
        for kind, i in self._representatives(config, layers).items():
            try:
                block = self._quantized_meta_block(config, i, scheme, targets)
            except AmctError as e:
                raise QuantConfigError(self._shape_misfit(config, i, scheme, targets) or f"--scheme {scheme.name}: {e}"
                                       ) from None
            units_of_kind[kind] = len(list(quant_module.iter_block_ptq_units(block, i, list(targets))))
        return {i: units_of_kind[_kind(config, i)] for i in layers}

    def hidden_values_per_token(self, config) -> int:
        """Values one token's hidden state holds between layers (hc_mult streams of dim): the
        plan's calibration-memory cap (amct_ext/pipeline/size_caps.py)."""
        return int(config.hc_mult) * int(config.dim)

    def quantized_weight_numel(self, config, scheme, targets: Sequence[str], layers: Sequence[int]) -> dict[int, int]:
        """{bits: elements} of every weight the scheme quantizes in ``layers`` (one meta skeleton
        per layer kind): what the plan's output-size estimate counts (amct_ext/io/output_space.py)."""
        from amct_ext.quant.quant_linear import QuantLinear

        of_kind: dict[tuple[int, bool], dict[int, int]] = {}
        total: dict[int, int] = {}
        for i in layers:
            kind = _kind(config, i)
            if kind not in of_kind:
                counts: dict[int, int] = {}
                for m in self._quantized_meta_block(config, i, scheme, targets).modules():
                    spec = m.weight_quantizer.spec if isinstance(m, QuantLinear) else None
                    if spec is not None:
                        counts[int(spec.bits)] = counts.get(int(spec.bits), 0) + m.weight.numel()
                of_kind[kind] = counts
            for bits, n in of_kind[kind].items():
                total[bits] = total.get(bits, 0) + n
        return total

    @staticmethod
    def _shape_misfit(config, i: int, scheme, targets: Sequence[str]) -> str | None:
        """The first targeted linear of layer ``i`` whose weight shape the scheme cannot take,
        as one line naming it (quantize_block's own error names no module)."""
        from amct_ext.quant import formats

        from .loading import empty_block

        block = empty_block(config, i, torch.bfloat16)
        owners = {"attn-linear": "attn.", "moe": "ffn."}
        for target, prefix in owners.items():
            ts = scheme.target(target) if target in targets else None
            spec = ts.weight if ts is not None else None
            if spec is None:
                continue
            for name, mod in block.named_modules():
                if name.startswith(prefix) and isinstance(mod, torch.nn.Linear):
                    try:
                        formats.scale_shape(mod.weight.shape, spec)
                    except AmctError as e:
                        return (f"--scheme {scheme.name} (target {target}) does not fit "
                                f"layers.{i}.{name}.weight {list(mod.weight.shape)}: {e}")
        return None

    def unit_stems(self, config, scheme, targets: Sequence[str], layers: Sequence[int]) -> dict[int, list[str]]:
        """{layer: the file stems of its units} (``ptq_params/{stem}.pt``)."""
        from . import quant_module

        by_kind: dict[tuple[int, bool], tuple[int, list[str]]] = {}
        out = {}
        for i in layers:
            kind = _kind(config, i)
            if kind not in by_kind:
                block = self._quantized_meta_block(config, i, scheme, targets)
                by_kind[kind] = (i, [u.file_stem for u in quant_module.iter_block_ptq_units(block, i, list(targets))])
            rep, stems = by_kind[kind]
            old, new = f"layer_{rep}_", f"layer_{i}_"
            out[i] = [new + s[len(old):] for s in stems]
        return out

    # ------------------------------------------------------------------ the run
    def adapter(self, run):
        """The adapter the job runs (``amct_ext.pipeline.job_runner.run_job`` opens it with the
        plan's ``RunConfig``)."""
        from .adapter import DeepseekV4Adapter

        return DeepseekV4Adapter(run)

    # ------------------------------------------------------------------ smoothing
    def unexportable_smoothing(self, config, targets: Sequence[str]) -> dict[str, str]:
        """{pair name: what it leaves behind} for smoothing pairs no export format writes."""
        if "moe" in targets and float(config.swiglu_limit) > 0:
            return {"w3": f"a per-channel SwiGLU limit (up_limit) on every expert instead of the scalar "
                          f"swiglu_limit {config.swiglu_limit:g}"}
        return {}

    def planned_params(self, config, targets: Sequence[str], recipe) -> list[str]:
        """Unit parameter names the recipe will save that an export may not represent, for the
        exporter's own ``ExportConfig.check(planned_params)`` (``serving.PAIR_PARAMS``)."""
        from amct_ext.algorithms.smoothing import pair_names

        from .serving import PAIR_PARAMS

        risky = self.unexportable_smoothing(config, targets)
        out: list[str] = []
        for algo in (recipe.algorithms if recipe is not None else []):
            pairs = getattr(algo, "pairs", None)
            if isinstance(pairs, str):
                out += [PAIR_PARAMS[p] for p in pair_names(pairs) if p in PAIR_PARAMS and p in risky]
        return sorted(set(out))
