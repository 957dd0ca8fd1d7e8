"""benchmarks/scripts/install_wheels.py: carried wheels, only what the machine lacks
(casebook/peer-llm-compressor.md P13)."""
from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from tests.conftest import load_script


def _tool():
    return load_script("benchmarks/scripts/install_wheels.py")


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    mod = name.replace("-", "_")
    p = folder / f"{mod}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(p, "w") as z:
        z.writestr(f"{mod}/__init__.py", f"VERSION = {version!r}\n")
        z.writestr(f"{mod}-{version}.dist-info/METADATA", meta)
    return p


def test_installs_what_is_missing_and_keeps_what_the_machine_has(tmp_path):
    t = _tool()
    w = tmp_path / "w"
    w.mkdir()
    _wheel(w, "i24-fake-root", "1.0", ["i24-fake-dep>=2", "packaging", 'i24-fake-never; python_version < "3"',
                                        "i24-fake-extra; extra == 'x'"])
    _wheel(w, "i24-fake-dep", "2.1", [])
    _wheel(w, "packaging", "0.1", [])            # an old copy: the installed packaging satisfies, so it stays
    install, kept, warnings = t.plan(["i24-fake-root"], t.carried_wheels(w), tmp_path / "site")
    assert install == ["i24_fake_dep-2.1-py3-none-any.whl", "i24_fake_root-1.0-py3-none-any.whl"]
    assert any(k.startswith("packaging ") for k in kept) and not warnings
    # the unpack path (a python without pip) puts the packages at the top of the target
    for n in install:
        t.unpack(w / n, tmp_path / "site")
    assert (tmp_path / "site" / "i24_fake_dep" / "__init__.py").read_text() == "VERSION = '2.1'\n"


def test_a_requirement_nobody_provides_is_one_error_line(tmp_path, capsys):
    t = _tool()
    w = tmp_path / "w"
    w.mkdir()
    _wheel(w, "i24-fake-root", "1.0", ["i24-fake-dep>=3"])
    _wheel(w, "i24-fake-dep", "2.1", [])         # carried, but too old
    with pytest.raises(SystemExit) as e:
        t.plan(["i24-fake-root"], t.carried_wheels(w), tmp_path / "site")
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: i24-fake-dep (i24-fake-dep>=3, needed by i24-fake-root)")
