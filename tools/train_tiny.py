#!/usr/bin/env python
"""Train a tiny DeepSeek-V4 (the project's own float model, every layer kind) on WikiText-2 *validation*.

    python tools/train_tiny.py --out DIR [--steps N] [--batch-size B] [--seq-len S] [--lr LR] [--seed N]
                               [--device auto|cuda|cpu] [--vocab-size V] [--time-budget-s T]

What it does
- trains a byte-level BPE (``amct_ext.pipeline.tokenizer.train_bpe_tokenizer``) on the validation split, writes
  it into DIR and tokenizes the protocol text of the same file ONCE (rows joined with "\\n\\n", like the
  perplexity protocol, so the model sees the test split's formatting). The test split is never read:
  ``refuse_test_split`` rejects such a path.
- holds out the last 5% of the tokens for the validation loss; training batches are random windows of
  ``seq_len + 1`` tokens from the other 95% (drawn with a private, seeded ``torch.Generator``).
- builds ``models.deepseek_v4.modeling.DeepseekV4ForCausalLM`` in fp32 from ``tiny.tiny_config`` with
  ratio 0 / 4 (indexer) / 128 layers, hash + score routed MoE, hc_mult 4 and one MTP entry, and
  initialises it with ``tiny.init_random_weights(model, seed)`` (the project's scaled random init; it
  also fills every hash layer's ``tid2eid`` with a random map of ``topk`` distinct experts per token).
- AdamW (weight decay on matrices only), linear warmup + cosine decay, grad-norm clipping, bf16
  autocast on an accelerator and fp32 on cpu.
- score-routed gates: ``gate.bias`` is NOT trained by gradient (requires_grad=False); it follows
  DeepSeek's auxiliary-loss-free balancing instead: after every step
  ``bias += bias_rate * sign(mean_load - load)`` with the expert loads counted by a forward hook on
  each score ``Gate`` (no host sync). No auxiliary loss is used.
- evaluates the held-out loss every ``--eval-every`` steps and keeps the weights with the best
  held-out loss (early stopping against overfitting the ~0.25M-token corpus); those are written.
- stops early when ``--time-budget-s`` would be exceeded and still writes the checkpoint.
- writes DIR/{config.json, model-0000k-of-00002.safetensors, model.safetensors.index.json, tokenizer.json,
  tokenizer_config.json, train_log.json}: the released flat layout (``write_release_checkpoint``,
  fmt='bf16': bf16 storage, fp32 islands in fp32, plus ``mtp.0.*`` tensors from
  ``tiny.random_mtp_tensors``). Refuses (before training, and again after writing) a checkpoint over
  16 MB (16,000,000 bytes).

Defaults (sized for one H200 in a 10-minute command): 4 layers, hidden 160, 8 experts (160 wide) top-2
+ 1 shared, vocab 4096, ~4.7M parameters, ~11.7 MB checkpoint; batch 32 x 256 tokens, lr 3e-3, up to
4000 steps or 420 s, whichever comes first (the cosine schedule follows the one that binds).

Determinism: same seed -> same weights, same batches, same losses on cpu as long as the step limit,
not the time budget, drives the schedule (pass a large --time-budget-s for a reproducible cpu run). On cuda the MoE's
``index_add_`` (atomic adds) and some backward kernels are not bitwise deterministic, so GPU runs of
one seed agree only to rounding.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from amct_ext.pipeline.calibration import DEFAULT_CALIBRATION_PATH, refuse_test_split  # noqa: E402
from amct_ext.runtime.device import resolve_device, synchronize  # noqa: E402
from amct_ext.runtime.empty import empty_weights  # noqa: E402
from amct_ext.errors import AmctError, ConfigError  # noqa: E402
from amct_ext.io.io_utils import atomic_write_json  # noqa: E402
from amct_ext.pipeline.perplexity import ROW_SEPARATOR, read_wikitext_rows  # noqa: E402
from amct_ext.pipeline.tokenizer import TOKENIZER_FILE, tokenizer_vocab_size, train_bpe_tokenizer  # noqa: E402
from models.deepseek_v4.modeling import DeepseekV4ForCausalLM, Gate  # noqa: E402
from models.deepseek_v4.release_format import _is_fp32_island, official_config_dict, write_release_checkpoint  # noqa: E402
from models.deepseek_v4.tiny import init_random_weights, random_mtp_tensors, tiny_config  # noqa: E402

MAX_CHECKPOINT_BYTES = 16_000_000  # "at most 16 MB" (decimal MB: the stricter reading)

# The default trained architecture (official HF names; everything else from tiny.TINY_CONFIG).
# 4 main layers: r0-hash, r4(indexer)-score, r128-score, r4(indexer)-score; + 1 MTP entry.
DEFAULT_MODEL: dict[str, Any] = {
    "hidden_size": 128,  # multiples of 128 everywhere: group-128 schemes (w4a16-g128) apply
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 128,
    "o_groups": 2,
    "o_lora_rank": 64,
    "moe_intermediate_size": 256,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "num_hash_layers": 1,
    "num_nextn_predict_layers": 1,
    "compress_ratios": [0, 4, 128, 4, 0],
    "sliding_window": 32,
    "index_n_heads": 4,
    "index_head_dim": 32,
    "index_topk": 16,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1024,  # = factor * original (transformers' YaRN check)
}


@dataclass
class TrainConfig:
    out: str | None = None                 # checkpoint folder (None: train only, write nothing)
    text_path: str = str(DEFAULT_CALIBRATION_PATH)
    vocab_size: int = 4096
    steps: int = 4000
    batch_size: int = 32
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    bias_rate: float = 5e-3                # aux-loss-free balancing step for gate.bias (0: frozen)
    seed: int = 0
    device: str = "auto"
    amp: str = "auto"                      # auto (bf16 on accelerators, fp32 on cpu) | bf16 | fp32
    time_budget_s: float = 420.0
    eval_every: int = 100
    log_every: int = 50
    val_fraction: float = 0.05
    max_val_windows: int = 64
    keep_best: bool = True
    n_shards: int = 2
    model: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(DEFAULT_MODEL))
    verbose: bool = True


@dataclass
class TrainResult:
    losses: list[float]
    val_history: list[tuple[int, float]]
    steps_done: int
    final_train_loss: float
    final_val_loss: float
    best_val_loss: float
    best_step: int
    unigram_val_loss: float
    wall_s: float
    n_params: int
    checkpoint_bytes: int | None
    out: str | None
    stopped_early: bool
    model: DeepseekV4ForCausalLM | None = None


# ------------------------------------------------------------------------------------------ data
def load_tokens(text_path: Path, tok_dir: Path) -> torch.Tensor:
    """The protocol text of ``text_path`` (rows joined with "\\n\\n") as one LongTensor of ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / TOKENIZER_FILE))
    text = ROW_SEPARATOR.join(read_wikitext_rows(text_path))
    return torch.tensor(tok.encode(text, add_special_tokens=False).ids, dtype=torch.long)


