"""Empty-weight (meta) construction.

Two traps live here (casebook/deepseek-v4.md):
- ``accelerate.init_empty_weights()`` without ``include_buffers=True`` still allocates every buffer
  for real; a model whose buffers scale with max_seq_len (1M) then runs out of memory.
- a module-level ``lru_cache`` returning tensors caches *meta* tensors when first called under the
  meta device; later real builds receive them. Caches that may be hit here must be keyed by device
  or purged with ``purge_caches``.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterable, Iterator

import torch
from accelerate import init_empty_weights
from torch import nn


@contextlib.contextmanager
def empty_weights() -> Iterator[None]:
    """Parameters AND buffers created inside land on the meta device (no memory, no init cost)."""
    with init_empty_weights(include_buffers=True):
        yield


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while building many modules.

    A V4-Pro skeleton creates ~400k Python objects; every few hundred allocations trigger a
    collection that walks all of them, which doubles the build time. Nothing built here is
    garbage, so the collections find nothing."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def purge_caches(functions: Iterable[Callable]) -> None:
    """``cache_clear()`` every lru_cache'd factory that may have produced meta tensors."""
    for fn in functions:
        clear = getattr(fn, "cache_clear", None)
        if clear is not None:
            clear()


def meta_tensors(module: nn.Module, include_buffers: bool = True) -> list[str]:
    """Names of parameters (and buffers) still on the meta device."""
    names = [n for n, p in module.named_parameters() if p.is_meta]
    if include_buffers:
        names += [n for n, b in module.named_buffers() if b.is_meta]
    return names


def assert_materialized(module: nn.Module, what: str) -> None:
    left = meta_tensors(module)
    if left:
        raise RuntimeError(f"{what}: {len(left)} tensors are still on the meta device, e.g. {left[:5]}")


def is_meta(t: torch.Tensor) -> bool:
    return t.device.type == "meta"
