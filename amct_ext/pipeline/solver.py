"""Blockwise PTQ solver for ONE unit: learnable weight clipping, MSE to the float output.

Given a quantized unit (an attention, an expert) and the calls captured while its float twin
ran (args, kwargs, float output), Adam optimises the unit's ``ptq_parameters()`` (one clip
factor per weight-scale block, in (0, 1]) to minimise

    MSE = sum over calls of ||unit_q(*args, **kwargs) - float_output||^2 / total elements

i.e. the mean squared error over every captured element (calls with more tokens weigh more).

Guarantees
- ``loss_before`` is the RTN loss (every clip at 1.0, the quantizer's full range).
- The returned state is the best seen: RTN, or the parameters after some epoch. So
  ``loss_after <= loss_before`` on the calibration data, always.
- Deterministic: calls are visited in capture order, the RNG is seeded per unit from the run
  seed and the unit name (no optimiser randomness today; the seed guards future use). Results
  are bit-reproducible on the same machine at the same torch thread count (a different
  count changes float reduction order).
"""
from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, asdict
from typing import Any, Sequence

import torch
from torch import nn

from .capture import UnitCall, _detach


@dataclass
class UnitResult:
    """What the report says about one unit."""

    name: str
    kind: str
    layer: int
    loss_before: float | None       # RTN MSE on the captured calibration calls (None: no calls)
    loss_after: float | None        # MSE of the kept parameters (<= loss_before)
    seconds: float
    n_calls: int
    n_params: int                   # learnable scalars (0: nothing to learn, RTN kept)
    best_epoch: int                 # 0 = RTN kept, k = after epoch k
    resumed: bool = False           # loaded from an earlier run's files, not solved now
    stats: dict[str, Any] | None = None   # recipe runs: per-algorithm statistics (algorithms/runner.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _to(obj: Any, device: torch.device) -> Any:
    """A captured call's (nested) tensors on ``device`` (capture's walker: they are detached already)."""
    return _detach(obj, device)


def _output_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"unit output of type {type(out).__name__} is not a tensor")


def _sq_err(module: nn.Module, call: UnitCall, device: torch.device) -> tuple[torch.Tensor, int]:
    """(sum of squared errors in fp32, number of elements) of one replayed call."""
    out = _output_tensor(module(*_to(call.args, device), **_to(call.kwargs, device)))
    ref = _output_tensor(call.output).to(device)
    diff = out.float() - ref.float()
    return diff.square().sum(), diff.numel()


@torch.no_grad()
def unit_mse(module: nn.Module, calls: Sequence[UnitCall], device: torch.device) -> float:
    """MSE over every element of every call (float64 accumulation on the host)."""
    total, count = 0.0, 0
    for call in calls:
        se, n = _sq_err(module, call, device)
        total += float(se.double().item())
        count += n
    return total / max(count, 1)


def unit_seed(seed: int, name: str) -> int:
    """A per-unit seed stable across processes (``hash()`` of a str is salted per process)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode("utf-8"))) % (2 ** 31)


def solve_unit(module: nn.Module, calls: Sequence[UnitCall], *, epochs: int, lr: float,
               device: torch.device, seed: int, name: str) -> tuple[float | None, float | None, int, int]:
    """Optimise ``module.ptq_parameters()`` in place; returns (loss_before, loss_after,
    best_epoch, n_learnable). ``module`` must already be on ``device``, quantizers on.

    The module's own float weights are frozen for the duration (only clips learn)."""
    torch.manual_seed(unit_seed(seed, name))
    was_training = module.training
    module.eval()  # QuantLinear skips its weight cache while a clip is trainable anyway
    frozen = [p for p in module.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    params = list(module.ptq_parameters())   # creates clips at 1.0 (= RTN) and enables grad
    n_learnable = sum(p.numel() for p in params)
    try:
        if not calls:
            return None, None, 0, n_learnable
        loss_before = unit_mse(module, calls, device)
        best_loss, best_epoch = loss_before, 0
        if not params or epochs == 0:
            return loss_before, loss_before, 0, n_learnable
        best_state = [p.detach().clone() for p in params]
        opt = torch.optim.Adam(params, lr=lr)
        for epoch in range(1, epochs + 1):
            for call in calls:
                opt.zero_grad(set_to_none=True)
                se, n = _sq_err(module, call, device)
                (se / n).backward()
                opt.step()
            loss = unit_mse(module, calls, device)
            if loss < best_loss:  # strict: ties keep the earlier (simpler) state
                best_loss, best_epoch = loss, epoch
                best_state = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, b in zip(params, best_state):
                p.copy_(b)
        return loss_before, best_loss, best_epoch, n_learnable
    finally:
        freeze = getattr(module, "freeze_ptq_parameters", None)
        if freeze is not None:
            freeze()
        else:
            for p in params:
                p.requires_grad_(False)
        for p in frozen:
            p.requires_grad_(True)
        module.train(was_training)


def timed_solve(unit, calls: Sequence[UnitCall], *, epochs: int, lr: float, device: torch.device,
                seed: int) -> UnitResult:
    """``solve_unit`` on a PtqUnit, timed, as a UnitResult."""
    t0 = time.perf_counter()
    before, after, best_epoch, n_params = solve_unit(unit.module, calls, epochs=epochs, lr=lr,
                                                     device=device, seed=seed, name=unit.name)
    return UnitResult(name=unit.name, kind=unit.kind, layer=unit.layer_idx, loss_before=before,
                      loss_after=after, seconds=time.perf_counter() - t0, n_calls=len(calls),
                      n_params=n_params, best_epoch=best_epoch)
