#!/usr/bin/env python
"""Continue the trained tiny's training on the release's grids and write it in the release layout.

    python tools/train_release_tiny.py --src assets/tiny-v4 --out assets/tiny-v4-release \\
        [--steps N] [--lr LR] [--batch-size B] [--seq-len S] [--eval-every K] [--threads T]

Why: DeepSeek-V4 was trained to its storage grids (FP8 e4m3 with ue8m0 scales per 128x128 block on
the attention and shared-expert linears, FP4 e2m1 with ue8m0 scales per 32 on the routed experts),
so the weights users quantize lie ON those grids. ``assets/tiny-v4`` was trained in bf16; plainly
rounding it to the release format costs ~1 % PPL (issue 35). This tool fine-tunes it with the
release's formats in the forward (straight-through estimator), so the released float is itself a
good model, as the real release is.

What it does
- loads ``--src`` (a bf16 release-layout tiny: config.json, shards, tokenizer) into
  ``DeepseekV4ForCausalLM`` in fp32 and keeps its ``mtp.*`` tensors as they are;
- puts a straight-through parametrization on every float parameter whose forward value is exactly
  what ``write_release_checkpoint(..., fmt="fp8")`` stores for it, decoded: the storage codecs'
  own ``decode(encode(w))`` for the FP8 / FP4 weights, a bf16 rounding for the other bf16-stored
  tensors, nothing for the fp32 islands. The training forward IS the release float's forward;
- trains on the same token stream as ``tools/train_tiny.py`` (the WikiText-2 validation split,
  tokenized with ``--src``'s tokenizer; the last 5 % held out), AdamW, linear warmup + cosine,
  grad-norm clipping, fp32 on cpu; gate biases frozen (no balancing: a short run);
- evaluates the held-out loss of the bf16 source, then of the release float before training and
  every ``--eval-every`` steps, and STOPS as soon as the release float is back to the source's
  held-out loss (``--target-held-out`` overrides it): the testbed is meant to be the same model
  as the bf16 tiny, only on the release's grids, not a better-trained one (trained on, it keeps
  improving: 100 steps at lr 3e-4 gave a release float 6 % below the bf16 tiny's PPL). It keeps
  the best held-out weights seen (step 0 included);
- writes ``--out``: the release layout (``fmt="fp8"``: FP8 / FP4 codes + ue8m0 scales), the
  tokenizer, ``train_log.json`` (config, command, held-out history, losses) and ``train.log``.
  Atomic: it writes into a temporary sibling folder and renames it.

Deterministic on cpu for a given seed and thread count.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from amct_ext.errors import AmctError, CheckpointError, ConfigError  # noqa: E402
from amct_ext.io.io_utils import atomic_write_json  # noqa: E402
from amct_ext.io.storage_formats import decode_fp4, decode_fp8_block, encode_fp4, encode_fp8_block  # noqa: E402
from amct_ext.pipeline.calibration import DEFAULT_CALIBRATION_PATH, refuse_test_split  # noqa: E402
from models.deepseek_v4.configuration import DeepseekV4Config  # noqa: E402
from models.deepseek_v4.modeling import DeepseekV4ForCausalLM  # noqa: E402
from models.deepseek_v4.release_format import FP4_EXPERT, FP8_LINEAR, _is_fp32_island, write_release_checkpoint  # noqa: E402

INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass
class QatConfig:
    src: str = "assets/tiny-v4"
    out: str | None = None
    text_path: str = str(DEFAULT_CALIBRATION_PATH)
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    eval_every: int = 1
    val_fraction: float = 0.05      # as tools/train_tiny.py: the same held-out tail
    max_val_windows: int = 64
    seed: int = 0
    threads: int = 1
    # stop once the release float's held-out loss is back to this (None: the bf16 source's own)
    target_held_out: float | None = None


# ------------------------------------------------------------------------------ release grids
def release_storage_kind(key: str) -> str:
    """How ``write_release_checkpoint(fmt="fp8")`` stores the float tensor ``key``:
    'fp4', 'fp8', 'fp32' (an fp32 island) or 'bf16'."""
    if FP4_EXPERT.match(key):
        return "fp4"
    if FP8_LINEAR.match(key):
        return "fp8"
    return "fp32" if _is_fp32_island(key) else "bf16"


def release_float(w: torch.Tensor, kind: str) -> torch.Tensor:
    """The fp32 value the release stores for ``w`` (kind from ``release_storage_kind``), decoded
    with the storage codecs themselves, so the training forward equals the released float."""
    w = w.detach().float()
    if kind == "fp4":
        return decode_fp4(*encode_fp4(w), dtype=torch.float32)
    if kind == "fp8":
        return decode_fp8_block(*encode_fp8_block(w, scale_fmt="ue8m0"), dtype=torch.float32)
    if kind == "bf16":
        return w.to(torch.bfloat16).float()
    return w


class ReleaseGrid(nn.Module):
    """Straight-through parametrization: forward value on the release grid, identity gradient."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + (release_float(w, self.kind) - w.detach())


