"""fp32 GEMMs of 16-bit activations on bf16 tensor cores: exact products, fp32 accumulation.

DeepSeek-V4 keeps "fp32 islands": the hyper-connection mixes, the compressors, the router and the
indexer's Hadamard rotation apply an fp32 (or bf16) weight to activations that are bf16 values. A
true fp32 GEMM runs at ~7 % of the bf16 tensor-core rate on an H200. TF32 would round the weight to
10 bits, which is not the float model.

Every fp32 number w is the sum of three bf16 numbers (``split_bf16``): hi = bf16(w),
mid = bf16(w - hi), lo = bf16(w - hi - mid), with hi + mid + lo == w exactly. Round-to-nearest leaves
at most 24 - 9 - 9 = 6 significant bits for lo; only fp32 subnormals could lose bits, and weights
beyond bf16's range are refused. For a bf16 x, every product x * part has at most 16 significant
bits and is exact in fp32, so ``x @ hi + x @ mid + x @ lo`` with fp32 output costs three bf16 GEMMs.

What is not exact is the accumulation. Hopper's tensor cores add the products in fp32 less exactly
than IEEE arithmetic. At V4-Flash shapes the result is 4.4e-6 from float64, against 0.4-1.1e-6
for a true fp32 GEMM (casebook N1). Whole bf16 layers are nevertheless no further from the fp32
layer with this path than without it (benchmarks/RESULTS.md §4.1).

Used only where ``amct_ext.runtime.device.fp32_out_gemm_supported`` allows it: CUDA, fast paths on, and
not ``AMCT_FP32_ISLANDS=strict``. Elsewhere the plain fp32 GEMM runs.
"""
from __future__ import annotations

import torch

from . import device as D


BF16_MAX = torch.finfo(torch.bfloat16).max


def split_bf16(w: torch.Tensor) -> torch.Tensor:
    """fp32 [..., K] -> bf16 [3, ..., K] with parts[0] + parts[1] + parts[2] == w (in fp32).

    Raises ValueError for a weight with a magnitude above bf16's largest finite value (~3.39e38):
    its leading part would overflow."""
    w = w.float()
    if w.numel() and bool(w.abs().amax() > BF16_MAX):
        raise ValueError(f"weight of shape {tuple(w.shape)} exceeds the bf16 range; it cannot be split")
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

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        """[3N, K] bf16 parts, or None when the weight cannot be split (see ``split_bf16``)."""
        # an inference tensor has no version counter (and is only changed inside inference mode)
        version = 0 if weight.is_inference() else weight._version
        key = (weight.data_ptr(), version, weight.shape, weight.device)
        if key != self._key:
            # kept across calls: build it as a normal tensor even when the first call runs under
            # torch.inference_mode (casebook S7)
            with torch.inference_mode(False), torch.no_grad():
                try:
                    self._parts = split_bf16(weight.detach()).flatten(0, 1)   # [3N, K]
                except ValueError:
                    self._parts = None                                    # callers use the fp32 GEMM
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
        parts = (cache or SplitWeightCache()).get(weight)
        if parts is not None:
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
