"""fp32 GEMMs of 16-bit activations, computed on bf16 tensor cores without losing precision.

DeepSeek-V4 keeps "fp32 islands" (the hyper-connection mixes, the compressors, the router): an
fp32 weight applied to activations that are bf16 values. A true fp32 GEMM runs at ~7 % of the bf16
tensor-core rate on an H200, and TF32 would round the weight to 10 bits -- not the float model.

Exact alternative: every fp32 number w is the sum of three bf16 numbers (``split_bf16``):
hi = bf16(w), mid = bf16(w - hi), lo = bf16(w - hi - mid), with hi + mid + lo == w exactly
(round-to-nearest leaves at most 24 - 9 - 9 = 6 significant bits for lo; only fp32 subnormals
below bf16's range could lose bits). For a bf16 x, every product x * part has at most 16
significant bits and is exact in fp32, and a bf16 GEMM with fp32 output accumulates in fp32. So
``x @ hi + x @ mid + x @ lo`` is the fp32 GEMM up to the order of the fp32 additions -- the same
rounding class as any fp32 GEMM -- at three bf16 GEMMs' cost.

Used only where ``amct_ext.device.fp32_out_gemm_supported`` says the backend has bf16 GEMMs with
fp32 output (``torch.mm(..., out_dtype=torch.float32)``: CUDA); elsewhere the plain fp32 GEMM runs.
"""
from __future__ import annotations

import torch

from . import device as D


def split_bf16(w: torch.Tensor) -> torch.Tensor:
    """fp32 [..., K] -> bf16 [3, ..., K] with parts[0] + parts[1] + parts[2] == w (in fp32)."""
    w = w.float()
    hi = w.to(torch.bfloat16)
    rest = w - hi.float()                      # exact: w and hi share the leading bits
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return torch.stack((hi, mid, lo))


class SplitWeightCache:
    """The bf16 split of one fp32 weight, rebuilt when the weight's storage or version changes."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._parts: torch.Tensor | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        # an inference tensor has no version counter (and is only changed inside inference mode)
        version = 0 if weight.is_inference() else weight._version
        key = (weight.data_ptr(), version, weight.shape, weight.device)
        if key != self._key:
            # kept across calls: build it as a normal tensor even when the first call runs under
            # torch.inference_mode (casebook S7)
            with torch.inference_mode(False), torch.no_grad():
                self._parts = split_bf16(weight.detach()).flatten(0, 1)   # [3N, K]
            self._key = key
        return self._parts


def linear_fp32(x: torch.Tensor, weight: torch.Tensor, cache: SplitWeightCache | None = None) -> torch.Tensor:
    """``F.linear(x.float(), weight.float())`` [..., N] fp32, for any x dtype and a bf16 or fp32 weight.

    A bf16 x on a backend with fp32-output bf16 GEMMs, without autograd, takes a bf16 GEMM: one
    for a bf16 weight (its products are exact in fp32), three for an fp32 weight (the split above).
    Everything else is the plain fp32 GEMM."""
    if (x.dtype == torch.bfloat16 and weight.dtype in (torch.bfloat16, torch.float32)
            and D.fp32_out_gemm_supported(x.device)
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        rows = x.reshape(-1, x.shape[-1])
        n = weight.shape[0]
        if weight.dtype == torch.bfloat16:
            return torch.mm(rows, weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], n)
        parts = cache.get(weight) if cache is not None else split_bf16(weight).flatten(0, 1)
        y = torch.mm(rows, parts.t(), out_dtype=torch.float32).view(-1, 3, n)
        return ((y[:, 0] + y[:, 1]) + y[:, 2]).view(*x.shape[:-1], n)
    return torch.nn.functional.linear(x.float(), weight.float())


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a.float() @ b.float()`` for 3-D a [B, M, K], b [B, K, N]. Two bf16 operands multiply
    exactly in fp32, so on a backend with fp32-output GEMMs this is one bf16 GEMM."""
    if (a.dtype == b.dtype == torch.bfloat16 and D.fp32_out_gemm_supported(a.device)
            and not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad))):
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())