def attach_release_grids(model: nn.Module) -> dict[str, int]:
    """Parametrize every float parameter of ``model`` (release names) whose stored value differs
    from fp32; returns the count per storage kind."""
    counts: dict[str, int] = {}
    for key, p in list(model.named_parameters()):
        kind = release_storage_kind(key)
        counts[kind] = counts.get(kind, 0) + 1
        if kind == "fp32" or not p.dtype.is_floating_point:
            continue
        owner_name, leaf = key.rsplit(".", 1)
        parametrize.register_parametrization(model.get_submodule(owner_name), leaf, ReleaseGrid(kind))
    return counts


def detach_release_grids(model: nn.Module) -> None:
    """Drop the parametrizations, keeping the latent (unrounded) weights: the writer rounds them."""
    for mod in list(model.modules()):
        if parametrize.is_parametrized(mod):
            for leaf in list(mod.parametrizations.keys()):
                parametrize.remove_parametrizations(mod, leaf, leave_parametrized=False)


# ------------------------------------------------------------------------------ source model
def read_release_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index_path = folder / INDEX
    if not index_path.is_file():
        raise CheckpointError(f"{folder}: no {INDEX} (not a release-layout checkpoint)")
    shards = sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
    out: dict[str, torch.Tensor] = {}
    for shard in shards:
        if "/" in shard or "\\" in shard or shard.startswith(".."):
            raise CheckpointError(f"{index_path}: shard name {shard!r} leaves the folder")
        out.update(load_file(str(folder / shard)))
    return out


def load_source(folder: Path) -> tuple[DeepseekV4Config, DeepseekV4ForCausalLM, dict[str, torch.Tensor]]:
    """(config, fp32 model, mtp tensors) of a bf16 release-layout folder."""
    config = DeepseekV4Config.from_pretrained(str(folder))
    tensors = read_release_tensors(folder)
    if any(k.endswith(".scale") for k in tensors):
        raise CheckpointError(f"{folder}: holds FP8 / FP4 scales; --src must be the bf16 tiny (assets/tiny-v4)")
    mtp = {k: v for k, v in tensors.items() if k.startswith("mtp.")}
    model = DeepseekV4ForCausalLM(config, dtype=torch.float32)
    state = {k: (v.float() if v.dtype.is_floating_point else v) for k, v in tensors.items() if k not in mtp}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{folder}: keys do not match the model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    return config, model, mtp


