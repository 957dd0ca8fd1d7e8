"""Shared pieces of the layer benchmarks (bench_layer.py, bench_load.py).

- configs: the V4-Flash config.json shipped in models/deepseek_v4/configs/ and the tiny config for
  ``--smoke``;
- a device-side random init of one decoder layer (same scaled scheme as ``tiny.init_block_weights``,
  drawn with ``Tensor.normal_`` on the device: a Flash layer is ~13 GB, far too slow to draw on a CPU);
- transformers' native ``DeepseekV4DecoderLayer`` built with the SAME weights (the key renames that
  transformers' loader applies to the flat release, see ``conversion_mapping.py`` "deepseek_v4") and
  called the way ``DeepseekV4Model.forward`` calls it;
- the two measured ceilings (bf16 matmul rate, device copy bandwidth) and small timing helpers.

Device access goes through ``amct_ext.runtime.device`` only (no torch.cuda / torch.npu here).
"""
from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from amct_ext.runtime import device as D  # noqa: E402
from models.deepseek_v4.configuration import DeepseekV4Config  # noqa: E402
from models.deepseek_v4.modeling import Block, Gate  # noqa: E402

GiB = 1024 ** 3

# -------------------------------------------------------------------------------------- configs
FLASH_CONFIG_NAME = "deepseek-v4-flash.config.json"
_FLASH_RATIOS = [0, 0] + [4, 128] * 20 + [4, 0]
# the V4-Flash config.json ships with the project (a GPU machine gets it with the checkout)
FLASH_CONFIG_PATH = REPO / "models" / "deepseek_v4" / "configs" / FLASH_CONFIG_NAME


def flash_config_dict(path: str | None = None) -> tuple[dict[str, Any], str]:
    """(config.json dict, where it came from). ``path`` wins; else the shipped V4-Flash config."""
    c = Path(path) if path else FLASH_CONFIG_PATH
    if not c.is_file():
        raise FileNotFoundError(f"--config {c}: no such file")
    return json.loads(c.read_text()), str(c)


def apply_overrides(d: dict[str, Any], overrides: list[str] | None) -> dict[str, Any]:
    """``["n_routed_experts=16", "index_topk=64"]`` (config.json names; values parsed as JSON)."""
    d = json.loads(json.dumps(d))
    for item in overrides or []:
        key, _, raw = item.partition("=")
        if not key or not raw:
            raise ValueError(f"--override {item!r}: expected key=value")
        try:
            d[key] = json.loads(raw)
        except json.JSONDecodeError:
            d[key] = raw
    return d


def tiny_config_dict() -> dict[str, Any]:
    from models.deepseek_v4.tiny import TINY_CONFIG

    return json.loads(json.dumps(TINY_CONFIG))


def our_config(d: dict[str, Any]) -> DeepseekV4Config:
    return DeepseekV4Config(**json.loads(json.dumps(d)))


def hf_config(d: dict[str, Any]):
    """transformers' own DeepseekV4Config from the same dict (it accepts the legacy names)."""
    import transformers

    d = json.loads(json.dumps(d))
    d.pop("quantization_config", None)  # the layer is built in bf16 here, not through the FP8 loader
    cfg = transformers.DeepseekV4Config(**d)
    cfg._attn_implementation = "eager"  # what from_pretrained picks for V4 (no sdpa / flash support)
    return cfg


def layer_kind(config: DeepseekV4Config, layer_id: int) -> str:
    r = config.compress_ratios[layer_id]
    route = "hash" if layer_id < config.n_hash_layers else "score"
    what = {0: "window", 4: "csa+indexer", 128: "hca"}[r]
    return f"ratio{r}-{what}-{route}"


