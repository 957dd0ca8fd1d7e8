"""Recipes: ordered lists of algorithms, from ``--algo`` strings or recipe files.

    --algo gptq
    --algo smoothquant,gptq,clip
    --algo gptq:act_order=true:block_size=64,clip:epochs=4
    --recipe recipe.json     {"recipe": [{"algo": "gptq", "act_order": true}, {"algo": "clip"}]}
                             (or a bare list; YAML with the same keys when PyYAML is importable)

Each entry names a registered algorithm; the other keys are fields of its config dataclass.
Values given on the command line are parsed as JSON scalars when they can be (``true``,
``64``, ``0.5``), else kept as strings; each is then checked against the field's type.
Unknown algorithms, unknown fields and ill-typed values raise :class:`RecipeError` naming the
source, the entry and the field.

Registry: :func:`register` (a class decorator) adds an algorithm; :data:`BUILTIN_MODULES`
names the modules imported on first lookup, so ``amct_ext.algorithms`` imports nothing heavy.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..errors import ConfigError
from .base import Algorithm, Needs

#: algorithm name -> module that registers it (imported lazily, on first lookup)
BUILTIN_MODULES = {
    "rtn": "amct_ext.algorithms.rtn",
    "gptq": "amct_ext.algorithms.gptq",
    "clip": "amct_ext.algorithms.clipping",
    "hclip": "amct_ext.algorithms.hessian_clip",
    "learned_clip": "amct_ext.algorithms.learned_clip",
    "smoothquant": "amct_ext.algorithms.smoothing",
    "awq": "amct_ext.algorithms.smoothing",
    "autoround": "amct_ext.algorithms.rounding",
    "blockround": "amct_ext.algorithms.block_rounding",
}

_REGISTRY: dict[str, type[Algorithm]] = {}


class RecipeError(ConfigError):
    """A recipe names an unknown algorithm or field, or gives a value of the wrong type."""


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make ``cls`` available under ``cls.name``."""
    if not cls.name:
        raise TypeError(f"{cls.__name__}.name is empty")
    other = _REGISTRY.get(cls.name)
    if other is not None and other is not cls:
        raise TypeError(f"algorithm name {cls.name!r} is registered twice ({other.__name__}, {cls.__name__})")
    _REGISTRY[cls.name] = cls
    return cls


def known_algorithms() -> list[str]:
    return sorted(set(_REGISTRY) | set(BUILTIN_MODULES))


def algorithm_class(name: str, where: str = "recipe") -> type[Algorithm]:
    if name not in _REGISTRY and name in BUILTIN_MODULES:
        importlib.import_module(BUILTIN_MODULES[name])
    cls = _REGISTRY.get(name)
    if cls is None:
        raise RecipeError(f"{where}: unknown algorithm {name!r}; known: {', '.join(known_algorithms())}")
    return cls


# ----------------------------------------------------------------------------- field checking
def _type_ok(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, value coerced): ints are accepted for float fields; bool is never an int."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        for arg in typing.get_args(tp):
            ok, v = _type_ok(value, arg)
            if ok:
                return True, v
        return False, value
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    if origin is typing.Literal:
        return value in typing.get_args(tp), value
    return True, value  # other annotations: the algorithm's check() decides


def build_algorithm(name: str, options: Mapping[str, Any], where: str = "recipe") -> Algorithm:
    """An algorithm instance from its name and field values, every field checked."""
    cls = algorithm_class(name, where)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in options.items():
        if key not in fields:
            valid = ", ".join(fields) or "(none)"
            raise RecipeError(f"{where}: algorithm {name!r} has no field {key!r}; valid: {valid}")
        ok, coerced = _type_ok(value, hints.get(key, Any))
        if not ok:
            raise RecipeError(f"{where}: {name}.{key} = {value!r} is not a valid "
                              f"{getattr(hints.get(key), '__name__', hints.get(key))}")
        kwargs[key] = coerced
    algo = cls(**kwargs)
    from .field_ranges import check_field_ranges

    bad = check_field_ranges(algo, where, finite_only=True)   # NaN / inf, named with the recipe
    if bad is not None:
        raise RecipeError(bad)
    try:
        algo.check()
    except RecipeError:
        raise
    except ConfigError as e:
        raise RecipeError(f"{where}: {name}: {e}") from None
    bad = check_field_ranges(algo, where)     # negative, absurdly large (after its own rules)
    if bad is not None:
        raise RecipeError(bad)
    return algo


