"""The export as a library call: ``export_run(ExportRequest(...))`` (tools/export.py and
tools/run_ptq.py --export both call it; neither builds the other's argv).

Before any layer is written it checks:
- the run folder (``--from``): scheme, targets, model (``exporter.resolve_run``);
- format x scheme x targets (``ExportConfig.check``, the exporter's own rules);
- what the format's engine cannot serve, saved unit parameters included (``up_limit``);
- that the run's layers are complete (issue 25.2): a layer counts as done when every unit of it
  has its parameter file, not when any has. The run's layer range is read from
  ``ptq_params/layers.json`` (written by tools/run_ptq.py); a layer of that range that is not
  complete, or any layer with some but not all units, is refused unless ``allow_partial``, which
  exports those layers float and says which.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import ConfigError

#: ptq_params/layers.json: the run's layer range and each layer's completion (tools/run_ptq.py).
#: A file of its own beside meta.json, which is the resume fingerprint compared field by field.
LAYERS_RECORD = "layers.json"


@dataclass
class ExportRequest:
    model_path: Path
    format: str
    out_dir: Path
    from_dir: Path | None = None      # a run_ptq output folder; None: plain RTN of ``scheme``
    scheme: str | None = None
    targets: str | None = None
    dequantize_rest: bool = False
    overwrite: bool = False
    device: str = "auto"
    dtype: str | None = None          # None: the run's dtype (meta.json), else bf16
    progress: bool = False
    allow_partial: bool = False
    #: the engine build and explicit serving choices (``engine.ServeOptions``; None: the default build)
    serve: Any = None


# ----------------------------------------------------------------------------- layer completion
def read_layers_record(params_dir: Path) -> dict[str, Any] | None:
    p = Path(params_dir) / LAYERS_RECORD
    if not p.is_file():
        return None
    try:
        rec = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: unreadable ({e}); rerun the same run_ptq command to rewrite it") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("range"), list) or len(rec["range"]) != 2:
        raise ConfigError(f"{p}: expected {{\"range\": [start, end], ...}}")
    return rec


def layer_completion(params_dir: Path, stems: dict[int, list[str]]) -> dict[int, int]:
    """{layer: how many of its units have their .pt} for every layer of ``stems``."""
    have = {p.stem for p in Path(params_dir).glob("layer_*.pt")}
    return {i: sum(s in have for s in st) for i, st in stems.items()}


def write_layers_record(params_dir: Path, layers: range, stems: dict[int, list[str]]) -> dict[str, Any]:
    """Record the run's range (merged with an earlier record: a resumed run may cover more) and
    which layers are complete now."""
    from ..io.io_utils import atomic_write_json

    old = read_layers_record(params_dir)
    lo, hi = layers.start, layers.stop
    if old is not None:
        lo, hi = min(lo, int(old["range"][0])), max(hi, int(old["range"][1]))
    done = layer_completion(params_dir, {i: s for i, s in stems.items()})
    rec = {"range": [lo, hi], "units": {str(i): len(s) for i, s in stems.items()},
           "complete": sorted(i for i, n in done.items() if n == len(stems[i]))}
    if old is not None:
        rec["units"] = {**old.get("units", {}), **rec["units"]}
        rec["complete"] = sorted(set(rec["complete"]) | {i for i in old.get("complete", [])
                                                          if i not in stems})
    atomic_write_json(rec, Path(params_dir) / LAYERS_RECORD)
    return rec


def check_run_layers(params_dir: Path, n_layers: int, stems_of: Callable[[Sequence[int]], dict[int, list[str]]],
                     allow_partial: bool, say: Callable[[str], None] = print) -> list[int]:
    """The layers to export quantized; refuses an incomplete run (see the module docstring)."""
    stems = stems_of(range(n_layers))
    done = layer_completion(params_dir, stems)
    rec = read_layers_record(params_dir)
    complete = [i for i in range(n_layers) if stems[i] and done[i] == len(stems[i])]
    started = [i for i in range(n_layers) if 0 < done[i] < len(stems[i])]
    if rec is not None:
        wanted = range(int(rec["range"][0]), int(rec["range"][1]))
        where = f"the run's layers [{wanted.start}, {wanted.stop}) ({params_dir / LAYERS_RECORD})"
    else:   # a run without the record (library call, older version): its layers are those it began
        wanted = [i for i in range(n_layers) if done[i]]
        where = "the layers the run began"
    missing = sorted(set(i for i in wanted if i not in complete) | set(started))
    if missing:
        detail = ", ".join(f"layer {i}: {done[i]} of {len(stems[i])} units" for i in missing[:4])
        more = f" (+{len(missing) - 4} more)" if len(missing) > 4 else ""
        if not allow_partial:
            raise ConfigError(f"--from {Path(params_dir).parent}: {len(missing)} of {where} are incomplete "
                              f"({detail}{more}); rerun the same run_ptq command to finish them, or pass "
                              "--allow-partial to export them float")
        say(f"export: --allow-partial: layers {', '.join(map(str, missing))} are incomplete and stay float")
    floats = [i for i in range(n_layers) if i not in complete]
    if floats and not missing:
        say(f"export: layers {', '.join(map(str, floats))} were not part of the run and stay float")
    return complete


# ----------------------------------------------------------------------------- the export
def export_config(req: ExportRequest, say: Callable[[str], None] = print):
    """The checked ``ExportConfig`` of ``req`` (nothing written)."""
    import torch

    from ..base import model_binding
    from ..quant.schemes import load_scheme, parse_targets
    from ..pipeline.plan_checks import check_checkpoint_links
    from ..pipeline.run_folder import RunFolder
    from .exporter import ExportConfig, resolve_run

    check_checkpoint_links(Path(req.model_path))   # no side file copied through a link out of it

    spec = model_binding(Path(req.model_path)).plan_spec()   # the model's plan answers (config, unit stems)
    config = spec.read_config(Path(req.model_path))
    dtype_name = req.dtype or "bf16"
    layers = None
    if req.from_dir:
        scheme, targets, pdir = resolve_run(req.from_dir, Path(req.model_path), req.scheme, req.targets)
        meta = RunFolder.of_params(pdir).require_meta()
        if req.dtype is None and meta.get("dtype") in ("bf16", "fp32"):
            dtype_name = meta["dtype"]
    else:
        scheme = load_scheme(req.scheme or "w8a8")
        targets, pdir = parse_targets(req.targets or "attn-linear,moe"), None
    cfg = ExportConfig(model_path=Path(req.model_path), out_dir=Path(req.out_dir), format=req.format, scheme=scheme,
                       targets=targets, params_dir=pdir, dequantize_rest=req.dequantize_rest,
                       overwrite=req.overwrite, device=req.device,
                       dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name], progress=req.progress,
                       **({} if req.serve is None else {"serve": req.serve}))
    cfg.check()
    from ..io import output_space as room   # writable --out with the free space for the export

    room.check_output_room(cfg.out_dir, "--out", room.export_bytes(
        room.checkpoint_bytes(req.model_path), req.dequantize_rest or req.format == "ascend"),
        f"the {req.format} export", already=[cfg.out_dir])
    if pdir is not None:   # (saved parameters an engine cannot represent: ExportConfig.check)
        layers = check_run_layers(pdir, spec.n_layers(config),
                                  lambda ls: spec.unit_stems(config, scheme, cfg.targets, ls),
                                  req.allow_partial, say)
    cfg.layers = layers
    return cfg


def export_run(req: ExportRequest, allow_distributed: bool = True) -> dict[str, Any]:
    """Check, then export; under torchrun (``allow_distributed``) the layers are spread over the
    ranks. Returns the ExportReport as a dict."""
    from ..pipeline import distributed
    from .exporter import export_checkpoint, export_checkpoint_distributed

    dist = distributed.env_from() if allow_distributed else None
    cfg = export_config(req, say=(lambda s: print(s, flush=True)) if dist is None or dist.is_main
                        else (lambda s: None))
    if dist is None:
        return dict(export_checkpoint(cfg).__dict__)
    dist = distributed.init(dist, req.device)
    distributed.install_stop_handler(dist)
    cfg.device = str(dist.device)
    ok = False
    try:
        report = export_checkpoint_distributed(cfg, dist)
        ok = True
    finally:
        distributed.shutdown(ok)
    return dict(report.__dict__)


__all__ = ["ExportRequest", "export_config", "export_run", "check_run_layers", "write_layers_record",
           "read_layers_record", "layer_completion", "LAYERS_RECORD"]
