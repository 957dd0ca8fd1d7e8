"""Per-layer device maps and accelerate-hook dispatch of one transformer block.

A block is split into placement units that can live on different devices; which submodules
form them is the model adapter's to say (a ``LayerPlacement``; DeepSeek-V4's is
``models.deepseek_v4.adapter.V4_PLACEMENT``):

- stem:     everything that is not one of the units below (norms, gates, containers) -- the
            block's forward runs here;
- attn:     the attention module and its submodules (except its side unit);
- attn_side: a part of the attention heavy enough for a device of its own, with its submodules
            (in the layers that have one; DeepSeek-V4's indexer);
- experts:  ``{experts_prefix}{e}`` and their submodules, one unit per routed expert.

Placement rule (``build_layer_device_map``), with devices d0..d{n-1}:
  stem -> d0; attn -> d1 (d0 if n == 1); attn_side -> d2 when present and n >= 3, else attn's
  device; the k devices taken by those units are "reserved" (k = 1, 2 or 3); routed experts go
  round-robin over d{k}..d{n-1}, or over ALL devices when no device is left after the reserved
  ones. So 1 device: everything on d0; 2 devices: stem d0, attn(+side) d1, experts alternate
  d0/d1; 3 devices with a side unit: stem d0, attn d1, side d2, experts over d0,d1,d2;
  8 devices with a side unit: experts over d3..d7. Every device gets work whenever the layer has
  enough units (a layer without experts cannot fill more than 2-3 devices).

``dispatch_layer`` places each module's own parameters/buffers on its device (Parameter objects
are kept, only ``.data`` moves, so references held elsewhere stay valid) and attaches an
accelerate ``AlignDevicesHook`` wherever the device changes: inputs are moved to the unit's
device, outputs come back to the caller's device (``io_same_device``), so the block's own
forward code sees everything on the stem device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
from accelerate.hooks import AlignDevicesHook, add_hook_to_module, remove_hook_from_module
from torch import nn

ROOT = ""


def _under(name: str, root: str) -> bool:
    return name == root or name.startswith(root + ".")


def _expert_id(name: str, experts_prefix: str) -> str | None:
    if not name.startswith(experts_prefix):
        return None
    head = name[len(experts_prefix):].split(".", 1)[0]
    return head or None


@dataclass(frozen=True)
class LayerPlacement:
    """The placement units of a layer by submodule name (relative to the layer): ``attn``,
    ``attn_side`` (a part of the attention placed on a device of its own; None: the model has
    none) and the prefix of the routed experts' names."""

    attn: str
    attn_side: str | None
    experts_prefix: str


def classify(name: str, placement: LayerPlacement) -> str:
    """'attn_side' | 'attn' | 'expert' | 'stem' for a submodule / parameter name."""
    if placement.attn_side and _under(name, placement.attn_side):
        return "attn_side"
    if placement.attn and _under(name, placement.attn):
        return "attn"
    if _expert_id(name, placement.experts_prefix) is not None:
        return "expert"
    return "stem"


def _id_sort_key(e: str) -> tuple[int, int | str]:
    return (0, int(e)) if e.isdigit() else (1, e)


def build_layer_device_map(module_names: Iterable[str], devices: Sequence[torch.device | str],
                           placement: LayerPlacement) -> dict[str, torch.device]:
    """Map every name in ``module_names`` (plus the root ``''``) to a device; see module doc."""
    experts_prefix = placement.experts_prefix
    devs = [torch.device(d) for d in devices]
    if not devs:
        raise ValueError("build_layer_device_map: at least one device is required")
    names = list(dict.fromkeys(module_names))  # de-duplicate, keep order
    kinds = {n: classify(n, placement) for n in names}
    has_side = "attn_side" in kinds.values()

    n = len(devs)
    stem = devs[0]
    attn = devs[1] if n >= 2 else devs[0]
    side = devs[2] if (has_side and n >= 3) else attn
    reserved = min(n, 1 + (n >= 2) + (has_side and n >= 3))
    pool = devs[reserved:] or devs

    expert_ids = sorted({_expert_id(x, experts_prefix) for x in names if kinds[x] == "expert"},
                        key=_id_sort_key)
    expert_dev = {e: pool[i % len(pool)] for i, e in enumerate(expert_ids)}

    out: dict[str, torch.device] = {ROOT: stem}
    for x in names:
        k = kinds[x]
        if k == "attn_side":
            out[x] = side
        elif k == "attn":
            out[x] = attn
        elif k == "expert":
            out[x] = expert_dev[_expert_id(x, experts_prefix)]
        else:
            out[x] = stem
    return out


