"""What quantization costs a model's multi-token-prediction (MTP) layer (issue 23.6).

The MTP layer is what a speculative-decoding engine (vllm-ascend's ``w8a8-mtp`` weights) keeps as
its draft: at position i it predicts token t_{i+2}. Measured on the evaluation windows, with the
float main model's last hidden states as its input (so the numbers are the MTP layer's own
quantization cost, not the main model's):

- ``top1_agreement``: the share of positions where the quantized MTP's top-1 token equals the
  float MTP's (the draft acceptance it would keep against a float draft);
- ``top1_accuracy``: float and quantized, the share of positions whose top-1 is t_{i+2}.

Everything model-specific goes through the adapter: ``mtp_layer_ids``, ``block``,
``mtp_block_inputs``, ``mtp_logits`` (DeepSeek-V4: models/deepseek_v4/adapter.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from ..base import BaseModel, EvalConfig
from ..quant.schemes import QuantScheme, parse_targets
from .workflow import embed_stream, load_unit_params, scheme_has_static

ACCURACY_NOTE = ("top1_accuracy means something only for a trained MTP layer (the tiny checkpoints' "
                 "complete MTP layers are random); top1_agreement measures the quantization either way")


def top1_stats(float_top1: torch.Tensor, quant_top1: torch.Tensor, targets: torch.Tensor) -> dict[str, Any]:
    """Top-1 token ids of the float / quantized MTP and the true tokens, same shape, one entry per
    predicted position."""
    if not (float_top1.shape == quant_top1.shape == targets.shape):
        raise ValueError(f"top1_stats: shapes {tuple(float_top1.shape)}, {tuple(quant_top1.shape)}, "
                         f"{tuple(targets.shape)} differ")
    n = targets.numel()
    if n == 0:
        raise ValueError("top1_stats: no positions")
    return {"positions": int(n),
            "top1_agreement": (float_top1 == quant_top1).sum().item() / n,
            "top1_accuracy": {"float": (float_top1 == targets).sum().item() / n,
                              "quant": (quant_top1 == targets).sum().item() / n}}


@torch.no_grad()
def _top1(adapter: BaseModel, layer_id: int, ys: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [adapter.mtp_logits(layer_id, y).argmax(-1).cpu() for y in ys]


@torch.no_grad()
def evaluate_mtp(adapter: BaseModel, windows: torch.Tensor, cfg: EvalConfig, scheme: QuantScheme,
                 targets: Sequence[str], params_dir: str | Path | None) -> dict[str, Any]:
    """Float vs quantized MTP layer on ``windows`` (the run's parameters from ``params_dir`` when it
    saved them for the MTP layer, else RTN). Returns the report.json entry."""
    ids = adapter.mtp_layer_ids()
    if not ids:
        return {"status": "not evaluated: the checkpoint has no complete MTP layer"}
    targets = parse_targets(targets)
    if scheme_has_static(scheme, targets):
        return {"status": "not evaluated: static activation scales need a calibration pass of their own"}
    lid = ids[0]
    dev = adapter.device
    stream = embed_stream(adapter, windows, cfg.batch_size)
    hidden = stream.hidden
    for i in range(adapter.num_layers):        # the float main model's last hidden states
        block = adapter.block(i, device=dev)
        hidden = adapter.do_block_forward(block, hidden, stream.state)
        adapter.release_block(block)
    xs, states = adapter.mtp_block_inputs(lid, hidden, stream.state)
    del hidden
    block = adapter.block(lid, device=dev)
    f_top1 = _top1(adapter, lid, adapter.do_block_forward(block, xs, states))
    adapter.quantize_block(block, scheme, targets)
    units = list(adapter.iter_ptq_units(block, lid, targets))
    pdir = Path(params_dir) if params_dir is not None else None
    with_params = [u for u in units if pdir is not None and (pdir / f"{u.file_stem}.pt").is_file()]
    for u in with_params:
        load_unit_params(u, pdir)
    adapter.set_quant_enabled(block, True)
    q_top1 = _top1(adapter, lid, adapter.do_block_forward(block, xs, states))
    adapter.release_block(block)
    # MTP position i predicts t_{i+2}: the last MTP position (i = S-2) has no target
    # the MTP samples' input_ids are t_1..t_{S-1}; dropping the first gives the targets t_2..t_{S-1}
    tgt = [st["input_ids"][:, 1:].cpu() for st in states]
    f = torch.cat([t[:, :-1].reshape(-1) for t in f_top1])
    q = torch.cat([t[:, :-1].reshape(-1) for t in q_top1])
    y = torch.cat([t.reshape(-1) for t in tgt])
    out = top1_stats(f, q, y)
    how = "run parameters" if len(with_params) == len(units) else \
        ("RTN" if not with_params else f"run parameters for {len(with_params)} of {len(units)} units, RTN for the rest")
    out.update({"layer": adapter.layer_name(lid), "quantized_with": how,
                "input": "the float main model's last hidden states on the evaluation windows",
                "note": ACCURACY_NOTE})
    return out
