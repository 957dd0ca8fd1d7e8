"""PTQ algorithms (one module each) and recipes (ordered lists of them).

    base.py      Algorithm / Needs / UnitData / SolveContext: the interface every algorithm implements
    recipe.py    registry, --algo / --recipe parsing
    rtn.py       round-to-nearest (nothing learned; the reference every algorithm must beat)
    learned_clip.py  learned clipping on every call (the pre-recipe solver, --legacy-solver)
    gptq.py      GPTQ (Hessian-based error compensation), batched over routed experts
    clipping.py  clipping that never loses: grid start + learned (Adam) clip, held-out check
    hessian_clip.py  hclip: clip factors from the capture's Hessians (no stored call), batched over experts
    runner.py    a recipe on the units of one layer (group entry points, RTN guard)
    smoothing.py SmoothQuant (fixed alpha) and AWQ (alpha searched per subgraph), scales folded
    rounding.py  AutoRound: SignSGD on per-weight rounding offsets + clip factors
"""
from .base import Algorithm, SolveContext, UnitData  # noqa: F401
from .recipe import Recipe, RecipeError, parse_algo, register, resolve_recipe  # noqa: F401
