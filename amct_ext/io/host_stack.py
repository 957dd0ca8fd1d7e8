"""A stack of float weights [E, R, C] parked on the host in the fewest bytes that give it back bit for bit.

Block-wise rounding in turns keeps the routed experts' float weights on the host while they wait
for their turn (``models/deepseek_v4/expert_turns.py``). A V4-Pro layer's 384 experts in bf16 are
47.4 GiB of host memory beside the calibration activations, past the bound of one layer's weights
+ 16 GiB. Yet the release stores these experts as MXFP4 (e2m1 values, one power-of-two e8m0
scale per 32 along the input dim), so every weight built from it is ``e2m1 value * 2^k`` for its
block's ``k``. Such a stack is held here in that same format, through the checkpoint codec
(``io.storage_formats.encode_fp4`` / ``decode_fp4``): 17/32 of a byte a weight instead of 2
(12.6 GiB for the same experts).

Whether a stack qualifies is decided on its values, never on names: every chunk is encoded,
decoded and compared with the original byte for byte. A stack with any value off that grid (a
bf16 checkpoint's weights) is held as it is, in its own dtype. The codec's scale puts a block's
largest magnitude in [4, 8); if any power of two maps a block onto e2m1 (largest value 6), that
one does: a larger one only halves values, which stay on the grid down to 0.5, and a smaller
one would put the largest past 6. So the byte check refuses only stacks truly off the grid.
"""
from __future__ import annotations

import torch

from .storage_formats import FP4_BLOCK, decode_fp4, encode_fp4


def encode_exact(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(packed e2m1 codes int8 [..., C / 2], e8m0 scales uint8 [..., C / 32]) of the float
    ``x`` [..., C] where :func:`decode` gives ``x`` back byte for byte, else None."""
    cols = x.shape[-1]
    if cols % FP4_BLOCK or not x.dtype.is_floating_point or x.numel() == 0 or not bool(torch.isfinite(x).all()):
        return None
    flat = x.reshape(-1, cols)
    packed, scale = encode_fp4(flat)
    # the codec writes no negative zero; a released checkpoint may hold one (code 8), and -0.0
    # must come back as itself: its sign bit set in the code's nibble
    neg_zero = (flat == 0) & torch.signbit(flat)
    if bool(neg_zero.any()):
        nz = neg_zero.to(torch.uint8)
        packed = (packed.view(torch.uint8) | (nz[:, 0::2] << 3) | (nz[:, 1::2] << 7)).view(torch.int8)
    scale = scale.view(torch.uint8)
    back = decode_fp4(packed, scale, x.dtype)
    if not torch.equal(back.view(torch.uint8), flat.contiguous().view(torch.uint8)):
        return None
    return packed.reshape(*x.shape[:-1], cols // 2), scale.reshape(*x.shape[:-1], cols // FP4_BLOCK)


def decode(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values :func:`encode_exact` encoded, in ``dtype``, on ``packed``'s device."""
    cols = 2 * packed.shape[-1]
    out = decode_fp4(packed.reshape(-1, cols // 2), scale.reshape(-1, cols // FP4_BLOCK), dtype)
    return out.reshape(*packed.shape[:-1], cols)


class HostStack:
    """The float stack ``x`` [E, R, C] (on any device) copied to the host, a few experts at a
    time (``chunk_elems`` values each, bounding the encoding's temporaries on the device): as
    MXFP4 codes and scales where every chunk is exact, else as itself. ``slice_to`` gives
    experts back on a device, bit for bit."""

    def __init__(self, x: torch.Tensor, chunk_elems: int = 1 << 26):
        self.shape, self.dtype = tuple(x.shape), x.dtype
        self.values: torch.Tensor | None = None
        n_exp, rows, cols = self.shape
        per = self.per = max(1, chunk_elems // max(1, rows * cols))
        ok = cols % FP4_BLOCK == 0 and x.dtype.is_floating_point
        # the host copies are made whole first and filled a chunk at a time (a concatenation of
        # parts would hold them twice at its peak)
        self.codes = torch.empty(n_exp, rows, cols // 2, dtype=torch.int8) if ok else None
        self.scales = torch.empty(n_exp, rows, cols // FP4_BLOCK, dtype=torch.uint8) if ok else None
        with torch.no_grad():
            for e0 in range(0, n_exp if ok else 0, per):
                enc = encode_exact(x[e0:e0 + per])
                if enc is None:
                    ok = False
                    break
                self.codes[e0:e0 + per].copy_(enc[0])
                self.scales[e0:e0 + per].copy_(enc[1])
            if not ok:
                self.codes = self.scales = None
                self.values = x.to("cpu", copy=True)

    @property
    def compact(self) -> bool:
        return self.values is None

    def nbytes(self) -> int:
        held = (self.values,) if self.values is not None else (self.codes, self.scales)
        return sum(t.numel() * t.element_size() for t in held)

    @torch.no_grad()
    def slice_to(self, e0: int, e1: int, device: torch.device | str) -> torch.Tensor:
        """Experts e0:e1 [e1 - e0, R, C] on ``device``, equal to what was stored byte for byte.
        Decoded ``per`` experts at a time: the codec's temporaries (an int64 index and a float32
        value a weight) for a whole V4-Pro turn would be 18 GiB."""
        if self.values is not None:
            return self.values[e0:e1].to(device)
        out = torch.empty((e1 - e0,) + self.shape[1:], dtype=self.dtype, device=device)
        for a in range(e0, e1, self.per):
            b = min(a + self.per, e1)
            out[a - e0:b - e0] = decode(self.codes[a:b].to(device), self.scales[a:b].to(device), self.dtype)
        return out
