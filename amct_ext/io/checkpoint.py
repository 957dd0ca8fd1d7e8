"""CheckpointReader: lazy, per-prefix access to a (possibly sharded) safetensors checkpoint.

Design points
- The index (``model.safetensors.index.json``) is read once; every shard file name in it is
  checked up front so that a hostile index cannot make us read outside the checkpoint folder
  (absolute names, ``..``, symlinks resolving elsewhere are refused).
- Shards are opened lazily with ``safetensors.safe_open`` and only when a requested key lives
  there, so fetching one layer of a 160-shard checkpoint touches one or two files. Open
  handles are cached per shard until ``close()``.
- ``load_prefix`` turns released storage (FP8 block / MXFP4 + ``.scale`` companions, see
  ``storage_formats``) into compute tensors, optionally on a target device, and accounts for
  every key: loaded / missing / unexpected / skipped. Nothing is dropped silently.
- Every floating tensor a ``load_prefix`` call returns is checked for NaN / Inf after
  dequantization and the cast (``check_finite``): garbage in a shard's data region (the header
  intact) decodes to NaN and would otherwise surface as a NaN perplexity naming nothing. The
  check is one ``aminmax`` per tensor on the tensor's device and ONE host read per call (per
  layer), through ``device_checks.raise_first``; the error names the tensor and its shard file.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from safetensors import safe_open

from ..runtime import device_checks
from ..errors import CheckpointError
from .links import outside_reason
from .storage_formats import FP4_PACKED_DTYPES, decode_fp4, decode_fp8_block

log = logging.getLogger(__name__)

INDEX_NAME = "model.safetensors.index.json"
# the index of an Ascend ModelSlim v1 export (amct_ext.export.ascend)
ASCEND_INDEX_NAME = "quant_model_weights.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SCALE_SUFFIX = ".scale"
WEIGHT_SUFFIX = ".weight"
#: key prefixes load_prefix leaves out by default: none (a model that keeps extra layers, e.g. draft
#: layers, out of an enclosing prefix passes their prefixes as ``skip_prefixes``)
DEFAULT_SKIP: tuple[str, ...] = ()
# safetensors dtype strings of weights that carry a ``.scale`` companion (FP8 block / MXFP4).
QUANT_STORAGE = frozenset({"F8_E4M3", "I8", "U8", "F4"})

# Stored dtypes returned as they are (then cast to the target dtype).
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
INT_DTYPES = (torch.int64, torch.int32)

# ``target_dtype(key, stored_dtype) -> dtype | None``: see ``load_prefix``.
TargetDtype = Callable[[str, torch.dtype], "torch.dtype | None"]


@dataclass
class LoadResult:
    """What one ``load_prefix`` call produced.

    tensors:    name -> compute tensor (names relative to the prefix when ``strip_prefix``)
    loaded:     names in ``tensors`` (checkpoint order)
    missing:    expected names absent from the checkpoint (only non-empty with ``strict=False``)
    unexpected: names under the prefix the caller did not expect (not loaded; a warning is logged)
    skipped:    full checkpoint keys deliberately ignored (under ``skip_prefixes``)
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def _parse_expected(spec: Any, name: str) -> tuple[tuple[int, ...], torch.dtype | None]:
    """An ``expected`` value -> (shape, dtype or None).

    Accepted: a tensor (meta tensors from ``module.state_dict()`` are ideal: shape and dtype),
    a shape (``torch.Size`` / tuple of ints), or a pair ``(shape, dtype_or_None)``.
    """
    if isinstance(spec, torch.Tensor):
        return tuple(spec.shape), spec.dtype
    if isinstance(spec, torch.Size):
        return tuple(spec), None
    if isinstance(spec, (tuple, list)):
        if len(spec) == 2 and isinstance(spec[0], (tuple, list, torch.Size)) and \
                (spec[1] is None or isinstance(spec[1], (torch.dtype, str))):
            dt = spec[1]
            if isinstance(dt, str):  # 'float32' / 'bfloat16' / 'int64'
                dt = getattr(torch, dt, None)
                if not isinstance(dt, torch.dtype):
                    raise CheckpointError(f"expected[{name!r}]: unknown dtype name {spec[1]!r}")
            return tuple(int(d) for d in spec[0]), dt
        if all(isinstance(d, int) for d in spec):
            return tuple(spec), None
    raise CheckpointError(f"expected[{name!r}]: cannot read {spec!r}; give a tensor, a shape, "
                          f"or (shape, dtype)")