# --------------------------------------------------------------------------- device-side init
@torch.no_grad()
def init_block_weights_device(block: Block, config: DeepseekV4Config, seed: int = 0) -> None:
    """The scheme of ``tiny.init_block_weights`` (linear weights N(0, 1/in), norms 1 +- 0.1, hc_fn std
    0.02, hc_base std 0.5, hc_scale 1 +- 0.1, attn_sink std 1, ape std 0.5, gate bias std 0.1, tid2eid =
    `topk` distinct experts per token id) drawn in place on the block's own device."""
    dev = next(block.parameters()).device
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    for name, p in block.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "weight" and p.dim() == 2:
            mean, std = 0.0, 1.0 / math.sqrt(p.shape[1])
        elif leaf == "weight":  # RMSNorm
            mean, std = 1.0, 0.1
        elif leaf in ("hc_attn_fn", "hc_ffn_fn"):
            mean, std = 0.0, 0.02
        elif leaf in ("hc_attn_base", "hc_ffn_base"):
            mean, std = 0.0, 0.5
        elif leaf in ("hc_attn_scale", "hc_ffn_scale"):
            mean, std = 1.0, 0.1
        elif leaf == "attn_sink":
            mean, std = 0.0, 1.0
        elif leaf == "ape":
            mean, std = 0.0, 0.5
        elif leaf == "bias":
            mean, std = 0.0, 0.1
        else:
            raise AssertionError(f"no init rule for {name}")
        p.normal_(mean, std, generator=gen)
    for module in block.modules():
        if isinstance(module, Gate) and module.hash:
            ranks = torch.rand(config.vocab_size, config.n_routed_experts, generator=gen, device=dev).argsort(dim=-1)
            module.tid2eid.copy_(ranks[:, : module.topk])


def build_block(config: DeepseekV4Config, layer_id: int, device: torch.device, seed: int = 0,
                dtype: torch.dtype = torch.bfloat16) -> Block:
    """One decoder layer allocated directly on ``device`` (bf16 with the fp32 islands), random weights."""
    with torch.device(device):
        block = Block(layer_id, config, dtype)
    init_block_weights_device(block, config, seed)
    block.ffn.pack_experts()  # what loading.load_block does: the grouped-GEMM expert path
    return block.eval()


def tensor_bytes(module_or_sd) -> int:
    sd = module_or_sd.state_dict() if isinstance(module_or_sd, nn.Module) else module_or_sd
    return sum(t.numel() * t.element_size() for t in sd.values())


