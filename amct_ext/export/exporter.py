"""Streamed export of a quantized DeepSeek-V4 checkpoint, one decoder layer at a time.

Per layer: build it from the release on the compute device (FP8 / FP4 decoded there), wrap it
for the scheme (``quantize_block``), load the run's unit parameters exactly as evaluation's
'ptq' mode does (``workflow.load_unit_params``) -- so whatever an algorithm learned (clip
factors, replaced weights, folded smoothing) is in the module -- then export each quantized
leaf's weight in the chosen format. Everything else is copied as released: a tensor the
parameters did not touch is read raw from the release (FP8 / FP4 stay FP8 / FP4 with their
scales unless ``dequantize_rest``); a tensor they did touch (a smoothed norm) is written from
the module. Host memory holds one layer's output tensors at a time.

The model's extra layers (``ModelBinding.extra_layers``; V4: the MTP layer ``mtp.{j}.*``) have
the decoder block's structure. When the binding builds one as a block (``build_extra_layer``:
the release has all of its block tensors) it is quantized with the same scheme: with the run's
parameters when the run calibrated it (a run that reaches the last layer does,
``workflow.run_blockwise_ptq(extra_layers=True)``), else RTN; otherwise (the tiny asset carries only
e_proj / h_proj / norms) every tensor of it is copied. It is never dropped.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..runtime import device as devmod
from ..io.checkpoint import QUANT_STORAGE, CheckpointReader
from ..errors import CheckpointError, ConfigError, DataError, QuantConfigError
from ..io.io_utils import atomic_write_json
from ..io.links import checked_file
from ..base import model_binding
from ..quant.quant_linear import QuantLinear
from ..quant.schemes import QuantScheme, load_scheme, parse_targets
from ..io.storage_formats import decode_fp4, decode_fp8_block
from ..pipeline.workflow import META_NAME, PARAMS_DIR, load_unit_params
from . import ascend, engine
from .export_format import FORMATS, export_format
from .writer import ShardedWriter

log = logging.getLogger(__name__)

EXPORT_KEY = "amct_export"
EXPORT_VERSION = 1
#: files copied from the source folder besides the weights and config.json
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
              "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


class ExportParamsError(ConfigError):
    """The parameters of --from belong to another scheme / model / checkpoint."""


@dataclass
class ExportConfig:
    model_path: Path
    out_dir: Path
    format: str
    scheme: QuantScheme
    targets: list[str]
    params_dir: Path | None = None      # OUTPUT/ptq_params of a run; None = RTN
    dequantize_rest: bool = False
    overwrite: bool = False
    device: str = "auto"
    dtype: torch.dtype = torch.bfloat16
    progress: bool = False
    #: follow the engine profile of the format (``engine.py``): modules the engine keeps float
    #: are written float, what it cannot serve is refused. False writes what the run did
    #: regardless (storage / this tool's own read-back only; recorded in config.json)
    serve_check: bool = True
    #: with params_dir: the decoder layers exported quantized, as checked complete by
    #: ``export.job.check_run_layers`` (None: every layer with any parameter file)
    layers: list[int] | None = None
    #: the engine build and the explicit choices the profile is built for (--vllm-build,
    #: --mx-weight-only, --allow-humming, --tensor-parallel)
    serve: engine.ServeOptions = field(default_factory=engine.ServeOptions)

    def engine_profile(self) -> engine.EngineProfile | None:
        """The profile of the engine that serves ``format``, or None (no profile / serve_check off)."""
        if not self.serve_check:
            return None
        model_binding(self.model_path)   # the model package is imported: its profiles are registered
        return engine.profile_for(self.format, self.serve)

    def check(self, planned_params: Sequence[str] = ()) -> None:
        """Every refusal the export can know before it writes anything: the format, the
        scheme, and what the format's engine would reject (``serving.check_export``). The plan
        of run_ptq.py --export calls this too, before the run: ``planned_params`` are the unit
        parameter names its recipe will save (e.g. ``up_limit`` when smoothing pair w3 runs on
        the experts; ``serving.PAIR_PARAMS``), checked like the saved ones of ``params_dir``."""
        if self.format not in FORMATS:
            raise ConfigError(f"--format {self.format!r} is unknown; valid: {', '.join(FORMATS)}")
        self.targets = self.scheme.check_targets(parse_targets(self.targets))
        export_format(self.format).check_scheme(self.scheme, self.targets)
        for t in self.targets:
            spec = self.scheme.cache if t == "attn-cache" else self.scheme.target(t).input
            if spec is not None and not spec.dynamic:
                raise QuantConfigError(f"scheme {self.scheme.name!r} target {t}: static activation scales "
                                       "(dynamic: false) are not exported")
        profile = self.engine_profile()
        if profile is not None:
            model_binding(self.model_path).check_export(self, profile, planned_params)


@dataclass
class ExportReport:
    out_dir: str
    format: str
    groups_written: list[str] = field(default_factory=list)
    groups_resumed: list[str] = field(default_factory=list)
    quantized_layers: list[int] = field(default_factory=list)
    #: the extra (draft) layers' states, e.g. V4's "mtp.0: copied" (benchmarks/bench_export.py and
    #: the job report read the field by this name)
    extra_layers: str = "absent"
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    peak_host_rss_bytes: int = 0


#: the ExportReport fields a job report (report.json "export") keeps
SUMMARY_FIELDS = ("out_dir", "format", "extra_layers", "seconds", "bytes_written")

# ----------------------------------------------------------------------------- --from
def _sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def resolve_run(run_dir: str | Path, model_path: Path, scheme_arg: str | None,
                targets_arg: str | None) -> tuple[QuantScheme, list[str], Path]:
    """Scheme, targets and params folder of a run_ptq output folder, checked against the model."""
    from ..pipeline.run_folder import RunFolder

    folder = RunFolder(run_dir)
    pdir, meta_path = folder.params, folder.meta_path
    meta = folder.read_meta()
    if meta is None:
        raise DataError(f"--from {run_dir}: {meta_path} not found (not a run_ptq output folder)")
    model = meta.get("model") or {}
    want = _sha256(model_path / "config.json")
    if model.get("config_sha256") != want:
        raise ExportParamsError(f"{meta_path}: field 'model.config_sha256' names another model "
                                f"({model.get('name')!r}, {str(model.get('config_sha256'))[:12]}...) than "
                                f"{model_path} ({str(want)[:12]}...)")
    for key in ("index_sha256", "checkpoint_index_sha256"):  # recorded by newer runs (issue 17)
        if key in model or key in meta:
            old = model.get(key, meta.get(key))
            new = _sha256(model_path / "model.safetensors.index.json")
            if old != new:
                raise ExportParamsError(f"{meta_path}: field {key!r} names another checkpoint index than {model_path}")
    name = meta.get("scheme")
    scheme = load_scheme(scheme_arg if scheme_arg else name)
    if scheme.fingerprint() != meta.get("scheme_fingerprint"):
        raise ExportParamsError(f"{meta_path}: field 'scheme_fingerprint' ({name!r}) does not match scheme "
                                f"{scheme.name!r}" + ("" if scheme_arg else "; pass --scheme FILE with the run's scheme file"))
    targets = list(meta.get("targets") or [])
    if targets_arg is not None and parse_targets(targets_arg) != targets:
        raise ExportParamsError(f"{meta_path}: field 'targets' {targets} differs from --quant-target {targets_arg}")
    return scheme, targets, pdir


# ----------------------------------------------------------------------------- per-tensor helpers
def _named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = dict(module.named_parameters(remove_duplicate=False))
    out.update({n: b for n, b in module.named_buffers(remove_duplicate=False) if b is not None})
    return out


def _snapshot(module: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Identity and version counter of every tensor: loading parameters either assigns a new
    tensor or writes in place (both change this), so untouched tensors can be copied raw."""
    return {n: (id(t), t._version) for n, t in _named_tensors(module).items()}