# ------------------------------------------------------------------------------ training
def lr_at(step: int, cfg: QatConfig) -> float:
    warm = max(1, min(cfg.warmup_steps, cfg.steps // 5))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = (step - warm) / max(1, cfg.steps - warm)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def held_out_loss(model: nn.Module, windows: torch.Tensor, batch_size: int) -> float:
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    with parametrize.cached():
        for i in range(0, windows.shape[0], batch_size):
            w = windows[i:i + batch_size]
            logits = model(w[:, :-1])
            total += float(F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
            count += w[:, 1:].numel()
    model.train(was_training)
    return total / count


def token_split(cfg: QatConfig, tok_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(train ids, held-out windows): train_tiny's stream and split."""
    from tools.train_tiny import load_tokens, val_windows

    ids = load_tokens(Path(cfg.text_path), tok_dir)
    n_val = max(cfg.seq_len + 1, int(ids.numel() * cfg.val_fraction))
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]
    if train_ids.numel() <= cfg.seq_len + 1:
        raise ConfigError(f"{cfg.text_path}: only {train_ids.numel()} training tokens, fewer than one window")
    return train_ids, val_windows(val_ids, cfg.seq_len, cfg.max_val_windows)


def check_config(cfg: QatConfig) -> None:
    for name in ("steps", "batch_size", "seq_len", "eval_every", "threads"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if not cfg.lr > 0:
        raise ConfigError(f"--lr must be > 0, got {cfg.lr}")
    src = Path(cfg.src)
    for f in ("config.json", INDEX, *TOKENIZER_FILES):
        if not (src / f).is_file():
            raise CheckpointError(f"--src {src}: missing {f}")
    refuse_test_split(Path(cfg.text_path), "training")


def train(cfg: QatConfig, log=print) -> tuple[DeepseekV4ForCausalLM, DeepseekV4Config, dict, dict]:
    """The fine-tuned model (parametrizations removed, best held-out weights), its config, the mtp
    tensors and the log dict."""
    check_config(cfg)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    config, model, mtp = load_source(Path(cfg.src))
    train_ids, vwin = token_split(cfg, Path(cfg.src))
    source_loss = held_out_loss(model, vwin, cfg.batch_size)
    target = source_loss if cfg.target_held_out is None else cfg.target_held_out
    counts = attach_release_grids(model)
    log(f"source {cfg.src}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
        f"tensors per storage kind {counts}; {train_ids.numel()} training tokens, {vwin.shape[0]} held-out windows")
    model.train()
    for name, p in model.named_parameters():
        if name.endswith("gate.bias"):
            p.requires_grad_(False)   # balancing bias: not a gradient parameter (train_tiny)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas, foreach=True)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    offsets = torch.arange(cfg.seq_len + 1)
    losses: list[float] = []
    history = [(0, held_out_loss(model, vwin, cfg.batch_size))]
    best_step, best_val = 0, history[0][1]
    best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
    log(f"step 0: held-out loss of the bf16 source {source_loss:.5f}, of the plainly rounded release "
        f"{best_val:.5f}; training until the release float is back to {target:.5f} (at most {cfg.steps} steps)")
    reached = best_val <= target
    for step in range(0 if reached else cfg.steps):
        starts = torch.randint(0, train_ids.numel() - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
        batch = train_ids[starts.unsqueeze(1) + offsets]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = F.cross_entropy(model(batch[:, :-1]).float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
        done = step + 1
        if done % cfg.eval_every == 0 or done == cfg.steps:
            v = held_out_loss(model, vwin, cfg.batch_size)
            history.append((done, v))
            if v < best_val:
                best_step, best_val = done, v
                best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
            tail = losses[-cfg.eval_every:]
            log(f"step {done:4d}/{cfg.steps}  train loss {sum(tail) / len(tail):.4f}  lr {lr_at(step, cfg):.2e}  "
                f"held-out {v:.5f}  ({time.perf_counter() - t0:.0f} s)")
            if v <= target:
                reached = True
                break
    model.load_state_dict(best_state)
    log(f"kept step {best_step} (held-out {best_val:.5f}; step 0 was {history[0][1]:.5f}; "
        f"target {target:.5f} {'reached' if reached else 'NOT reached'})")
    detach_release_grids(model)
    model.eval()
    record = {
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "train_config": asdict(cfg),
        "storage_kinds": counts,
        "torch_version": torch.__version__,
        "tokens": {"train": int(train_ids.numel()), "held_out_windows": int(vwin.shape[0])},
        "held_out_history": history,
        "source_held_out_loss": source_loss,
        "target_held_out_loss": target,
        "target_reached": reached,
        "best_step": best_step,
        "best_held_out_loss": best_val,
        "start_held_out_loss": history[0][1],
        "wall_s": time.perf_counter() - t0,
        "losses": losses,
    }
    return model, config, mtp, record


def write_release(model: nn.Module, config: DeepseekV4Config, mtp: dict, record: dict, src: Path,
                  out: Path, log_lines: list[str]) -> Path:
    """The release layout in ``out`` (temp sibling folder + rename: never half a checkpoint)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        state = {k: t.detach().cpu() for k, t in model.state_dict().items()}
        write_release_checkpoint(state, config, tmp, fmt="fp8", extra=mtp)
        for f in TOKENIZER_FILES:
            shutil.copy2(src / f, tmp / f)
        atomic_write_json(record, tmp / "train_log.json")
        (tmp / "train.log").write_text("\n".join(log_lines) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv=None) -> int:
    d = QatConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default=d.src, help="the bf16 tiny (default assets/tiny-v4)")
    ap.add_argument("--out", required=True, help="output folder (release layout, fmt fp8)")
    for name in ("steps", "batch_size", "seq_len", "eval_every", "warmup_steps", "seed", "threads"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    for name in ("lr", "min_lr_ratio", "weight_decay"):
        ap.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    ap.add_argument("--target-held-out", type=float, default=None,
                    help="stop once the release float's held-out loss is at most this (default: the bf16 source's)")
    ap.add_argument("--text", default=d.text_path, help="training text (default: the shipped validation split)")
    args = ap.parse_args(argv)
    cfg = QatConfig(src=args.src, out=args.out, text_path=args.text, steps=args.steps, batch_size=args.batch_size,
                    seq_len=args.seq_len, eval_every=args.eval_every, warmup_steps=args.warmup_steps,
                    seed=args.seed, threads=args.threads, lr=args.lr, min_lr_ratio=args.min_lr_ratio,
                    weight_decay=args.weight_decay, target_held_out=args.target_held_out)
    lines: list[str] = []

    def log(msg: str) -> None:
        lines.append(msg)
        print(msg, flush=True)

    try:
        model, config, mtp, record = train(cfg, log)
        out = write_release(model, config, mtp, record, Path(cfg.src), Path(cfg.out), lines)
    except AmctError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {out} ({size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
