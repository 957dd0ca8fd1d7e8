"""Replaying a unit's captured calls: the losses every algorithm and the runner's guard share.

A captured call (``capture.UnitCall``) holds the unit's inputs and its FLOAT output. Replaying
it on the quantized unit and comparing with that output gives the unit's error; these are the
one implementation of that comparison (the RTN loss before a recipe, the kept loss after it,
an algorithm's own search).
"""
from __future__ import annotations

import zlib
from typing import Any, Sequence

import torch
from torch import nn

from .capture import UnitCall, detach_to


def output_tensor(out: Any) -> torch.Tensor:
    """The tensor a unit returned (the first element of a tuple / list output)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"unit output of type {type(out).__name__} is not a tensor")


def replay_calls(module: nn.Module, calls: Sequence[UnitCall], device: torch.device) -> None:
    """Run ``module`` on every call's inputs (on ``device``), outputs dropped: for the hooks
    that an algorithm attached (statistics of the leaves' inputs)."""
    with torch.no_grad():
        for call in calls:
            module(*detach_to(call.args, device), **detach_to(call.kwargs, device))


def call_sq_err(module: nn.Module, call: UnitCall, device: torch.device) -> tuple[torch.Tensor, int]:
    """(sum of squared errors in fp32, number of elements) of one replayed call; differentiable
    (an algorithm's training step backpropagates through it)."""
    out = output_tensor(module(*detach_to(call.args, device), **detach_to(call.kwargs, device)))
    ref = output_tensor(call.output).to(device)
    diff = out.float() - ref.float()
    return diff.square().sum(), diff.numel()


@torch.no_grad()
def unit_mse(module: nn.Module, calls: Sequence[UnitCall], device: torch.device) -> float:
    """MSE over every element of every call (float64 accumulation on the host)."""
    total, count = 0.0, 0
    for call in calls:
        se, n = call_sq_err(module, call, device)
        total += float(se.double().item())
        count += n
    return total / max(count, 1)


def unit_seed(seed: int, name: str) -> int:
    """A per-unit seed stable across processes (``hash()`` of a str is salted per process)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode("utf-8"))) % (2 ** 31)
