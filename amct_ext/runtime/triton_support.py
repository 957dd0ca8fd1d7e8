"""Triton, when installed: the one place that imports it for the project's kernels.

Triton is optional: CPU and NPU installs (and CUDA installs without it) use the torch paths, so
every kernel module does ``from amct_ext.runtime.triton_support import triton, tl`` and defines its
kernels under ``if triton is not None``. ``device.fused_kernels_enabled`` decides whether they run.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

__all__ = ["triton", "tl"]
