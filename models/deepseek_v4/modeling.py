"""DeepSeek-V4 float reference (prefill), written to be read against the architecture
spec shipped beside it, models/deepseek_v4/SPEC.md §2.

Module names are the released checkpoint keys (``embed``, ``layers.{i}.attn.wq_a``,
``layers.{i}.ffn.experts.{e}.w1``, ``hc_head_fn`` ...), so a flat state dict loads without renaming.

Notation in shape comments: B batch, S sequence, D dim, H n_heads, Dh head_dim, R rope_head_dim,
hc hc_mult, W window_size, r compress ratio, Nc = S // r compressed entries, E routed experts.

fp32 islands (spec "Parameter dtypes"): every RMSNorm weight, all hc_* parameters, attn_sink, the
Compressor's ape / wkv / wgate, head.weight and gate.bias are created in fp32 whatever the compute
dtype; tid2eid is int64. Everything else uses the model's compute ``dtype``.

Differences from the upstream inference code, on purpose:
- prefill only (start_pos == 0), no kv / compressor caches;
- batch > 1 works (upstream's sparse-attention mask breaks there, spec §5 trap 3);
- ``forward`` returns fp32 logits for every position;
- rope uses real cos / sin tables (no complex dtype: Ascend has no complex kernels).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from amct_ext.runtime.device import fast_paths_enabled, fp32_out_gemm_supported, fused_kernels_enabled, has_python_hooks
from amct_ext.runtime.exact_gemm import SplitWeightCache, linear_fp32, matmul_fp32

from .banded_attention import BandedAttention, banded_attention
from .configuration import DeepseekV4Config
from .fused_attention import fused_index_score, fused_sparse_attention
from .fused_hc import hc_post_fused, hc_pre_fused
from .fused_moe import clamped_swiglu, combine_slots, grouped_gemm, grouped_gemm_suited, slot_rows
from .fused_norm_rope import rms_norm, rope_inplace


# ----------------------------------------------------------------------------------------- helpers
class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, in fp32 with an fp32 weight; returns x's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused_16bit(x, self.weight):
            return rms_norm(x, self.weight, self.eps)                 # fused_norm_rope.py: one pass
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


def _fused_16bit(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """Whether an elementwise Triton kernel may replace the torch expression on x: a 16-bit x on a
    device with the fused kernels, and nothing that autograd would have to differentiate."""
    if x.dtype not in (torch.bfloat16, torch.float16) or not fused_kernels_enabled(x.device):
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)))


def head_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, fp32 math, x's dtype out (no weight).

    This runs on the [B, S, H, Dh] queries, the largest activation, so it takes one pass where it
    can: the Triton kernel (fused_norm_rope.rms_norm), else with the fast paths on torch's fused
    ``F.rms_norm`` (same formula, fp32 inside), else four passes over an fp32 copy."""
    if _fused_16bit(x):
        return rms_norm(x, None, eps)                                  # fused_norm_rope.py: one pass
    if fast_paths_enabled(x.device) and x.dtype != torch.float32:
        return F.rms_norm(x, (x.shape[-1],), eps=eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)


class Linear(nn.Linear):
    """nn.Linear (no bias) whose weight is allocated but not initialised.

    Every weight comes from a checkpoint (or ``tiny.init_random_weights``); skipping the default
    kaiming init keeps the 1.6T-parameter meta skeleton fast to build and a real layer fast to
    allocate. Still an ``nn.Linear``, so generic code that looks for linears finds it."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        # nn.Linear.__init__ minus the init and the bias bookkeeping: half the construction cost,
        # which matters for the ~70k linears of a V4-Pro skeleton.
        nn.Module.__init__(self)
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = None

    def reset_parameters(self) -> None:
        pass

    @property
    def split_cache(self) -> SplitWeightCache:
        """bf16 split of an fp32 weight for ``linear_fp32`` (made on first use)."""
        cache = self.__dict__.get("_split_cache")
        if cache is None:
            cache = self.__dict__["_split_cache"] = SplitWeightCache()
        return cache


def _plain(module: nn.Module, cls: type) -> bool:
    """``module`` is exactly ``cls`` with no Python hooks (torch's, or accelerate's dispatch hooks,
    which replace ``forward``): a fast path may then compute its call without skipping anything."""
    return type(module) is cls and not has_python_hooks(module)


def island_linear(linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An fp32-island projection: ``linear(x.float())`` in fp32. A plain unhooked ``Linear`` goes
    through ``linear_fp32`` (exact bf16 tensor-core GEMMs where the backend has them); a wrapper
    (e.g. a QuantLinear) or a hooked module is called as a module, on the fp32 input."""
    if _plain(linear, Linear):   # a dispatch hook on the Linear itself must see the call (S15)
        return linear_fp32(x, linear.weight, linear.split_cache)
    return linear(x.float())


class Embedding(nn.Embedding):
    """nn.Embedding without the default (unused) normal init, for the same reason as Linear."""

    def reset_parameters(self) -> None:
        pass


class Matmul(nn.Module):
    """``a @ b`` (``a @ b^T`` with ``transpose_b``) as a module of its own.

    The attention and indexer score / value products go through these so that quantization can
    swap in a ``QuantizedMatmul`` without a second copy of the attention math. ``b`` is passed
    token-major ([..., N, d]) in both cases, which is also the layout of a kv cache."""

    def __init__(self, transpose_b: bool = False):
        super().__init__()
        self.transpose_b = transpose_b

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a, b.transpose(-1, -2) if self.transpose_b else b)

    def extra_repr(self) -> str:
        return f"transpose_b={self.transpose_b}"


def _factory_device() -> torch.device:
    """Where a tensor created right now without ``device=`` lands (meta inside init_empty_weights)."""
    return torch.empty(0).device


