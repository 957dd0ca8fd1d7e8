"""The calibration / evaluation stream between layers, and the byte counts the loops report.

A ``Stream`` is the hidden states of a set of samples (one tensor per sample batch, on the host
between layers) with each sample's state (the kwargs ``BaseModel.do_block_forward`` passes on).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..base import BaseModel, batches


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters and buffers (a layer's size in the memory report)."""
    return tensor_bytes(list(module.parameters()) + [b for b in module.buffers() if b is not None])


@dataclass
class Stream:
    """Hidden states of a set of samples between layers, with their per-sample state."""

    hidden: list[torch.Tensor]
    state: list[dict[str, Any]]

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.hidden)


def embed_stream(adapter: BaseModel, windows: torch.Tensor, batch_size: int) -> Stream:
    hidden = adapter.do_embedding_forward(batches(windows, batch_size))
    return Stream(hidden, list(adapter.sample_state or [{}] * len(hidden)))


def mtp_layers(adapter: BaseModel, layers: range) -> list[int]:
    """The MTP layer quantized after the run's layers: the adapter's first one (its input is
    the last main layer's output), when the run ends at the model's last layer."""
    if layers.stop != adapter.num_layers:
        return []
    return adapter.mtp_layer_ids()[:1]


def mtp_stream(adapter: BaseModel, layer_idx: int, stream: Stream) -> Stream:
    """The MTP layer's inputs: the last layer's hidden states with the next tokens' embeddings
    (``adapter.mtp_block_inputs``, issue 23.6)."""
    return Stream(*adapter.mtp_block_inputs(layer_idx, stream.hidden, stream.state))


__all__ = ["Stream", "embed_stream", "tensor_bytes", "module_bytes", "mtp_layers", "mtp_stream"]