class _Exporter:
    def __init__(self, cfg: ExportConfig):
        self.cfg = cfg
        # the model family's knowledge (layer builds, quantized leaves, cost), by config.json model_type
        self.model = model_binding(cfg.model_path)
        self.model.check_config(cfg.model_path)
        from .readback import exported_quant

        if exported_quant(cfg.model_path) is not None:
            # its weights are already on a grid: quantizing them again is not what anyone wants
            raise ConfigError(f"{cfg.model_path} is itself an exported quantized checkpoint; export from the release")
        self.config = self.model.load_config(cfg.model_path)
        self.reader = CheckpointReader(cfg.model_path)
        self.device = devmod.resolve_device(cfg.device)
        self.fmt = export_format(cfg.format)
        self.bytes_read = 0
        self.types: dict[str, str] = {}
        self._headers: dict[str, tuple[int, dict]] = {}
        self.profile = cfg.engine_profile()
        #: layer-relative leaves written as float weights (-> quantization_config.ignore)
        self.float_leaves: set[str] = set()
        #: the key of the extra (draft) layers' states in the resume state and the metadata
        self.extra_key = self.model.extra_layers or "extra_layers"
        #: the name of a gated MLP's down projection (ModelBinding.gated_projections)
        self.down_name = self.model.gated_projections.get("down")

    # -------------------------------------------------------------- raw copies
    def _location(self, key: str) -> tuple[Path, str, list[int], int, int]:
        """(shard file, safetensors dtype, shape, absolute byte offset, byte length) of a source
        tensor, from the shard's header (read once per shard)."""
        shard = self.reader.shard_of(key)
        header = self._headers.get(shard)
        if header is None:
            path = self.reader.root / shard
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = (8 + n, json.loads(f.read(n)))
            self._headers[shard] = header
        base, entries = header
        e = entries.get(key)
        if e is None:
            raise CheckpointError(f"key {key!r}: the index maps it to shard {shard!r}, but that shard does not contain it")
        a, b = e["data_offsets"]
        return self.reader.root / shard, e["dtype"], e["shape"], base + a, b - a

    def _raw(self, key: str) -> torch.Tensor:
        t = self.reader.get_raw(key)
        self.bytes_read += t.numel() * t.element_size()
        return t

    def _copy_released(self, keys: list[str], stream) -> None:
        """Tensors as released; FP8 / FP4 weights decoded to bf16 for ascend / dequantize_rest."""
        present = set(keys)
        decode = self.fmt.decodes_released or self.cfg.dequantize_rest
        # the '.scale' companions of quantized-storage weights, found before the loop: 'X.scale'
        # sorts before 'X.weight', so marking them while iterating would be too late
        companion = {k: k[: -len(".weight")] + ".scale" for k in keys if k.endswith(".weight")
                     and k[: -len(".weight")] + ".scale" in present and self.reader.stored_dtype(k) in QUANT_STORAGE}
        skip = set(companion.values()) if decode else set()
        for key in keys:
            if key in skip:
                continue
            if decode and key in companion:
                w, s = self._raw(key), self._raw(companion[key])
                dec = decode_fp8_block if w.dtype == torch.float8_e4m3fn else decode_fp4
                stream.add(key, dec(w, s, dtype=torch.bfloat16, device=self.device, name=key))
                self.types[key] = ascend.FLOAT
                continue
            self.types[key] = ascend.FLOAT
            if self.fmt.copies_raw(key):
                # large tensors go file to file (the embedding and head are GBs at real size)
                src, st_dtype, shape, start, nbytes = self._location(key)
                if stream.add_file_range(key, st_dtype, shape, src, start, nbytes):
                    self.bytes_read += nbytes
                    continue
            stream.add(key, self.fmt.released_tensor(key, self._raw(key)))

    # -------------------------------------------------------------- one decoder block
    def _export_block(self, block: torch.nn.Module, prefix: str, keys: list[str], layer_idx: int,
                      quantize: bool, with_params: bool, stream) -> None:
        """Stream the block's tensors into ``stream`` (a ShardStream): each quantized leaf as soon as it
        is encoded (host memory holds one leaf's output), then everything else."""
        before = _snapshot(block)
        leaves: dict[str, Any] = {}
        if quantize:
            self.model.quantize_block(block, self.cfg.scheme, self.cfg.targets)
            if with_params:
                for unit in self.model.iter_ptq_units(block, layer_idx, self.cfg.targets):
                    load_unit_params(unit, self.cfg.params_dir)
            leaves = self.model.quantized_weights(block)
        now = _named_tensors(block)
        consumed: set[str] = set()
        for wname, leaf in leaves.items():
            base = prefix + wname[: -len(".weight")]
            w = leaf.weight
            spec, act = leaf.weight_quantizer.spec, leaf.input_quantizer.spec
            if self.profile is not None:
                plan = self.profile.plan_leaf(wname[: -len(".weight")], spec, act, where=base)
                if plan.action == engine.FLOAT:
                    # the engine keeps it float: the exact fake-quant weight the run evaluated
                    with torch.no_grad():
                        stream.add(prefix + wname, leaf.weight_quantizer(w).detach())
                    self.types[prefix + wname] = ascend.FLOAT
                    self.float_leaves.add(wname[: -len(".weight")])
                    consumed.update({prefix + wname, prefix + wname[: -len(".weight")] + ".scale"})
                    continue
            with torch.no_grad():
                d = leaf.weight_quantizer.export(w)
                tensors, typ = self.fmt.encode_weight(base, spec, act, d, tuple(w.shape),
                                                      base.rpartition(".")[2] == self.down_name)
            for k, v in tensors.items():
                stream.add(k, v)
                self.types[k] = typ or ascend.FLOAT
            del tensors, d
            consumed.update({prefix + wname, prefix + wname[: -len(".weight")] + ".scale"})
        rest = []
        for key in keys:
            if key in consumed:
                continue
            rel = key[len(prefix):]
            cur = now.get(rel)
            if cur is not None and before.get(rel) != (id(cur), cur._version):
                stream.add(key, cur)                           # changed by the run's parameters
                self.types[key] = ascend.FLOAT
                scale = key[: -len(".weight")] + ".scale" if key.endswith(".weight") else None
                consumed.add(scale)
                continue
            rest.append(key)
        if self.profile is not None and quantize:
            # modules the engine would build quantized that this export leaves float (wo_a under
            # attn-linear, experts without moe): listed as unquantized too. Only from quantized
            # layers: a layer outside a partial run is ignored whole, and its names (patterns
            # over every layer) must not unquantize the same module of a quantized layer
            done = {w[: -len(".weight")] for w in leaves}
            for key in keys:
                rel = key[len(prefix):]
                if rel.endswith(".weight") and rel[: -len(".weight")] not in done:
                    rule = self.profile.rule_for(rel[: -len(".weight")])
                    if rule is not None:
                        self.float_leaves.add(rel[: -len(".weight")])
        self._copy_released([k for k in rest if k not in consumed], stream)

    def _add_mtp_head(self, group: str, stream) -> None:
        """vllm-ascend's MTP draft loads its own head from ``{group}.head.weight`` (``mtp.{j}``) and
        does not share the target's lm_head (models/deepseek_v4/serving_ascend.py MTP_HEAD_SOURCE);
        a release without one gets a copy of ``head.weight`` (what vllm-ascend itself does for the
        FP8 release)."""
        key = f"{group}.head.weight"
        stream.add(key, self._raw("head.weight"))
        self.types[key] = ascend.FLOAT

    def _build_layer(self, i: int) -> torch.nn.Module:
        return self.model.build_layer(self.reader, self.config, i, self.cfg.dtype, self.device)

    @staticmethod
    def _release(block: torch.nn.Module) -> None:
        block.to("meta")

    # -------------------------------------------------------------- the whole checkpoint
    def quantized_layers(self) -> list[int]:
        """With --from: layers that have unit parameters (a run may cover a layer range)."""
        n = int(self.config.n_layers)
        if self.cfg.params_dir is None:
            return list(range(n))
        if self.cfg.layers is not None:
            return [i for i in range(n) if i in set(self.cfg.layers)]
        stems = {p.name for p in Path(self.cfg.params_dir).glob("layer_*.pt")}
        return [i for i in range(n) if any(s.startswith(f"layer_{i}_") for s in stems)]

    def _has_params(self, layer_id: int) -> bool:
        """Whether the run saved unit parameters for layer ``layer_id`` (the MTP layer's: n_layers + j)."""
        return self.cfg.params_dir is not None and any(Path(self.cfg.params_dir).glob(f"layer_{layer_id}_*.pt"))

    def run(self, only_groups: Sequence[str] | None = None, absorb: Sequence[Path] = ()) -> ExportReport:
        """The whole export; ``only_groups``: write just those groups' shards (one torchrun
        rank's layers: no side files, no index); ``absorb``: staging folders of other ranks
        whose finished shards are taken over first (``ShardedWriter.absorb``)."""
        cfg = self.cfg
        t0 = time.perf_counter()
        devmod.reset_peak_memory("cpu")
        keys = self.reader.keys()
        n = int(self.config.n_layers)
        by_group: dict[str, list[str]] = {"stem": []}
        for i in range(n):
            by_group[f"layers.{i}"] = []
        # the model's extra (draft) layers, ``{extra}.{j}.*`` (ModelBinding.extra_layers)
        extra_name = self.model.extra_layers
        numbered = ("layers", extra_name) if extra_name else ("layers",)
        extra_ids = sorted({int(k.split(".")[1]) for k in keys
                            if extra_name and k.startswith(f"{extra_name}.") and k.split(".")[1].isdigit()})
        for j in extra_ids:
            by_group[f"{extra_name}.{j}"] = []
        for k in keys:
            parts = k.split(".")
            g = ".".join(parts[:2]) if parts[0] in numbered and len(parts) > 2 else "stem"
            if g not in by_group:
                raise CheckpointError(f"checkpoint key {k!r} names a layer the config does not have (n_layers={n})")
            by_group[g].append(k)
        qlayers = self.quantized_layers()
        fingerprint = {
            "version": EXPORT_VERSION, "format": cfg.format, "scheme_fingerprint": cfg.scheme.fingerprint(),
            "targets": cfg.targets, "dequantize_rest": cfg.dequantize_rest, "quantized_layers": qlayers,
            "source_config_sha256": _sha256(cfg.model_path / "config.json"),
            "source_index_sha256": _sha256(self.reader.index_path) if self.reader.index_path else None,
            "params": _params_digest(cfg.params_dir),
            # a resumed export must not mix layers written for the engine with storage-only ones
            "engine": None if self.profile is None else self.profile.engine,
        }
        stem, index_name = self.fmt.shard_stem, self.fmt.index_name
        writer = ShardedWriter(cfg.out_dir, list(by_group), fingerprint, stem, index_name, overwrite=cfg.overwrite,
                               protect=[cfg.model_path])
        for staging in absorb:
            writer.absorb(staging)
        report = ExportReport(out_dir=str(cfg.out_dir), format=cfg.format, quantized_layers=qlayers,
                              groups_resumed=writer.resumed_groups)
        mtp_state = {}
        for group, gkeys in by_group.items():
            if only_groups is not None and group not in only_groups:
                continue
            if writer.done(group):
                extra = writer.state["groups"][group].get("extra", {})
                self.types.update(extra.get("types", {}))
                mtp_state.update(extra.get(self.extra_key, {}))
                continue
            self.types = {}
            self.float_leaves = set()
            extra: dict[str, Any] = {}
            stream = writer.open_group(group, n_hint=4 * len(gkeys) + 16)
            try:
                if group == "stem":
                    self._copy_released(gkeys, stream)
                elif group.startswith("layers."):
                    i = int(group.split(".")[1])
                    block = self._build_layer(i)
                    self._export_block(block, f"{group}.", gkeys, i, i in qlayers, cfg.params_dir is not None,
                                       stream)
                    self._release(block)
                else:
                    j = int(group.split(".")[1])
                    block = self.model.build_extra_layer(self.reader, self.config, j, cfg.dtype, self.device)
                    if block is None:
                        self._copy_released(gkeys, stream)
                        extra[self.extra_key] = {group: "copied"}
                    else:
                        # the run's MTP parameters when it calibrated the MTP layer, else RTN
                        mtp_params = self._has_params(n + j)
                        self._export_block(block, f"{group}.", gkeys, n + j, True, mtp_params, stream)
                        self._release(block)
                        if self.fmt.adds_mtp_head() and f"{group}.head.weight" not in gkeys:
                            self._add_mtp_head(group, stream)
                        extra[self.extra_key] = {group: "quantized (run parameters)" if mtp_params
                                                 else "quantized (RTN)"}
                    mtp_state.update(extra[self.extra_key])
                extra["types"] = dict(self.types)
                extra["float_leaves"] = sorted(self.float_leaves)
                report.bytes_written += writer.close_group(group, stream, extra)
            except BaseException:
                stream.abort()
                raise
            report.groups_written.append(group)
            devmod.empty_cache(self.device)
            if cfg.progress:   # plain lines: readable in a log file
                print(f"export: {group} done ({len(report.groups_written) + len(report.groups_resumed)}/"
                      f"{len(by_group)} groups, {time.perf_counter() - t0:.1f} s)", flush=True)
        if only_groups is not None:   # one rank's share: the coordinating rank finishes
            report.seconds = time.perf_counter() - t0
            report.peak_host_rss_bytes = devmod.peak_memory_bytes("cpu")
            self.reader.close()
            return report
        types, float_leaves = {}, set()
        for g in by_group:
            extra = writer.state["groups"][g].get("extra", {})
            types.update(extra.get("types", {}))
            float_leaves.update(extra.get("float_leaves", ()))
        self._write_side_files(qlayers, mtp_state, types, sorted(float_leaves))
        writer.finish()
        report.extra_layers = ", ".join(f"{k}: {v}" for k, v in sorted(mtp_state.items())) or "absent"
        # every source byte is read at least once (layers through load_block, the rest raw);
        # shards of resumed groups were not read this time, which the count ignores
        shards = set(self.reader.weight_map.values())
        report.bytes_read = sum((cfg.model_path / s).stat().st_size for s in shards)
        report.seconds = time.perf_counter() - t0
        report.peak_host_rss_bytes = devmod.peak_memory_bytes("cpu")
        self.reader.close()
        return report

    def _write_side_files(self, qlayers: list[int], mtp_state: dict[str, str], types: dict[str, str],
                          float_leaves: Sequence[str] = ()) -> None:
        cfg = self.cfg
        src = json.loads((cfg.model_path / "config.json").read_text(encoding="utf-8"))
        released_qc = src.pop("quantization_config", None)
        for key, value in self.model.released_config_keys(self.config).items():   # a source that predates them
            src.setdefault(key, value)
        # the format's description: side files and config.json entries (export_format.py)
        mx_weight_only = self.profile is not None and self.profile.options.mx_weight_only
        weight_only = self.fmt.write_description(cfg.out_dir, src, cfg, types, qlayers, mtp_state, float_leaves,
                                                 int(self.config.n_layers), mx_weight_only=mx_weight_only)
        src[EXPORT_KEY] = {
            "version": EXPORT_VERSION, "format": cfg.format, "scheme": cfg.scheme.name,
            "scheme_fingerprint": cfg.scheme.fingerprint(), "targets": cfg.targets,
            "quantized_layers": qlayers, self.extra_key: mtp_state, "from_params": cfg.params_dir is not None,
            "dequantize_rest": cfg.dequantize_rest,
            # the engine profile the export followed (None: serve_check off, or no profile)
            "engine": None if self.profile is None else self.profile.engine,
            "float_leaves": list(float_leaves),
            # FP8 / FP4 tensors left as released keep the release's own storage description
            "released_quantization_config": self.fmt.released_quantization_config(released_qc, cfg.dequantize_rest),
        }
        if self.profile is not None:
            src[EXPORT_KEY].update(_serving_metadata(self, weight_only))
        atomic_write_json(src, cfg.out_dir / "config.json")
        for name in COPY_FILES:
            p = cfg.model_path / name
            if p.is_file():   # never through a link out of the checkpoint (io/links.py)
                shutil.copyfile(checked_file(cfg.model_path, name, "side file"), cfg.out_dir / name)


