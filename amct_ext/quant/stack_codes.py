"""A stack of same-shaped integer-grid weights [E, R, C] held as codes, not as float values.

Block-wise rounding tunes a V4-Pro layer's 384 experts in turns (``blockround:turns``): only the
experts of the current turn keep their float weights and offsets on the device; every other
expert enters the layer's forward at its current fake-quant value. Held in bf16 those values are
as large as the float weights (47 GiB on a V4-Pro layer); held as codes they take half a byte
each (<= 4 bits: two codes a byte) or one byte (5-8 bits), plus one scale (and zero point) a
block: 11.8 GiB for the same experts at 4 bits.

``put`` stores ``formats.quantize``'s codes of some rows of an expert; ``decode`` gives experts'
values through ``formats.dequantize_int``, the function ``fake_quant`` ends in, so a decoded
weight equals the fake-quant weight it was stored from bit for bit (tests/test_stack_codes.py).
"""
from __future__ import annotations

import torch

from . import formats
from ..runtime import device as devmod, fused_codes
from .schemes import TensorSpec


class StackCodes:
    """Codes, scales and zero points of a stack of ``shape`` = [E, R, C] under the integer
    ``spec`` (group or channel blocks along C), on ``device``."""

    def __init__(self, shape: tuple[int, int, int], spec: TensorSpec, device: torch.device):
        if spec.format != "int" or spec.granularity not in ("group", "channel"):
            raise ValueError(f"StackCodes holds integer group / channel grids, not {spec}")
        n_exp, rows, cols = shape
        self.shape, self.spec = (n_exp, rows, cols), spec
        self.qmin, self.qmax = formats._int_range(spec.bits, spec.symmetric)
        # two codes a byte where they fit a nibble (the width of the grid, not of its values)
        self.packed = self.qmax - self.qmin < 16 and cols % 2 == 0
        self.codes = torch.zeros(n_exp, rows, cols // 2 if self.packed else cols, dtype=torch.uint8, device=device)
        pub = formats.scale_shape((rows, cols), spec)
        self.scale = torch.ones(n_exp, *pub, dtype=torch.float32, device=device)
        # zero points are integers in [0, 2^bits - 1]: one byte each
        self.zero_point = None if spec.symmetric else torch.zeros(n_exp, *pub, dtype=torch.uint8, device=device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero_point) if t is not None)

    @torch.no_grad()
    def put(self, expert: int, rows: tuple[int, int], q: torch.Tensor, scale: torch.Tensor,
            zero_point: torch.Tensor | None) -> None:
        """Rows ``rows`` of ``expert`` from ``formats.quantize_int``'s (q, scale, zero_point)."""
        r0, r1 = rows
        u = (q.to(torch.int16) - self.qmin).to(torch.uint8)          # 0 .. qmax - qmin
        if self.packed:
            u = u[..., 0::2] | (u[..., 1::2] << 4)
        self.codes[expert, r0:r1].copy_(u)
        self.scale[expert, r0:r1].copy_(scale)
        if self.zero_point is not None:
            self.zero_point[expert, r0:r1].copy_(zero_point)

    def quantized(self, e0: int, e1: int) -> torch.Tensor:
        """Experts e0:e1's integer codes (int16, the grid's own values)."""
        u = self.codes[e0:e1]
        if self.packed:
            u = torch.stack((u & 15, u >> 4), dim=-1).flatten(-2)
        return u.to(torch.int16) + self.qmin

    def decode(self, e0: int, e1: int, dtype: torch.dtype) -> torch.Tensor:
        """Experts e0:e1's fake-quant weights [e1 - e0, R, C] in ``dtype``: one kernel on CUDA
        (``fused_codes``, the same bits), else ``formats.dequantize_int``."""
        if devmod.fused_kernels_enabled(self.codes.device) and fused_codes.fused_decode_supported(self.codes):
            zp = None if self.zero_point is None else self.zero_point[e0:e1]
            block = self.spec.group_size if self.spec.granularity == "group" else self.shape[2]
            return fused_codes.decode(self.codes[e0:e1], self.scale[e0:e1], zp, (e1 - e0,) + self.shape[1:],
                                      block, self.qmin, self.packed, dtype)
        return self.decode_reference(e0, e1, dtype)

    def decode_reference(self, e0: int, e1: int, dtype: torch.dtype) -> torch.Tensor:
        """:meth:`decode` through ``formats.dequantize_int`` (the definition; any device)."""
        zp = None if self.zero_point is None else self.zero_point[e0:e1]
        return formats.dequantize_int(self.quantized(e0, e1), self.scale[e0:e1], zp, self.spec, dtype)

    def qparams(self, expert: int, rows: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(scale, zero point as float32) of rows ``rows`` of ``expert``: a fixed grid's."""
        r0, r1 = rows
        zp = None if self.zero_point is None else self.zero_point[expert, r0:r1].float()
        return self.scale[expert, r0:r1], zp

    def part(self, e0: int, e1: int, device: torch.device | str) -> "StackCodes":
        """Experts e0:e1 as codes of their own on ``device`` (copies): the codes parked on the
        host, one chunk decoded on the device at a time."""
        out = object.__new__(StackCodes)
        out.__dict__.update(self.__dict__)
        out.shape = (e1 - e0,) + self.shape[1:]
        out.codes, out.scale = self.codes[e0:e1].to(device), self.scale[e0:e1].to(device)
        out.zero_point = None if self.zero_point is None else self.zero_point[e0:e1].to(device)
        return out
