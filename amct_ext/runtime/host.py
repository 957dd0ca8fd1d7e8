"""The host CPU's class, for figures that are bit-reproducible only on the same kind of CPU.

PyTorch's CPU kernels (oneDNN, MKL, ATen's vectorized loops) pick their code by the CPU's vendor
and instruction set, and a different summation order can flip a quantizer's rounding. On the
tiny model the same w8a8 run gives 274.4046 on an AMD EPYC with AVX2 and 274.4891 on an Intel Xeon
with AVX-512 (3.1e-4 relative; a recipe that searches clip factors moves by up to 2.1e-3), while
each machine reruns its own figure bit for bit (casebook H4).
A recorded figure therefore names the class of the CPU it was measured on.
"""
from __future__ import annotations

import platform
from functools import lru_cache


@lru_cache(maxsize=1)
def cpu_class() -> str:
    """``<vendor>-<widest x86 vector ISA>``, e.g. ``AuthenticAMD-avx2``, ``GenuineIntel-avx512``;
    ``<machine>`` elsewhere (``aarch64``), from /proc/cpuinfo where it exists."""
    vendor, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key == "flags" and not flags:
                    flags = set(value.split())
                if vendor and flags:
                    break
    except OSError:
        pass
    if not vendor:
        return platform.machine() or "unknown"
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "sse"
    return f"{vendor}-{isa}"