def _cast(key: str, name: str, t: torch.Tensor, want_dtype: torch.dtype | None,
          target_dtype: TargetDtype | None, dtype: torch.dtype) -> torch.Tensor:
    """A decoded tensor in the dtype the caller wants (``load_prefix``'s rules, in order)."""
    if t.dtype.is_floating_point:
        target = want_dtype
        if target is None and target_dtype is not None:
            target = target_dtype(name, t.dtype)
        return t.to(target or dtype)
    if want_dtype is not None and want_dtype != t.dtype:
        if want_dtype.is_floating_point:
            raise CheckpointError(f"tensor {key!r}: stored as integer {t.dtype} but the model expects {want_dtype}")
        return t.to(want_dtype)
    return t


def _copy_into(key: str, t: torch.Tensor, dest: torch.Tensor) -> None:
    """``load_prefix(into=...)``: the decoded tensor into the caller's destination."""
    if tuple(dest.shape) != tuple(t.shape) or dest.dtype != t.dtype:
        raise CheckpointError(f"tensor {key!r}: decodes to {list(t.shape)} {t.dtype}, but the "
                              f"destination given for it is {list(dest.shape)} {dest.dtype}")
    with torch.no_grad():       # a Parameter's view: the copy is not a computation
        dest.copy_(t)