@dataclass
class Recipe:
    """An ordered list of algorithms run on every unit."""

    algorithms: list[Algorithm] = field(default_factory=list)
    source: str = ""

    def __post_init__(self) -> None:
        # a block-level algorithm runs after the layer's unit algorithms (the workflow runs
        # them in that order): a unit algorithm after it would be run before it, silently
        seen_block = None
        for a in self.algorithms:
            if a.solves_block:
                if seen_block is not None:
                    raise RecipeError(f"recipe {self.source or self}: two block-level algorithms "
                                      f"({seen_block}, {a.name}); at most one, last")
                seen_block = a.name
            elif seen_block is not None:
                raise RecipeError(f"recipe {self.source or self}: {a.name!r} comes after the block-level "
                                  f"{seen_block!r}, which must be the last entry (it tunes the whole layer "
                                  f"after the unit algorithms)")

    @property
    def names(self) -> list[str]:
        return [a.name for a in self.algorithms]

    @property
    def block_algorithm(self) -> Algorithm | None:
        """The block-level algorithm (the last entry), or None."""
        return self.algorithms[-1] if self.algorithms and self.algorithms[-1].solves_block else None

    def unit_recipe(self) -> "Recipe":
        """The recipe without its block-level algorithm: what runs on the units (``rtn`` when
        nothing else is left, so the units keep a well-defined RTN report)."""
        algos = [a for a in self.algorithms if not a.solves_block]
        return Recipe(algos or [build_algorithm("rtn", {})], source=self.source)

    def settings(self) -> list[dict[str, Any]]:
        return [a.settings() for a in self.algorithms]

    def needs(self) -> Needs:
        """What the workflow captures for this recipe: the union of its algorithms' needs."""
        out = Needs(calls=False, statistics=False)
        for a in self.algorithms:
            out = out | a.needs()
        return out

    def __str__(self) -> str:
        return ",".join(self.names) or "(empty)"


def recipe_label(settings: Sequence[dict[str, Any]]) -> str:
    """The ``--algo`` text of recorded settings (``Recipe.settings()``, as report.json and
    ptq_params/meta.json keep them): each algorithm with the options that differ from its
    defaults (``hclip,gptq:sequential=false``), so a run is named by what RAN, whatever the
    defaults are today. Unknown names or options are kept as recorded."""
    parts = []
    for e in settings:
        name = e["name"]
        try:
            base = {f.name: f.default for f in dataclasses.fields(algorithm_class(name))
                    if f.default is not dataclasses.MISSING}
        except RecipeError:
            base = None
        opts = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in e.items()
                if k != "name" and (base is None or (k in base and base[k] != v))]
        parts.append(":".join([name, *opts]))
    return ",".join(parts)


# ----------------------------------------------------------------------------- parsing
def _cli_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_algo(spec: str, where: str = "--algo") -> Recipe:
    """``name[:key=value...][,name...]`` -> Recipe."""
    if not isinstance(spec, str) or not spec.strip():
        raise RecipeError(f"{where}: empty algorithm list; known: {', '.join(known_algorithms())}")
    algos = []
    for i, item in enumerate(spec.split(",")):
        item = item.strip()
        if not item:
            raise RecipeError(f"{where}: entry {i} is empty in {spec!r}")
        name, *opts = item.split(":")
        options = {}
        for opt in opts:
            key, eq, value = opt.partition("=")
            if not eq or not key:
                raise RecipeError(f"{where}: option {opt!r} of {name!r} must be key=value")
            options[key.strip()] = _cli_value(value.strip())
        algos.append(build_algorithm(name.strip(), options, f"{where} entry {i} ({name.strip()})"))
    return Recipe(algos, source=spec)


def recipe_from_data(data: Any, where: str) -> Recipe:
    """A recipe from parsed JSON / YAML: ``{"recipe": [...]}`` or a bare list of entries, each
    ``{"algo": name, field: value...}``."""
    if isinstance(data, Mapping):
        extra = sorted(set(data) - {"recipe", "description"})
        if extra:
            raise RecipeError(f"{where}: unknown top-level key(s) {', '.join(extra)}; expected 'recipe' (and 'description')")
        if "recipe" not in data:
            raise RecipeError(f"{where}: missing key 'recipe' (a list of algorithm entries)")
        data = data["recipe"]
    if not isinstance(data, list) or not data:
        raise RecipeError(f"{where}: 'recipe' must be a non-empty list of entries like {{\"algo\": \"gptq\"}}")
    algos = []
    for i, entry in enumerate(data):
        if isinstance(entry, str):
            entry = {"algo": entry}
        if not isinstance(entry, Mapping) or "algo" not in entry:
            raise RecipeError(f"{where}: entry {i} must be a mapping with an 'algo' key, got {entry!r}")
        options = {k: v for k, v in entry.items() if k != "algo"}
        algos.append(build_algorithm(str(entry["algo"]), options, f"{where} entry {i} ({entry['algo']})"))
    return Recipe(algos, source=where)


