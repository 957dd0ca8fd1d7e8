"""DeepSeek-V4's multi-token-prediction (MTP) layer ``mtp.{j}``: what it computes, from a checkpoint.

At position i the MTP layer predicts token t_{i+2} from the main model's last hidden state h_i (hc
form [.., hc, D]: the residual stream before the model's HC head) and the embedding of the next
token t_{i+1}::

    x_i = e_proj(enorm(embed(t_{i+1}))) (the same for every hc copy) + h_proj(hnorm(h_i))
    y   = Block_{n_layers + j}(x)                  a decoder block; its compress ratio is the
                                                   entry of compress_ratios after the main layers'
    logits_i = head(norm(hc_head(y; mtp.{j}.hc_head_*)))

as DeepSeek's reference MTPBlock and vllm-ascend compute it (vllm_ascend/models/deepseek_v4/
mtp.py:106-135; vllm-ascend also zeroes the embedding at position 0, a serving convention of its
draft positions that we do not copy). ``embed`` is the main model's (vllm-ascend shares it with
the draft); ``head`` is ``mtp.{j}.head.weight`` when the checkpoint has one, else the main head
(what the release's MTP uses). Only positions 0..S-2 have a next token: the MTP sequence of a
window of S tokens has S-1 positions, and S-2 of them have a target t_{i+2}.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from amct_ext.io.checkpoint import CheckpointReader

from .configuration import DeepseekV4Config
from .modeling import Block, Linear, RMSNorm, hc_head_logits

#: the name of V4's extra layers: checkpoint keys ``mtp.{j}.*`` (``ModelBinding.extra_layers``)
MTP_NAME = "mtp"
#: mtp.{j}.<name> tensors besides its decoder block (head / emb.tok_emb are optional)
PROJECTION_KEYS = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight",
                   "hc_head_fn", "hc_head_base", "hc_head_scale")


class MtpProjections(nn.Module):
    """The MTP layer's own tensors around its block (``mtp.{j}.*`` minus the block's)."""

    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype, own_head: bool):
        super().__init__()
        d, hc = config.dim, config.hc_mult
        self.config = config
        self.e_proj = Linear(d, d, dtype)
        self.h_proj = Linear(d, d, dtype)
        self.enorm = RMSNorm(d, config.norm_eps)
        self.hnorm = RMSNorm(d, config.norm_eps)
        self.norm = RMSNorm(d, config.norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * d, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.head = Linear(d, config.vocab_size, dtype=torch.float32) if own_head else None

    @torch.no_grad()
    def block_input(self, hidden: torch.Tensor, next_embed: torch.Tensor) -> torch.Tensor:
        """hidden [B, S, hc, D] (h_0..h_{S-1}), next_embed [B, S-1, D] (embed(t_1..t_{S-1}))
        -> the block's input [B, S-1, hc, D]."""
        h = hidden[:, :-1]
        e = self.e_proj(self.enorm(next_embed.to(h.dtype)))
        return e.unsqueeze(2) + self.h_proj(self.hnorm(h))

    @torch.no_grad()
    def logits(self, y: torch.Tensor, main_head: nn.Module) -> torch.Tensor:
        """The block's output [B, S-1, hc, D] -> fp32 logits [B, S-1, V] (for t_2..t_S)."""
        head = self.head if self.head is not None else main_head
        return hc_head_logits(y, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.norm, head,
                              self.config.hc_eps, self.config.norm_eps)


def mtp_prefix(config: DeepseekV4Config, layer_id: int) -> str:
    return f"mtp.{layer_id - int(config.n_layers)}."


def complete_mtp_ids(reader: CheckpointReader, config: DeepseekV4Config) -> list[int]:
    """Layer ids (n_layers + j) of the MTP layers the checkpoint holds completely: every block
    tensor and every projection tensor (the tiny asset carries only e_proj / h_proj / norms)."""
    from .loading import empty_block

    n, out = int(config.n_layers), []
    for j in range(int(getattr(config, "n_mtp_layers", 0) or 0)):
        lid = n + j
        if len(config.compress_ratios) <= lid:
            break
        prefix = f"mtp.{j}."
        want = list(empty_block(config, lid, torch.bfloat16).state_dict()) + list(PROJECTION_KEYS)
        if all(reader.has(prefix + k) for k in want):
            out.append(lid)
    return out


def load_mtp_block(reader: CheckpointReader, config: DeepseekV4Config, layer_id: int, dtype: torch.dtype,
                   device: torch.device | str) -> Block:
    """The MTP layer's decoder block (layer id ``layer_id``) from ``mtp.{j}.*``."""
    from amct_ext.runtime.empty import assert_materialized

    from .loading import empty_block, materialize_derived_buffers

    block = empty_block(config, layer_id, dtype)
    res = reader.load_prefix(mtp_prefix(config, layer_id), block.state_dict(), device=device, dtype=dtype)
    block.load_state_dict(res.tensors, strict=True, assign=True)
    materialize_derived_buffers(block, device)
    assert_materialized(block, f"{mtp_prefix(config, layer_id)[:-1]} block")
    return block.eval()


def load_complete_mtp_block(reader: CheckpointReader, config: DeepseekV4Config, j: int, dtype: torch.dtype,
                            device: torch.device | str) -> Block | None:
    """MTP layer ``j``'s decoder block (layer id n_layers + j) for the export, or None when the
    config has no compress ratio for it or the checkpoint lacks some of its block tensors (the
    tiny asset carries only e_proj / h_proj / norms): then its tensors are copied as released."""
    from .loading import empty_block

    lid = int(config.n_layers) + j
    if len(config.compress_ratios) <= lid:
        return None
    prefix = mtp_prefix(config, lid)
    if not all(reader.has(prefix + n) for n in empty_block(config, lid, dtype).state_dict()):
        return None
    return load_mtp_block(reader, config, lid, dtype, device)


def load_mtp_projections(reader: CheckpointReader, config: DeepseekV4Config, layer_id: int, dtype: torch.dtype,
                         device: torch.device | str) -> MtpProjections:
    """The MTP layer's own tensors; the block's tensors under the same prefix are left to
    :func:`load_mtp_block` (callers silence the reader's "not expected" warning for them)."""
    prefix = mtp_prefix(config, layer_id)
    mod = MtpProjections(config, dtype, own_head=reader.has(prefix + "head.weight"))
    res = reader.load_prefix(prefix, mod.state_dict(), device=device, dtype=dtype)
    mod.load_state_dict(res.tensors, strict=True, assign=True)
    return mod.eval()


def shifted_state(state: dict[str, Any]) -> dict[str, Any]:
    """A sample's block kwargs for the MTP sequence (tokens t_1..t_{S-1})."""
    out = dict(state)
    if isinstance(out.get("input_ids"), torch.Tensor):
        out["input_ids"] = out["input_ids"][:, 1:]
    return out


def block_inputs(proj: MtpProjections, embed: nn.Module, hidden: Sequence[torch.Tensor],
                 states: Sequence[dict[str, Any]]) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """Per sample: the MTP block's input from the last main layer's output and the next tokens."""
    xs, sts = [], []
    for h, st in zip(hidden, states):
        ids = st.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            raise ValueError("MTP inputs need each sample's input_ids (the model's recorded block kwargs)")
        dev = proj.e_proj.weight.device
        with torch.no_grad():
            e = embed(ids[:, 1:].to(dev))
        x = proj.block_input(h.to(dev), e)
        xs.append(x.to(h.device))
        sts.append(shifted_state(st))
    return xs, sts