@functools.lru_cache(maxsize=64)
def rope_frequencies(rope_dim: int, base: float, factor: float, original_seq_len: int,
                     beta_fast: float, beta_slow: float) -> tuple[float, ...]:
    """f_i = base^(-2i/R), i < R/2, with YaRN interpolation when original_seq_len > 0 (spec §2 Rope).

    Returns plain Python floats: caching tensors here would cache a *meta* tensor when first called
    inside an empty-weights context (spec §5 trap 2)."""
    freqs = [base ** (-(2 * i) / rope_dim) for i in range(rope_dim // 2)]
    if original_seq_len > 0:
        def corr(n_rot: float) -> float:
            return rope_dim * math.log(original_seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corr(beta_fast)), 0)
        high = min(math.ceil(corr(beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001
        ramp = [min(max((i - low) / (high - low), 0.0), 1.0) for i in range(rope_dim // 2)]
        freqs = [f / factor * r + f * (1 - r) for f, r in zip(freqs, ramp)]
    return tuple(freqs)


@functools.lru_cache(maxsize=32)
def _rope_table(freqs: tuple[float, ...], length: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / sin of pos * f_i, [length, R/2] fp32, cached per device (never a meta tensor for a real
    device: the device is part of the key)."""
    with torch.inference_mode(False):  # cached across calls: must not be an inference tensor (casebook S7)
        return _rope_table_uncached(freqs, length, device)


def _rope_table_uncached(freqs: tuple[float, ...], length: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    f = torch.tensor(freqs, dtype=torch.float64, device=device)
    pos = torch.arange(length, dtype=torch.float64, device=device)
    angles = torch.outer(pos, f)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
               inplace: bool = False) -> torch.Tensor:
    """Rotate the last R channels of x as interleaved pairs (x0, x1), (x2, x3), ... by pos * f_i.

    x [..., S, (heads,) C]; cos / sin [S, R/2] are broadcast over batch and heads (``x`` must have
    the sequence axis at dim 1). ``inverse`` rotates by -pos (attention output). fp32 math, result in
    x's dtype; the non-rope channels are passed through untouched."""
    if inplace and x.dim() in (3, 4) and x.stride(-1) == 1 and x.shape[1] == cos.shape[0] and _fused_16bit(x) \
            and cos.shape[-1] & (cos.shape[-1] - 1) == 0:
        return rope_inplace(x, cos, sin, inverse)                     # fused_norm_rope.py: one pass
    rd = cos.shape[-1] * 2
    nope, rope = x[..., :-rd], x[..., -rd:]
    shape = [1] * x.dim()
    shape[1] = cos.shape[0]
    shape[-1] = cos.shape[1]
    c = cos.view(shape)
    s = sin.view(shape)
    if inverse:
        s = -s
    pairs = rope.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    if inplace and not (torch.is_grad_enabled() and x.requires_grad):
        # the caller owns x: write the R rotated channels back instead of copying all C of them
        rope.copy_(rotated)
        return x
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)


@functools.lru_cache(maxsize=8)
def _hadamard(d: int, device: str) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix H_d / sqrt(d), fp32 (d a power of two)."""
    if d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two size, got {d}")
    with torch.inference_mode(False):  # cached across calls: must not be an inference tensor (casebook S7)
        h = torch.ones(1, 1, dtype=torch.float32, device=device)
        while h.shape[0] < d:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        return h / math.sqrt(d)


@functools.lru_cache(maxsize=8)
def _hadamard_split(d: int, device: str) -> SplitWeightCache:
    return SplitWeightCache()


@functools.lru_cache(maxsize=8)
def _hadamard_signs(d: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(H_d's +-1 entries in bf16, the fp32 magnitude 1/sqrt(d) of _hadamard's entries, 0-dim)."""
    h = _hadamard(d, device)
    with torch.inference_mode(False):
        return torch.sign(h).bfloat16(), h[0, 0].clone()


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ (H_d / sqrt(d)) over the last dim, fp32 math, x's dtype out. H is symmetric, so this is
    ``linear(x, H)``: an fp32 island like the others (exact_gemm.linear_fp32).

    Every entry of H_d / sqrt(d) is +-v with the same v, so sum_k x_k (+-v) = v * sum_k (+-x_k):
    with fp32-output bf16 GEMMs, a bf16 x takes one GEMM against the +-1 matrix (exact products,
    fp32 sums) and one product with v, instead of three GEMMs against a 3-way split of H."""
    d = x.shape[-1]
    h = _hadamard(d, str(x.device))
    if x.dtype == torch.bfloat16 and fp32_out_gemm_supported(x.device) and \
            not (torch.is_grad_enabled() and x.requires_grad):
        signs, v = _hadamard_signs(d, str(x.device))
        y = torch.mm(x.reshape(-1, d), signs, out_dtype=torch.float32)
        return y.mul_(v).to(x.dtype).view(x.shape)
    return linear_fp32(x, h, _hadamard_split(d, str(x.device))).to(x.dtype)


class RotaryTable(nn.Module):
    """Per-layer rope cos / sin buffers (non-persistent), grown on demand for longer sequences."""

    def __init__(self, freqs: tuple[float, ...], length: int):
        super().__init__()
        self.freqs = freqs
        cos, sin = _rope_table(freqs, length, str(_factory_device()))
        self.register_buffer("cos", cos.clone(), persistent=False)
        self.register_buffer("sin", sin.clone(), persistent=False)

    def materialize(self, device: torch.device | str) -> None:
        """Recompute the (derived, non-persistent) tables on ``device``: used after a meta build."""
        cos, sin = _rope_table(self.freqs, self.cos.shape[0], str(torch.device(device)))
        self.cos, self.sin = cos.clone(), sin.clone()

    def forward(self, seqlen: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos.shape[0] >= seqlen and self.cos.device == device:
            return self.cos[:seqlen], self.sin[:seqlen]
        cos, sin = _rope_table(self.freqs, max(seqlen, self.cos.shape[0]), str(device))
        return cos[:seqlen], sin[:seqlen]


def layer_rope_frequencies(config: DeepseekV4Config, ratio: int) -> tuple[float, ...]:
    """Ratio-0 layers: rope_theta, no YaRN. Compressed layers: compress_rope_theta with YaRN."""
    if ratio == 0:
        return rope_frequencies(config.rope_head_dim, float(config.rope_theta), 1.0, 0, 0.0, 0.0)
    return rope_frequencies(config.rope_head_dim, float(config.compress_rope_theta), float(config.rope_factor),
                            int(config.original_seq_len), float(config.beta_fast), float(config.beta_slow))


def rope_table_length(config: DeepseekV4Config) -> int:
    # A table for every position up to max_seq_len (1M) would cost 256 MB per layer; keep a short one
    # and let RotaryTable extend it for longer inputs.
    return min(int(config.max_seq_len), 4096)


# ------------------------------------------------------------------------------------ Compressor
class Compressor(nn.Module):
    """Gated pooling of every r consecutive tokens into one kv entry (spec §2 Compressor).

    ``head_dim`` is Dh for the attention's compressor, index_head_dim for the Indexer's one
    (``rotate=True``). With r == 4 the windows overlap: each entry pools 2r candidate rows."""

    def __init__(self, config: DeepseekV4Config, ratio: int, head_dim: int, rotate: bool, dtype: torch.dtype):
        super().__init__()
        self.ratio = ratio
        self.head_dim = head_dim
        self.rotate = rotate
        self.overlap = ratio == 4
        c = 2 if self.overlap else 1
        # fp32 island: ape, wkv, wgate
        self.ape = nn.Parameter(torch.zeros(ratio, c * head_dim, dtype=torch.float32))
        self.wkv = Linear(config.dim, c * head_dim, dtype=torch.float32)
        self.wgate = Linear(config.dim, c * head_dim, dtype=torch.float32)
        self.norm = RMSNorm(head_dim, config.norm_eps)
        self.rope = RotaryTable(layer_rope_frequencies(config, ratio), rope_table_length(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, D] -> entries [B, S // r, head_dim] in x's dtype."""
        bsz, seqlen, _ = x.shape
        r, d = self.ratio, self.head_dim
        n = seqlen // r
        if n == 0:
            return x.new_zeros(bsz, 0, d)
        xs = x[:, : n * r]
        kv = island_linear(self.wkv, xs).view(bsz, n, r, -1)         # [B, n, r, c*d] fp32
        score = island_linear(self.wgate, xs).view(bsz, n, r, -1) + self.ape  # [B, n, r, c*d]
        if self.overlap:
            # rows r..2r: the block's own tokens, channels [d:]; rows 0..r: the previous block's
            # tokens, channels [:d]; block 0 has no predecessor (kv 0, score -inf).
            prev_kv = F.pad(kv[:, :-1, :, :d], (0, 0, 0, 0, 1, 0))
            prev_score = F.pad(score[:, :-1, :, :d], (0, 0, 0, 0, 1, 0), value=float("-inf"))
            kv = torch.cat((prev_kv, kv[..., d:]), dim=2)             # [B, n, 2r, d]
            score = torch.cat((prev_score, score[..., d:]), dim=2)
        entries = (score.softmax(dim=2) * kv).sum(dim=2)              # [B, n, d] fp32
        entries = self.norm(entries.to(x.dtype))
        cos, sin = self.rope(n * r, x.device)
        entries = apply_rope(entries, cos[::r], sin[::r], inplace=True)  # entry j sits at position j*r
        if self.rotate:
            entries = hadamard_rotate(entries)
        return entries


# --------------------------------------------------------------------------------------- Indexer
class Indexer(nn.Module):
    """Scores the compressed entries for each query and keeps the top-k (r == 4 layers)."""

    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype):
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.topk = config.index_topk
        self.ratio = 4
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, dtype=dtype)
        self.weights_proj = Linear(config.dim, self.n_heads, dtype=dtype)
        self.compressor = Compressor(config, 4, self.head_dim, rotate=True, dtype=dtype)
        self.score_matmul = Matmul(transpose_b=True)
        self.rope = RotaryTable(layer_rope_frequencies(config, 4), rope_table_length(config))

    def forward(self, x: torch.Tensor, qr: torch.Tensor) -> torch.Tensor:
        """x [B, S, D], qr [B, S, q_lora] -> indices [B, S, k] into the compressed entries, -1 = no key."""
        bsz, seqlen, _ = x.shape
        cos, sin = self.rope(seqlen, x.device)
        q = self.wq_b(qr).view(bsz, seqlen, self.n_heads, self.head_dim)
        q = hadamard_rotate(apply_rope(q, cos, sin, inplace=True))    # [B, S, Ih, Id]
        kc = self.compressor(x)                                       # [B, Nc, Id]
        n_entries = kc.shape[1]
        if n_entries == 0:
            return torch.empty(bsz, seqlen, 0, dtype=torch.long, device=x.device)
        weights = self.weights_proj(x).float() * (self.head_dim ** -0.5 * self.n_heads ** -0.5)  # [B, S, Ih]
        plain = _plain(self.score_matmul, Matmul)
        if plain and fused_kernels_enabled(x.device) and q.dtype in (torch.bfloat16, torch.float16) \
                and not (torch.is_grad_enabled() and (q.requires_grad or kc.requires_grad)) \
                and self.head_dim >= 16 and self.head_dim & (self.head_dim - 1) == 0:
            score = fused_index_score(q, kc, weights, self.ratio)          # [B, S, Nc], -inf = not yet
        else:
            if plain:
                # bf16 q and entries: their products are exact in fp32 (exact_gemm.matmul_fp32)
                logits = matmul_fp32(q.reshape(bsz, seqlen * self.n_heads, -1), kc.transpose(1, 2))
                logits = logits.view(bsz, seqlen, self.n_heads, n_entries).relu_()     # [B, S, Ih, Nc]
            else:  # a quantization wrapper sees the fp32 operands
                logits = self.score_matmul(q.float(), kc.float().unsqueeze(1)).relu()
            score = torch.matmul(weights.unsqueeze(-2), logits).squeeze(-2)      # sum_h w[h] relu(.)[h]: [B, S, Nc]
            allowed = causal_entry_mask(seqlen, n_entries, self.ratio, x.device)  # [S, Nc]
            score = score.masked_fill(~allowed, float("-inf"))
        k = min(self.topk, n_entries)
        idx = score.topk(k, dim=-1).indices                           # [B, S, k]
        # a query with fewer than k allowed entries still gets k picks: mark the extra ones "no key"
        limit = ((torch.arange(seqlen, device=x.device) + 1) // self.ratio).view(1, seqlen, 1)
        return torch.where(idx < limit, idx, -1)


def causal_entry_mask(seqlen: int, n_entries: int, ratio: int, device: torch.device) -> torch.Tensor:
    """[S, Nc] bool: query t may see compressed entry j iff j < (t + 1) // r."""
    limit = (torch.arange(seqlen, device=device) + 1) // ratio
    return torch.arange(n_entries, device=device).view(1, -1) < limit.view(-1, 1)


# ------------------------------------------------------------------------------------- Attention
class Attention(nn.Module):
    """MLA with one shared KV head, sliding window + compressed entries, attention sink, grouped wo_a."""

    def __init__(self, config: DeepseekV4Config, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        self.rope_head_dim = config.rope_head_dim
        self.window = config.window_size
        self.ratio = config.compress_ratios[layer_id]
        self.o_groups = config.o_groups
        self.o_lora_rank = config.o_lora_rank
        self.eps = config.norm_eps
        self.softmax_scale = self.head_dim ** -0.5

        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.wq_a = Linear(config.dim, config.q_lora_rank, dtype=dtype)
        self.q_norm = RMSNorm(config.q_lora_rank, config.norm_eps)
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, dtype=dtype)
        self.wkv = Linear(config.dim, self.head_dim, dtype=dtype)
        self.kv_norm = RMSNorm(self.head_dim, config.norm_eps)
        # wo_a is stored as a Linear weight [G * o_lora, H * Dh / G] but applied as a grouped einsum
        self.wo_a = nn.Linear(self.n_heads * self.head_dim // self.o_groups, self.o_groups * self.o_lora_rank,
                              bias=False, dtype=dtype)
        self.wo_b = Linear(self.o_groups * self.o_lora_rank, config.dim, dtype=dtype)
        self.qk_matmul = Matmul(transpose_b=True)
        self.pv_matmul = Matmul()
        if self.ratio:
            self.compressor = Compressor(config, self.ratio, self.head_dim, rotate=False, dtype=dtype)
            if self.ratio == 4:
                self.indexer = Indexer(config, dtype)
        self.rope = RotaryTable(layer_rope_frequencies(config, self.ratio), rope_table_length(config))

    # -- pieces a quantization wrapper may override -------------------------------------------
    def wo_a_weight(self) -> torch.Tensor:
        """wo_a viewed as [G, o_lora, H*Dh/G] for the grouped einsum."""
        return self.wo_a.weight.view(self.o_groups, self.o_lora_rank, -1)

    def grouped_output(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, S, G, H*Dh/G] -> z [B, S, G, o_lora]: z[b,s,g] = wo_a[g] @ o[b,s,g] (not an F.linear)."""
        return torch.einsum("bsgd,grd->bsgr", o, self.wo_a_weight())

    # -------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, D] -> [B, S, D]."""
        bsz, seqlen, _ = x.shape
        cos, sin = self.rope(seqlen, x.device)
        qr = self.q_norm(self.wq_a(x))                                  # [B, S, q_lora]
        q = self.wq_b(qr).view(bsz, seqlen, self.n_heads, self.head_dim)
        q = head_rms_norm(q, self.eps)                                  # per-head RMS, no weight
        kv = self.kv_norm(self.wkv(x))                                  # [B, S, Dh], keys == values
        q = apply_rope(q, cos, sin, inplace=True)                       # q, kv: fresh tensors of this call
        kv = apply_rope(kv, cos, sin, inplace=True)

        comp_kv, comp_idx = None, None
        if self.ratio:
            comp_kv = self.compressor(x)                                # [B, Nc, Dh]
            if self.ratio == 4:
                comp_idx = self.indexer(x, qr)                          # [B, S, k], -1 = no key

        o = self.sparse_attention(q, kv, comp_kv, comp_idx)             # [B, S, H, Dh]
        o = apply_rope(o, cos, sin, inverse=True, inplace=True)
        z = self.grouped_output(o.reshape(bsz, seqlen, self.o_groups, -1))  # [B, S, G, o_lora]
        return self.wo_b(z.flatten(2))

    def sparse_attention(self, q: torch.Tensor, kv: torch.Tensor, comp_kv: torch.Tensor | None,
                         comp_idx: torch.Tensor | None) -> torch.Tensor:
        """softmax over {window keys} + {compressed entries} + one sink logit per head; keys == values.

        q [B, S, H, Dh]; kv [B, S, Dh]; comp_kv [B, Nc, Dh] or None; comp_idx [B, S, k] (the
        indexer's picks, -1 = none) or None, in which case query t sees entries j < (t + 1) // r.
        On CUDA without autograd this is one fused Triton kernel (fused_attention.py); otherwise
        the torch path below, which a quantization wrapper can hook into (qk_matmul / pv_matmul)."""
        if self._use_fused_kernel(q, kv, comp_kv):
            return fused_sparse_attention(q, kv, self.attn_sink, self.softmax_scale, self.window,
                                          comp_kv, comp_idx, self.ratio)
        comp_allowed = None
        if comp_kv is not None:
            seqlen, n_entries = q.shape[1], comp_kv.shape[1]
            if comp_idx is not None:
                comp_allowed = torch.zeros(q.shape[0], seqlen, n_entries + 1, dtype=torch.bool, device=q.device)
                comp_allowed.scatter_(-1, torch.where(comp_idx < 0, n_entries, comp_idx), True)
                comp_allowed = comp_allowed[..., :n_entries]
            else:
                comp_allowed = causal_entry_mask(seqlen, n_entries, self.ratio, q.device).expand(q.shape[0], -1, -1)
        return self.sparse_attention_torch(q, kv, comp_kv, comp_allowed)

    def _use_fused_kernel(self, q: torch.Tensor, kv: torch.Tensor, comp_kv: torch.Tensor | None) -> bool:
        """The fused kernel computes the float function only: no autograd (PTQ's backward pass), no
        quantized or hooked qk / pv matmuls, a 16-bit dtype (its dots would be TF32 in fp32)."""
        if not fused_kernels_enabled(q.device) or q.dtype not in (torch.bfloat16, torch.float16):
            return False
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, kv, comp_kv)):
            return False
        for m in (self.qk_matmul, self.pv_matmul):
            if not _plain(m, Matmul):
                return False
        dh = q.shape[-1]
        return dh >= 16 and dh & (dh - 1) == 0

    def sparse_attention_torch(self, q: torch.Tensor, kv: torch.Tensor, comp_kv: torch.Tensor | None,
                               comp_allowed: torch.Tensor | None) -> torch.Tensor:
        """The torch path of ``sparse_attention``; comp_allowed [B, S, Nc] bool.

        Query blocks of W tokens attend to the 2W keys of their own and the previous block (a banded
        window without an S x S score matrix); compressed entries are scored densely and masked.
        The single shared KV head lets the heads fold into the rows of plain batched GEMMs:
        [B, nb, W*H, Dh] @ [B, nb, Dh, 2W] -- no per-head copy of the keys. The softmax and the two
        products: ``banded_attention.banded_attention``."""
        bsz, seqlen, n_heads, dh = q.shape
        w = self.window
        n_blocks = -(-seqlen // w)
        pad = n_blocks * w - seqlen
        qb = F.pad(q, (0, 0, 0, 0, 0, pad)).view(bsz, n_blocks, w * n_heads, dh)   # rows = (token, head)
        kvp = F.pad(kv, (0, 0, 0, pad)).view(bsz, n_blocks, w, dh)
        keys = torch.cat((F.pad(kvp[:, :-1], (0, 0, 0, 0, 1, 0)), kvp), dim=2)      # [B, nb, 2W, Dh]

        # key slot j of block b is position (b-1)*W + j; query i of block b is b*W + i
        i = torch.arange(w, device=q.device).view(w, 1)
        j = torch.arange(2 * w, device=q.device).view(1, 2 * w)
        band = (j > i) & (j <= i + w)                                   # t-W < p <= t
        first = band & (j >= w)                                         # block 0 has no predecessor
        win_allowed = torch.cat((first.unsqueeze(0), band.expand(n_blocks - 1, w, 2 * w)))
        win_allowed = win_allowed.view(1, n_blocks, w, 1, 2 * w)
        if comp_kv is not None and comp_kv.shape[1] > 0:
            comp_allowed = F.pad(comp_allowed, (0, 0, 0, pad)).view(bsz, n_blocks, w, 1, comp_kv.shape[1])

        if self._use_banded_backward(q, kv, comp_kv):
            out = BandedAttention.apply(qb, keys, comp_kv, win_allowed, comp_allowed, self.attn_sink,
                                        self.softmax_scale)
        else:
            out = banded_attention(qb, keys, win_allowed, self.attn_sink, self.softmax_scale, comp_kv, comp_allowed,
                                   qk=self.qk_matmul, pv=self.pv_matmul, inplace=not torch.is_grad_enabled())
        return out.view(bsz, n_blocks * w, n_heads, dh)[:, :seqlen]

    def _use_banded_backward(self, q: torch.Tensor, kv: torch.Tensor, comp_kv: torch.Tensor | None) -> bool:
        """``BandedAttention`` (its own backward, recomputing the probabilities) under autograd on
        the fast-path devices, with plain qk / pv products and a frozen sink; the CPU and NPU keep
        autograd through the plain ops (the same function; the tiny table's numbers unchanged)."""
        if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, kv, comp_kv))):
            return False
        if not fast_paths_enabled(q.device) or self.attn_sink.requires_grad:
            return False
        return _plain(self.qk_matmul, Matmul) and _plain(self.pv_matmul, Matmul)


# ------------------------------------------------------------------------------------------- MoE
class Gate(nn.Module):
    """Router (fp32 math). Score layers: topk(score + bias). Hash layers: tid2eid[input_id]."""

    def __init__(self, config: DeepseekV4Config, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.topk = config.n_activated_experts
        self.score_func = config.score_func
        self.route_scale = config.route_scale
        self.hash = layer_id < config.n_hash_layers
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.dim, dtype=dtype))
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.topk, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D], input_ids [N] -> (weights [N, k] fp32, indices [N, k])."""
        z = linear_fp32(x, self.weight)                                  # [N, E] fp32
        if self.score_func == "softmax":
            score = z.softmax(dim=-1)
        elif self.score_func == "sigmoid":
            score = z.sigmoid()
        else:  # sqrtsoftplus
            score = F.softplus(z).sqrt()
        if self.hash:
            if input_ids is None:
                raise ValueError("hash-routed MoE layers need input_ids (Block.forward(x, input_ids=...))")
            indices = self.tid2eid[input_ids]
        else:
            indices = (score + self.bias).topk(self.topk, dim=-1).indices
        weights = score.gather(1, indices)
        if self.score_func != "softmax":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.route_scale, indices


class Expert(nn.Module):
    """SwiGLU with V4's clamp: u = clamp(w3 x, -L, L), g = clamp(w1 x, max=L); w2(silu(g) * u * weight)."""

    def __init__(self, dim: int, inter_dim: int, swiglu_limit: float, dtype: torch.dtype):
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.w1 = Linear(dim, inter_dim, dtype=dtype)
        self.w2 = Linear(inter_dim, dim, dtype=dtype)
        self.w3 = Linear(dim, inter_dim, dtype=dtype)

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate = self.w1(x).float()
        up = self.w3(x).float()
        if self.swiglu_limit > 0:
            up = up.clamp(-self.swiglu_limit, self.swiglu_limit)
            gate = gate.clamp(max=self.swiglu_limit)
        h = F.silu(gate) * up
        if weights is not None:
            h = h * weights                                              # routing weight before w2
        return self.w2(h.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, config: DeepseekV4Config, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.dim = config.dim
        self.n_routed_experts = config.n_routed_experts
        self.gate = Gate(config, layer_id, dtype)
        self.experts = nn.ModuleList(
            Expert(config.dim, config.moe_inter_dim, config.swiglu_limit, dtype) for _ in range(config.n_routed_experts)
        )
        self.shared_experts = Expert(config.dim, config.n_shared_experts * config.moe_inter_dim,
                                     config.swiglu_limit, dtype) if config.n_shared_experts else None
        self._packed: tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]] | None = None
        # prefer the grouped path when packed; False forces the per-expert loop (e.g. so that
        # forward hooks on the expert modules see every call while calibration data is captured)
        self.grouped = True

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, D], input_ids [B, S] -> [B, S, D]; routed + shared summed in fp32."""
        shape = x.shape
        flat = x.reshape(-1, self.dim)
        weights, indices = self.gate(flat, None if input_ids is None else input_ids.reshape(-1))
        if self._can_group(flat):
            out = self.route_grouped(flat, weights, indices)
        else:
            out = self.route(flat, weights, indices)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat).float()
        return out.to(x.dtype).view(shape)

    def route(self, flat: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Reference routing: tokens sorted by expert, one call of each expert module on its tokens."""
        out = torch.zeros(flat.shape, dtype=torch.float32, device=flat.device)
        order = indices.flatten().argsort(stable=True)                   # slots grouped by expert
        counts = torch.bincount(indices.flatten(), minlength=self.n_routed_experts).tolist()
        token_of_slot = order // indices.shape[1]
        slot_weights = weights.flatten()[order].unsqueeze(-1)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of_slot[start:start + n]
            out.index_add_(0, tok, self.experts[e](flat[tok], slot_weights[start:start + n]).float())
            start += n
        return out

    # -- grouped GEMM path ----------------------------------------------------------------------
    @torch.no_grad()
    def pack_experts(self) -> None:
        """Stack the routed experts' weights into w13 [E, 2I, D] (w1 rows, then w3 rows) and
        w2 [E, D, I], and make every expert's parameters views into them.

        ``forward`` then runs two grouped GEMMs over the tokens sorted by expert instead of a
        Python loop over E experts (and needs no host sync). Call it after the weights are loaded
        and before any wrapper takes references to the parameters; moving the module (``.to()``)
        drops the packing (the loop path is used until it is packed again). The stacks are a
        second copy of the experts until the old weights are freed; a layer built from a
        checkpoint is packed as it loads instead (:meth:`packed_slots`)."""
        w1 = self.experts[0].w1.weight
        if not _grouped_mm_supported(w1):
            return
        self._bind_stacks(*self._new_stacks(w1.dtype, w1.device), copy=True)

    def packed_slots(self, device: torch.device | str) -> dict[str, torch.Tensor]:
        """Before a load: allocate the stacks on ``device`` and make every routed expert's weights
        views into them now (uninitialized), for the loader to decode each weight straight into
        its view. {name relative to this module: view}; {} where grouped GEMMs do not serve
        these weights (the layer is then loaded unpacked). One copy of the experts at the peak of
        a build, where loading and then :meth:`pack_experts` held two: a V4-Pro layer's build
        peaked at 100.6 GiB of device memory for 53.3 GiB held (casebook i34-14)."""
        w1 = self.experts[0].w1.weight
        dev = torch.device(device)
        if not _grouped_mm_supported_for(w1.shape, w1.dtype, dev):
            return {}
        w13, w2 = self._new_stacks(w1.dtype, dev)
        self._bind_stacks(w13, w2, copy=False)
        return {f"experts.{e}.{proj}.weight": getattr(ex, proj).weight
                for e, ex in enumerate(self.experts) for proj in ("w1", "w3", "w2")}

    def _new_stacks(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        inter, dim = self.experts[0].w1.weight.shape
        n_exp = len(self.experts)
        return (torch.empty(n_exp, 2 * inter, dim, dtype=dtype, device=device),
                torch.empty(n_exp, dim, inter, dtype=dtype, device=device))

    def _bind_stacks(self, w13: torch.Tensor, w2: torch.Tensor, copy: bool) -> None:
        """Every expert's w1 / w3 / w2 a Parameter viewing its rows of ``w13`` / ``w2`` (their
        current values copied in first with ``copy``)."""
        inter = w2.shape[-1]
        for e, expert in enumerate(self.experts):
            for lin, view in ((expert.w1, w13[e, :inter]), (expert.w3, w13[e, inter:]), (expert.w2, w2[e])):
                if copy:
                    view.copy_(lin.weight)
                lin.weight = nn.Parameter(view, requires_grad=lin.weight.requires_grad)
        self._packed = (w13, w2, self._weight_ptrs())

    def _weight_ptrs(self) -> list[tuple[int, int, int]]:
        """Each expert's (w1, w3, w2) weight addresses: the packed stacks back the experts while
        these equal the ones recorded with them."""
        return [(e.w1.weight.data_ptr(), e.w3.weight.data_ptr(), e.w2.weight.data_ptr()) for e in self.experts]

    def packed_backing(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(w13, w2) where the packed stacks still back every expert's weights, else None."""
        packed = self._packed
        return (packed[0], packed[1]) if packed is not None and packed[2] == self._weight_ptrs() else None

    def _apply(self, fn, *args, **kwargs):
        self._packed = None  # parameters get new storage: the stacked copies would go stale
        return super()._apply(fn, *args, **kwargs)

    def _packed_requires_grad(self) -> bool:
        e = self.experts[0]
        return e.w1.weight.requires_grad or e.w2.weight.requires_grad or e.w3.weight.requires_grad

    def _can_group(self, flat: torch.Tensor) -> bool:
        """Packed weights still back every expert, and every expert computes the float function.

        Runs every forward, so it reads the module dicts directly (no nn.Module __getattr__):
        ~0.3 ms of host time for 256 experts instead of a few ms."""
        if not self.grouped or self._packed is None or self._packed[0].device != flat.device:
            return False
        if torch.is_grad_enabled() and self._packed_requires_grad():
            return False  # the stacks are plain tensors: training must reach the expert parameters
        current = []
        for expert in self.experts:
            if type(expert) is not Expert and getattr(expert, "quantized", False):
                return False
            mods = expert._modules
            current.append((mods["w1"]._parameters["weight"].data_ptr(), mods["w3"]._parameters["weight"].data_ptr(),
                            mods["w2"]._parameters["weight"].data_ptr()))
        return current == self._packed[2]

    def route_grouped(self, flat: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """Same math as ``route`` + ``Expert.forward``, as two grouped GEMMs over sorted slots
        (chunk by chunk of experts where the weights come a chunk at a time: ``grouped_chunks``)."""
        slots = indices.flatten()
        order = slots.argsort(stable=True)
        # rows per expert by scatter-add: on CUDA torch.bincount reads the largest index back to
        # the host (a sync, which also makes the forward impossible to capture in a graph)
        counts = torch.zeros(self.n_routed_experts, dtype=torch.int64, device=slots.device)
        counts.scatter_add_(0, slots, torch.ones_like(slots))
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        tok = order // indices.shape[1]
        xs = flat[tok]
        # statistics during calibration (e.g. per-expert Hessians): the float rows, sorted by
        # expert, and the rows per expert; a plain attribute, never set outside a capture
        observer = self.__dict__.get("row_observer")
        if observer is not None:
            observer(xs, "w1", counts)
        xs = self.grouped_rows(xs, "w1")
        slot_weights = weights.flatten()[order]
        chunks = self.grouped_chunks()
        if chunks is None:
            w13, w2 = self.grouped_weights()
            y = self._grouped_experts(xs, w13, w2, offsets, slot_weights, observer, counts)
        else:
            y = self._grouped_experts_chunked(chunks, xs, offsets, slot_weights, observer, counts)
        # each token sums its k rows in expert order, as ``route`` does -- by gathering them, not
        # by index_add_ (atomics on CUDA: an arbitrary order, and slower); one Triton pass on CUDA
        return combine_slots(y, slot_rows(order, indices.shape[1]), tok)

    def _grouped_experts(self, xs: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor,
                         slot_weights: torch.Tensor, observer, counts: torch.Tensor,
                         hidden: list | None = None) -> torch.Tensor:
        """The experts ``w13`` / ``w2`` on their sorted rows ``xs`` (``offsets``: cumulative rows
        per expert) -> [rows, D]. ``hidden``: collects the w2 input rows instead of observing them
        here (the chunked path observes them whole)."""
        inter = w2.shape[-1]
        limit = self.experts[0].swiglu_limit
        fused = fused_kernels_enabled(xs.device) and not (torch.is_grad_enabled() and (
            xs.requires_grad or w13.requires_grad or w2.requires_grad))
        triton_gemm = fused and xs.dtype == w13.dtype == w2.dtype == torch.bfloat16 and \
            grouped_gemm_suited(xs.shape[0], w13.shape[0])
        if triton_gemm:  # both projections, the clamp and SwiGLU in one kernel: [T, I]
            h = grouped_gemm(xs, w13, offsets, swiglu_limit=limit, row_weights=slot_weights)
        else:
            h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offsets)      # [T, 2I]
            if fused:
                h = clamped_swiglu(h, limit, slot_weights)                      # [T, I], one pass
            else:
                gate, up = h[:, :inter].float(), h[:, inter:].float()
                if limit > 0:
                    up = up.clamp(-limit, limit)
                    gate = gate.clamp(max=limit)
                h = (F.silu(gate) * up * slot_weights.unsqueeze(-1)).to(xs.dtype)
        if hidden is not None:
            hidden.append(h)
        elif observer is not None:
            observer(h, "w2", counts)
        h = self.grouped_rows(h, "w2")
        if triton_gemm:
            return grouped_gemm(h, w2, offsets)                                 # [T, D], sorted slots
        return torch._grouped_mm(h, w2.transpose(1, 2), offs=offsets)

    def _grouped_experts_chunked(self, chunks, xs: torch.Tensor, offsets: torch.Tensor, slot_weights: torch.Tensor,
                                 observer, counts: torch.Tensor) -> torch.Tensor:
        """:meth:`_grouped_experts` a chunk of experts at a time, each chunk's weights made for it
        and dropped after it (``grouped_chunks``); the same per-row math. One host read of the
        counts (the chunks' row ranges): a CUDA-graph capture of such a layer fails on it and the
        replay wrapper runs it eagerly (``runtime.device``), as for any forward that syncs."""
        ends = offsets.tolist()
        ys, hidden = [], ([] if observer is not None else None)
        for e0, e1, weights_of in chunks:
            r0, r1 = (ends[e0 - 1] if e0 else 0), ends[e1 - 1]
            if r1 == r0:
                continue
            w13, w2 = weights_of()
            local = (offsets[e0:e1] - r0).to(torch.int32)
            ys.append(self._grouped_experts(xs[r0:r1], w13, w2, local, slot_weights[r0:r1], None, None, hidden))
            del w13, w2
        if hidden is not None:
            observer(torch.cat(hidden), "w2", counts)
        return torch.cat(ys) if ys else xs.new_zeros(0, self.dim)

    # hooks of the grouped path (a quantization wrapper swaps in fake-quant weights / inputs)
    def grouped_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, D], w2 [E, D, I]) used by the grouped GEMMs."""
        return self._packed[0], self._packed[1]

    def grouped_chunks(self):
        """None: the grouped GEMMs run once over :meth:`grouped_weights`. Else a list of
        (first expert, end expert, a function making that chunk's (w13, w2)), in expert order:
        for weights made on the fly that do not fit all at once (a wrapper's fake-quant stacks)."""
        return None

    def grouped_rows(self, rows: torch.Tensor, projection: str) -> torch.Tensor:
        """The input rows of ``projection`` ('w1' covers w1 and w3) as the experts see them."""
        return rows


def _grouped_mm_supported(weight: torch.Tensor) -> bool:
    """torch._grouped_mm: CPU (bf16 / fp32) and CUDA (bf16); rows must be 16-byte aligned."""
    return _grouped_mm_supported_for(weight.shape, weight.dtype, weight.device)


def _grouped_mm_supported_for(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> bool:
    """:func:`_grouped_mm_supported` for a weight of ``shape`` and ``dtype`` to be made on ``device``."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    ok_dtype = dtype == torch.bfloat16 or (device.type == "cpu" and dtype == torch.float32)
    aligned = all((n * dtype.itemsize) % 16 == 0 for n in shape)
    return device.type in ("cpu", "cuda") and ok_dtype and aligned


# ----------------------------------------------------------------------------- Hyper-connections
def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int,
           sinkhorn_iters: int, hc_eps: float, norm_eps: float, fn_split: SplitWeightCache | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, S, hc, D] -> (y [B, S, D] in x's dtype, post [B, S, hc], comb [B, S, hc, hc]); fp32 math."""
    if _use_fused_hc(x, fn, scale, base):
        return hc_pre_fused(x, fn, scale, base, hc_mult, sinkhorn_iters, hc_eps, norm_eps, fn_split, hc_weights_torch)
    flat = x.flatten(-2)                                                  # [B, S, hc*D]
    mean_sq = flat.float().square().mean(-1, keepdim=True)
    mix = linear_fp32(flat, fn, fn_split) * torch.rsqrt(mean_sq + norm_eps)
    pre, post, comb = hc_weights_torch(mix, scale, base, hc_mult, sinkhorn_iters, hc_eps)
    y = (pre.unsqueeze(-1) * x.float()).sum(dim=2)
    return y.to(x.dtype), post, comb


def hc_weights_torch(mix: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int,
                     sinkhorn_iters: int, hc_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token weights from the normalised mix [..., (2 + hc) * hc] fp32: (pre [..., hc],
    post [..., hc], comb [..., hc, hc], a Sinkhorn-balanced doubly stochastic mix)."""
    pre, post, comb = mix.split([hc_mult, hc_mult, hc_mult * hc_mult], dim=-1)
    pre = torch.sigmoid(pre * scale[0] + base[:hc_mult]) + hc_eps
    post = 2 * torch.sigmoid(post * scale[1] + base[hc_mult:2 * hc_mult])
    comb = (comb * scale[2] + base[2 * hc_mult:]).unflatten(-1, (hc_mult, hc_mult))
    comb = comb.softmax(-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)                  # column sums
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)              # row sums
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_post(y: torch.Tensor, res: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out[:, :, j] = post[j] * y + sum_k comb[k, j] * res[:, :, k]; fp32 math, res's dtype out."""
    if _use_fused_hc(res):
        return hc_post_fused(y, res, post, comb)
    out = post.unsqueeze(-1) * y.float().unsqueeze(-2) + torch.einsum("bskj,bskd->bsjd", comb, res.float())
    return out.to(res.dtype)


def _use_fused_hc(x: torch.Tensor, *frozen: torch.Tensor) -> bool:
    """The Triton hc mixes (fused_hc.py) on CUDA with Triton. They carry their own backward for
    the stream's tensors; ``frozen`` (hc_pre's parameters) must not need a gradient."""
    if not fused_kernels_enabled(x.device):
        return False
    return not (torch.is_grad_enabled() and any(p.requires_grad for p in frozen))


# ----------------------------------------------------------------------------------------- Block
class Block(nn.Module):
    def __init__(self, layer_id: int, config: DeepseekV4Config, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.layer_id = layer_id
        self.hc_mult = hc = config.hc_mult
        self.sinkhorn_iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.norm_eps
        self.attn = Attention(config, layer_id, dtype)
        self.ffn = MoE(config, layer_id, dtype)
        self.attn_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        mix = (2 + hc) * hc
        self.hc_attn_fn = nn.Parameter(torch.zeros(mix, hc * config.dim, dtype=torch.float32))
        self.hc_ffn_fn = nn.Parameter(torch.zeros(mix, hc * config.dim, dtype=torch.float32))
        self.hc_attn_base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.hc_ffn_base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.hc_attn_scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.hc_ffn_scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        # bf16 splits of the two hc fns (exact_gemm), one per site; they follow the weights' storage
        self._fn_splits = {"attn": SplitWeightCache(), "ffn": SplitWeightCache()}

    def _hc_pre(self, x, site: str):
        """hc_pre with this block's ``hc_{site}_*`` parameters, site 'attn' or 'ffn'."""
        fn, scale, base = (getattr(self, f"hc_{site}_{name}") for name in ("fn", "scale", "base"))
        return hc_pre(x, fn, scale, base, self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps,
                      self._fn_splits[site])

    def forward(self, x: torch.Tensor, start_pos: int = 0, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, S, hc, D] -> [B, S, hc, D]. Prefill only; input_ids [B, S] feed hash routing."""
        if start_pos != 0:
            raise ValueError(f"the float reference is prefill-only: start_pos must be 0, got {start_pos}")
        res = x
        y, post, comb = self._hc_pre(x, "attn")
        x = hc_post(self.attn(self.attn_norm(y)), res, post, comb)
        res = x
        y, post, comb = self._hc_pre(x, "ffn")
        return hc_post(self.ffn(self.ffn_norm(y), input_ids), res, post, comb)


# ------------------------------------------------------------------------------------ the model
class DeepseekV4ForCausalLM(nn.Module):
    """embed -> hc copies -> blocks -> HC head -> norm -> head (fp32 logits for every position)."""

    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.config = config
        self.dtype = dtype
        hc = config.hc_mult
        self.embed = Embedding(config.vocab_size, config.dim, dtype=dtype)
        self.layers = nn.ModuleList(Block(i, config, dtype) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.head = Linear(config.dim, config.vocab_size, dtype=torch.float32)
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * config.dim, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    # the three stages, also used one at a time by the blockwise pipeline
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, S] -> h [B, S, hc, D] (hc identical copies)."""
        h = self.embed(input_ids)
        return h.unsqueeze(2).repeat(1, 1, self.config.hc_mult, 1)

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, hc, D] -> fp32 logits [B, S, vocab]."""
        return hc_head_logits(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, self.norm, self.head,
                              self.config.hc_eps, self.config.norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, 0, input_ids)
        return self.head_logits(x)


def hc_head_logits(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm: RMSNorm,
                   head: nn.Linear, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """pre = sigmoid(mix * scale + base) + eps; y = sum_k pre[k] x[k]; logits = head(norm(y).float())."""
    xf = x.flatten(-2).float()
    mix = F.linear(xf, fn.float()) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(mix * scale + base) + hc_eps                        # [B, S, hc]
    y = (pre.unsqueeze(-1) * x.float()).sum(dim=2).to(x.dtype)
    return F.linear(norm(y).float(), head.weight.float())
