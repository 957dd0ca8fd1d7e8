"""Synthetic DeepSeek-V4 checkpoints: random weights at the real shapes, in the release layout.

What a folder written by ``write_synthetic_checkpoint`` holds (what the release holds, spec §3):
- ``config.json``: the official-style config of V4-Flash / V4-Pro (``configs/``) with
  ``num_hidden_layers`` cut to N and ``compress_ratios`` cut to its first N entries plus the
  trailing MTP entries (so layer i keeps the kind it has in the full model);
- one shard per decoder layer, one for the stem (embed, norm, head, hc_head_*) and one for
  ``mtp.0.*``, then ``model.safetensors.index.json`` written LAST (a folder without an index is
  not a checkpoint: an interrupted write is never mistaken for one);
- attention / indexer / shared-expert linears as FP8 e4m3 with ue8m0 128x128 block scales,
  routed experts as packed FP4 e2m1 with e8m0 per-32 scales, everything else as
  ``release_format.release_tensors`` stores it (fp32 islands fp32, other floats bf16);
- a tokenizer (byte-level BPE from ``amct_ext.pipeline.tokenizer``, or copied from another folder).

Why on the device: a V4-Flash layer is ~13 GB of bf16 weights; drawing and FP4/FP8-encoding
it on a host CPU takes minutes, on an accelerator seconds. Each layer is drawn, encoded, moved
to the host as its (4x smaller) stored bytes, written, and dropped before the next: host memory
holds about one stored layer, the device about one bf16 layer.

Weights follow ``tiny.init_block_weights``'s scheme (linear weights N(0, 1/fan_in), norms 1 +-
0.1, ...) so activations stay O(1) through the layers; the draw is seeded per layer, so one
layer's bytes do not depend on how many layers are written.
"""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from amct_ext.runtime import device as devmod
from amct_ext.io.checkpoint_writer import INDEX_NAME, shard_file_name
from amct_ext.errors import ConfigError
from amct_ext.io.io_utils import atomic_write, atomic_write_json
from amct_ext.io.storage_formats import encode_fp4, encode_fp8_block

from .configuration import DeepseekV4Config
from .loading import build_skeleton
from .modeling import Block, Gate
from .release_format import FP4_EXPERT, FP8_LINEAR, release_tensors
from .tiny import TINY_CONFIG

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
CONFIG_FILES = {"v4-flash": "deepseek-v4-flash.config.json", "v4-pro": "deepseek-v4-pro.config.json"}
LIKES = ("v4-flash", "v4-pro", "tiny")
# the tiny dims on the V4-Flash layer pattern (--like tiny): every field of TINY_CONFIG except
# those that fix the number and kinds of layers, which stay Flash's
_TINY_KEEP_FLASH = ("num_hidden_layers", "compress_ratios", "num_hash_layers", "num_nextn_predict_layers")
TINY_DIMS = {k: v for k, v in TINY_CONFIG.items() if k not in _TINY_KEEP_FLASH}


# ----------------------------------------------------------------------------- config
def base_config_dict(like: str) -> dict[str, Any]:
    """The official-style config.json of ``like`` (tiny: Flash's with the tiny dims)."""
    if like not in LIKES:
        raise ConfigError(f"--like {like!r} is unknown; valid: {', '.join(LIKES)}")
    path = CONFIG_DIR / CONFIG_FILES["v4-flash" if like == "tiny" else like]
    d = json.loads(path.read_text(encoding="utf-8"))
    if like == "tiny":
        d.update(json.loads(json.dumps(TINY_DIMS)))
    return d


