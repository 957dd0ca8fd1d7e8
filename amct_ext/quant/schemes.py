"""Quantization config objects, built-in schemes and quant targets.

A scheme says *how* tensors are quantized; the quant targets say *which* parts of the model
(``attn-linear``, ``attn-cache``, ``moe``, and the wider targets a model declares) a run
applies it to.

``attn-linear`` is the attention linears the serving engines quantize. A model may declare a
wider selection (``ModelBinding.wider_targets``, registered with :func:`register_wider_target`;
DeepSeek-V4's ``attn-linear-all``: AMCT's every attention linear the model has) quantized with
the same specs (the scheme's ``attn-linear`` key). Which modules each name selects is the
model's business (``models/deepseek_v4/serving.py``); a wider target and the one it widens are
alternatives, never given together.

Scheme file format (JSON; YAML with the same keys when PyYAML is installed)::

    {
      "name": "w8a8",
      "description": "free text, ignored by the fingerprint",
      "weight": {"format": "int", "bits": 8, "symmetric": true, "granularity": "channel"},
      "input":  {"format": "int", "bits": 8, "symmetric": true, "granularity": "token",
                 "dynamic": true},
      "cache":  {"format": "int", "bits": 8, "symmetric": true, "granularity": "token"},
      "targets": {"moe": {"weight": {...}}}
    }

``weight`` / ``input`` are the defaults of every linear target (``attn-linear`` and ``moe``);
``targets`` may override them per target, key by key (a key that is absent keeps the default,
a key set to ``null`` turns that operand's quantization off). ``cache`` is the spec of the
q / k / p / v operands of the attention matmuls (target ``attn-cache``); ``null`` = untouched.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..errors import QuantConfigError

FORMATS = ("int", "fp8", "mxfp8", "mxfp4", "none")
GRANULARITIES = ("tensor", "channel", "group", "token", "block")
#: OCP Microscaling block: 32 consecutive elements along the last dim share one e8m0 scale.
MX_BLOCK_SIZE = 32
#: Bits of the element format of the float formats (fixed by the format itself).
_FIXED_BITS = {"fp8": 8, "mxfp8": 8, "mxfp4": 4}
#: Integer widths the fake-quant kernels support; int specs with bits >= 16 mean "leave float".
INT_BITS_RANGE = (2, 8)
IDENTITY_INT_BITS = 16

LINEAR_TARGETS = ("attn-linear", "moe")
CACHE_TARGET = "attn-cache"
#: the framework's own targets in canonical order (``valid_targets`` adds the models' wider ones)
BASE_TARGETS = ("attn-linear", "attn-cache", "moe")
#: wider target -> the linear target whose specs it uses and whose modules it contains (a model's
#: wider selection, ``ModelBinding.wider_targets``, see :func:`register_wider_target`); the two
#: exclude each other
_WIDER: dict[str, str] = {}


def register_wider_target(name: str, spec_key: str) -> None:
    """Make ``name`` a target: a wider module set than the linear target ``spec_key`` (a model's
    selection, e.g. every attention linear it has), quantized with ``spec_key``'s specs."""
    if spec_key not in LINEAR_TARGETS or name in BASE_TARGETS or not name:
        raise QuantConfigError(f"wider target {name!r}: must widen one of {', '.join(LINEAR_TARGETS)} "
                               f"under a name of its own, got {spec_key!r}")
    _WIDER[name] = spec_key


def wider_targets() -> dict[str, str]:
    """The registered wider targets: name -> the linear target whose specs it uses."""
    return dict(_WIDER)


def valid_targets() -> tuple[str, ...]:
    """Every target name in canonical order (parse_targets returns targets in this order, so
    fingerprints are stable): each wider target right after the one it widens."""
    return tuple(t for base in BASE_TARGETS for t in (base, *(w for w, k in _WIDER.items() if k == base)))
_SPEC_KEYS = ("format", "bits", "symmetric", "granularity", "group_size", "block_size", "dynamic", "scale_format")
#: how an fp8 scale is stored: any float, or a power of two (ue8m0, DeepSeek's released FP8 blocks)
SCALE_FORMATS = ("float", "ue8m0")
_SCHEME_KEYS = ("name", "description", "weight", "input", "cache", "targets")
_TARGET_KEYS = ("weight", "input")

SCHEME_DIR = Path(__file__).resolve().parent / "schemes"


