"""The export formats as objects: each knows its own rules.

An export writes one of two layouts: compressed-tensors (vLLM) or Ascend ModelSlim v1
(vllm-ascend). Where the two differ -- the scheme each can describe, how a quantized weight is
encoded, whether released FP8 / FP4 tensors are decoded, the file names, the side files, what
config.json says -- is a method or an attribute of an :class:`ExportFormat`, asked by the exporter
(``exporter.py``), the run's export step and the plan, instead of a test of the format's name.
The tensor encodings themselves stay plain functions in ``compressed_tensors.py`` / ``ascend.py``.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from abc import ABC, abstractmethod

import torch

from ..base import model_binding
from ..errors import ConfigError
from ..io.io_utils import atomic_write_json
from ..quant import formats
from ..quant.schemes import spec_targets
from . import ascend, compressed_tensors as ct


class ExportFormat(ABC):
    """One export layout. ``name``: the --format / --export value; ``shard_stem`` and
    ``index_name``: the weight files; ``decodes_released``: FP8 / FP4 tensors left as released
    are written decoded to bf16 (else as stored, unless --dequantize-rest)."""

    name = ""
    shard_stem = ""
    index_name = ""
    decodes_released = False

    @abstractmethod
    def check_scheme(self, scheme: Any, targets: Sequence[str]) -> None:
        """Refuse (one line) a scheme / targets the format cannot describe."""

    @abstractmethod
    def encode_weight(self, base: str, spec: Any, act: Any, exported: dict[str, torch.Tensor],
                      shape: tuple[int, ...], down_projection: bool = False
                      ) -> tuple[dict[str, torch.Tensor], str | None]:
        """A quantized leaf's tensors (``exported``: ``WeightQuantizer.export``) and its type
        for the description (None: the float type). ``down_projection``: the leaf is a gated
        MLP's down projection (``ModelBinding.gated_projections["down"]``)."""

    def released_tensor(self, key: str, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """A tensor copied as released, in the format's own storage (None in, None out: the
        tensor may be copied file to file when the format keeps it as is)."""
        return tensor

    def copies_raw(self, key: str) -> bool:
        """Whether a released tensor may go file to file, unchanged."""
        return True

    def adds_mtp_head(self) -> bool:
        """Whether an MTP layer needs its own head copied in (an engine that does not share
        the target's lm_head with the draft)."""
        return False

    @abstractmethod
    def write_description(self, out_dir: Path, src: dict[str, Any], cfg: Any, types: dict[str, str],
                          quantized_layers: Sequence[int], mtp_state: dict[str, str],
                          float_leaves: Sequence[str], n_layers: int, mx_weight_only: bool = False) -> list[str]:
        """The format's description of the quantization: side files in ``out_dir`` and the
        entries of the exported config.json (``src``, edited in place). ``mx_weight_only``: the
        MX schemes' activation quantization dropped from the description (what vLLM's CUDA build
        serves; --mx-weight-only). Returns the targets made weight-only."""

    def released_quantization_config(self, released: Any, dequantize_rest: bool) -> Any:
        """What config.json keeps of the release's own storage description."""
        return None if dequantize_rest else released

    def index_path(self, out_dir: Path) -> Path:
        return Path(out_dir) / self.index_name


class CompressedTensors(ExportFormat):
    """compressed-tensors tensors + ``quantization_config`` in config.json (vLLM)."""

    name = "compressed-tensors"
    shard_stem = "model"
    index_name = "model.safetensors.index.json"

    def check_scheme(self, scheme: Any, targets: Sequence[str]) -> None:
        ct.quantization_config(scheme, targets)  # raises on what it cannot describe

    def encode_weight(self, base, spec, act, exported, shape, down_projection=False):
        return ct.encode_weight(base, spec, act, exported, shape), None

    def write_description(self, out_dir, src, cfg, types, quantized_layers, mtp_state, float_leaves, n_layers,
                          mx_weight_only=False):
        float_layers = [i for i in range(n_layers) if i not in quantized_layers]
        float_layers += [n_layers + int(g.split(".")[1]) for g, how in mtp_state.items() if how == "copied"]
        model = model_binding(cfg.model_path)
        qc = ct.quantization_config(cfg.scheme, cfg.targets, float_layers, model.module_patterns,
                                    model.unquantized_modules)
        # an extra (draft) layer copied as released: every module under its group (``mtp.0``)
        qc["ignore"] += [rf"re:.*{re.escape(g)}\..*" for g, how in mtp_state.items() if how == "copied"]
        qc["ignore"] += ct.leaf_ignore_patterns(float_leaves)
        weight_only = ct.drop_mx_inputs(qc) if mx_weight_only else []
        src["quantization_config"] = qc
        if "moe" in cfg.targets or cfg.dequantize_rest:
            src["expert_dtype"] = None
        return weight_only


class AscendModelSlim(ExportFormat):
    """Ascend ModelSlim v1 tensors + ``quant_model_description.json`` (vllm-ascend): every
    released FP8 / FP4 tensor decoded, the integer tables the engine profile names as int32
    (``ascend.stores_int32``; V4's ``tid2eid``, as msModelSlim stores it), the MTP draft's own head."""

    name = "ascend"
    shard_stem = ascend.SHARD_STEM
    index_name = ascend.INDEX_NAME
    decodes_released = True

    def check_scheme(self, scheme: Any, targets: Sequence[str]) -> None:
        ascend.check_scheme(scheme, targets)

    def encode_weight(self, base, spec, act, exported, shape, down_projection=False):
        fq = formats.dequantize({("q" if k == "qweight" else k): v for k, v in exported.items()}, spec)
        return ascend.encode_weight(base, spec, act, exported, shape, fq, down_projection)

    def copies_raw(self, key: str) -> bool:
        return not ascend.stores_int32(key)

    def released_tensor(self, key, tensor):
        if tensor is not None and ascend.stores_int32(key):
            return tensor.to(torch.int32)   # as msModelSlim stores it
        return tensor

    def adds_mtp_head(self) -> bool:
        return True

    def write_description(self, out_dir, src, cfg, types, quantized_layers, mtp_state, float_leaves, n_layers,
                          mx_weight_only=False):
        desc = ascend.description(types, cfg.scheme, spec_targets(cfg.targets))
        atomic_write_json(desc, Path(out_dir) / ascend.DESCRIPTION_NAME)
        src["expert_dtype"] = None   # every FP4 / FP8 tensor was decoded or quantized
        return []

    def released_quantization_config(self, released, dequantize_rest):
        return None


_FORMATS: dict[str, ExportFormat] = {f.name: f for f in (CompressedTensors(), AscendModelSlim())}
#: the --format / --export values
FORMATS = tuple(_FORMATS)


def export_format(name: str) -> ExportFormat:
    """The format named ``name``; ConfigError naming the valid ones otherwise."""
    fmt = _FORMATS.get(name)
    if fmt is None:
        raise ConfigError(f"--format {name!r} is unknown; valid: {', '.join(FORMATS)}")
    return fmt


def finished_export(out_dir: Path) -> bool:
    """Whether ``out_dir`` holds a finished export of any format (its index is written last)."""
    return any(f.index_path(out_dir).is_file() for f in _FORMATS.values())


__all__ = ["ExportFormat", "CompressedTensors", "AscendModelSlim", "FORMATS", "export_format", "finished_export"]