def synthetic_config_dict(like: str, n_layers: int, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """``like``'s config with its first ``n_layers`` layers (and its MTP entries) kept."""
    d = base_config_dict(like)
    if overrides:
        d.update(json.loads(json.dumps(overrides)))
    n_main = int(d["num_hidden_layers"])
    ratios = list(d["compress_ratios"])
    if not 1 <= n_layers <= n_main:
        raise ConfigError(f"--layers {n_layers}: must be within 1..{n_main} for {like}")
    d["compress_ratios"] = ratios[:n_layers] + ratios[n_main:]   # trailing entries: the MTP module
    d["num_hidden_layers"] = n_layers
    d["num_hash_layers"] = min(int(d.get("num_hash_layers", 0)), n_layers)
    return d


# ----------------------------------------------------------------------------- device-side init
def _init_rule(name: str, p: torch.Tensor) -> tuple[float, float]:
    """(mean, std) of ``tiny.init_block_weights``'s scheme for a block parameter."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "weight" and p.dim() == 2:
        return 0.0, 1.0 / math.sqrt(p.shape[1])
    rules = {"weight": (1.0, 0.1), "hc_attn_fn": (0.0, 0.02), "hc_ffn_fn": (0.0, 0.02),
             "hc_attn_base": (0.0, 0.5), "hc_ffn_base": (0.0, 0.5), "hc_attn_scale": (1.0, 0.1),
             "hc_ffn_scale": (1.0, 0.1), "attn_sink": (0.0, 1.0), "ape": (0.0, 0.5), "bias": (0.0, 0.1)}
    if leaf not in rules:
        raise AssertionError(f"no init rule for {name}")
    return rules[leaf]


@torch.no_grad()
def init_block_weights_device(block: Block, config: DeepseekV4Config, seed: int = 0) -> None:
    """``tiny.init_block_weights``'s scheme drawn in place on the block's own device."""
    dev = next(block.parameters()).device
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    for name, p in block.named_parameters():
        mean, std = _init_rule(name, p)
        p.normal_(mean, std, generator=gen)
    for module in block.modules():
        if isinstance(module, Gate) and module.hash:  # each token id gets `topk` distinct experts
            ranks = torch.rand(config.vocab_size, config.n_routed_experts, generator=gen, device=dev).argsort(dim=-1)
            module.tid2eid.copy_(ranks[:, : module.topk])


def random_block(config: DeepseekV4Config, layer_id: int, device: torch.device, seed: int,
                 dtype: torch.dtype = torch.bfloat16) -> Block:
    """Decoder layer ``layer_id`` allocated on ``device`` with random weights."""
    with torch.device(device):
        block = Block(layer_id, config, dtype)
    init_block_weights_device(block, config, seed)
    return block.eval()


@torch.no_grad()
def random_stem(config: DeepseekV4Config, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """embed / norm / head / hc_head_* at the skeleton's shapes and dtypes (``init_random_weights``'s scheme)."""
    skeleton = build_skeleton(config, torch.bfloat16)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    rules = {"embed.weight": (0.0, 1.0), "norm.weight": (1.0, 0.1), "head.weight": (0.0, 1.0 / math.sqrt(config.dim)),
             "hc_head_fn": (0.0, 0.02), "hc_head_base": (0.0, 0.5), "hc_head_scale": (1.0, 0.1)}
    out = {}
    for key, meta in skeleton.state_dict().items():
        if key.startswith("layers."):
            continue
        mean, std = rules[key]
        out[key] = torch.empty(meta.shape, dtype=meta.dtype, device=device).normal_(mean, std, generator=gen)
    return out


def random_mtp_projections(config: DeepseekV4Config, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """The MTP module's own tensors (beside its block): e/h norms and projections."""
    d = config.dim
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return {
        "mtp.0.enorm.weight": torch.ones(d, dtype=torch.float32, device=device),
        "mtp.0.hnorm.weight": torch.ones(d, dtype=torch.float32, device=device),
        "mtp.0.e_proj.weight": torch.empty(d, d, device=device).normal_(0, 1 / math.sqrt(d), generator=gen).bfloat16(),
        "mtp.0.h_proj.weight": torch.empty(d, d, device=device).normal_(0, 1 / math.sqrt(d), generator=gen).bfloat16(),
    }


