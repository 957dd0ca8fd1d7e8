import os
import stat

import pytest
import torch

from amct_ext.io.io_utils import atomic_save, atomic_write, atomic_write_json, safe_torch_load


def test_atomic_outputs_get_ordinary_permissions(tmp_path):
    """mkstemp creates 0600 files; outputs must be readable like any other file."""
    p = atomic_write_json({"a": 1}, tmp_path / "x.json")
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~mask


def test_failed_write_leaves_nothing(tmp_path):
    def boom(tmp):
        open(tmp, "w").write("half")
        raise RuntimeError("crash")

    with pytest.raises(RuntimeError):
        atomic_write(tmp_path / "out.pt", boom)
    assert list(tmp_path.iterdir()) == []


class Evil:
    """An arbitrary class: weights_only loading must refuse to unpickle it."""


def test_save_load_round_trip_is_weights_only(tmp_path):
    atomic_save({"w": torch.arange(3)}, tmp_path / "a.pt")
    assert torch.equal(safe_torch_load(tmp_path / "a.pt")["w"], torch.arange(3))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(Exception):
        safe_torch_load(tmp_path / "evil.pt")