def _is_int(v: Any) -> bool:
    # bool is an int subclass; `true` for a bit width is a config mistake, not 1.
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class TensorSpec:
    """How one tensor (a weight, an activation, a cache operand) is fake-quantized.

    Fields (``None`` means "the default for this format"; defaults are filled in at
    construction so two equal specs compare and fingerprint equal):

    - ``format``: ``int`` | ``fp8`` (e4m3, max 448) | ``mxfp8`` | ``mxfp4`` | ``none``.
    - ``bits``: int: 2..8, or >= 16 meaning "not quantized" (identity). fp8 / mxfp8: 8,
      mxfp4: 4 (fixed, may be omitted).
    - ``symmetric``: int only may be asymmetric (zero point); float formats are symmetric.
    - ``granularity``: what shares one scale.
      ``tensor`` one scale; ``channel`` one per row (all dims but the last, i.e. output
      channels of a [out, in] weight); ``token`` same math as channel, meant for activations
      ``[..., K]`` and always dynamic; ``group`` ``group_size`` consecutive elements of the last
      dim; ``block`` 2-D tiles ``block_size`` over the last two dims (edges padded).
      mxfp8 / mxfp4 are always ``group`` of 32 (OCP MX block).
    - ``dynamic``: activations only: scales come from the current tensor (True) or from
      statistics observed during calibration (False). ``token`` and MX imply True.
      Weights ignore it (a weight's scale always comes from the weight).
    - ``scale_format``: fp8 only: ``float`` (``amax / 448``) or ``ue8m0`` (that value rounded UP
      to a power of two, as DeepSeek-V4's release stores its FP8 blocks: with ``block`` 128 x 128
      this grid holds the released FP8 weights exactly, which ``float`` does not). Left out of
      ``to_dict`` when ``float``, so the fingerprints of existing schemes do not change.
    """

    format: str = "int"
    bits: int | None = None
    symmetric: bool = True
    granularity: str | None = None
    group_size: int | None = None
    block_size: tuple[int, int] | None = None
    dynamic: bool | None = None
    scale_format: str = "float"

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731  (frozen dataclass)
        fmt = self.format
        if fmt not in FORMATS:
            raise QuantConfigError(f"TensorSpec.format={fmt!r} is unknown; valid: {', '.join(FORMATS)}")
        if self.scale_format not in SCALE_FORMATS:
            raise QuantConfigError(f"TensorSpec.scale_format={self.scale_format!r} is unknown; valid: "
                                   f"{', '.join(SCALE_FORMATS)}")
        if self.scale_format != "float" and fmt != "fp8":
            raise QuantConfigError(f"TensorSpec.scale_format={self.scale_format!r} applies to format 'fp8' only "
                                   f"(got {fmt!r}; MX scales are e8m0 already)")
        if fmt == "none":
            # Normalise so every "off" spec is equal to every other one.
            for k, v in (("bits", None), ("symmetric", True), ("granularity", None),
                         ("group_size", None), ("block_size", None), ("dynamic", None)):
                set_(k, v)
            return

        # bits
        if fmt in _FIXED_BITS:
            if self.bits is None:
                set_("bits", _FIXED_BITS[fmt])
            elif self.bits != _FIXED_BITS[fmt] or not _is_int(self.bits):
                raise QuantConfigError(
                    f"TensorSpec.bits={self.bits!r} is impossible for format {fmt!r} "
                    f"(its elements have {_FIXED_BITS[fmt]} bits)")
        else:
            if not _is_int(self.bits):
                raise QuantConfigError(f"TensorSpec.bits={self.bits!r}: format 'int' needs an integer bit width")
            lo, hi = INT_BITS_RANGE
            if not (lo <= self.bits <= hi or self.bits >= IDENTITY_INT_BITS):
                raise QuantConfigError(
                    f"TensorSpec.bits={self.bits} is unsupported for format 'int'; use {lo}..{hi} "
                    f"(or >= {IDENTITY_INT_BITS} for 'not quantized')")

        if not isinstance(self.symmetric, bool):
            raise QuantConfigError(f"TensorSpec.symmetric={self.symmetric!r} must be true or false")
        if fmt != "int" and not self.symmetric:
            raise QuantConfigError(f"TensorSpec.symmetric=false is impossible for format {fmt!r} (float formats are symmetric)")

        # granularity
        gran = self.granularity
        if fmt in ("mxfp8", "mxfp4"):
            gran = "group" if gran is None else gran
            if gran != "group":
                raise QuantConfigError(
                    f"TensorSpec.granularity={gran!r} is impossible for {fmt}: MX formats scale "
                    f"blocks of {MX_BLOCK_SIZE} along the last dim (granularity 'group')")
            if self.group_size not in (None, MX_BLOCK_SIZE):
                raise QuantConfigError(
                    f"TensorSpec.group_size={self.group_size!r} is impossible for {fmt}: the OCP MX "
                    f"block is {MX_BLOCK_SIZE}")
            set_("group_size", MX_BLOCK_SIZE)
        if gran is None:
            raise QuantConfigError(f"TensorSpec.granularity is required for format {fmt!r}; valid: {', '.join(GRANULARITIES)}")
        if gran not in GRANULARITIES:
            raise QuantConfigError(f"TensorSpec.granularity={gran!r} is unknown; valid: {', '.join(GRANULARITIES)}")
        set_("granularity", gran)

        if gran == "group":
            if not _is_int(self.group_size) or self.group_size < 1:
                raise QuantConfigError(f"TensorSpec.group_size={self.group_size!r}: granularity 'group' needs a positive integer group_size")
        elif self.group_size is not None:
            raise QuantConfigError(f"TensorSpec.group_size={self.group_size!r} is only meaningful with granularity 'group' (got {gran!r})")

        if gran == "block":
            bs = (128, 128) if self.block_size is None else self.block_size
            if (not isinstance(bs, (tuple, list)) or len(bs) != 2
                    or not all(_is_int(b) and b >= 1 for b in bs)):
                raise QuantConfigError(f"TensorSpec.block_size={self.block_size!r}: granularity 'block' needs two positive integers [rows, cols]")
            set_("block_size", (int(bs[0]), int(bs[1])))
        elif self.block_size is not None:
            raise QuantConfigError(f"TensorSpec.block_size={self.block_size!r} is only meaningful with granularity 'block' (got {gran!r})")

        # dynamic: per-token and MX scales exist only for the tensor at hand.
        implied_dynamic = gran == "token" or fmt in ("mxfp8", "mxfp4")
        if self.dynamic is None:
            set_("dynamic", implied_dynamic)
        elif not isinstance(self.dynamic, bool):
            raise QuantConfigError(f"TensorSpec.dynamic={self.dynamic!r} must be true or false")
        elif implied_dynamic and not self.dynamic:
            raise QuantConfigError(
                f"TensorSpec.dynamic=false is impossible with format {fmt!r} / granularity {gran!r}: "
                f"those scales are computed from the current tensor")

    # ------------------------------------------------------------------ helpers
    @property
    def is_identity(self) -> bool:
        """True when this spec leaves tensors untouched (format 'none' or int bits >= 16)."""
        return self.format == "none" or (self.format == "int" and self.bits >= IDENTITY_INT_BITS)

    @property
    def is_mx(self) -> bool:
        return self.format in ("mxfp8", "mxfp4")

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in _SPEC_KEYS}
        if d["scale_format"] == "float":
            del d["scale_format"]          # the default: fingerprints as before the field existed
        if d["block_size"] is not None:
            d["block_size"] = list(d["block_size"])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, where: str = "spec") -> "TensorSpec | None":
        """Build from a dict (``None`` stays ``None`` = not quantized); ``where`` names the
        place in the scheme file for error messages."""
        if d is None:
            return None
        if isinstance(d, TensorSpec):
            return d
        if not isinstance(d, Mapping):
            raise QuantConfigError(f"{where}: expected an object with keys {', '.join(_SPEC_KEYS)}, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_SPEC_KEYS))
        if unknown:
            raise QuantConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(_SPEC_KEYS)}")
        kw = dict(d)
        if isinstance(kw.get("block_size"), list):
            kw["block_size"] = tuple(kw["block_size"])
        try:
            return cls(**kw)
        except QuantConfigError as e:
            raise QuantConfigError(f"{where}: {e}") from None