class CheckpointReader:
    """Read-only view of a checkpoint folder (index + shards) or a single ``.safetensors`` file.

    ``path`` may be the folder, its ``model.safetensors.index.json``, or one ``.safetensors``
    file. Use as a context manager (or call ``close()``) to release the open shard handles.
    """

    def __init__(self, path: str | os.PathLike):
        p = Path(path)
        if p.is_dir():
            if (p / INDEX_NAME).is_file():
                index = p / INDEX_NAME
            elif (p / ASCEND_INDEX_NAME).is_file():
                index = p / ASCEND_INDEX_NAME
            elif (p / SINGLE_NAME).is_file():
                index = None
                p = p / SINGLE_NAME
            else:
                raise CheckpointError(f"{p}: neither {INDEX_NAME} nor {SINGLE_NAME} found")
        elif p.is_file():
            index = p if p.name.endswith(".json") else None
        else:
            raise CheckpointError(f"checkpoint path {p} does not exist")

        self.root = (index.parent if index is not None else p.parent).resolve()
        self.index_path = index
        self._handles: dict[str, Any] = {}
        self.shards_opened: list[str] = []  # order in which shards were opened (for diagnostics)

        if index is not None:
            self.weight_map = self._read_index(index)
        else:
            # Single file: the one shard must be opened to learn its keys.
            self.weight_map = {}
            shard = p.name
            self._check_entry("<single file>", shard)
            for key in self._handle(shard).keys():
                self.weight_map[key] = shard

    # ------------------------------------------------------------------ index & safety
    def _read_index(self, index: Path) -> dict[str, str]:
        try:
            data = json.loads(index.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise CheckpointError(f"{index}: cannot read index json ({e})") from None
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        checked: set[str] = set()
        for key, shard in wm.items():
            if not isinstance(shard, str) or not shard:
                raise CheckpointError(f"{index}: entry {key!r} has a bad shard name {shard!r}")
            if shard not in checked:   # once per shard: a real-size index has ~100k keys, ~50 shards
                self._check_entry(key, shard)
                checked.add(shard)
        return dict(wm)

    def _check_entry(self, key: str, shard: str) -> None:
        """Refuse shard names that would leave the checkpoint folder."""
        bad = None
        if os.path.isabs(shard) or shard.startswith(("/", "\\")) or \
                (len(shard) > 1 and shard[1] == ":"):
            bad = "absolute path"
        elif ".." in Path(shard.replace("\\", "/")).parts:
            bad = "'..' component"
        else:   # a link out of the folder is refused; the hub cache's blobs/ is accepted (io/links.py)
            bad = outside_reason(self.root, shard)
        if bad:
            raise CheckpointError(f"index entry {key!r} -> shard file {shard!r} refused: {bad} "
                                  f"(checkpoint directory {self.root})")

    def _handle(self, shard: str) -> Any:
        """The cached ``safe_open`` handle of ``shard`` (opened on first use)."""
        h = self._handles.get(shard)
        if h is not None:
            return h
        file = self.root / shard
        if not file.is_file():
            raise CheckpointError(f"shard file {shard!r} is missing ({file})")
        try:
            h = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # SafetensorError on truncated / corrupt headers, OSError, ...
            raise CheckpointError(f"shard file {shard!r} is corrupt or truncated: {e}") from e
        self._handles[shard] = h
        self.shards_opened.append(shard)
        return h

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        for h in self._handles.values():
            try:
                h.__exit__(None, None, None)
            except Exception:  # closing must never mask the caller's error
                pass
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; explicit close() is preferred
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ key queries
    def keys(self) -> list[str]:
        return list(self.weight_map)

    def has(self, key: str) -> bool:
        return key in self.weight_map

    def __contains__(self, key: str) -> bool:
        return self.has(key)

    def shard_of(self, key: str) -> str:
        try:
            return self.weight_map[key]
        except KeyError:
            raise CheckpointError(f"key {key!r} is not in the checkpoint index") from None

    def keys_under(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix`` (e.g. 'layers.3.'); no shard is opened."""
        return [k for k in self.weight_map if k.startswith(prefix)]

    def stored_dtype(self, key: str) -> str:
        """The safetensors dtype string of ``key`` ('BF16', 'F8_E4M3', 'I8', 'F4', ...), read
        from the shard header without loading the data."""
        shard = self.shard_of(key)
        h = self._handle(shard)
        try:
            return h.get_slice(key).get_dtype()
        except Exception as e:
            raise self._read_error(key, shard, h, e) from e

    def _read_error(self, key: str, shard: str, h: Any, e: Exception) -> CheckpointError:
        # Either the index lies about the shard, or the data is unreadable.
        try:
            in_shard = key in set(h.keys())
        except Exception:
            in_shard = True
        if not in_shard:
            return CheckpointError(f"key {key!r}: the index maps it to shard {shard!r}, "
                                   f"but that shard does not contain it")
        return CheckpointError(f"shard file {shard!r}: cannot read tensor {key!r}: {e}")

    def get_raw(self, key: str) -> torch.Tensor:
        """The tensor exactly as stored (storage dtype, CPU)."""
        shard = self.shard_of(key)
        h = self._handle(shard)
        try:
            return h.get_tensor(key)
        except Exception as e:
            raise self._read_error(key, shard, h, e) from e

    # ------------------------------------------------------------------ per-prefix load
    def load_prefix(self, prefix: str, expected: Mapping[str, Any] | None = None, *,
                    device: str | torch.device | None = None,
                    dtype: torch.dtype = torch.bfloat16,
                    target_dtype: TargetDtype | None = None,
                    strip_prefix: bool = True, strict: bool = True,
                    skip_prefixes: Sequence[str] = DEFAULT_SKIP,
                    check_finite: bool = True,
                    into: Mapping[str, torch.Tensor] | None = None) -> LoadResult:
        """Fetch every tensor under ``prefix`` as compute tensors.

        Storage handling (key ``X.weight`` with companion ``X.scale``):
          - ``float8_e4m3fn`` weight -> FP8 128x128 block dequantization;
          - int8 / uint8 / float4_e2m1fn_x2 weight -> MXFP4 decode (logical in = 2 * packed in);
          - the consumed ``X.scale`` keys are not returned;
          - int32 / int64 tensors (``tid2eid``) are returned as int64;
          - bf16 / fp16 / fp32 / fp64 tensors are returned cast to the target dtype.
        With ``device``, raw bytes are moved first and decoding runs on that device.

        Target dtype of a floating tensor, first rule that applies:
          1. the dtype given by ``expected[name]`` (a tensor or ``(shape, dtype)``) -- pass the
             model's meta ``state_dict()`` and its fp32 islands survive automatically;
          2. ``target_dtype(name, stored_dtype)`` if it returns a dtype;
          3. ``dtype`` (default bf16).

        ``expected`` maps names (as returned: relative to ``prefix`` when ``strip_prefix``) to a
        tensor, a shape, or ``(shape, dtype)``. With it: a missing name raises CheckpointError
        (``strict``) or is recorded in ``missing``; a shape mismatch and an unsupported stored
        dtype raise; names under the prefix that are not expected are NOT loaded, are listed in
        ``unexpected`` and logged as a warning. Keys under ``skip_prefixes`` (e.g. a model's
        extra layers, ``mtp.``) are recorded in ``skipped`` unless ``prefix`` itself asks for them.

        ``check_finite``: a NaN / Inf in any returned floating tensor raises CheckpointError
        naming the key and its shard (one device reduction per tensor, one host read per call).

        ``into``: name -> a tensor allocated by the caller (of the expected shape and dtype) that
        the decoded tensor is copied into; it is listed in ``loaded`` but not returned in
        ``tensors``, and its decoded copy is freed before the next key is read. A model that
        stacks tensors (a MoE's experts) loads them into their stack this way: one copy of them
        at the peak, not the decoded tensors and the stack side by side.
        """
        result = LoadResult()
        rel = (lambda k: k[len(prefix):]) if strip_prefix else (lambda k: k)
        skip = tuple(s for s in skip_prefixes if not prefix.startswith(s))

        keys: list[str] = []
        for k in self.keys_under(prefix):
            (result.skipped if skip and k.startswith(skip) else keys).append(k)
        present = set(keys)

        # Pair ``X.weight`` stored in a quantized dtype with its ``X.scale``. The stored dtype
        # comes from the shard header (no data read). A ``.scale`` next to a bf16 weight is not
        # consumed: it stays an ordinary key and gets accounted for like any other.
        scale_of: dict[str, str] = {}
        for k in keys:
            if k.endswith(WEIGHT_SUFFIX):
                s = k[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX
                if s in present and self.stored_dtype(k) in QUANT_STORAGE:
                    scale_of[k] = s
        candidate_scales = set(scale_of.values())

        # Exported weights (amct_ext.export): ``M.weight`` / ``M.weight_packed`` with
        # ``M.weight_scale`` and friends form one logical ``M.weight``.
        from ..export.readback import group_parts

        exported = group_parts(keys)
        parts_of = {k for parts in exported.values() for k in parts.values()}

        # Logical tensors: every key except scales that have a weight companion.
        tensors_keys = [k for k in keys if k not in candidate_scales and k not in parts_of]
        tensors_keys += list(exported)

        exp: dict[str, tuple[tuple[int, ...], torch.dtype | None]] | None = None
        if expected is not None:
            exp = {n: _parse_expected(v, n) for n, v in expected.items()}
            rel_names = {rel(k): k for k in tensors_keys}
            missing = [n for n in exp if n not in rel_names]
            if missing:
                if strict:
                    raise CheckpointError(self._missing_message(missing, prefix, strip_prefix))
                result.missing = missing
            unexpected = [k for k in tensors_keys if rel(k) not in exp]
            if unexpected:
                result.unexpected = [rel(k) for k in unexpected]
                log.warning("checkpoint keys under %r not expected by the model (not loaded): %s",
                            prefix, ", ".join(unexpected[:10]) +
                            (f" (+{len(unexpected) - 10} more)" if len(unexpected) > 10 else ""))
                tensors_keys = [k for k in tensors_keys if rel(k) in exp]

        for k in tensors_keys:
            name = rel(k)
            want_shape, want_dtype = exp[name] if exp is not None else (None, None)
            if k in exported:
                t = self._load_exported(k, exported[k], want_shape, device)
            else:
                t = self._load_one(k, scale_of.get(k), want_shape, device)
            # a tensor read without any conversion is a view of the shard's memory map, and the
            # handle is cached: writing into it in place (smoothing, GPTQ, a loaded replaced
            # weight) would change what every later load of that key returns (casebook/smoothing-rounding.md-1, i15b-1)
            # (an exported tensor is decoded into fresh memory: nothing to check)
            mapped = self._is_mapped(k, t) if t.device.type == "cpu" and k not in exported else None
            t = _cast(k, name, t, want_dtype, target_dtype, dtype)
            dest = into.get(name) if into else None
            if dest is not None:
                _copy_into(k, t, dest)
            else:
                if mapped is not None and _shares_memory(t, mapped):
                    t = t.clone()
                result.tensors[name] = t
            del t
            result.loaded.append(name)
        if check_finite:
            self.check_finite({k: into[rel(k)] if into and rel(k) in into else result.tensors[rel(k)]
                               for k in tensors_keys})
        return result

    def check_finite(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise CheckpointError for the first (checkpoint order) floating tensor of ``tensors``
        (full key -> tensor) holding a NaN or an Inf. Where the tensors live: one ``aminmax`` per
        tensor (NaN propagates; Inf shows as an extreme), then per (device, dtype) group one
        stack + isfinite; the flags are read with one host sync per device
        (``device_checks.raise_first``), not one per tensor."""
        groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
        for key, t in tensors.items():
            if t.dtype.is_floating_point and t.numel() > 0:
                groups.setdefault((t.device, t.dtype), []).append((key, t))
        checks = []
        for members in groups.values():
            ext = [torch.aminmax(t.detach().reshape(-1)) for _, t in members]
            bounds = torch.stack([m for lo_hi in ext for m in lo_hi]).view(-1, 2)
            flags = ~torch.isfinite(bounds).all(dim=1)
            errors = [CheckpointError(f"tensor {key!r} in shard file {self.weight_map.get(key, '?')!r} holds NaN "
                                      f"or Inf values after decoding (corrupt data region?); re-download that shard")
                      for key, _ in members]
            checks.append((flags, errors))
        if checks:
            device_checks.raise_first(checks)

    def _is_mapped(self, key: str, t: torch.Tensor):
        """The raw stored tensor when ``t`` is (still) that very memory, else None."""
        if t.dtype not in FLOAT_DTYPES and t.dtype not in INT_DTYPES:
            return None
        raw = self.get_raw(key)
        return raw if _shares_memory(t, raw) else None

    def _missing_message(self, missing: list[str], prefix: str, strip_prefix: bool) -> str:
        parts = []
        for n in missing[:5]:
            full = prefix + n if strip_prefix else n
            where = f"shard {self.weight_map[full]!r}" if full in self.weight_map else "not in index"
            parts.append(f"{full!r} ({where})")
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        return f"missing checkpoint key(s) under {prefix!r}: " + ", ".join(parts) + more

    def _load_exported(self, key: str, parts: dict[str, str], want_shape: tuple[int, ...] | None,
                       device: str | torch.device | None) -> torch.Tensor:
        """An exported (compressed-tensors / Ascend) weight -> fp32 compute tensor."""
        from ..export.readback import decode

        t = decode(self.get_raw, parts, want_shape, device, key)
        if want_shape is not None and tuple(t.shape) != tuple(want_shape):
            raise CheckpointError(f"tensor {key!r}: shape mismatch, model expects {list(want_shape)}, "
                                  f"the exported weight decodes to {list(t.shape)}")
        return t

    def _load_one(self, key: str, scale_key: str | None,
                  want_shape: tuple[int, ...] | None,
                  device: str | torch.device | None) -> torch.Tensor:
        """One key -> compute tensor (not yet cast): decode quantized storage, check shape."""
        raw = self.get_raw(key)
        st = raw.dtype
        if st == torch.float8_e4m3fn:
            kind, logical = "fp8", tuple(raw.shape)
        elif st in FP4_PACKED_DTYPES and scale_key is not None:
            kind = "fp4"
            if raw.dim() != 2:
                raise CheckpointError(f"tensor {key!r}: FP4 packed weight must be 2-D, "
                                      f"got {tuple(raw.shape)}")
            logical = (raw.shape[0], 2 * raw.shape[1])
        elif st in FLOAT_DTYPES or st in INT_DTYPES:
            kind, logical = "plain", tuple(raw.shape)
        else:
            hint = " (packed FP4 needs a companion .scale)" if st in FP4_PACKED_DTYPES else ""
            raise CheckpointError(f"tensor {key!r}: unsupported stored dtype {st}{hint}")

        if want_shape is not None and tuple(logical) != tuple(want_shape):
            raise CheckpointError(f"tensor {key!r}: shape mismatch, model expects "
                                  f"{list(want_shape)}, checkpoint has {list(logical)}"
                                  + (f" (stored {kind} {list(raw.shape)})" if kind == "fp4" else ""))

        if kind == "plain":
            if st == torch.int32:
                raw = raw.to(torch.int64)
            return raw.to(device) if device is not None else raw
        if scale_key is None:
            raise CheckpointError(f"tensor {key!r}: FP8 weight without its companion "
                                  f"{key[: -len(WEIGHT_SUFFIX)] + SCALE_SUFFIX!r}")
        scale = self.get_raw(scale_key)
        # Decode to float32 here; the caller casts to the target dtype (so fp32 islands that are
        # stored quantized would not lose precision through an intermediate bf16).
        if kind == "fp8":
            return decode_fp8_block(raw, scale, dtype=torch.float32, device=device, name=key)
        return decode_fp4(raw, scale, dtype=torch.float32, device=device, name=key)

    # ------------------------------------------------------------------ convenience
    def layer_indices(self, prefix: str = "layers.") -> list[int]:
        """Sorted distinct ``i`` of keys ``{prefix}{i}.*``."""
        out = set()
        for k in self.keys_under(prefix):
            head = k[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                out.add(int(head))
        return sorted(out)


def iter_layer_prefixes(reader: CheckpointReader, prefix: str = "layers.") -> Iterator[str]:
    """``'layers.0.'``, ``'layers.1.'``, ... for every layer present in the checkpoint."""
    for i in reader.layer_indices(prefix):
        yield f"{prefix}{i}."


def _shares_memory(a: torch.Tensor, b) -> bool:
    if not isinstance(b, torch.Tensor) or a.device != b.device or not a.numel():
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
