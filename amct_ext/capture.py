"""Capturing activations: a layer's inputs (Catcher) and the I/O of units inside a layer.

``Catcher`` replaces layer 0 of a model whose own forward is then run: the embedding and
whatever precedes layer 0 execute, the Catcher records the hidden state and the extra
arguments the model passes to its layers, then raises ``StopForward`` so nothing after it
runs (layers 1.. may still be on the meta device; they are never touched).

``capture_unit_io`` hooks sub-modules (PTQ units) while a block runs and keeps every call's
positional args, kwargs and output: the solver's training data.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn


class StopForward(Exception):
    """Raised by Catcher after recording; private to this module and its callers."""


def _detach(obj: Any, device: torch.device | str | None) -> Any:
    """Detach tensors in (nested) tuples / lists / dicts, optionally moving them to ``device``."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.to(device) if device is not None else t
    if isinstance(obj, tuple):
        return tuple(_detach(o, device) for o in obj)
    if isinstance(obj, list):
        return [_detach(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _detach(v, device) for k, v in obj.items()}
    return obj


class Catcher(nn.Module):
    """Stands in for ``module`` (usually layer 0): records ``(inp, kwargs)`` and stops the forward.

    ``forward(inp, *args, **kwargs)``: extra positional arguments are bound to their parameter
    names with the wrapped module's forward signature, so the recorded kwargs are the same
    whether the model calls ``layer(x, 0, ids)`` or ``layer(x, start_pos=0, input_ids=ids)``;
    they can be replayed as ``module(inp, **kwargs)``. The wrapped module is kept as
    ``.module`` so the caller can put it back after the capture.
    """

    def __init__(self, module: nn.Module, store_device: torch.device | str | None = None):
        super().__init__()
        self.module = module
        self.store_device = store_device
        self.inputs: list[torch.Tensor] = []
        self.kwargs: list[dict[str, Any]] = []
        try:
            params = list(inspect.signature(module.forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        # names of the positional parameters after the hidden state
        self._pos_names = [p.name for p in params[1:]
                           if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def forward(self, inp: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if len(args) > len(self._pos_names):
            raise TypeError(f"Catcher: {len(args)} extra positional arguments, but "
                            f"{type(self.module).__name__}.forward names only {self._pos_names}")
        bound = dict(zip(self._pos_names, args))
        bound.update(kwargs)
        self.inputs.append(_detach(inp, self.store_device))
        self.kwargs.append(_detach(bound, self.store_device))
        raise StopForward


def run_until_caught(model_forward: Callable[[], Any]) -> None:
    """Call ``model_forward()``; a ``StopForward`` from a Catcher ends it normally."""
    try:
        model_forward()
    except StopForward:
        return
    raise RuntimeError("the forward finished without reaching the Catcher "
                       "(is the Catcher installed in place of layer 0?)")


@dataclass
class UnitCall:
    """One call of a hooked module: replay with ``module(*args, **kwargs)``; target ``output``."""

    args: tuple
    kwargs: dict[str, Any]
    output: Any


def capture_unit_io(modules: Mapping[str, nn.Module] | Iterable[Any], run_fn: Callable[[], Any],
                    store_device: torch.device | str | None = "cpu") -> tuple[dict[str, list[UnitCall]], Any]:
    """Run ``run_fn()`` with forward hooks on ``modules``; returns (calls per name, run_fn's result).

    ``modules``: a mapping name -> module, or an iterable of objects with ``.name`` and
    ``.module`` (PtqUnits). Every call's args / kwargs / output are detached and, by default,
    moved to the host (``store_device='cpu'``) so captured data does not pile up in device
    memory; pass ``store_device=None`` to keep them where they are. Hooks are removed even if
    ``run_fn`` raises.
    """
    if isinstance(modules, Mapping):
        named = dict(modules)
    else:
        named = {u.name: u.module for u in modules}
    calls: dict[str, list[UnitCall]] = {name: [] for name in named}
    handles = []

    def make_hook(name: str):
        def hook(_module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            calls[name].append(UnitCall(_detach(args, store_device), _detach(kwargs, store_device),
                                        _detach(output, store_device)))
        return hook

    try:
        for name, module in named.items():
            handles.append(module.register_forward_hook(make_hook(name), with_kwargs=True))
        result = run_fn()
    finally:
        for h in handles:
            h.remove()
    return calls, result