def _serving_metadata(exporter: "_Exporter", weight_only: list[str]) -> dict[str, Any]:
    """What the export says about how it is served: the engine build, the targets served
    weight-only (--mx-weight-only: their MX activation quantization is not in the export), and
    the tensor-parallel sizes the engine can shard it over."""
    profile, cfg = exporter.profile, exporter.cfg
    return {"serving": {
        "build": None if exporter.fmt.name == "ascend" else profile.options.build,
        "served_weight_only": weight_only,
        "tensor_parallel_checked": profile.options.tensor_parallel,
        "tensor_parallel_sizes": exporter.model.served_tp_sizes(cfg, profile),
    }}


def _params_digest(pdir: Path | None) -> str | None:
    """Content hash of a params folder (names + bytes of every .pt and the meta), so a resumed
    export cannot mix shards of two different runs."""
    if pdir is None:
        return None
    h = hashlib.sha256()
    for p in sorted(Path(pdir).glob("*.pt")) + [Path(pdir) / META_NAME]:
        if p.is_file():
            h.update(p.name.encode())
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def export_checkpoint(cfg: ExportConfig) -> ExportReport:
    cfg.check()
    return _Exporter(cfg).run()


def staging_dir(out_dir: Path, rank: int) -> Path:
    """Where torchrun rank ``rank`` > 0 writes its layers' shards before rank 0 takes them over."""
    return Path(out_dir) / f".rank{rank}"