def resolve_device_for(name: str, device_map: Mapping[str, torch.device | str]) -> torch.device:
    """Device of ``name``: its own entry or that of its closest mapped ancestor (``''`` last)."""
    probe = name
    while True:
        if probe in device_map:
            return torch.device(device_map[probe])
        if not probe:
            raise ValueError(f"device_map has no entry for {name!r} nor for the root ''")
        probe = probe.rpartition(".")[0]


class _InputAlignHook(AlignDevicesHook):
    """AlignDevicesHook that only moves inputs/outputs.

    ``dispatch_layer`` places tensors itself (moving ``.data`` so Parameter identity survives);
    the stock ``init_hook`` would re-wrap every parameter in a new ``nn.Parameter``.
    """

    def init_hook(self, module: nn.Module) -> nn.Module:
        return module


def _move_parameter(owner: nn.Module, pname: str, p: nn.Parameter, dev: torch.device) -> None:
    """Move ``p`` to ``dev`` keeping the Parameter object when torch allows it (``.data`` swap
    works between ordinary dense devices, e.g. cpu <-> cuda); otherwise (e.g. to 'meta', whose
    tensor type is incompatible for ``set_data``) replace the Parameter."""
    new = p.data.to(dev)
    try:
        p.data = new
    except RuntimeError:
        owner._parameters[pname] = nn.Parameter(new, requires_grad=p.requires_grad)


def dispatch_layer(module: nn.Module, device_map: Mapping[str, torch.device | str],
                   root_io_same_device: bool = False) -> nn.Module:
    """Place ``module``'s submodules per ``device_map`` and hook their forwards.

    ``device_map`` keys are submodule names relative to ``module`` (``''`` = the module itself;
    a missing name inherits its closest mapped ancestor). Parameters and buffers live with the
    module that owns them -- entries naming a parameter are not used for placement, since the
    owner's forward must see all its tensors on one device.

    Hooks: the root gets one that moves inputs to the stem device (outputs stay there unless
    ``root_io_same_device``); every module whose device differs from its parent's gets one with
    ``io_same_device=True`` so its outputs return to the parent's device.
    """
    modules = dict(module.named_modules())
    for name, sub in modules.items():
        dev = resolve_device_for(name, device_map)
        with torch.no_grad():
            for pname, p in list(sub._parameters.items()):
                if p is not None and p.device != dev:
                    _move_parameter(sub, pname, p, dev)
            for bname, b in list(sub._buffers.items()):
                if b is not None and b.device != dev:
                    sub._buffers[bname] = b.to(dev)
        if name == ROOT:
            hook = _InputAlignHook(execution_device=dev, io_same_device=root_io_same_device)
        else:
            parent_dev = resolve_device_for(name.rpartition(".")[0], device_map)
            if parent_dev == dev:
                continue
            hook = _InputAlignHook(execution_device=dev, io_same_device=True)
        add_hook_to_module(sub, hook)
    return module


def undispatch_layer(module: nn.Module) -> nn.Module:
    """Remove the hooks ``dispatch_layer`` added (tensors stay where they are).

    accelerate's removal leaves ``module.forward`` as an INSTANCE attribute (the bound method it
    had saved). Harmless by itself, but a wrapper built by copying the module's ``__dict__``
    (``quant_module._rebind``) would inherit it and run the FLOAT module's forward on the float
    children: a quantized layer silently computing in float (casebook/real-size-ptq.md-1). So the attribute
    is dropped whenever it is just the module's own class forward."""
    remove_hook_from_module(module, recurse=True)
    for sub in module.modules():
        fwd = sub.__dict__.get("forward")
        if fwd is not None and getattr(fwd, "__self__", None) is sub and \
                getattr(fwd, "__func__", None) is getattr(type(sub), "forward", None):
            del sub.__dict__["forward"]
    return module