def load_recipe_file(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {path} not found")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError(f"recipe file {path}: unreadable ({e})") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml  # optional dependency
        except ImportError:
            raise RecipeError(f"recipe file {path}: YAML needs PyYAML (pip install pyyaml), "
                              "or write the recipe as JSON") from None
        try:
            data = yaml.safe_load(text)
        except (yaml.YAMLError, RecursionError) as e:
            raise RecipeError(f"recipe file {path}: invalid YAML ({str(e).splitlines()[0]})") from None
    else:
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:   # nested 100,000 deep: one line
            raise RecipeError(f"recipe file {path}: invalid JSON ({e})") from None
    return recipe_from_data(data, str(path))


def resolve_recipe(algo: str | None = None, recipe_file: str | Path | None = None,
                   default: str | Sequence[Mapping[str, Any]] | None = None) -> Recipe:
    """``--algo`` or ``--recipe`` (not both), else ``default`` (an algo string or entries)."""
    if algo and recipe_file:
        raise RecipeError("pass either --algo or --recipe, not both")
    if recipe_file:
        return load_recipe_file(recipe_file)
    if algo:
        return parse_algo(algo)
    if default is None:
        raise RecipeError("no algorithm given and no default recipe")
    if isinstance(default, str):
        return parse_algo(default, "default recipe")
    return recipe_from_data(list(default), "default recipe")


__all__ = ["Recipe", "RecipeError", "register", "known_algorithms", "algorithm_class", "build_algorithm",
           "parse_algo", "recipe_from_data", "load_recipe_file", "resolve_recipe", "BUILTIN_MODULES",
           "DEFAULT_RECIPES", "BEST_RECIPES", "NAMED_RECIPES", "named_recipe", "default_recipe",
           "resolve_named_recipe", "choose_recipe", "RecipeChoice"]


# ----------------------------------------------------------------------------- defaults
#: The default recipe and propagation of every built-in scheme. Two rules (issues 24 and 34):
#: 1. it runs a real V4-Flash layer (128 x 2048 calibration tokens, one H200) within 60 s and the
#:    host-memory bound, or within 90 s when it has a block stage (block-wise rounding: the grouped
#:    experts and fused rounding kernels of issue 34, RESULTS' block-rounding section);
#: 2. among those, the best on the whole test split (1487 windows, the mean over calibration seeds
#:    0-2; the 64-window splits disagree by more than recipes differ, RESULTS §3.3), else on the DEV
#:    split (windows 64-127, never the reported 0-63; tiny-trained, 16 x 256 calibration).
#: The weight-only integer schemes and w4a8 run block-wise rounding at 100 steps with float16 offsets
#: (BLOCKROUND_DEFAULT): ahead of Intel's auto-round 0.16.1 and of the statistics-path defaults they
#: replace on the whole split (benchmarks/results/block-rounding.md, quality/blockround_default.json),
#: and on the release-format testbed's dev split (issue 35: the same choice from the released weights).
#: Dev PPLs of the others, 2026-12-01 / 02 (log §3.1 and its addenda) beside their entries.
#:
#: BLOCKROUND_DEFAULT: block-wise SignRound over each whole decoder layer (BlockRounding), started from
#: hclip's clips: 100 steps of batch 8 (lr 1/100, decayed), offsets in float16 (half the device memory;
#: the kernels step in float32), the end state kept unless the start was better. 61.5 s capture + solve
#: a V4-Flash layer on one H200 (median of 3 warm runs; 79 s in the machine's first run), 51.4 GiB device
#: peak (73 s / 48.9 GiB on an H100 before recompute_units=false); 83 s at w4a8 on the H100 (its
#: activation fake-quant in every step).
BLOCKROUND_DEFAULT = "hclip,blockround:keep_best=false:offset_dtype=float16:iters=100"
DEFAULT_RECIPES: dict[str, tuple[str, str]] = {
    "w8a8": ("rtn", "float"),                 # dev: RTN 244.295 (clip 244.277 within 0.1 %, replays calls)
    # until issue 34 w4a16-g128 ran hclip:sweeps=2,gptq:sequential=false@float (dev 244.567; 46.6 s a
    # V4-Flash layer on the H200) and w3a16-g128 hclip,gptq@quant (dev 252.721; 29.6 s)
    "w4a16-g128": (BLOCKROUND_DEFAULT, "quant"),
    "w3a16-g128": (BLOCKROUND_DEFAULT, "quant"),
    "w4a16": (BLOCKROUND_DEFAULT, "quant"),        # until issue 34: hclip,gptq:sequential=false@float (dev 244.708)
    # until 2026-12-06 hclip,gptq:sequential=false@quant (dev 245.972; 24.6 s a V4-Flash layer). Block-wise
    # rounding: whole split mean of seeds 0-2 304.87 against 306.56 (quality/w4a8_default.json), and
    # on the release testbed (issue 35) 303.99 against 305.88 whole split (mean of seeds), 245.33 against
    # 247.84 on its dev split; 82.8 s capture + solve a V4-Flash layer (H100, median of 2 warm runs;
    # benchmarks/results/block-rounding.md)
    "w4a8": (BLOCKROUND_DEFAULT, "quant"),
    "w2a16-g64": (BLOCKROUND_DEFAULT, "quant"),    # until issue 34: hclip:sweeps=2@float (dev 309.981; windows 0-63 338.45)
    "fp8": ("gptq:sequential=false", "float"),               # dev 244.626 < hclip,gptq 245.150; best clip 244.473
    "mxfp8": ("gptq:sequential=false", "float"),             # dev (hclip is a no-op on MX) 244.080 = best clip,gptq@quant 244.077
    "mxfp4": ("rtn", "float"),                # dev: RTN 253.504 < gptq 253.885 < gptq@quant = clip,gptq@quant 254.673
    "kv8": ("rtn", "float"),                  # cache-only schemes: no weights to solve
    "kv8-fp8": ("rtn", "float"),
}
# A user's scheme file: hclip (statistics only, never worse than RTN on each leaf's exact output
# error, so within the time target whatever the scheme); its best is clip, which beat RTN on every
# built-in scheme of the table but w8a8 (274.38 against 274.25, inside the seed noise).
DEFAULT_FALLBACK = ("hclip", "float")
BEST_FALLBACK = ("clip", "float")

#: The second named recipe of a scheme, ``--recipe best``: the best quality found (on the whole
#: test split where it was measured, RESULTS §3.3-3.4; else on the dev split) where it costs more
#: than the default's real-size time target allows (issue 24: the
#: default runs a V4-Flash layer in <= 60 s on one H200; `best` may replay every captured call).
#: A scheme not listed here has no slower recipe worth its cost: ``best`` is its default.
BLOCKROUND_BEST = "hclip,blockround:keep_best=false"
BEST_RECIPES: dict[str, tuple[str, str]] = {
    # block-wise SignRound over each whole decoder layer against the float model's output (auto-round's
    # own method, enable_quanted_input), started from hclip's clip; keep_best=false: no copy of the
    # offsets for a best step (a real-size layer's memory). 135.6 s capture + solve a V4-Flash layer on
    # one H200 with float32 offsets, 65.3 GiB (RESULTS §2, run A32).
    # whole test split (1487 windows) against auto-round 0.16 on the same CPU / the recipe it replaces
    # (RESULTS §3.4); on the dev split within 0.1 % of the old best
    "w4a16-g128": (BLOCKROUND_BEST, "quant"),   # 303.895 vs 304.952 / clip,gptq@float 305.350
    "w3a16-g128": (BLOCKROUND_BEST, "quant"),   # 306.813 vs 309.318 / autoround@float 309.860
    "w4a16": (BLOCKROUND_BEST, "quant"),        # 304.592 vs 304.852 / clip,gptq@quant 305.661
    # whole split, mean of seeds 0-2: 304.70 against clip,gptq@float's 306.36 (the best until 2026-12-06)
    # and the default's 304.87 (quality/w4a8_default.json; from the release it trails the default)
    "w4a8": (BLOCKROUND_BEST, "quant"),
    "w2a16-g64": (BLOCKROUND_BEST, "quant"),    # the default's method at 200 steps (clip@float until issue 34)
    "fp8": ("clip", "float"),                 # dev 244.473 (default 244.626)
    "mxfp8": ("clip,gptq", "quant"),          # dev 244.077 (default 244.080)
}

#: the recipe names ``--recipe`` accepts besides a file (a file called like one: ``./best``)
NAMED_RECIPES = ("default", "best")


def named_recipe(scheme, name: str = "default",
                 source_defaults: dict[str, tuple[str, str]] | None = None) -> tuple[str, str]:
    """(algo string, propagate) of the named recipe ``name`` (one of NAMED_RECIPES) for a
    scheme, looked up by what the scheme *does* (its fingerprint), never by its name: a user's
    3-bit scheme file named "w8a8" is not w8a8 and gets DEFAULT_FALLBACK, a renamed copy of a
    built-in scheme gets that scheme's recipes. A string is loaded as a scheme name or file first.
    ``source_defaults``: {built-in scheme: (algo, propagate)} replacing DEFAULT_RECIPES for the
    checkpoint's weights (the model's ``source_defaults``: a release already on a low-precision
    grid); ``best`` of a scheme with no BEST_RECIPES entry is its default, so it follows."""
    from ..quant.schemes import QuantScheme, load_scheme

    if name not in NAMED_RECIPES:
        raise RecipeError(f"--recipe {name}: not a named recipe ({', '.join(NAMED_RECIPES)}) nor a file")
    if not isinstance(scheme, QuantScheme):
        scheme = load_scheme(scheme)
    builtin = builtin_scheme_named(scheme)
    if builtin is None:
        return BEST_FALLBACK if name == "best" else DEFAULT_FALLBACK
    default = (source_defaults or {}).get(builtin) or DEFAULT_RECIPES.get(builtin, DEFAULT_FALLBACK)
    return BEST_RECIPES.get(builtin, default) if name == "best" else default


def default_recipe(scheme) -> tuple[str, str]:
    """(algo string, propagate) of the scheme's default recipe (``named_recipe(scheme)``)."""
    return named_recipe(scheme, "default")


def resolve_named_recipe(scheme, name: str = "default",
                         source_defaults: dict[str, tuple[str, str]] | None = None) -> tuple[Recipe, str]:
    """(Recipe, propagate) of the scheme's named recipe ``name`` (``named_recipe``), parsed."""
    algo, propagate = named_recipe(scheme, name, source_defaults)
    where = f"{name} recipe"
    return (parse_algo(algo, where) if isinstance(algo, str) else recipe_from_data(list(algo), where)), propagate


@dataclass
class RecipeChoice:
    """What ``--algo`` / ``--recipe`` / ``--legacy-solver`` chose. ``recipe`` None: the legacy
    solver; ``propagate``: the named recipe's propagation (None: not a named recipe, float
    unless given); ``source``: where the recipe came from (the report's "source");
    ``job_spec``: the job keys a recipe file held beside its algorithms."""

    recipe: Recipe | None
    propagate: str | None
    source: str
    job_spec: dict


def choose_recipe(scheme, algo: str | None = None, recipe: str | None = None, *, legacy: bool = False,
                  read_file: Callable[[str], tuple[Recipe, dict]] | None = None,
                  source_defaults: dict[str, tuple[str, str]] | None = None, source_label: str = "") -> RecipeChoice:
    """The one resolution of a run's recipe: ``--algo`` or ``--recipe FILE|default|best`` (not
    both; neither = the scheme's default recipe), or the legacy solver. ``read_file(path)`` ->
    (Recipe, job keys) reads a recipe file (default: ``load_recipe_file``, no job keys).
    ``source_defaults`` / ``source_label``: the named recipes the checkpoint's weights call for
    (``named_recipe``) and what those weights are (the report's source says when they applied)."""
    if legacy and (algo or recipe):
        raise ConfigError("--legacy-solver runs the learned-clip solver alone: drop --algo / --recipe")
    if algo and recipe:
        raise RecipeError("pass either --algo or --recipe, not both")
    if recipe and recipe not in NAMED_RECIPES:   # a file (one named like a named recipe: ./best)
        rec, job_spec = read_file(recipe) if read_file is not None else (load_recipe_file(recipe), {})
        return RecipeChoice(rec, None, str(recipe), job_spec)
    if algo:
        return RecipeChoice(parse_algo(algo), None, "--algo", {})
    if legacy:
        return RecipeChoice(None, None, "legacy", {})
    name = recipe or "default"
    rec, propagate = resolve_named_recipe(scheme, name, source_defaults)
    source = f"{name} for {scheme.name}'s content"
    if source_defaults and named_recipe(scheme, name, source_defaults) != named_recipe(scheme, name):
        source += f" from {source_label or 'this checkpoint'}"
    return RecipeChoice(rec, propagate, source, {})


def builtin_scheme_named(scheme) -> str | None:
    """The built-in scheme with the same content as ``scheme`` (None: none has)."""
    from ..quant.schemes import builtin_schemes, load_scheme

    fp = scheme.fingerprint()
    if scheme.name in builtin_schemes() and load_scheme(scheme.name).fingerprint() == fp:
        return scheme.name
    for name in builtin_schemes():
        if load_scheme(name).fingerprint() == fp:
            return name
    return None
