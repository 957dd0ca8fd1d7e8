#!/usr/bin/env python
"""Functions (and methods) longer than a limit in the product code, longest first.

    python benchmarks/long_functions.py                # over 120 lines in amct_ext/, models/, tools/
    python benchmarks/long_functions.py --limit 60 --top 20

A function's length is its ``def`` line through its last line (decorators and the docstring
included), as Python's ``ast`` reports them. Exit code 1 when any function is over the limit.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRODUCT = ("amct_ext", "models", "tools")


def function_lengths(root: Path, folders=PRODUCT) -> list[tuple[int, str]]:
    """(lines, "path:line name") of every function under ``folders`` of ``root``."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    found.append((node.end_lineno - start + 1,
                                  f"{path.relative_to(root)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=120)
    ap.add_argument("--top", type=int, default=10, help="also list the N longest (default 10)")
    a = ap.parse_args(argv)
    lengths = function_lengths(REPO)
    over = [(n, where) for n, where in lengths if n > a.limit]
    print(f"functions over {a.limit} lines: {len(over)}")
    for n, where in over:
        print(f"  {n:5d}  {where}")
    print(f"the {a.top} longest:")
    for n, where in lengths[:a.top]:
        print(f"  {n:5d}  {where}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
