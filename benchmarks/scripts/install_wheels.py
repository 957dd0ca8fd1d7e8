#!/usr/bin/env python
"""Install a peer's carried wheels on a machine that reaches no registry, only what is missing.

    python3 benchmarks/scripts/install_wheels.py WHEEL_DIR TARGET_DIR llmcompressor [--json F]
    PYTHONPATH=TARGET_DIR python3 -c "import llmcompressor"

Walks the requirements of the ROOT distributions (``Requires-Dist`` read from the carried wheels'
METADATA, markers evaluated for this interpreter, extras skipped) and, for each requirement:
- an installed distribution that satisfies it is kept (the machine's own torch, transformers,
  numpy, pyarrow ... stay in charge);
- otherwise a carried wheel that satisfies it is installed into TARGET_DIR (and its own
  requirements are walked);
- an installed one that does not satisfy it and no carried wheel: a warning (the import check
  that follows is the real test);
- neither installed nor carried: an error line naming the distribution and who needs it, exit 2.

Why not ``pip install --target --find-links``: with ``--target`` pip does not count the packages
already installed, so it would want torch and every other dependency from the wheel folder. Why
not ``--no-deps *.whl``: a carried wheel would then shadow the machine's newer copy for no reason.
The chosen wheels are installed with ``pip install --no-index --no-deps --target`` (or unpacked
directly when this python has no pip). A second run installs the same choice again (pip --upgrade); the stage marker skips it.
"""
from __future__ import annotations

import argparse
import email.parser
import importlib.metadata as md
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def wheel_metadata(path: Path) -> list[Requirement]:
    with zipfile.ZipFile(path) as z:
        name = next((n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)), None)
        if name is None:
            fail(f"{path}: no .dist-info/METADATA inside: not a wheel")
        msg = email.parser.Parser().parsestr(z.read(name).decode("utf-8", "replace"))
    return [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


def carried_wheels(folder: Path) -> dict[str, tuple[Version, Path]]:
    out: dict[str, tuple[Version, Path]] = {}
    for p in sorted(folder.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(p.name)
        if name in out:
            fail(f"{folder}: two wheels of {name} ({out[name][1].name}, {p.name}); keep one")
        out[name] = (version, p)
    return out


def installed_version(name: str, target: Path) -> Version | None:
    """The version this interpreter sees outside TARGET (what the machine itself has)."""
    paths = [p for p in sys.path if Path(p or ".").resolve() != target.resolve()]
    for dist in md.distributions(path=paths):
        if canonicalize_name(dist.metadata["Name"] or "") == name:
            return Version(dist.version)
    return None


def plan(roots: list[str], wheels: dict, target: Path) -> tuple[list[str], list[str], list[str]]:
    """(wheels to install, kept installed, warnings); exits on a requirement nobody provides."""
    env = {"extra": ""}
    todo = [(Requirement(r), "(root)") for r in roots]
    chosen: dict[str, str] = {}
    kept: dict[str, str] = {}
    warnings: list[str] = []
    seen: set[tuple[str, str]] = set()
    while todo:
        req, who = todo.pop(0)
        name = canonicalize_name(req.name)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        key = (name, str(req.specifier))
        if key in seen:
            continue
        seen.add(key)
        have = installed_version(name, target)
        if name in chosen:
            v = wheels[name][0]
            if not req.specifier.contains(v, prereleases=True):
                warnings.append(f"{who} wants {req}; the carried {name} {v} does not satisfy it")
            continue
        if have is not None and req.specifier.contains(have, prereleases=True):
            kept[name] = str(have)
            continue
        if name in wheels and req.specifier.contains(wheels[name][0], prereleases=True):
            chosen[name] = wheels[name][1].name
            todo += [(r, name) for r in wheel_metadata(wheels[name][1])]
            continue
        if have is not None:
            warnings.append(f"{who} wants {req}; installed {name} {have} does not satisfy it and no carried "
                            f"wheel does: trying the installed one")
            kept[name] = str(have)
            continue
        fail(f"{name} ({req}, needed by {who}) is neither installed nor among the carried wheels; "
             f"download it with pip download --no-deps into the wheel folder")
    return sorted(chosen.values()), [f"{k} {v}" for k, v in sorted(kept.items())], warnings


def unpack(whl: Path, target: Path) -> None:
    """A wheel is a zip of its install tree; .data/purelib and .data/platlib go to the top."""
    with zipfile.ZipFile(whl) as z:
        for n in z.namelist():
            m = re.match(r"[^/]+\.data/(purelib|platlib)/(.+)", n)
            dest = m.group(2) if m else (None if re.match(r"[^/]+\.data/", n) else n)
            if dest is None or dest.endswith("/"):
                continue
            out = (target / dest).resolve()
            if target.resolve() not in out.parents:
                fail(f"{whl}: member {n} would land outside {target}")
            out.parent.mkdir(parents=True, exist_ok=True)
            with z.open(n) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheels", type=Path)
    ap.add_argument("target", type=Path)
    ap.add_argument("roots", nargs="+", help="distributions to make importable, e.g. llmcompressor")
    ap.add_argument("--json", type=Path, default=None, help="write what was installed / kept here")
    a = ap.parse_args(argv)
    if not a.wheels.is_dir():
        fail(f"{a.wheels}: no such wheel folder (carry it)")
    wheels = carried_wheels(a.wheels)
    a.target.mkdir(parents=True, exist_ok=True)
    install, kept, warnings = plan(a.roots, wheels, a.target)
    for w in warnings:
        print(f"warning: {w}", flush=True)
    print(f"keep installed: {', '.join(kept) or '-'}", flush=True)
    print(f"install into {a.target}: {', '.join(install) or 'nothing'}", flush=True)
    paths = [str(wheels[parse_wheel_filename(n)[0]][1]) for n in install]
    if paths:
        has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode == 0
        if has_pip:
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--upgrade", "--target", str(a.target)] + paths, check=True)
        else:
            for p in paths:
                unpack(Path(p), a.target)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"installed": install, "kept": kept, "warnings": warnings}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