# ------------------------------------------------------------------ transformers' decoder layer
# transformers' loader renames for the flat release (conversion_mapping.py, "deepseek_v4"), in order.
HF_RENAMES: list[tuple[str, str]] = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn$", ".attn_hc.fn"),
    (r"\.hc_attn_base$", ".attn_hc.base"),
    (r"\.hc_attn_scale$", ".attn_hc.scale"),
    (r"\.hc_ffn_fn$", ".ffn_hc.fn"),
    (r"\.hc_ffn_base$", ".ffn_hc.base"),
    (r"\.hc_ffn_scale$", ".ffn_hc.scale"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(w[123])\.weight$")


def hf_key(our_key: str) -> str:
    """Block-relative key of ours ('attn.wq_a.weight') -> transformers' layer-relative key."""
    k = "." + our_key
    for pat, rep in HF_RENAMES:
        k = re.sub(pat, rep, k)
    return k[1:]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _fp32_strict(hf_module_cls) -> list[str]:
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    return list(getattr(m.DeepseekV4PreTrainedModel, "_keep_in_fp32_modules_strict", []) or [])


@torch.no_grad()
def build_hf_layer(block: Block, hf_cfg, layer_id: int, device: torch.device,
                   all_fp32: bool = False) -> tuple[nn.Module, dict]:
    """transformers' DeepseekV4DecoderLayer for ``layer_id`` on ``device`` holding ``block``'s weights.

    Built like ``from_pretrained(dtype=bf16)`` leaves it: bf16 everywhere except the modules listed in
    ``_keep_in_fp32_modules_strict`` (hc, sinks, position_bias, e_score_correction_bias, the norms),
    rope inv_freq buffers in fp32. Every tensor of ``block`` is consumed and every persistent tensor of
    the transformers layer is written (checked). ``all_fp32``: every float tensor in fp32 instead (the
    exact mapping check, against a block built in fp32). Returns (layer, info)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    with torch.device(device), _default_dtype(torch.float32 if all_fp32 else torch.bfloat16):
        layer = m.DeepseekV4DecoderLayer(hf_cfg, layer_id)
    # rope tables: rebuild in fp32 (the bf16 default dtype must not leak into them)
    for sub in layer.modules():
        if isinstance(sub, m.DeepseekV4RotaryEmbedding):
            fresh = m.DeepseekV4RotaryEmbedding(hf_cfg, device=device)
            for name, buf in fresh.named_buffers(recurse=False):
                sub._buffers[name] = buf.to(device=device, dtype=torch.float32)
    strict = _fp32_strict(m)
    targets = dict(layer.named_parameters())
    targets.update(dict(layer.named_buffers()))

    def want_fp32(name: str) -> bool:
        parts = name.split(".")
        return any(s in parts for s in strict)

    persistent = set(layer.state_dict().keys())  # params + persistent buffers (not the rope tables)
    for name, t in targets.items():
        if name in persistent and t.is_floating_point():
            dt = torch.float32 if all_fp32 or want_fp32(name) else torch.bfloat16
            if t.dtype != dt:
                t.data = t.data.to(dt)

    written: set[str] = set()
    inter = layer.mlp.experts.gate_up_proj.shape[1] // 2
    for key, src in block.state_dict().items():
        k = hf_key(key)
        em = _EXPERT.match(k)
        if em:
            e, w = int(em.group(1)), em.group(2)
            if w == "w2":
                targets["mlp.experts.down_proj"][e].copy_(src)
            else:
                rows = slice(0, inter) if w == "w1" else slice(inter, 2 * inter)  # gate rows first, then up
                targets["mlp.experts.gate_up_proj"][e, rows].copy_(src)
            written.add("mlp.experts.down_proj" if w == "w2" else "mlp.experts.gate_up_proj")
            continue
        if k not in targets:
            raise KeyError(f"our key {key!r} -> {k!r}: no such tensor in transformers' layer "
                           f"(renames out of date for this transformers version?)")
        dst = targets[k]
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"{key!r} -> {k!r}: shape {tuple(src.shape)} vs transformers {tuple(dst.shape)}")
        dst.copy_(src)
        written.add(k)
    missing = sorted(persistent - written)
    if missing:
        raise KeyError(f"transformers' layer tensors not written from ours: {missing[:8]}")
    info = {
        "hf_fp32_tensors": sorted(k for k, t in layer.state_dict().items() if t.dtype == torch.float32),
        "hf_weight_bytes": tensor_bytes(layer),
    }
    return layer.eval(), info


class HFCaller:
    """Calls a transformers decoder layer the way ``DeepseekV4Model.forward`` does: the {"main",
    "compress"} rope dict and the sliding-window mask are built once (per model forward, shared by all
    layers: outside the timed region), position_ids = arange(S)[None], input_ids for hash routing."""

    def __init__(self, hf_cfg, x: torch.Tensor, input_ids: torch.Tensor):
        from transformers.masking_utils import create_sliding_window_causal_mask
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

        B, S = input_ids.shape
        dev = x.device
        embeds = x[:, :, 0]  # [B, S, D] in the model dtype: only its dtype / device / shape are used
        self.position_ids = torch.arange(S, device=dev).unsqueeze(0)
        with torch.device(dev):
            rotary = m.DeepseekV4RotaryEmbedding(hf_cfg, device=dev)
        self.position_embeddings = {
            t: rotary(embeds, position_ids=self.position_ids, layer_type=t) for t in ("main", "compress")
        }
        params = inspect.signature(create_sliding_window_causal_mask).parameters
        kw: dict[str, Any] = {"config": hf_cfg, "attention_mask": None, "position_ids": self.position_ids}
        kw["inputs_embeds" if "inputs_embeds" in params else "input_embeds"] = embeds
        for cache_name in ("cache", "past_key_values"):
            if cache_name in params:
                kw[cache_name] = None
        if "cache_position" in params:  # older signatures
            kw["cache_position"] = torch.arange(S, device=dev)
        self.mask = create_sliding_window_causal_mask(**kw)
        self.input_ids = input_ids

    autocast = False  # set when the installed transformers mixes fp32 activations with bf16 weights

    def __call__(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        def call():
            return layer(x, position_embeddings=self.position_embeddings, position_ids=self.position_ids,
                         attention_mask=self.mask, input_ids=self.input_ids)

        # the autocast fallback is for bf16 runs only: an fp32 check after a bf16 run must stay fp32
        # (it once did not: casebook S6)
        if not self.autocast or x.dtype != torch.bfloat16:
            try:
                return call()
            except RuntimeError as e:
                # transformers 5.17 keeps the hyper-connection output in fp32 and then feeds a bf16
                # linear; its own bf16 models run under autocast. Do the same, once, and say so.
                if "dtype" not in str(e) or x.dtype != torch.bfloat16:
                    raise
                print(f"transformers layer: {e}; retrying under bf16 autocast", flush=True)
                HFCaller.autocast = True
        with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
            return call()


def set_experts_impl(hf_cfg, impl: str) -> None:
    """'eager' (per-expert loop of the class) or a registered kernel such as 'grouped_mm' (what a
    transformers model picks by default when it can)."""
    hf_cfg._experts_implementation = impl


def compare(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor | None = None) -> dict[str, float]:
    """Errors of ``out`` against ``ref`` ([B, S, hc, D]): max-abs, relative Frobenius, relative
    Frobenius of the layer update (out - x), and per-token relative errors (median, p99, share of tokens
    above 5%: discrete routing / top-k flips show up there, not in the median)."""
    o, r = out.float(), ref.float()
    diff = o - r
    tok = diff.flatten(2).norm(dim=-1) / r.flatten(2).norm(dim=-1).clamp_min(1e-30)  # [B, S]
    res = {
        "max_abs": diff.abs().max().item(),
        "ref_max_abs": r.abs().max().item(),
        "rel_fro": (diff.norm() / r.norm().clamp_min(1e-30)).item(),
        "tok_rel_median": tok.median().item(),
        "tok_rel_p99": torch.quantile(tok.flatten().float(), 0.99).item() if tok.numel() < 2 ** 24 else float("nan"),
        "tok_share_above_5pct": (tok > 0.05).float().mean().item(),
        "finite": bool(torch.isfinite(o).all().item()),
    }
    if x is not None:
        res["rel_fro_update"] = (diff.norm() / (r - x.float()).norm().clamp_min(1e-30)).item()
    return res


# ------------------------------------------------------------------------------------ measuring
def stats(times_ms: list[float]) -> dict[str, Any]:
    return {"median_ms": statistics.median(times_ms), "min_ms": min(times_ms), "max_ms": max(times_ms),
            "times_ms": [round(t, 4) for t in times_ms]}


def time_fn(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> dict[str, Any]:
    """Device-event timing (host clock on cpu) after warm-up; median of ``repeats``."""
    return stats(D.elapsed_ms(fn, device, repeats=repeats, warmup=warmup))


def time_host(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 0) -> dict[str, Any]:
    """Host wall clock with a device synchronize on both sides (for work that is mostly host-side)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        with D.Timer(device) as t:
            fn()
        out.append(t.ms)
    return stats(out)


def peak_extra(fn: Callable[[], Any], device: torch.device) -> dict[str, Any]:
    """Run ``fn`` once; resident bytes before, peak during, and the extra peak over resident.
    On cpu these are process RSS numbers (not resettable): indicative only."""
    D.synchronize(device)
    base = D.memory_allocated(device)
    D.reset_peak_memory(device)
    fn()
    D.synchronize(device)
    peak = D.peak_memory_bytes(device)
    return {"resident_bytes": base, "peak_bytes": peak, "extra_peak_bytes": max(0, peak - base),
            "memory_note": "process RSS (cpu)" if device.type == "cpu" else "allocator"}


def timed_once_with_peak(fn: Callable[[], Any], device: torch.device, repeats: int,
                         warmup: int = 3) -> tuple[Any, float | None, float]:
    """(``fn()``'s result, median ms over ``repeats`` after ``warmup`` (None when ``repeats`` is 0),
    GiB of its peak above the memory resident before it): the autograd checks' measurement."""
    ms = time_fn(fn, device, repeats, warmup)["median_ms"] if repeats else None
    got = []
    mem = peak_extra(lambda: got.append(fn()), device)
    return got[0], ms, mem["extra_peak_bytes"] / 2 ** 30


def rel_fro_each(names, got, refs) -> dict[str, float]:
    """Relative Frobenius error of each tensor of ``got`` against ``refs`` (fp64), by name."""
    return {n: ((x.double() - r).norm() / r.norm()).item() for n, x, r in zip(names, got, refs)}


def finish_check(report: dict[str, Any], path: str | None, ok: bool, check: bool) -> int:
    """Print the report, write it (atomically) to ``path``; exit status 1 only for a failed --check."""
    print(json.dumps(report, indent=1))
    write_json(path, report)
    return 0 if ok or not check else 1


def matmul_rate(device: torch.device, n: int, repeats: int = 10) -> dict[str, Any]:
    """bf16 [n,n] @ [n,n] on random data (never zeros): FLOP/s of the library matmul."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    s = time_fn(lambda: torch.matmul(a, b, out=out), device, repeats, warmup=3)
    flops = 2.0 * n ** 3
    s.update({"n": n, "flops": flops, "flop_per_s": flops / (s["median_ms"] * 1e-3)})
    del a, b, out
    return s


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10) -> dict[str, Any]:
    """Device-to-device copy of ``nbytes`` (random data); bandwidth counts bytes read + bytes written."""
    n = nbytes // 4
    gen = torch.Generator(device=device)
    gen.manual_seed(2)
    src = torch.randn(n, device=device, generator=gen)
    dst = torch.empty_like(src)
    s = time_fn(lambda: dst.copy_(src), device, repeats, warmup=3)
    moved = 2.0 * n * 4
    s.update({"bytes": n * 4, "bytes_moved": moved, "bytes_per_s": moved / (s["median_ms"] * 1e-3)})
    del src, dst
    return s


# ----------------------------------------------------------------------------------- reporting
def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", GiB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else (f"{x:.3f}" if x < 10 else f"{x:.1f}")


def table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, p)


def environment(device: torch.device) -> dict[str, Any]:
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
            "python": sys.version.split()[0], "cpu_threads": torch.get_num_threads(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


class Deadline:
    """Wall-clock budget: later items are skipped (and say so) once it is spent."""

    def __init__(self, seconds: float | None):
        self.t0 = time.monotonic()
        self.seconds = seconds

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def spent(self) -> bool:
        return self.seconds is not None and self.elapsed() > self.seconds


def bench_config(args) -> tuple[dict[str, Any], str, DeepseekV4Config]:
    """(config.json dict, where it came from, our config) for a benchmark's --smoke / --config /
    --override arguments."""
    cfg_dict, cfg_src = (tiny_config_dict(), "tiny_config()") if args.smoke else flash_config_dict(args.config)
    if args.override:
        cfg_dict = apply_overrides(cfg_dict, args.override)
        cfg_src += f" with overrides {args.override}"
    return cfg_dict, cfg_src, our_config(cfg_dict)
