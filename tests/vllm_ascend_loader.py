"""A replay of vllm-ascend's DeepSeek-V4 weight loading (``--quantization ascend``) on a tensor
layout and a quant_model_description.json, written from its source (vllm-project/vllm-ascend at
182b75e, Atlas A2 / A3) and independent of the exporter and of models/deepseek_v4/serving_ascend.py.

It builds the parameters vllm-ascend's model creates (module list from the config, quant method
per module from the description, as ``AscendModelSlimConfig.get_quant_method`` picks it), renames
every checkpoint tensor as ``load_weights`` does, and reports every tensor that has no parameter,
the wrong dtype class or shape, or lands twice, and every parameter left unset (vLLM checks that
only for unquantized models: a quantized one would run on torch.empty garbage).

Paths are relative to ``vllm_ascend/``; ``model.py`` / ``mtp.py`` / ``compressor.py`` /
``indexer.py`` are in ``models/deepseek_v4/``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

INT, FLT = "int", "float"
_INT_DTYPES = {"I8", "I32", "I64", "U8"}


def dtype_class(st_dtype: str) -> str:
    return INT if st_dtype in _INT_DTYPES else FLT


# ----------------------------------------------------------------------------- the description
def adapt_description(desc: dict) -> dict:
    """``AscendModelSlimConfig._apply_extra_quant_adaptations`` (modelslim_config.py:960-1012):
    with 'hc_head_fn' present, every key is added again under vLLM's names, pass by pass."""
    d = dict(desc)
    if "hc_head_fn" in d:
        d.update({(k if k.startswith("model") else f"model.{k}"): v for k, v in list(d.items())})
        d.update({(k.replace(".attn.", ".self_attn.") if "attn" in k and "self_attn" not in k else k): v
                  for k, v in list(d.items())})
        d.update({k.replace("ffn", "mlp"): v for k, v in list(d.items())})
        new = {}
        for k, v in list(d.items()):
            n = k
            if "w1" in k:
                n = k.replace(".w1.", ".gate_proj.")
            if "w2" in k:
                n = k.replace(".w2.", ".down_proj.")
            if "w3" in k:
                n = k.replace(".w3.", ".up_proj.")
            if "head" in k and "lm_head" not in k:
                n = k.replace("head", "lm_head")
            if "embed" in k and "embed_tokens" not in k:
                n = k.replace("embed", "embed_tokens")
            new[n] = v
        d.update(new)
    return d


PACKED = {"gate_up_proj": ["gate_proj", "up_proj"],              # modelslim_config.py:143-146
          "experts": ["experts.0.gate_proj", "experts.0.up_proj", "experts.0.down_proj"]}


class LoadError(Exception):
    pass


def is_skipped(desc: dict, prefix: str) -> bool:
    """``is_layer_skipped_ascend`` (modelslim_config.py:776-808)."""
    proj = prefix.split(".")[-1]
    if proj in PACKED:
        flags = {desc[prefix.replace(proj, s) + ".weight"] == "FLOAT" for s in PACKED[proj]}
        if len(flags) != 1:
            raise LoadError(f"{prefix}: some but not all shards are FLOAT")
        return flags.pop()
    return any(k.startswith(prefix) and k.endswith(".weight") and v == "FLOAT" for k, v in desc.items())


def quant_type(desc: dict, prefix: str) -> str:
    """``get_linear_quant_type`` (modelslim_config.py:431-470): a missing key is a KeyError there."""
    proj = prefix.split(".")[-1]
    keys = [prefix.replace(proj, s) + ".weight" for s in PACKED[proj]] if proj in PACKED else [prefix + ".weight"]
    missing = [k for k in keys if k not in desc]
    if missing:
        raise LoadError(f"{prefix}: no description entry {missing[0]!r} (KeyError, modelslim_config.py:456/469)")
    types = {desc[k] for k in keys}
    if len(types) != 1:
        raise LoadError(f"{prefix}: shards with different quant types {sorted(types)} (modelslim_config.py:458-462)")
    return types.pop()