def unigram_loss(train: torch.Tensor, val: torch.Tensor, vocab: int) -> float:
    """Cross-entropy (nats) of ``val`` under the add-one smoothed unigram of ``train``: the bar to beat."""
    counts = torch.bincount(train, minlength=vocab).double() + 1.0
    logp = (counts / counts.sum()).log()
    return float(-logp[val].mean())


def val_windows(val: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    n = min((val.numel() - 1) // seq_len, max_windows)
    if n < 1:
        raise ConfigError(f"held-out set of {val.numel()} tokens is shorter than one window of {seq_len + 1}")
    # windows of seq_len + 1 tokens overlapping by one, so every held-out token is predicted once
    return torch.stack([val[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


# ----------------------------------------------------------------------------------------- model
def build_model_config(cfg: TrainConfig, vocab: int):
    overrides = {**cfg.model, "vocab_size": vocab}
    config = tiny_config(**overrides)
    if cfg.seq_len > config.max_seq_len:
        raise ConfigError(f"seq_len={cfg.seq_len} exceeds max_position_embeddings={config.max_seq_len}")
    return config


def estimate_checkpoint_bytes(model: DeepseekV4ForCausalLM, extra: dict[str, torch.Tensor]) -> int:
    """Bytes of the bf16 release tensors (fp32 islands 4 bytes, tid2eid int64) before writing."""
    total = 0
    for key, t in list(model.state_dict().items()) + list(extra.items()):
        if not t.dtype.is_floating_point:
            total += t.numel() * 8
        elif t.dtype == torch.float32 and _is_fp32_island(key):
            total += t.numel() * 4
        else:
            total += t.numel() * 2
    return total


class LoadBalancer:
    """Aux-loss-free balancing (DeepSeek-V3/V4): count each score gate's expert loads with a forward
    hook, then nudge ``gate.bias`` by ``rate * sign(mean - load)`` after the optimizer step."""

    def __init__(self, model: DeepseekV4ForCausalLM, rate: float):
        self.rate = rate
        self.gates = [m for m in model.modules() if isinstance(m, Gate) and not m.hash]
        self.loads = {id(g): None for g in self.gates}
        self.handles = [g.register_forward_hook(self._hook) for g in self.gates]
        self.enabled = True

    def _hook(self, gate, args, output):
        if not self.enabled:
            return
        counts = torch.bincount(output[1].flatten(), minlength=gate.weight.shape[0]).float()
        prev = self.loads[id(gate)]
        self.loads[id(gate)] = counts if prev is None else prev + counts

    @torch.no_grad()
    def update(self) -> None:
        for g in self.gates:
            load = self.loads[id(g)]
            if load is not None and self.rate > 0:
                g.bias.add_(self.rate * torch.sign(load.mean() - load))
            self.loads[id(g)] = None

    def max_over_mean(self) -> float:
        """Worst expert load / mean load over the score gates of the last step (1.0 = perfect)."""
        worst = 1.0
        for g in self.gates:
            load = self.loads[id(g)]
            if load is not None:
                worst = max(worst, float(load.max() / load.mean().clamp_min(1e-9)))
        return worst


def lr_at(step: int, cfg: TrainConfig, time_fraction: float = 0.0) -> float:
    """Linear warmup to cfg.lr, then cosine decay to cfg.lr * min_lr_ratio.

    The cosine runs over whichever limit binds first: ``cfg.steps`` or the time budget
    (``time_fraction`` = training time spent / training time available), so a run cut by
    ``--time-budget-s`` still ends with a decayed learning rate."""
    warm = max(1, min(cfg.warmup_steps, cfg.steps // 5))
    if step < warm:
        return cfg.lr * (step + 1) / warm
    t = min(1.0, max((step - warm) / max(1, cfg.steps - warm), time_fraction))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, device, amp_dtype, batch_size: int) -> float:
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i:i + batch_size].to(device)
        with torch.autocast(device_type=device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            logits = model(w[:, :-1])
        total += F.cross_entropy(logits.float().flatten(0, 1), w[:, 1:].flatten(), reduction="sum").double()
        count += w[:, 1:].numel()
    model.train(was_training)
    return float(total) / count


def _say(cfg: TrainConfig, *msg: Any) -> None:
    if cfg.verbose:
        print(*msg, flush=True)


# ----------------------------------------------------------------------------------------- train
def _training_data(cfg: TrainConfig, text_path: Path, tok_dir: Path, tmp):
    """The tokenizer trained into ``tok_dir`` (``tmp``: its temporary folder, removed after),
    the text's tokens split into training and held-out ids: (tokenizer bytes, ids, train ids,
    held-out ids, held-out windows, vocabulary size, held-out unigram loss)."""
    train_bpe_tokenizer(text_path, cfg.vocab_size, tok_dir)
    vocab = tokenizer_vocab_size(tok_dir)
    ids = load_tokens(text_path, tok_dir)
    tok_bytes = (tok_dir / TOKENIZER_FILE).stat().st_size
    if tmp is not None:
        tmp.cleanup()
    n_val = max(cfg.seq_len + 1, int(ids.numel() * cfg.val_fraction))
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]
    if train_ids.numel() <= cfg.seq_len + 1:
        raise ConfigError(f"training text has only {train_ids.numel()} tokens, fewer than one window")
    vwin = val_windows(val_ids, cfg.seq_len, cfg.max_val_windows)
    uni = unigram_loss(train_ids, val_ids, vocab)
    _say(cfg, f"tokens: {ids.numel()} (train {train_ids.numel()}, held-out {val_ids.numel()}, "
              f"{vwin.shape[0]} eval windows), vocab {vocab}, held-out unigram loss {uni:.3f}")
    return tok_bytes, ids, train_ids, val_ids, vwin, vocab, uni


def _build_model(cfg: TrainConfig, vocab: int, tok_bytes: int, out: Path | None, device):
    """(model config, MTP tensors, parameter count, the initialised model on ``device``); the
    checkpoint's size is checked on a meta skeleton first (a too-big model is never allocated)."""
    config = build_model_config(cfg, vocab)
    with empty_weights():  # size check on a meta skeleton first: a too-big model is never allocated
        skeleton = DeepseekV4ForCausalLM(config, dtype=torch.float32)
    mtp = random_mtp_tensors(config, torch.Generator().manual_seed(cfg.seed + 1))
    n_params = sum(p.numel() for p in skeleton.parameters())
    est = estimate_checkpoint_bytes(skeleton, mtp) + tok_bytes
    del skeleton
    _say(cfg, f"model: {n_params / 1e6:.2f}M parameters, layers {config.compress_ratios[:config.n_layers]} "
              f"({config.n_hash_layers} hash), {config.n_routed_experts} experts top-{config.n_activated_experts}; "
              f"checkpoint estimate {est / 1e6:.2f} MB")
    if out is not None and est > MAX_CHECKPOINT_BYTES:
        raise ConfigError(f"the checkpoint would take ~{est / 1e6:.2f} MB, over the {MAX_CHECKPOINT_BYTES / 1e6:.0f} MB "
                          f"limit: shrink the model (vocab, hidden size, experts)")
    model = DeepseekV4ForCausalLM(config, dtype=torch.float32)
    init_random_weights(model, cfg.seed)
    model.to(device).train()
    return config, mtp, n_params, model


def _write_train_log(cfg: TrainConfig, out: Path, config, device, amp_dtype, n_params: int, tokens: tuple,
                     result: TrainResult, train_wall: float) -> None:
    """OUTPUT/train_log.json (the command, the settings, the losses), and the size check of the
    written checkpoint."""
    ids, train_ids, val_ids, vwin = tokens
    ckpt_bytes = result.checkpoint_bytes
    log = {
        "command": " ".join([sys.executable] + sys.argv),
        "seed": cfg.seed,
        "train_config": {k: v for k, v in asdict(cfg).items() if k != "verbose"},
        "model_config": official_config_dict(config, "bf16"),
        "device": str(device),
        "amp": "bf16" if amp_dtype is not None else "fp32",
        "torch_version": torch.__version__,
        "n_params": n_params,
        "tokens": {"total": ids.numel(), "train": train_ids.numel(), "held_out": val_ids.numel(),
                   "eval_windows": int(vwin.shape[0])},
        "steps_requested": cfg.steps,
        "steps_done": result.steps_done,
        "stopped_early": result.stopped_early,
        "final_train_loss": result.final_train_loss,
        "final_val_loss": result.final_val_loss,
        "best_val_loss": result.best_val_loss,
        "best_step": result.best_step,
        "saved_weights": f"step {result.best_step}" if cfg.keep_best else f"step {result.steps_done}",
        "unigram_val_loss": result.unigram_val_loss,
        "train_wall_s": train_wall,
        "wall_s": result.wall_s,
        "checkpoint_bytes": ckpt_bytes,
        "val_history": result.val_history,
        "losses": result.losses,
    }
    atomic_write_json(log, out / "train_log.json")
    _say(cfg, f"checkpoint {out}: {ckpt_bytes / 1e6:.2f} MB (+ train_log.json)")
    if ckpt_bytes > MAX_CHECKPOINT_BYTES:
        raise ConfigError(f"checkpoint in {out} is {ckpt_bytes / 1e6:.2f} MB, over the "
                          f"{MAX_CHECKPOINT_BYTES / 1e6:.0f} MB limit: do not commit it; shrink the model")


def _checked_device(cfg: TrainConfig):
    """(device, autocast dtype or None) after the sizes and the amp setting are checked."""
    for name in ("steps", "batch_size", "seq_len", "eval_every", "log_every"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    device = resolve_device(cfg.device)
    if cfg.amp not in ("auto", "bf16", "fp32"):
        raise ConfigError(f"amp must be auto, bf16 or fp32, got {cfg.amp!r}")
    use_bf16 = cfg.amp == "bf16" or (cfg.amp == "auto" and device.type != "cpu")
    return device, (torch.bfloat16 if use_bf16 else None)


def _tokenizer_dir(out: Path | None):
    """(where the tokenizer is trained, its temporary folder or None): the output folder, or a
    temporary one when the run writes no checkpoint."""
    import tempfile

    if out is None:
        tmp = tempfile.TemporaryDirectory(prefix="train_tiny_tok_")
        return Path(tmp.name), tmp
    out.mkdir(parents=True, exist_ok=True)
    return out, None


def _finish_model(cfg: TrainConfig, model, balancer, best_state, best_step: int, best_val: float) -> None:
    """The best held-out weights back (``best_state`` None: the last ones are the best, or
    keep_best is off), the balancer's hooks removed, eval mode."""
    if cfg.keep_best and best_state is not None:
        model.load_state_dict(best_state)
        _say(cfg, f"restored the best held-out weights (step {best_step}, val {best_val:.4f})")
    for h in balancer.handles:
        h.remove()
    model.eval()


def _write_checkpoint(model, config, out: Path, cfg: TrainConfig, mtp) -> int:
    """The release-layout bf16 checkpoint of the trained model (+ MTP tensors); its bytes."""
    state = {k: t.detach().cpu() for k, t in model.state_dict().items()}
    write_release_checkpoint(state, config, out, fmt="bf16", n_shards=cfg.n_shards, extra=mtp)
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file() and p.name != "train_log.json")


def _optimizer(model, cfg: TrainConfig, device) -> torch.optim.Optimizer:
    """AdamW, weight decay on the matrices only."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas,
                             # one fused kernel group on accelerators (the step is launch-bound there)
                             **({"fused": True} if device.type == "cuda" else {"foreach": True}))


def _step_line(cfg: TrainConfig, done: int, interval_loss: torch.Tensor, lr: float, tokens: int, seconds: float,
               val_history: list, balance: float | None) -> str:
    """The progress line every ``log_every`` steps."""
    n = done % cfg.log_every or cfg.log_every
    msg = (f"step {done:5d}/{cfg.steps}  loss {float(interval_loss) / n:.4f}  lr {lr:.2e}  "
           f"{tokens / seconds:,.0f} tok/s  {seconds / n * 1e3:.0f} ms/step")
    if val_history and val_history[-1][0] == done:
        msg += f"  val {val_history[-1][1]:.4f}"
    if balance is not None:
        msg += f"  max/mean expert load {balance:.2f}"
    return msg


def train(cfg: TrainConfig) -> TrainResult:
    t_start = time.perf_counter()
    text_path = Path(cfg.text_path)
    refuse_test_split(text_path, "training")
    device, amp_dtype = _checked_device(cfg)

    torch.manual_seed(cfg.seed)
    out = Path(cfg.out) if cfg.out else None
    tok_dir, tmp = _tokenizer_dir(out)

    # tokenizer + data
    tok_bytes, ids, train_ids, val_ids, vwin, vocab, uni = _training_data(cfg, text_path, tok_dir, tmp)

    # model
    config, mtp, n_params, model = _build_model(cfg, vocab, tok_bytes, out, device)
    balancer = LoadBalancer(model, cfg.bias_rate)
    for g in balancer.gates:
        g.bias.requires_grad_(False)  # aux-loss-free balancing, not gradient
    opt = _optimizer(model, cfg, device)
    data_gen = torch.Generator().manual_seed(cfg.seed + 2)
    offsets = torch.arange(cfg.seq_len + 1)

    losses: list[float] = []
    val_history: list[tuple[int, float]] = []
    best_val, best_step, best_state = float("inf"), 0, None
    stopped_early = False
    step_times: list[float] = []
    interval_loss = torch.zeros((), device=device)
    t_train = t_log = time.perf_counter()
    tokens_since_log = 0
    step = 0
    pending: list[torch.Tensor] = []

    def flush_losses():
        if pending:
            losses.extend(torch.stack(pending).tolist())
            pending.clear()

    def do_eval(at: int) -> float:
        nonlocal best_val, best_step, best_state
        balancer.enabled = False
        v = evaluate(model, vwin, device, amp_dtype, cfg.batch_size)
        balancer.enabled = True
        val_history.append((at, v))
        if v < best_val:
            best_val, best_step = v, at
            if cfg.keep_best:
                best_state = {k: t.detach().clone() for k, t in model.state_dict().items()}
        return v

    for step in range(cfg.steps):
        t0 = time.perf_counter()
        starts = torch.randint(0, train_ids.numel() - cfg.seq_len - 1, (cfg.batch_size,), generator=data_gen)
        batch = train_ids[starts.unsqueeze(1) + offsets].to(device, non_blocking=True)
        # time left for training: budget minus setup so far and ~10 s for the final eval + write
        time_fraction = (time.perf_counter() - t_train) / max(1e-9, cfg.time_budget_s - (t_train - t_start) - 10.0)
        lr = lr_at(step, cfg, time_fraction)
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast(device_type=device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
            logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        balance = balancer.max_over_mean() if (step + 1) % cfg.log_every == 0 else None
        balancer.update()
        pending.append(loss.detach())
        interval_loss += loss.detach()
        tokens_since_log += batch.shape[0] * cfg.seq_len
        done = step + 1

        if done % cfg.eval_every == 0 or done == cfg.steps:
            do_eval(done)
        if done % cfg.log_every == 0 or done == cfg.steps:
            flush_losses()
            synchronize(device)
            now = time.perf_counter()
            _say(cfg, _step_line(cfg, done, interval_loss, lr, tokens_since_log, now - t_log, val_history, balance))
            interval_loss.zero_()
            tokens_since_log, t_log = 0, now
        step_times.append(time.perf_counter() - t0)
        # time budget: stop when the next step (+ final eval and write, ~2 steps' worth + 10 s) would overrun
        elapsed = time.perf_counter() - t_start
        recent = sum(step_times[-20:]) / len(step_times[-20:])
        if done < cfg.steps and elapsed + 2 * recent + 10.0 > cfg.time_budget_s:
            stopped_early = True
            _say(cfg, f"time budget {cfg.time_budget_s:.0f} s reached after {done} steps: stopping")
            break
    steps_done = step + 1
    flush_losses()
    if not val_history or val_history[-1][0] != steps_done:
        do_eval(steps_done)
    final_val = val_history[-1][1]
    tail = losses[-min(20, len(losses)):]
    final_train = sum(tail) / len(tail)
    train_wall = time.perf_counter() - t_train

    _finish_model(cfg, model, balancer, best_state if best_step != steps_done else None, best_step, best_val)

    ckpt_bytes = _write_checkpoint(model, config, out, cfg, mtp) if out is not None else None
    wall = time.perf_counter() - t_start
    result = TrainResult(
        losses=losses, val_history=val_history, steps_done=steps_done, final_train_loss=final_train,
        final_val_loss=final_val, best_val_loss=best_val, best_step=best_step, unigram_val_loss=uni,
        wall_s=wall, n_params=n_params, checkpoint_bytes=ckpt_bytes, out=str(out) if out else None,
        stopped_early=stopped_early, model=model,
    )
    _say(cfg, f"final train loss {final_train:.4f} (mean of last {len(tail)} steps), val loss {final_val:.4f}, "
              f"best val {best_val:.4f} @ step {best_step}, unigram {uni:.3f}; {steps_done} steps in "
              f"{train_wall:.1f} s, wall {wall:.1f} s")
    if out is not None:
        _write_train_log(cfg, out, config, device, amp_dtype, n_params, (ids, train_ids, val_ids, vwin), result,
                         train_wall)
    return result


def main(argv=None) -> int:
    d = TrainConfig()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="checkpoint folder")
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--seq-len", type=int, default=d.seq_len)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--device", default=d.device, help="auto | cuda | cpu | npu (default auto)")
    ap.add_argument("--vocab-size", type=int, default=d.vocab_size)
    ap.add_argument("--time-budget-s", type=float, default=d.time_budget_s)
    ap.add_argument("--amp", choices=["auto", "bf16", "fp32"], default=d.amp)
    ap.add_argument("--eval-every", type=int, default=d.eval_every)
    ap.add_argument("--log-every", type=int, default=d.log_every)
    ap.add_argument("--text", default=d.text_path, help="training text (default: wikitext-2 valid.txt)")
    ap.add_argument("--model-json", default=None,
                    help="JSON object of tiny_config overrides (official names) replacing the default model")
    args = ap.parse_args(argv)
    cfg = TrainConfig(out=args.out, text_path=args.text, vocab_size=args.vocab_size, steps=args.steps,
                      batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                      device=args.device, amp=args.amp, time_budget_s=args.time_budget_s,
                      eval_every=args.eval_every, log_every=args.log_every)
    if args.model_json:
        cfg.model = {**cfg.model, **json.loads(args.model_json)}
    try:
        train(cfg)
    except AmctError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
