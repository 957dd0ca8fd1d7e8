"""``--device-memory-gb`` / ``device.cap_memory``: a run on a large card held to a smaller one's
memory (a 64-GB Ascend 910B planned on an 80-GB H100): every budget sees the cap, the allocator
is told it, and a cap the device cannot give (or a CPU run) is refused naming the flag."""
from __future__ import annotations

import types

import pytest
import torch

from amct_ext.errors import ConfigError
from amct_ext.runtime import device as devmod

GIB = 2 ** 30


@pytest.fixture
def fake_card(monkeypatch):
    """An 80-GiB 'cuda' card whose allocator records the fraction it is given."""
    told = {}
    card = types.SimpleNamespace(
        current_device=lambda: 0,
        get_device_properties=lambda index: types.SimpleNamespace(total_memory=80 * GIB),
        set_per_process_memory_fraction=lambda frac, index: told.update({index: frac}))
    monkeypatch.setattr(devmod, "_accel_module", lambda kind: card)
    monkeypatch.setattr(devmod, "_MEMORY_CAPS", {})
    return told


def test_the_cap_is_what_every_budget_sees_and_what_the_allocator_is_told(fake_card):
    dev = torch.device("cuda", 0)
    assert devmod.total_memory_bytes(dev) == 80 * GIB
    devmod.cap_memory(dev, 60 * GIB, "--device-memory-gb")
    assert devmod.total_memory_bytes(dev) == 60 * GIB
    assert fake_card == {0: 0.75}


def test_a_cap_the_card_cannot_give_is_refused(fake_card):
    with pytest.raises(ConfigError, match=r"--device-memory-gb 90 GiB: cuda:0 has 80.0 GiB"):
        devmod.cap_memory(torch.device("cuda", 0), 90 * GIB, "--device-memory-gb")
    assert fake_card == {}


def test_a_cap_on_the_cpu_is_refused():
    with pytest.raises(ConfigError, match="--device-memory-gb: the run is on cpu"):
        devmod.cap_memory("cpu", GIB, "--device-memory-gb")


@pytest.mark.parametrize("value, message", [(0, "must be > 0"), (-2, "must be a number of GiB")])
def test_the_flag_is_checked_with_the_plan(value, message, tmp_path):
    import models.deepseek_v4  # noqa: F401  (registers the model names)
    from amct_ext.pipeline.options import PtqOptions, plan_job

    with pytest.raises(ConfigError, match=f"--device-memory-gb .*{message}"):
        plan_job(PtqOptions(model="tiny", output_dir=str(tmp_path / "out"), device_memory_gb=value))
    assert not (tmp_path / "out").exists()