def export_checkpoint_distributed(cfg: ExportConfig, dist_env) -> ExportReport:
    """The export over torchrun ranks (``amct_ext.pipeline.distributed``), one cost-balanced range of
    decoder layers per rank; one process when ``dist_env`` is None.

    Rank 0 opens the output folder first (refusal / --overwrite / resume happen once, before
    any rank writes); every rank then writes its layers' shards, rank r > 0 into
    ``OUT/.rank{r}`` with a writer of its own (one state file per writer: no two processes
    write the same file); after a barrier rank 0 takes the finished shards over, writes the
    stem, the MTP layer and the side files, and the index last. The files are those of the
    one-process export (same shard names, same bytes). A rank that dies leaves its finished
    shards in its staging folder: a rerun resumes them."""
    from dataclasses import replace

    from ..pipeline import distributed

    if dist_env is None:
        return export_checkpoint(cfg)
    cfg.check()
    first = _Exporter(cfg)
    n = int(first.config.n_layers)
    layers = range(n)
    costs = [first.model.layer_cost(first.config, i, cfg.targets, 1, 0) for i in layers]
    ranges = distributed.partition_layers(layers, costs, dist_env.world_size, prefix=False, use="float")
    mine = ranges[dist_env.rank]
    if dist_env.is_main:
        first.run(only_groups=[])          # opens OUT once: refusal, --overwrite, resume state
    else:
        first.reader.close()
    distributed.barrier(dist_env)
    own = replace(cfg, overwrite=False) if dist_env.is_main else \
        replace(cfg, out_dir=staging_dir(cfg.out_dir, dist_env.rank), overwrite=False)
    part = _Exporter(own).run(only_groups=[f"layers.{i}" for i in mine]) if len(mine) else None
    written = distributed.all_gather_json(0 if part is None else part.bytes_written, dist_env)
    if not dist_env.is_main:
        return part or ExportReport(out_dir=str(cfg.out_dir), format=cfg.format, quantized_layers=[])
    report = _Exporter(replace(cfg, overwrite=False)).run(
        absorb=[staging_dir(cfg.out_dir, r) for r in range(1, dist_env.world_size)])
    report.bytes_written += sum(written)
    report.ranges = [[r.start, r.stop] for r in ranges]
    return report
