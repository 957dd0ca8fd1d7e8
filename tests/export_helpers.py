"""Helpers of the export tests: a tiny checkpoint with a complete MTP layer, tensor layouts."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "assets" / "tiny-v4"
REFERENCE = Path(__file__).resolve().parent / "data" / "msmodelslim-26.1-tiny-v4"


@torch.no_grad()
def with_complete_mtp(src: Path, dst: Path, seed: int = 7, own_head: bool = True) -> Path:
    """A copy of ``src`` whose ``mtp.0.*`` holds a whole decoder block (layer id n_layers) plus the
    MTP head tensors, like the checkpoint msModelSlim's MTP run used (``own_head=False``: without
    ``mtp.0.head.weight`` / ``mtp.0.emb.tok_emb.weight``, which the release shares with the model)."""
    from amct_ext.io.checkpoint_writer import save_sharded
    from models.deepseek_v4.loading import load_config
    from models.deepseek_v4.modeling import Block
    from models.deepseek_v4.release_format import release_tensors
    from models.deepseek_v4.tiny import init_block_weights

    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.suffix == ".json" and p.name != "model.safetensors.index.json" or p.name.startswith("tokenizer"):
            shutil.copyfile(p, dst / p.name)
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    config = load_config(src)
    block = Block(int(config.n_layers), config, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    init_block_weights(block, config, gen)
    d = config.dim
    extra = {f"mtp.0.{k}": v for k, v in block.state_dict().items() if not k.endswith(("cos", "sin"))}
    extra.update({"mtp.0.head.weight": torch.randn(config.vocab_size, d, generator=gen) / d ** 0.5,
                  "mtp.0.norm.weight": torch.ones(d), "mtp.0.emb.tok_emb.weight": torch.randn(config.vocab_size, d, generator=gen),
                  "mtp.0.hc_head_fn": 0.02 * torch.randn(config.hc_mult, config.hc_mult * d, generator=gen),
                  "mtp.0.hc_head_base": torch.zeros(config.hc_mult), "mtp.0.hc_head_scale": torch.ones(1)})
    if not own_head:
        extra = {k: v for k, v in extra.items() if k not in ("mtp.0.head.weight", "mtp.0.emb.tok_emb.weight")}
    extra = {k: v for k, v in extra.items() if k not in tensors}
    tensors.update(release_tensors(extra, "bf16"))
    save_sharded(tensors, dst, 2)
    return dst


def tensor_layout(folder: Path, index_name: str) -> dict[str, dict]:
    """{name: {'dtype', 'shape'}} of every tensor of an exported folder (from the shard headers)."""
    idx = json.loads((folder / index_name).read_text())
    out = {}
    for shard in sorted(set(idx["weight_map"].values())):
        with safe_open(str(folder / shard), "pt") as f:
            for k in f.keys():
                s = f.get_slice(k)
                out[k] = {"dtype": s.get_dtype(), "shape": list(s.get_shape())}
    return out