# ----------------------------------------------------------------------------- release encoding
@torch.no_grad()
def encode_release(tensors: dict[str, torch.Tensor], rule_key: Callable[[str], str] = lambda k: k) -> dict[str, torch.Tensor]:
    """``release_tensors(tensors, 'fp8')`` with the FP8 / FP4 encoding run where the tensors are;
    result on the host. ``rule_key`` maps a key to the name whose storage rule applies (the MTP
    block is stored like a decoder layer)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        rk = rule_key(key)
        if t.is_floating_point() and (FP4_EXPERT.match(rk) or FP8_LINEAR.match(rk)):
            q, s = encode_fp4(t.float()) if FP4_EXPERT.match(rk) else encode_fp8_block(t.float(), scale_fmt="ue8m0")
            out[key], out[key[: -len("weight")] + "scale"] = q.cpu(), s.cpu()
        else:
            out.update(release_tensors({key: t}, "fp8"))
    return out


def expected_release_layout(config: DeepseekV4Config, layer_id: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{checkpoint key: (shape, stored dtype)} of decoder layer ``layer_id`` in the release layout,
    derived from the meta block (no allocation)."""
    from .loading import empty_block

    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for k, meta in empty_block(config, layer_id, torch.bfloat16).state_dict().items():
        key = f"layers.{layer_id}.{k}"
        shape = tuple(meta.shape)
        if meta.is_floating_point() and FP4_EXPERT.match(key):
            out[key] = ((shape[0], shape[1] // 2), torch.int8)
            out[key[: -len("weight")] + "scale"] = ((shape[0], -(-shape[1] // 32)), torch.float8_e8m0fnu)
        elif meta.is_floating_point() and FP8_LINEAR.match(key):
            out[key] = (shape, torch.float8_e4m3fn)
            out[key[: -len("weight")] + "scale"] = ((-(-shape[0] // 128), -(-shape[1] // 128)), torch.float8_e8m0fnu)
        elif not meta.is_floating_point():
            out[key] = (shape, torch.int64 if key.endswith("tid2eid") else meta.dtype)
        else:
            stored = release_tensors({key: torch.empty(0, dtype=meta.dtype)}, "fp8")[key].dtype
            out[key] = (shape, stored)
    return out


# ----------------------------------------------------------------------------- writer
def _tokenizer(out_dir: Path, config: DeepseekV4Config, tokenizer_from: str | os.PathLike | None,
               text_path: str | os.PathLike | None, tokenizer_vocab: int) -> None:
    from amct_ext.pipeline.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILE, tokenizer_vocab_size, train_bpe_tokenizer

    if tokenizer_from is not None:
        src = Path(tokenizer_from)
        for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE):
            if not (src / name).is_file():
                raise ConfigError(f"--tokenizer-from {src}: {name} not found")
            shutil.copyfile(src / name, out_dir / name)
    else:
        from amct_ext.pipeline.calibration import DEFAULT_CALIBRATION_PATH

        train_bpe_tokenizer(text_path or DEFAULT_CALIBRATION_PATH, min(tokenizer_vocab, config.vocab_size), out_dir)
    n = tokenizer_vocab_size(out_dir)
    if n > config.vocab_size:
        raise ConfigError(f"{out_dir}: tokenizer has {n} entries but the model vocabulary is {config.vocab_size}")


def write_synthetic_checkpoint(out_dir: str | os.PathLike, like: str = "v4-flash", n_layers: int = 4, *,
                               device: str | torch.device = "cpu", seed: int = 0,
                               overrides: dict[str, Any] | None = None, mtp_block: bool = True,
                               tokenizer_from: str | os.PathLike | None = None,
                               text_path: str | os.PathLike | None = None, tokenizer_vocab: int = 4096,
                               log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write a synthetic checkpoint (see the module docstring); returns a summary (bytes, seconds).

    ``mtp_block``: ``mtp.0`` holds a whole decoder block (as in the release) beside its
    projections; False writes the projections only (a smaller folder; the main forward never
    reads ``mtp.*``)."""
    import time

    out = Path(out_dir)
    if (out / INDEX_NAME).exists():
        raise ConfigError(f"{out} already holds a checkpoint ({INDEX_NAME}); pass a fresh --out")
    out.mkdir(parents=True, exist_ok=True)
    dev = devmod.resolve_device(device) if not isinstance(device, torch.device) else device
    cfg_dict = synthetic_config_dict(like, n_layers, overrides)
    config = DeepseekV4Config(**json.loads(json.dumps(cfg_dict)))
    say = log or (lambda s: None)
    t_start = time.perf_counter()
    _tokenizer(out, config, tokenizer_from, text_path, tokenizer_vocab)

    n_shards = n_layers + 2
    weight_map: dict[str, str] = {}
    summary: dict[str, Any] = {"like": like, "layers": n_layers, "device": str(dev), "shards": [], "total_bytes": 0}

    def write_shard(idx: int, what: str, make: Callable[[], dict[str, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        tensors = make()
        devmod.synchronize(dev)
        t_gen = time.perf_counter() - t0
        name = shard_file_name(idx, n_shards)
        t1 = time.perf_counter()
        shard = {k: v.contiguous() for k, v in sorted(tensors.items())}
        atomic_write(out / name, lambda tmp: save_file(shard, tmp, metadata={"format": "pt"}))
        nbytes = sum(t.numel() * t.element_size() for t in shard.values())
        for k in shard:
            weight_map[k] = name
        rec = {"file": name, "what": what, "bytes": nbytes, "tensors": len(shard),
               "generate_encode_s": t_gen, "write_s": time.perf_counter() - t1}
        summary["shards"].append(rec)
        summary["total_bytes"] += nbytes
        say(f"{name}: {what}, {len(shard)} tensors, {nbytes / 2**30:.2f} GiB "
            f"(draw+encode {t_gen:.1f} s, write {rec['write_s']:.1f} s)")
        del tensors, shard
        devmod.empty_cache(dev)

    def layer_tensors(i: int) -> dict[str, torch.Tensor]:
        block = random_block(config, i, dev, seed=seed * 1_000_003 + 17 * (i + 1))
        sd = {f"layers.{i}.{k}": v for k, v in block.state_dict().items()}
        enc = encode_release(sd)
        expected = expected_release_layout(config, i)
        got = {k: (tuple(v.shape), v.dtype) for k, v in enc.items()}
        if got != expected:  # a writer bug guard: the folder must match what the config implies
            diff = sorted(set(got.items()) ^ set(expected.items()))[:5]
            raise AssertionError(f"layer {i}: written layout differs from the config's: {diff}")
        return enc

    def stem_tensors() -> dict[str, torch.Tensor]:
        return encode_release(random_stem(config, dev, seed * 1_000_003 + 1))

    def mtp_tensors() -> dict[str, torch.Tensor]:
        t = random_mtp_projections(config, dev, seed * 1_000_003 + 2)
        enc = encode_release(t)
        if mtp_block:
            # the MTP block sits after the main layers: its compress ratio is the trailing entry
            block = random_block(config, n_layers, dev, seed=seed * 1_000_003 + 3)
            sd = {f"mtp.0.{k}": v for k, v in block.state_dict().items()}
            enc.update(encode_release(sd, rule_key=lambda k: f"layers.{n_layers}." + k[len("mtp.0."):]))
        return enc

    write_shard(0, "stem (embed, norm, head, hc_head)", stem_tensors)
    for i in range(n_layers):
        write_shard(i + 1, f"layer {i} (ratio {config.compress_ratios[i]}, "
                           f"{'hash' if i < config.n_hash_layers else 'score'})", lambda i=i: layer_tensors(i))
    write_shard(n_layers + 1, "mtp.0" + (" (block + projections)" if mtp_block else " (projections)"), mtp_tensors)
    atomic_write_json(cfg_dict, out / "config.json")
    index = {"metadata": {"total_size": summary["total_bytes"]}, "weight_map": dict(sorted(weight_map.items()))}
    atomic_write_json(index, out / INDEX_NAME)   # last: only now is the folder a checkpoint
    summary["seconds"] = time.perf_counter() - t_start
    return summary