# ----------------------------------------------------------------------------- parameters
@dataclass
class Param:
    shape: tuple[int, ...]
    kind: str                                  # INT / FLT
    # slices that must be loaded: (shard, expert) -> expected slice shape; (None, None) = the whole
    slots: dict = field(default_factory=dict)
    loaded: set = field(default_factory=set)


class Model:
    """The parameters of one vllm-ascend model (target or MTP draft) and the loader's checks."""

    def __init__(self, desc: dict, group_size: int):
        self.desc = desc
        self.group_size = group_size
        self.params: dict[str, Param] = {}
        self.methods: dict[str, str] = {}       # vLLM module -> quant method (for reports)
        self.errors: list[str] = []

    def plain(self, name: str, shape, kind=FLT) -> None:
        self.params[name] = Param(tuple(shape), kind, {(None, None): tuple(shape)})

    def linear(self, mod: str, qprefix: str | None, out_in: tuple[int, int], *, raw_weight: str = "",
               shards: list[tuple[str, int]] | None = None) -> None:
        """A LinearBase at vLLM name ``mod``; ``qprefix`` the prefix its quant lookup uses (None:
        built with quant_config=None); ``raw_weight``: a kernel consumes ``.weight`` directly (no
        scale), so a quantized method there computes garbage; ``shards``: merged (name, rows)."""
        out_f, in_f = out_in
        if qprefix is None or is_skipped(self.desc, qprefix):
            method = "unquantized" if qprefix is None else "FLOAT"
        else:
            method = quant_type(self.desc, qprefix)
        self.methods[mod] = method
        if method in ("unquantized", "FLOAT"):
            tensors = {"weight": ((out_f, in_f), FLT, lambda rows: (rows, in_f))}
        elif method == "W8A8_DYNAMIC":                     # methods/w8a8_dynamic.py:51-83
            if raw_weight:
                self.errors.append(f"{mod}: {method}, but {raw_weight} uses the raw int8 weight with no scale")
            tensors = {"weight": ((out_f, in_f), INT, lambda rows: (rows, in_f)),
                       "weight_scale": ((out_f, 1), FLT, lambda rows: (rows, 1)),
                       "weight_offset": ((out_f, 1), FLT, lambda rows: (rows, 1))}
        else:                                              # methods/registry.py: nothing else for 'linear' we write
            self.errors.append(f"{mod}: no vllm-ascend method for ({method}, linear) (modelslim_config.py:531-541)")
            return
        for t, (shape, kind, shard_shape) in tensors.items():
            slots = {(None, None): shape} if not shards else {(s, None): shard_shape(rows) for s, rows in shards}
            self.params[f"{mod}.{t}"] = Param(shape, kind, slots)

    def moe(self, mod: str, qprefix: str, n_exp: int, inter: int, hidden: int) -> None:
        """FusedMoE at ``mod`` (model.py:335-354): w13 = [gate; up] rows, w2 = down."""
        method = "FLOAT" if is_skipped(self.desc, qprefix) else quant_type(self.desc, qprefix)
        self.methods[mod] = method
        E, I, H = n_exp, inter, hidden
        if method == "FLOAT":
            spec = {"w13_weight": ((E, 2 * I, H), FLT), "w2_weight": ((E, H, I), FLT)}
        elif method == "W8A8_DYNAMIC":                     # methods/w8a8_dynamic.py:197-221
            spec = {"w13_weight": ((E, 2 * I, H), INT), "w2_weight": ((E, H, I), INT),
                    "w13_weight_scale": ((E, 2 * I, 1), FLT), "w13_weight_offset": ((E, 2 * I, 1), FLT),
                    "w2_weight_scale": ((E, H, 1), FLT), "w2_weight_offset": ((E, H, 1), FLT)}
        elif method == "W4A8_DYNAMIC":                     # methods/w4a8.py:142-194, modelslim path, tp 1
            if self.group_size > 0:
                self.errors.append(f"{mod}: W4A8_DYNAMIC with group_size {self.group_size} > 0 is refused "
                                   "(methods/w4a8.py:114-127)")
            spec = {"w13_weight": ((E, I, H), INT), "w2_weight": ((E, H // 2, I), INT),
                    "w13_weight_scale": ((E, 2 * I, 1), FLT), "w13_weight_offset": ((E, 2 * I, 1), FLT),
                    "w2_weight_scale": ((E, H, 1), FLT), "w2_weight_offset": ((E, H, 1), FLT),
                    "w13_scale_bias": ((E, 2 * I, 1), FLT), "w2_scale_bias": ((E, H, 16), FLT)}
        else:
            self.errors.append(f"{mod}: no vllm-ascend method for ({method}, moe)")
            return
        for t, (shape, kind) in spec.items():
            if t.startswith("w13"):   # gate / up fill the two halves of dim 1
                slots = {(s, e): (shape[1] // 2, *shape[2:]) for s in ("w1", "w3") for e in range(E)}
            else:
                slots = {("w2", e): shape[1:] for e in range(E)}
            self.params[f"{mod}.{t}"] = Param(shape, kind, slots)

    # -------------------------------------------------------------------------- loading
    def load(self, name: str, dtype: str, shape, shard=None, expert=None, src: str = "") -> None:
        p = self.params.get(name)
        if p is None:
            self.errors.append(f"{src}: no parameter {name!r} (KeyError in load_weights)")
            return
        slot = (shard, expert)
        if slot not in p.slots:
            self.errors.append(f"{src}: parameter {name} has no slot {slot}")
            return
        if dtype_class(dtype) != p.kind:
            self.errors.append(f"{src}: {dtype} into the {p.kind} parameter {name}")
        if tuple(shape) != tuple(p.slots[slot]):
            self.errors.append(f"{src}: shape {list(shape)} into {name}{'' if slot == (None, None) else slot} "
                               f"which takes {list(p.slots[slot])}")
        if slot in p.loaded:
            self.errors.append(f"{src}: {name}{slot} loaded twice")
        p.loaded.add(slot)

    def unset(self) -> list[str]:
        return [f"{n}{'' if s == (None, None) else s}" for n, p in self.params.items()
                for s in p.slots if s not in p.loaded]


# ----------------------------------------------------------------------------- one decoder layer
def build_layer(m: Model, mod: str, qpre: str, ratio: int, hashed: bool, cfg: dict, shapes) -> None:
    """``DeepseekV2DecoderLayer`` (model.py:645-702) at vLLM name ``mod``; its quant lookups use
    ``qpre`` (``model.layers.i`` in the target, ``mtp.0`` in the draft). ``shapes(rel)``: the
    [out, in] of the float weight ``rel`` (release name relative to the block)."""
    a, f = f"{mod}.self_attn", f"{mod}.mlp"
    qa, qf = f"{qpre}.self_attn", f"{qpre}.mlp"
    m.plain(f"{a}.attn_sink", (cfg["num_attention_heads"],))                   # model.py:472-473
    for lin in ("wq_a", "wq_b", "wkv", "wo_b"):                                 # model.py:474-517
        m.linear(f"{a}.{lin}", f"{qa}.{lin}", shapes(f"attn.{lin}"))
    m.linear(f"{a}.wo_a", f"{qa}.wo_a", shapes("attn.wo_a"),
             raw_weight="the A2/A3 o_proj batch matmul (attention/dsa_v1.py:1172-1180)")
    for norm, n in (("q_norm", cfg["q_lora_rank"]), ("kv_norm", cfg["head_dim"])):
        m.plain(f"{a}.{norm}.weight", (n,))
    comps = ([("compressor", "attn.compressor")] if ratio > 1 else []) + \
        ([("indexer.compressor", "attn.indexer.compressor")] if ratio == 4 else [])
    for sub, rel in comps:                                                      # compressor.py:124-144
        m.plain(f"{a}.{sub}.ape", shapes(f"{rel}.ape"))
        m.plain(f"{a}.{sub}.norm.weight", shapes(f"{rel}.norm.weight"))
        for lin in ("wkv", "wgate"):
            m.linear(f"{a}.{sub}.{lin}", f"{qa}.{sub}.{lin}", shapes(f"{rel}.{lin}"),
                     raw_weight="the fused compressor kernel (compressor.py:212-216)")
    if ratio == 4:                                                              # indexer.py:270-290
        m.linear(f"{a}.indexer.wq_b", f"{qa}.indexer.wq_b", shapes("attn.indexer.wq_b"))
        m.linear(f"{a}.indexer.weights_proj", None, shapes("attn.indexer.weights_proj"))
    H, E, I = cfg["hidden_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    m.linear(f"{f}.gate", None, (E, H))                                          # model.py:279-281
    if hashed:                                                                  # model.py:317-330
        m.plain(f"{f}.gate.tid2eid", (cfg["vocab_size"], cfg["num_experts_per_tok"]), INT)
    else:
        m.plain(f"{f}.gate.e_score_correction_bias", (E,))
    if cfg.get("n_shared_experts"):                                             # model.py:301-313
        si = I * cfg["n_shared_experts"]
        m.linear(f"{f}.shared_experts.gate_up_proj", f"{qf}.shared_experts.gate_up_proj", (2 * si, H),
                 shards=[("gate_proj", si), ("up_proj", si)])
        m.linear(f"{f}.shared_experts.down_proj", f"{qf}.shared_experts.down_proj", (H, si))
    m.moe(f"{f}.experts", f"{qf}.experts", E, I, H)
    m.plain(f"{mod}.input_layernorm.weight", (H,))
    m.plain(f"{mod}.post_attention_layernorm.weight", (H,))
    hc = cfg["hc_mult"]
    mix = (2 + hc) * hc
    for site in ("attn", "ffn"):                                                # model.py:692-702
        m.plain(f"{mod}.hc_{site}_fn", (mix, hc * H))
        m.plain(f"{mod}.hc_{site}_base", (mix,))
        m.plain(f"{mod}.hc_{site}_scale", (3,))


def _common_renames(name: str) -> str:
    for a, b in ((".w1.", ".gate_proj."), (".w2.", ".down_proj."), (".w3.", ".up_proj.")):
        name = name.replace(a, b)
    return name


def _route(m: Model, name: str, dtype: str, shape, src: str) -> None:
    """The stacked / expert mapping of load_weights (model.py:1125-1262, mtp.py:352-484)."""
    if ".mlp.experts." in name:
        head, _, rest = name.partition(".mlp.experts.")
        e, proj, tensor = rest.split(".", 2)
        shard, pname = {"gate_proj": ("w1", "w13"), "up_proj": ("w3", "w13"), "down_proj": ("w2", "w2")}[proj]
        # fused_moe_make_expert_params_mapping: 'experts.E.gate_proj.' -> 'experts.w13_'; the
        # ModelSlim loader maps *_scale_bias (modelslim_config.py:59-91)
        m.load(f"{head}.mlp.experts.{pname}_{tensor}", dtype, shape, shard, int(e), src)
        return
    for proj in ("gate_proj", "up_proj"):
        if f".{proj}." in name:
            m.load(name.replace(proj, "gate_up_proj"), dtype, shape, proj, None, src)
            return
    m.load(name, dtype, shape, src=src)


# ----------------------------------------------------------------------------- target and draft
def _shapes_from(layout: dict, prefix: str, src_layout: dict):
    def shapes(rel: str):
        key = f"{prefix}.{rel}" + ("" if rel.endswith((".ape", ".weight")) else ".weight")
        if key not in src_layout:
            raise LoadError(f"the source has no {key!r}")
        return tuple(src_layout[key]["shape"])
    return shapes


def load_target(cfg: dict, layout: dict, desc: dict, src_layout: dict) -> Model:
    """``AscendDeepseekV4ForCausalLM`` (model.py:740-1262)."""
    d = adapt_description(desc)
    m = Model(d, int(desc.get("group_size", 0)))
    H, V, hc = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"]
    if is_skipped(d, "model.embed_tokens"):                                     # model.py:769-774
        m.plain("model.embed_tokens.weight", (V, H))
    else:
        m.errors.append("model.embed_tokens: not FLOAT in the description")
    if is_skipped(d, "lm_head"):                                                # model.py:965-970
        m.plain("lm_head.weight", (V, H))
    else:
        m.errors.append("lm_head: not FLOAT in the description")
    m.plain("model.norm.weight", (H,))
    m.plain("model.hc_head_fn", (hc, hc * H))                                   # model.py:810-812
    m.plain("model.hc_head_base", (hc,))
    m.plain("model.hc_head_scale", (1,))
    n, ratios = cfg["num_hidden_layers"], cfg["compress_ratios"]
    for i in range(n):
        try:
            build_layer(m, f"model.layers.{i}", f"model.layers.{i}", ratios[i], i < cfg["num_hash_layers"], cfg,
                        _shapes_from(layout, f"layers.{i}", src_layout))
        except (LoadError, KeyError) as e:
            m.errors.append(f"layer {i}: {e}")
    for key, t in layout.items():                                               # model.py:1069-1110
        if key.startswith("mtp."):
            continue                      # get_spec_layer_idx_from_weight_name: the draft's
        name = key if key.startswith("model") else f"model.{key}"
        name = _common_renames(name)
        if "model.head." in name:
            name = name.replace("model.head.", "lm_head.")
        if "embed." in name and "embed_token." not in name:
            name = name.replace("embed.", "embed_tokens.")
        if "attn" in name and "self_attn" not in name:
            name = name.replace(".attn.", ".self_attn.")
        name = name.replace(".ffn.", ".mlp.").replace(".ffn_norm.", ".post_attention_layernorm.")
        name = name.replace(".attn_norm.", ".input_layernorm.")
        if name.endswith(".scale"):
            name = name.replace(".scale", ".weight_scale")
        name = name.replace(".gate.bias", ".gate.e_score_correction_bias")
        _route(m, name, t["dtype"], t["shape"], key)
    return m


_NO_BLOCK = (".hc_head_fn", ".hc_head_base", ".hc_head_scale", ".e_proj.", ".h_proj.", ".enorm.", ".hnorm.",
             ".norm.", ".head.", ".emb.tok_emb.")                              # mtp.py:517-530


def load_draft(cfg: dict, layout: dict, desc: dict, src_layout: dict) -> Model:
    """``DeepSeekV4MTP`` (mtp.py:148-484), one MTP layer; its embed_tokens is the target's
    (spec_decode/llm_base_proposer.py _maybe_share_embeddings), its shared head its own."""
    d = adapt_description(desc)
    m = Model(d, int(desc.get("group_size", 0)))
    H, V, hc, n = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"], cfg["num_hidden_layers"]
    base = "model.layers.0"
    for proj in ("e_proj", "h_proj"):    # quant_config but prefix '' (mtp.py:64-68)
        m.linear(f"{base}.{proj}", "", (H, H))
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        m.plain(f"{base}.{norm}.weight", (H,))
    if is_skipped(d, "mtp.0.head"):                                             # mtp.py:44-49
        m.plain(f"{base}.shared_head.head.weight", (V, H))
    else:
        m.errors.append("mtp.0.head: not FLOAT in the description")
    m.plain(f"{base}.hc_head_fn", (hc, hc * H))
    m.plain(f"{base}.hc_head_base", (hc,))
    m.plain(f"{base}.hc_head_scale", (1,))
    try:
        build_layer(m, f"{base}.mtp_block", "mtp.0", cfg["compress_ratios"][n], False, cfg,
                    _shapes_from(layout, "mtp.0", src_layout))
    except (LoadError, KeyError) as e:
        m.errors.append(f"mtp block: {e}")
    for key, t in layout.items():                                               # mtp.py:286-338
        if not key.startswith("mtp."):
            continue
        if ".emb.tok_emb." in key:
            continue                      # loaded, then replaced by the target's embedding
        name = key.replace("mtp.0.", f"{base}." if any(s in key for s in _NO_BLOCK) else f"{base}.mtp_block.")
        name = _common_renames(name)
        if name.endswith(".scale"):
            name = name.replace(".scale", ".weight_scale")
        name = name.replace(".head.", ".shared_head.head.").replace(".norm.", ".shared_head.norm.")
        if "attn" in name and "self_attn" not in name:
            name = name.replace(".attn.", ".self_attn.")
        name = name.replace(".ffn.", ".mlp.").replace(".ffn_norm.", ".post_attention_layernorm.")
        name = name.replace(".attn_norm.", ".input_layernorm.")
        name = name.replace(".gate.bias", ".gate.e_score_correction_bias")
        _route(m, name, t["dtype"], t["shape"], key)
    return m