def _off(spec: TensorSpec | None) -> TensorSpec | None:
    """Identity specs are stored as None so 'off' has one spelling."""
    return None if spec is None or spec.is_identity else spec


@dataclass(frozen=True)
class TargetScheme:
    """Specs of one linear target: its weights and its inputs (None = not quantized)."""

    weight: TensorSpec | None = None
    input: TensorSpec | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "weight", _off(self.weight))
        object.__setattr__(self, "input", _off(self.input))

    @property
    def is_identity(self) -> bool:
        return self.weight is None and self.input is None

    def to_dict(self) -> dict[str, Any]:
        return {"weight": self.weight.to_dict() if self.weight else None,
                "input": self.input.to_dict() if self.input else None}


@dataclass(frozen=True)
class QuantScheme:
    """A named scheme: per-target linear specs plus the attention-cache spec."""

    name: str
    targets: dict[str, TargetScheme] = field(default_factory=dict)
    cache: TensorSpec | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise QuantConfigError(f"QuantScheme.name={self.name!r} must be a non-empty string")
        bad = sorted(set(self.targets) - set(LINEAR_TARGETS))
        if bad:
            raise QuantConfigError(
                f"scheme {self.name!r}: unknown linear target(s) {', '.join(bad)}; valid: "
                f"{', '.join(LINEAR_TARGETS)} (the attention cache is the 'cache' key)")
        # Every linear target is present so lookups never KeyError.
        full = {t: self.targets.get(t) or TargetScheme() for t in LINEAR_TARGETS}
        object.__setattr__(self, "targets", full)
        object.__setattr__(self, "cache", _off(self.cache))

    def __hash__(self) -> int:  # the targets dict is unhashable; equal schemes share content
        return hash((self.name, self.description, self.fingerprint()))

    def target(self, name: str) -> TargetScheme:
        """Specs of a linear target ('attn-linear' or 'moe'; a wider target has its base's)."""
        name = _WIDER.get(name, name)
        if name not in LINEAR_TARGETS:
            raise QuantConfigError(f"{name!r} is not a linear target; valid: {', '.join(LINEAR_TARGETS)}")
        return self.targets[name]

    def quantizes(self, target: str) -> bool:
        """Whether this scheme quantizes anything for ``target``."""
        if target == CACHE_TARGET:
            return self.cache is not None
        return not self.target(target).is_identity

    def check_targets(self, targets: Iterable[str]) -> list[str]:
        """Validate targets and refuse ones this scheme leaves untouched (a silent no-op run
        would look like a successful quantization)."""
        targets = parse_targets(targets)
        idle = [t for t in targets if not self.quantizes(t)]
        if idle:
            raise QuantConfigError(
                f"scheme {self.name!r} quantizes nothing for target(s) {', '.join(idle)}; "
                f"it covers: {', '.join(t for t in valid_targets() if self.quantizes(t)) or 'nothing'}")
        return targets

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description,
                "targets": {t: self.targets[t].to_dict() for t in LINEAR_TARGETS},
                "cache": self.cache.to_dict() if self.cache else None}

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of what the scheme *does* (name and description are
        left out: a renamed copy of a scheme produces interchangeable parameters)."""
        content = {"targets": {t: self.targets[t].to_dict() for t in LINEAR_TARGETS},
                   "cache": self.cache.to_dict() if self.cache else None}
        blob = json.dumps(content, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], source: str = "scheme") -> "QuantScheme":
        """Parse the file format described in the module docstring. Also accepts the output
        of ``to_dict`` (where every target is spelled out)."""
        if not isinstance(d, Mapping):
            raise QuantConfigError(f"{source}: expected a JSON object at the top level, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_SCHEME_KEYS))
        if unknown:
            raise QuantConfigError(f"{source}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(_SCHEME_KEYS)}")
        name = d.get("name")
        if not isinstance(name, str) or not name:
            raise QuantConfigError(f"{source}: 'name' is required and must be a non-empty string")
        default = {k: TensorSpec.from_dict(d.get(k), f"{source}: {k}") for k in _TARGET_KEYS}
        overrides = d.get("targets") or {}
        if not isinstance(overrides, Mapping):
            raise QuantConfigError(f"{source}: 'targets' must be an object keyed by {', '.join(LINEAR_TARGETS)}")
        bad_t = sorted(set(overrides) - set(LINEAR_TARGETS))
        if bad_t:
            hint = " (DeepSeek-V4 has MoE layers: use 'moe')" if "mlp" in bad_t else ""
            raise QuantConfigError(f"{source}: targets: unknown target(s) {', '.join(bad_t)}; valid: {', '.join(LINEAR_TARGETS)}{hint}")
        targets = {}
        for t in LINEAR_TARGETS:
            spec = dict(default)
            o = overrides.get(t, {})
            if not isinstance(o, Mapping):
                raise QuantConfigError(f"{source}: targets.{t} must be an object with keys weight / input")
            bad = sorted(set(o) - set(_TARGET_KEYS))
            if bad:
                raise QuantConfigError(f"{source}: targets.{t}: unknown key(s) {', '.join(bad)}; valid: weight, input")
            for k in _TARGET_KEYS:
                if k in o:  # present-but-null means "off" for this target
                    spec[k] = TensorSpec.from_dict(o[k], f"{source}: targets.{t}.{k}")
            targets[t] = TargetScheme(**spec)
        cache = TensorSpec.from_dict(d.get("cache"), f"{source}: cache")
        desc = d.get("description") or ""
        return cls(name=name, targets=targets, cache=cache, description=str(desc))


# ---------------------------------------------------------------------------------- loading
def builtin_schemes() -> list[str]:
    """Names of the schemes shipped in amct_ext/quant/schemes/*.json."""
    return sorted(p.stem for p in SCHEME_DIR.glob("*.json"))


def _read_file(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml  # optional dependency
        except ImportError:
            raise QuantConfigError(f"{path}: reading YAML schemes needs PyYAML (pip install pyyaml); or write the scheme as JSON") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise QuantConfigError(f"{path}: invalid YAML: {e}".replace("\n", " ")) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise QuantConfigError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None


def load_scheme(name_or_path: "str | Path | QuantScheme | Mapping[str, Any]") -> QuantScheme:
    """A built-in scheme by name, a scheme file (.json, or .yaml/.yml with PyYAML), a dict
    in the file format, or a QuantScheme (returned as is)."""
    if isinstance(name_or_path, QuantScheme):
        return name_or_path
    if isinstance(name_or_path, Mapping):
        return QuantScheme.from_dict(name_or_path)
    s = str(name_or_path)
    path = Path(s)
    looks_like_file = path.suffix.lower() in (".json", ".yaml", ".yml") or "/" in s or "\\" in s
    if looks_like_file:
        if not path.is_file():
            raise QuantConfigError(f"scheme file {s} does not exist")
        return QuantScheme.from_dict(_read_file(path), source=s)
    if s in builtin_schemes():
        p = SCHEME_DIR / f"{s}.json"
        return QuantScheme.from_dict(_read_file(p), source=str(p))
    raise QuantConfigError(f"unknown scheme {s!r}; built-in schemes: {', '.join(builtin_schemes())} (or give a .json/.yaml path)")


def parse_targets(targets: "str | Iterable[str]") -> list[str]:
    """``"attn-linear,moe"`` (or a list) -> validated, de-duplicated targets in canonical order."""
    if isinstance(targets, str):
        items = targets.split(",")
    else:
        items = list(targets)
    valid = valid_targets()
    names = []
    for raw in items:
        if not isinstance(raw, str):
            raise QuantConfigError(f"quant target {raw!r} must be a string; valid: {', '.join(valid)}")
        t = raw.strip().lower()
        if not t:
            continue
        if t == "mlp":
            raise QuantConfigError("quant target 'mlp' does not exist: DeepSeek-V4 has MoE layers, use 'moe'")
        if t not in valid:
            raise QuantConfigError(f"unknown quant target {t!r}; valid: {', '.join(valid)}")
        names.append(t)
    if not names:
        raise QuantConfigError(f"no quant target given; valid: {', '.join(valid)}")
    for group in ((key, wide) for wide, key in _WIDER.items()):
        given = [t for t in group if t in names]
        if len(given) > 1:
            raise QuantConfigError(f"quant targets {' and '.join(given)} exclude each other "
                                   f"({group[-1]} already contains {group[0]}); give one")
    return [t for t in valid if t in names]



def spec_targets(targets: Iterable[str]) -> list[str]:
    """``targets`` with each name replaced by the scheme key whose specs it uses
    (a wider target -> the one it widens, V4: ``attn-linear-all`` -> ``attn-linear``): for code
    that describes what specs a run applies (export configs, plans) rather than which modules."""
    out = [_WIDER.get(t, t) for t in parse_targets(targets)]
    return [t for t in valid_targets() if t in out]
