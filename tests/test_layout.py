"""The amct_ext layout of ARCHITECTURE.md: which subpackage may import which, and nothing flat
beside errors.py / base.py (casebook/layout.md)."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "amct_ext"

# subpackage -> the amct_ext subpackages / top-level modules its modules may import at module level
ALLOWED = {
    "runtime": {"runtime", "errors"},
    "io": {"io", "runtime", "errors"},
    "quant": {"quant", "runtime", "errors"},
}
# imports inside functions (lazy) that cross a layer on purpose
LAZY_ALLOWED = {
    "io": {"export"},      # CheckpointReader decodes exported checkpoints (export/readback.py)
}
FLAT = {"__init__.py", "base.py", "errors.py"}


def _imported_parts(path: Path):
    """(top-level amct_ext part, lazy) for every amct_ext import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = path.relative_to(REPO).with_suffix("").parts[:-1]      # ("amct_ext", "io")
    in_function = set()
    for node in tree.body:
        for sub in ast.walk(node):
            if not isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(sub):
                in_function.add(id(inner))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = own[:len(own) - node.level + 1]
                mod = list(base) + (node.module.split(".") if node.module else [])
            else:
                mod = (node.module or "").split(".")
            targets = [mod] if len(mod) > 1 else [mod + [a.name] for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".") for a in node.names]
        else:
            continue
        for t in targets:
            if t[0] == "amct_ext" and len(t) > 1:
                yield t[1], id(node) in in_function


def test_lower_layers_import_only_what_the_architecture_allows():
    offenders = []
    for sub, allowed in ALLOWED.items():
        for f in sorted((PKG / sub).glob("*.py")):
            for part, lazy in _imported_parts(f):
                ok = part in allowed or (lazy and part in LAZY_ALLOWED.get(sub, set()))
                if not ok:
                    offenders.append(f"{f.relative_to(REPO)} imports amct_ext.{part}{' (lazy)' if lazy else ''}")
    assert offenders == []


def test_no_flat_modules_beside_the_subpackages():
    flat = sorted(f.name for f in PKG.glob("*.py") if f.name not in FLAT)
    assert flat == [], f"place these in a subpackage (ARCHITECTURE.md): {flat}"


def test_subpackage_inits_import_nothing():
    for sub in ("runtime", "io", "quant", "pipeline", "export"):
        tree = ast.parse((PKG / sub / "__init__.py").read_text(encoding="utf-8"))
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], sub
