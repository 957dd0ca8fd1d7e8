"""What a PTQ run computes: scheme, targets, calibration, recipe and its run-level settings.

``PtqSpec`` is the one config object ``workflow.run_blockwise_ptq`` (and its torchrun
scale-out) takes for everything that changes a unit's result; how the run executes (memory
budgets, sharding, progress hooks) is ``workflow.PtqRuntime`` and never enters the
fingerprint. ``PtqSpec.solver_meta()`` is the one implementation of the "solver" part of
ptq_params/meta.json, so the CLI's early check of an output folder and the run itself compare
the very same dict.

Defaults are the CLI's: no recipe means the scheme's default recipe (``recipe.default_recipe``,
measured on the quality table), and no propagation means that default's propagation.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from ..base import PtqConfig
from ..errors import ConfigError
from ..quant.schemes import QuantScheme, parse_targets

#: what later layers are calibrated on: float predecessors, or the quantized ones (sequential)
PROPAGATE = ("float", "quant")


@dataclass
class PtqSpec:
    """Scheme, quant targets, calibration and the recipe of one PTQ run.

    ``recipe``: an ``algorithms.Recipe``, an ``--algo`` string, or None for the scheme's
    default recipe. ``propagate``: 'float' | 'quant' | None (the default recipe's choice for
    this scheme). ``holdout``: the share of each unit's calls held out by validating algorithms.
    ``guard``: a unit the recipe made worse than RTN on its calls falls back to RTN.
    Call :meth:`resolved` (or pass the spec to the workflow, which does) before reading
    ``recipe`` / ``propagate``."""

    scheme: QuantScheme
    targets: Sequence[str]
    calibration: PtqConfig = field(default_factory=PtqConfig)
    recipe: Any = None
    propagate: str | None = None
    holdout: float = 0.25
    guard: bool = True

    def resolved(self) -> "PtqSpec":
        """A checked copy with the targets parsed and the default recipe / propagation filled
        in; raises ConfigError (RecipeError) naming the field."""
        from ..algorithms.recipe import Recipe, parse_algo, resolve_named_recipe

        self.calibration.check()
        targets = tuple(self.scheme.check_targets(parse_targets(self.targets)))
        default, d_propagate = resolve_named_recipe(self.scheme, "default")   # by content, not by name
        recipe = self.recipe
        if recipe is None:
            recipe = default
        elif isinstance(recipe, str):
            recipe = parse_algo(recipe)
        elif not isinstance(recipe, Recipe):
            raise ConfigError(f"PtqSpec.recipe must be a Recipe, an --algo string or None, "
                              f"got {type(recipe).__name__}")
        propagate = self.propagate if self.propagate is not None else d_propagate
        if propagate not in PROPAGATE:
            raise ConfigError(f"propagate={propagate!r} is unknown; valid: {', '.join(PROPAGATE)}")
        if not (0 <= self.holdout < 1):
            raise ConfigError(f"holdout={self.holdout} must lie in [0, 1)")
        return replace(self, targets=targets, recipe=recipe, propagate=propagate)

    def solver_meta(self) -> dict[str, Any]:
        """The "solver" entry of ptq_params/meta.json: everything besides scheme, targets and
        calibration that changes a unit's result."""
        spec = self.resolved()
        return {**spec.calibration.solver_settings(), "recipe": spec.recipe.settings(),
                "propagate": spec.propagate, "holdout": spec.holdout, "guard": spec.guard}


def resolve_spec(scheme: QuantScheme, targets: Sequence[str] | str, calibration: PtqConfig, *,
                 algo: str | None = None, recipe_file: str | None = None, propagate: str | None = None,
                 holdout: float = 0.25, guard: bool = True) -> PtqSpec:
    """The spec of a command line: ``--algo`` or ``--recipe FILE|default|best`` (not both;
    neither = the scheme's default recipe), ``--propagate``, ``--holdout``, ``--no-guard``; checked."""
    from ..algorithms.recipe import choose_recipe

    choice = choose_recipe(scheme, algo, recipe_file)   # the one resolution (algorithms/recipe.py)
    recipe = choice.recipe if (algo or recipe_file) else None
    propagate = choice.propagate if propagate is None else propagate
    return PtqSpec(scheme, parse_targets(targets) if isinstance(targets, str) else targets, calibration,
                   recipe=recipe, propagate=propagate, holdout=holdout, guard=guard).resolved()
