"""Checks whose answer is computed on the device, read back with as few host syncs as possible.

The fake quantizers refuse NaN / Inf inputs (a NaN scale would silently poison a whole block).
Finding one is a reduction on the device; *reading* the answer is a host sync, and a sync stops
the host from queueing further kernels until the device has caught up. A quantized V4 layer has
~16 quantizers: one sync in each made the eager w8a8 layer 1.4-1.6x slower than it computes
(casebook S14), and a sync cannot be captured into a CUDA graph at all.

So a check hands its flags to :func:`refuse_if`, which reads them at once only when no scope is
open:

- :func:`deferred_checks` collects the flags of every call in the scope and reads them with one
  sync per device when the scope ends (``do_block_forward`` opens one per sample). The error is
  the first failing call's, in call order, and it comes before the scope's results are used.
- :func:`collecting_checks` (graph capture) only collects: the flag tensors are then outputs of
  the captured graph, rewritten by every replay, and ``device.GraphedForward`` passes them to
  :func:`refuse_if` after each replay. A replay so makes exactly the checks of the eager call.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import torch

_scope = threading.local()


def _pending() -> list | None:
    return getattr(_scope, "pending", None)


def refuse_if(flags: torch.Tensor, errors: Sequence[Exception]) -> None:
    """Raise ``errors[i]`` if ``flags[i]`` (an integer or bool device tensor of ``len(errors)``
    entries) is non-zero; now, or at the end of the open scope."""
    flags = flags.reshape(-1)
    if flags.numel() != len(errors):
        raise ValueError(f"refuse_if: {flags.numel()} flags for {len(errors)} errors")
    pending = _pending()
    if pending is not None:
        pending.append((flags.to(torch.int32), list(errors)))
        return
    for flag, err in zip(flags.tolist(), errors):
        if flag:
            raise err


def raise_first(checks: Sequence[tuple[torch.Tensor, Sequence[Exception]]]) -> None:
    """Read collected ``(flags, errors)`` checks (one sync per device) and raise the first failing
    one in order."""
    by_device: dict[torch.device, list[int]] = {}
    for i, (flags, _) in enumerate(checks):
        by_device.setdefault(flags.device, []).append(i)
    values: dict[int, list] = {}
    for idx in by_device.values():
        flat = torch.cat([checks[i][0] for i in idx]).tolist()   # the one sync on this device
        for i in idx:
            values[i], flat = flat[:checks[i][0].numel()], flat[checks[i][0].numel():]
    for i, (_, errors) in enumerate(checks):
        for flag, err in zip(values[i], errors):
            if flag:
                raise err


@contextlib.contextmanager
def deferred_checks() -> Iterator[None]:
    """Read the checks of this scope once, when it ends. A nested scope reports to the outer one;
    an exception inside the scope propagates without reading them."""
    if _pending() is not None:
        yield
        return
    _scope.pending = pending = []
    try:
        yield
    finally:
        _scope.pending = None
    if pending:
        raise_first(pending)


@contextlib.contextmanager
def collecting_checks() -> Iterator[list]:
    """Collect the checks of this scope into the yielded list without reading them, isolated from
    any open scope (for graph capture, where the flags hold no values until a replay)."""
    outer = _pending()
    _scope.pending = collected = []
    try:
        yield collected
    finally:
        _scope.pending = outer
