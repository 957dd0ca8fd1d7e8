"""``y = x @ w[e].T`` for consecutive row ranges of ``x``, one expert ``e`` per range, with autograd.

Rows sorted by expert (``counts[e]`` rows for expert e, in expert order) against a weight stack
``w [E, N, K]``: one ``torch._grouped_mm`` where torch has it for the dtype and device (CUDA
bf16, CPU bf16 / fp32; its own backward computes the gradients), else one matmul per expert (the
same products: float64 tests, NPUs).

torch's CPU backward of ``_grouped_mm`` fails on a zero-stride (expanded) gradient such as the
one ``y.sum()`` gives ("Invalid strides/sizes"), so the gradient reaching it is made
contiguous first (casebook i34-1).
"""
from __future__ import annotations

from typing import Sequence

import torch


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm: CUDA bf16, CPU bf16 / fp32; every dim 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    ok_dtype = x.dtype == torch.bfloat16 or (x.device.type == "cpu" and x.dtype == torch.float32)
    aligned = all((n * w.element_size()) % 16 == 0 for n in w.shape[1:])
    return x.device.type in ("cpu", "cuda") and ok_dtype and aligned


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: Sequence[int],
                   offsets: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] (rows sorted by expert, ``sum(counts) == T``), w [E, N, K] -> [T, N].

    ``offsets``: the int32 cumulative row counts on x's device (computed when not given)."""
    if len(counts) != w.shape[0] or sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_linear: {len(counts)} counts summing to {sum(counts)} for x {tuple(x.shape)} "
                         f"and w {tuple(w.shape)}")
    if grouped_mm_supported(x, w):
        if offsets is None:
            offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(x.device)
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=offsets)
        return _ContiguousGrad.apply(y) if y.requires_grad else y
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            outs.append(x[start:start + n] @ w[e].transpose(0, 1))
        start += n
    if not outs:
        return x.new_zeros(0, w.shape[1])
    return torch.cat(outs)
