"""DeepSeek-V4 quantization wrappers (prefill only, no kv caches held).

The wrappers are subclasses of the float modules that *reuse their forward*: a wrapper is the
float module with quantized pieces swapped in -- ``QuantLinear`` for its linears, a
``QuantMatmul`` for the attention / indexer score and value products, and, for ``wo_a``, a side
weight quantizer behind the float module's own ``wo_a_weight()`` / ``grouped_output()`` hooks.
A second copy of the attention math would silently drift from the float layer when that gets
optimised; this way there is one copy.

    QuantV4Attention   wq_a, wq_b, wkv, wo_b -> QuantLinear (target attn-linear: what the
                       serving engines quantize, serving.py); with attn-linear-all also wo_a,
                       which keeps its grouped einsum (bsgd,grd->bsgr) and gets WoAQuant
                       (observes its input, fake-quantizes the [G, o_lora, d] view), and the
                       compressors; QK / PV through QuantMatmul when 'attn-cache' is on;
                       nested QuantV4Compressor and QuantV4Indexer.
    QuantV4Compressor  wkv, wgate -> QuantLinear (fp32 weights stay fp32).
    QuantV4Indexer     wq_b (+ weights_proj, attn-linear-all) -> QuantLinear; its own QuantV4Compressor; the
                       index-score matmul through QuantMatmul when 'attn-cache' is on.
    QuantV4Expert      the gated-MLP wrapper with a w1/w3/w2 -> gate/up/down facade; forward is
                       the float Expert's (clamp-then-silu, routing weight before w2).

Smoothing state (algorithms/smoothing.py): each unit lists its scale-migration pairs
(``smoothing_subgraphs()``); the attention keeps a plain reference to the block's attn_norm and
folds ``input_smooth`` into it; an expert whose w3 rows were scaled clamps its up projection
per channel (``up_limit``). Replaced float weights (smoothing, GPTQ) are saved under their own
parameter names (``mark_replaced``) and written back by ``load_ptq_params``.

Block and FFN children are named ``attn`` / ``ffn`` (not ``self_attn`` / ``mlp``): generic code
that looks for the HF names finds nothing here, so the adapter applies these wrappers itself.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Iterator, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from amct_ext.errors import QuantConfigError
from amct_ext.pipeline.ptq_units import PtqUnit, iter_indexed_units, make_ptq_unit
from amct_ext.quant.quant_linear import (QuantGatedMLP, QuantizedMatmul, QuantLinear, load_replaced_weight,
                                         load_weight_codes, replaced_weight_params)
from amct_ext.quant.leaf_stack import (LeafStack, SignStep, StackMember, chunk_bounds, held_chunks, stack_leaves,
                                       stackable)
from amct_ext.quant.quantizers import ActivationQuantizer, WeightQuantizer
from amct_ext.runtime import device as devmod
from amct_ext.runtime.grouped_linear import grouped_linear
from amct_ext.quant.schemes import QuantScheme, TensorSpec, parse_targets

from .modeling import Attention, Block, Compressor, Expert, Indexer, Matmul, MoE, _grouped_mm_supported
from .expert_turns import ExpertTurns
from .fused_moe import combine_slots, slot_rows

ATTN_TARGETS = ("attn-linear", "attn-linear-all", "attn-cache")


# ----------------------------------------------------------------------------------- leaves
class QuantMatmul(QuantizedMatmul):
    """QuantizedMatmul with the float ``Matmul``'s call signature (``forward(a, b)``)."""

    def __init__(self, float_matmul: Matmul, spec: TensorSpec | None):
        super().__init__(spec, spec)
        self.transpose_b = float_matmul.transpose_b

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return torch.matmul(a, b.transpose(-1, -2) if self.transpose_b else b)
        return super().forward(a, b, transpose_b=self.transpose_b)

    def export_ptq_params(self) -> dict[str, torch.Tensor]:
        out = {f"a_quantizer.{k}": v for k, v in self.a_quantizer.ptq_params().items()}
        out.update({f"b_quantizer.{k}": v for k, v in self.b_quantizer.ptq_params().items()})
        return out

    def load_ptq_params(self, params: Mapping[str, torch.Tensor]) -> None:
        split = _split_params(params, ("a_quantizer", "b_quantizer"), "QuantMatmul")
        self.a_quantizer.load_ptq_params(split["a_quantizer"])
        self.b_quantizer.load_ptq_params(split["b_quantizer"])


class WoAQuant(nn.Module):
    """Side quantizers of ``wo_a``: an input quantizer on o [B, S, G, H*Dh/G] and a weight
    quantizer on the [G, o_lora, H*Dh/G] view. Granularities act on the rows of that view
    (per output channel of each group), which are the rows of the stored [G*o_lora, d] weight."""

    def __init__(self, wo_a: nn.Linear, n_groups: int, weight_spec: TensorSpec | None,
                 act_spec: TensorSpec | None):
        super().__init__()
        # a plain reference, not a submodule: the weight keeps its single checkpoint name attn.wo_a
        object.__setattr__(self, "_owner", wo_a)
        self.n_groups = n_groups
        self.enabled = True
        self.weight_quantizer = WeightQuantizer(weight_spec)
        self.weight_quantizer.check_shape(wo_a.weight)
        self.input_quantizer = ActivationQuantizer(act_spec)

    @property
    def weight(self) -> torch.Tensor:
        return self._owner.weight

    def quantized_view(self) -> torch.Tensor:
        """[G, o_lora, d] fake-quant view (the 2-D weight is quantized, then viewed)."""
        w = self.weight_quantizer(self.weight) if self.enabled else self.weight
        return w.view(self.n_groups, -1, w.shape[-1])

    def quantize_input(self, o: torch.Tensor) -> torch.Tensor:
        # wo_a is no module call of its own: observers (GPTQ's Hessians) see its input here,
        # with quantization on or off
        for fn in self.__dict__.get("input_observers", ()):
            fn(o)
        return self.input_quantizer(o) if self.enabled else o

    def export_ptq_params(self) -> dict[str, torch.Tensor]:
        out = {f"weight_quantizer.{k}": v for k, v in self.weight_quantizer.ptq_params().items()}
        out.update({f"input_quantizer.{k}": v for k, v in self.input_quantizer.ptq_params().items()})
        if getattr(self, "weight_replaced", False):   # set by algorithms that rewrite wo_a
            out.update(replaced_weight_params(self.weight, self.weight_quantizer))
        return out

    def load_ptq_params(self, params: Mapping[str, torch.Tensor]) -> None:
        params = dict(params)
        if "weight" in params:
            load_replaced_weight(self.weight, params.pop("weight"), "WoAQuant")
            self.weight_replaced = True
        codes = params.pop("weight_codes", None)
        split = _split_params(params, ("weight_quantizer", "input_quantizer"), "WoAQuant")
        self.weight_quantizer.load_ptq_params(split["weight_quantizer"], self.weight)
        self.input_quantizer.load_ptq_params(split["input_quantizer"])
        if codes is not None:   # decoded on the fixed grid just loaded
            load_weight_codes(self.weight, self.weight_quantizer, codes, "WoAQuant")
            self.weight_replaced = True

    @torch.no_grad()
    def export(self) -> dict[str, torch.Tensor]:
        out = self.weight_quantizer.export(self.weight)
        out.update({f"input_{k}": v for k, v in self.input_quantizer.export().items()})
        return out


def _split_params(params: Mapping[str, torch.Tensor], owners: tuple[str, ...], who: str) -> dict[str, dict]:
    split: dict[str, dict] = {o: {} for o in owners}
    for key, value in params.items():
        owner, _, name = key.partition(".")
        if owner not in split:
            raise QuantConfigError(f"{who}: unknown PTQ parameter {key!r} (expected keys under {', '.join(owners)})")
        split[owner][name] = value
    return split


QUANT_LEAVES = (QuantLinear, QuantMatmul, WoAQuant)


@dataclasses.dataclass
class SmoothPair:
    """One smoothing subgraph of a unit: ``producer`` (a unit-relative module name) makes the
    activation channels that ``readers`` (modules with a [out, in] weight) consume.

    Folding a per-channel s: the producer is divided by s (``producer_kind`` 'norm': its weight;
    'rows': its weight rows; 'up_rows': an expert's w3 rows and its clamp limit) and every
    reader's weight column j is multiplied by s_j, so the float function is unchanged.
    ``producer=None`` means the unit's input (the attention's attn_norm, outside the unit):
    the unit folds s into that norm and the captured inputs become x / s. ``stat_module`` is the
    reader whose input the channel statistics are taken from (None: the unit's first argument).
    """

    name: str
    readers: list[str]
    producer: str | None
    producer_kind: str = "input"
    stat_module: str | None = None


# ---------------------------------------------------------------------------- unit mixin
class PtqUnitMixin:
    """What the blockwise solver needs from a unit: its learnable parameters and their state."""

    def quant_leaves(self) -> Iterator[tuple[str, nn.Module]]:
        for name, module in self.named_modules():
            if isinstance(module, QUANT_LEAVES):
                yield name, module

    def ptq_parameters(self) -> list[nn.Parameter]:
        """Learnable weight-clipping factors of every weight quantizer in the unit."""
        params: list[nn.Parameter] = []
        for _, leaf in self.quant_leaves():
            if isinstance(leaf, (QuantLinear, WoAQuant)):
                params += leaf.weight_quantizer.enable_learning(leaf.weight)
                if isinstance(leaf, QuantLinear):
                    leaf.invalidate_cache()
        return params

    def freeze_ptq_parameters(self) -> None:
        for _, leaf in self.quant_leaves():
            if isinstance(leaf, (QuantLinear, WoAQuant)):
                leaf.weight_quantizer.disable_learning()
                if isinstance(leaf, QuantLinear):
                    leaf.invalidate_cache()

    # -- float tensors an algorithm replaced (GPTQ, smoothing): saved under their own names
    def mark_replaced(self, name: str) -> None:
        """Record that the unit's parameter ``name`` (e.g. 'wq_a.weight', 'q_norm.weight') now
        holds a value that differs from the checkpoint: it is saved with the unit's parameters."""
        if name not in dict(self.named_parameters()):
            raise QuantConfigError(f"{type(self).__name__} has no parameter {name!r} to replace")
        self.__dict__.setdefault("_replaced", set()).add(name)

    def replaced_names(self) -> list[str]:
        return sorted(self.__dict__.get("_replaced", ()))

    def extra_ptq_params(self) -> dict[str, torch.Tensor]:
        """Unit-level state that belongs to no quantized leaf (see the subclasses)."""
        return {}

    def snapshot_extra_state(self):
        """A callable that puts back what ``state_dict`` does not hold: the replaced-weight
        record and the subclasses' unit-level state (non-persistent buffers, the attention's
        input norm outside the unit). Used by the recipe runner's fall back to RTN."""
        replaced = set(self.__dict__.get("_replaced", ()))

        def restore() -> None:
            self.__dict__["_replaced"] = set(replaced)
        return restore

    def load_extra_ptq_params(self, params: dict[str, torch.Tensor]) -> None:
        """Consume the unit-level keys of ``params`` (pop them); the rest go to the leaves."""

    def export_ptq_params(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for name, leaf in self.quant_leaves():
            for key, value in leaf.export_ptq_params().items():
                out[f"{name}.{key}"] = value.detach().cpu()
        named = dict(self.named_parameters())
        for name in self.replaced_names():
            if f"{name}_codes" not in out:   # a leaf that saved its codes holds the same values
                out[name] = named[name].detach().cpu().clone()
        for key, value in self.extra_ptq_params().items():
            out[key] = value.detach().cpu().clone()
        return out

    def load_ptq_params(self, params: Mapping[str, torch.Tensor]) -> None:
        params = dict(params)
        named = dict(self.named_parameters())
        for key in [k for k in params if k in named]:
            _load_replaced(self, key, named[key], params.pop(key))
        self.load_extra_ptq_params(params)
        leaves = dict(self.quant_leaves())
        grouped: dict[str, dict[str, torch.Tensor]] = collections.defaultdict(dict)
        for key, value in params.items():
            owner = max((n for n in leaves if key.startswith(n + ".")), key=len, default=None)
            if owner is None:
                raise QuantConfigError(f"PTQ parameter {key!r} matches no quantized module of "
                                       f"{type(self).__name__}")
            grouped[owner][key[len(owner) + 1:]] = value
        for owner, values in grouped.items():
            leaves[owner].load_ptq_params(values)


def _load_replaced(unit: nn.Module, key: str, param: torch.Tensor, value: torch.Tensor) -> None:
    """Write a saved replacement into the unit's parameter ``key`` (same shape and dtype, finite)."""
    load_replaced_weight(param, value, f"PTQ parameter {key!r}")
    unit.mark_replaced(key)
    invalidate_quant_caches(unit)


def invalidate_quant_caches(module: nn.Module) -> None:
    """Drop every cached fake-quant weight inside ``module`` (after writing weights in place)."""
    for leaf in module.modules():
        if isinstance(leaf, QuantLinear):
            leaf.invalidate_cache()


# ---------------------------------------------------------------------------- rebinding
def _rebind(cls: type, module: nn.Module) -> nn.Module:
    """A ``cls`` instance sharing ``module``'s parameters, buffers and submodules (containers
    copied, so swapping a child in the wrapper leaves the float module untouched)."""
    new = cls.__new__(cls)
    # never carry a bound forward (or accelerate's saved one) over from the float module: it
    # would run the float module's forward on the float children (casebook/real-size-ptq.md-1)
    state = {k: v for k, v in module.__dict__.items() if k not in ("forward", "_old_forward", "_hf_hook")}
    for key, value in state.items():
        if isinstance(value, (dict, set)) and key.startswith("_"):
            state[key] = type(value)(value)
    new.__dict__.update(state)
    return new


def _quant_linear(linear: nn.Linear, weight_spec, act_spec) -> QuantLinear:
    return QuantLinear.from_linear(linear, weight_spec, act_spec)


# ------------------------------------------------------------------------------- wrappers
class QuantV4Compressor(PtqUnitMixin, Compressor):
    @classmethod
    def from_float(cls, comp: Compressor, weight_spec, act_spec) -> "QuantV4Compressor":
        q = _rebind(cls, comp)
        q.wkv = _quant_linear(comp.wkv, weight_spec, act_spec)
        q.wgate = _quant_linear(comp.wgate, weight_spec, act_spec)
        return q


class QuantV4Indexer(PtqUnitMixin, Indexer):
    @classmethod
    def from_float(cls, idx: Indexer, weight_spec, act_spec, cache_spec, linear: bool, cache: bool,
                   wide: bool = True) -> "QuantV4Indexer":
        """``linear``: wq_b; with ``wide`` also weights_proj and the indexer's compressor."""
        q = _rebind(cls, idx)
        if linear:
            q.wq_b = _quant_linear(idx.wq_b, weight_spec, act_spec)
        if linear and wide:
            q.weights_proj = _quant_linear(idx.weights_proj, weight_spec, act_spec)
            q.compressor = QuantV4Compressor.from_float(idx.compressor, weight_spec, act_spec)
        if cache:
            q.score_matmul = QuantMatmul(idx.score_matmul, cache_spec)
        return q


class QuantV4Attention(PtqUnitMixin, Attention):
    @classmethod
    def from_float(cls, attn: Attention, scheme: QuantScheme, targets: list[str]) -> "QuantV4Attention":
        q = _rebind(cls, attn)
        # attn-linear: the linears the serving engines quantize (serving.ENGINE_ATTN_LEAVES);
        # attn-linear-all: also wo_a, the compressors and the indexer's weights_proj
        wide = "attn-linear-all" in targets
        linear = wide or "attn-linear" in targets
        cache = "attn-cache" in targets
        ts = scheme.target("attn-linear")
        wspec, aspec = (ts.weight, ts.input) if (linear and ts is not None) else (None, None)
        cspec = scheme.cache if cache else None
        if linear:
            for name in ("wq_a", "wq_b", "wkv", "wo_b"):
                setattr(q, name, _quant_linear(getattr(attn, name), wspec, aspec))
        if wide:
            q.wo_a_quant = WoAQuant(attn.wo_a, attn.o_groups, wspec, aspec)
            if attn.ratio:
                q.compressor = QuantV4Compressor.from_float(attn.compressor, wspec, aspec)
        if attn.ratio == 4 and (linear or cache):
            q.indexer = QuantV4Indexer.from_float(attn.indexer, wspec, aspec, cspec, linear, cache, wide)
        if cache:
            q.qk_matmul = QuantMatmul(attn.qk_matmul, cspec)
            q.pv_matmul = QuantMatmul(attn.pv_matmul, cspec)
        # smoothing of the attention input (attn_norm -> every reader of x): the per-channel
        # vector s folded into the block's attn_norm (weight / s); the norm itself lives in the
        # Block, so the unit keeps a plain reference to it (set by quantize_block)
        q.register_buffer("input_smooth", None, persistent=False)
        object.__setattr__(q, "_input_norm", None)
        object.__setattr__(q, "_input_norm_weight", None)
        return q

    def set_input_norm(self, norm: nn.Module | None) -> None:
        """The RMSNorm whose output is this attention's input (plain reference, not a child)."""
        object.__setattr__(self, "_input_norm", norm)
        object.__setattr__(self, "_input_norm_weight", None)

    @property
    def input_norm(self) -> nn.Module | None:
        return self.__dict__.get("_input_norm")

    @torch.no_grad()
    def fold_input_smooth(self, s: torch.Tensor) -> None:
        """Divide the input norm's weight by ``s`` (accumulated over calls: the weight is always
        the checkpoint weight / the total s, so a reload computes the same bits)."""
        norm = self.input_norm
        if norm is None:
            raise QuantConfigError(f"layer {self.layer_id}: the attention has no input-norm reference "
                                   "(quantize the block with quantize_block) -- cannot fold input_smooth")
        s = s.detach().to(torch.float32)
        if s.shape != norm.weight.shape or not bool(torch.isfinite(s).all() & (s > 0).all()):
            raise QuantConfigError(f"input_smooth must be finite, positive and of shape {tuple(norm.weight.shape)}, "
                                   f"got shape {tuple(s.shape)}")
        if self.__dict__.get("_input_norm_weight") is None:
            object.__setattr__(self, "_input_norm_weight", norm.weight.detach().clone())
        total = s.to(norm.weight.device) if self.input_smooth is None else self.input_smooth * s.to(self.input_smooth.device)
        self.input_smooth = total
        norm.weight.copy_(self._input_norm_weight.to(norm.weight.device) / total.to(norm.weight.device))

    def extra_ptq_params(self) -> dict[str, torch.Tensor]:
        return {} if self.input_smooth is None else {"input_smooth": self.input_smooth}

    def snapshot_extra_state(self):
        base = super().snapshot_extra_state()
        smooth = None if self.input_smooth is None else self.input_smooth.clone()
        orig = self.__dict__.get("_input_norm_weight")
        norm = self.input_norm
        norm_w = None if norm is None else norm.weight.detach().clone()

        @torch.no_grad()
        def restore() -> None:
            base()
            self.input_smooth = smooth
            object.__setattr__(self, "_input_norm_weight", orig)
            if norm is not None:
                norm.weight.copy_(norm_w)
        return restore

    def smoothing_subgraphs(self) -> list[SmoothPair]:
        """Scale-migration pairs of the attention (producer / s, every reader * s).

        attn_norm -> every reader of the attention input x: wq_a, wkv, the compressor's wkv /
        wgate and the indexer's weights_proj and compressor (they all read the same x, so all
        get the compensating columns, quantized or not; compressor weights stay fp32);
        q_norm -> wq_b and the indexer's wq_b (the only readers of qr); wo_a (its rows, i.e.
        the [G, o_lora] output channels of the grouped einsum) -> wo_b's input columns."""
        pairs = []
        readers = ["wq_a", "wkv"]
        if self.ratio:
            readers += ["compressor.wkv", "compressor.wgate"]
            if self.ratio == 4:
                readers += ["indexer.weights_proj", "indexer.compressor.wkv", "indexer.compressor.wgate"]
        if self.input_norm is not None:
            pairs.append(SmoothPair("attn_norm", readers, producer=None, stat_module=None))
        q_readers = ["wq_b"] + (["indexer.wq_b"] if self.ratio == 4 else [])
        pairs.append(SmoothPair("q_norm", q_readers, producer="q_norm", producer_kind="norm", stat_module="wq_b"))
        pairs.append(SmoothPair("wo_a", ["wo_b"], producer="wo_a", producer_kind="rows", stat_module="wo_b"))
        return pairs

    def load_extra_ptq_params(self, params: dict[str, torch.Tensor]) -> None:
        if "input_smooth" not in params:
            return
        if self.input_smooth is not None:
            raise QuantConfigError(f"layer {self.layer_id}: input_smooth is already folded into attn_norm "
                                   "(parameters loaded twice into the same block?)")
        self.fold_input_smooth(params.pop("input_smooth"))

    # the float module's hooks for wo_a, with the side quantizer swapped in
    def wo_a_weight(self) -> torch.Tensor:
        if "wo_a_quant" in self._modules:
            return self.wo_a_quant.quantized_view()
        return super().wo_a_weight()

    def grouped_output(self, o: torch.Tensor) -> torch.Tensor:
        if "wo_a_quant" in self._modules:
            o = self.wo_a_quant.quantize_input(o)
        return super().grouped_output(o)


class _ExpertFacade:
    """Gives a V4 Expert the gate/up/down + act_fn face that QuantGatedMLP expects."""

    def __init__(self, expert: Expert):
        self.w1, self.w2, self.w3 = expert.w1, expert.w2, expert.w3
        self.act_fn = torch.nn.functional.silu
        self.hidden_size = expert.w1.in_features
        self.intermediate_size = expert.w1.out_features


class QuantV4Expert(PtqUnitMixin, QuantGatedMLP):
    """Routed or shared expert: QuantGatedMLP with w1/w3/w2 as gate/up/down, V4 semantics."""

    PROJECTIONS = {"gate": "w1", "up": "w3", "down": "w2"}

    def __init__(self, expert: Expert, weight_spec, act_spec):
        super().__init__(_ExpertFacade(expert), weight_spec, act_spec)
        self.swiglu_limit = expert.swiglu_limit
        # per-channel clamp limit of the up projection after w3 -> w2 smoothing (None: the
        # scalar swiglu_limit). Scaling w3's row j by 1/s_j is exact only with the limit
        # L / s_j: clamp(u / s, -L / s, L / s) == clamp(u, -L, L) / s (s > 0).
        self.register_buffer("up_limit", None, persistent=False)

    # -- the activation clamp (GatedProjections): swiglu_limit, the per-channel up_limit ----------
    @property
    def clamp_limit(self) -> float:
        return self.swiglu_limit

    def channel_clamp(self) -> torch.Tensor | None:
        return self.up_limit

    def set_channel_clamp(self, limit: torch.Tensor | None) -> None:
        self.up_limit = limit

    @property
    def quantized(self) -> bool:
        """True when any projection really quantizes (MoE then leaves its grouped float path)."""
        return any(p.enabled and not (p.weight_quantizer.is_identity and p.input_quantizer.is_identity)
                   for p in (self.w1, self.w2, self.w3))

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        if self.up_limit is None:
            # the float Expert's own math (clamp-then-silu, routing weight before w2) on our linears
            return Expert.forward(self, x, weights)
        gate = self.w1(x).float()
        up = self.w3(x).float()
        lim = self.up_limit
        up = torch.minimum(torch.maximum(up, -lim), lim)
        gate = gate.clamp(max=self.swiglu_limit)
        h = torch.nn.functional.silu(gate) * up
        if weights is not None:
            h = h * weights
        return self.w2(h.to(x.dtype))

    # -- the routed experts of a layer at once (AutoRound's batched solve) ---------------------
    #: the projections grouped_forward takes stacked, in the order it applies them
    GROUPED_PROJECTIONS = ("w1", "w3", "w2")

    @staticmethod
    def grouped_forward_blocker(members: list["QuantV4Expert"]) -> str | None:
        """Why :meth:`grouped_forward` would NOT compute each member's own forward, or None.

        It reproduces the members row for row only when every input quantizer treats a row on
        its own (off, identity, dynamic per-token / per-group: a padding row of zeros stays
        zero and changes no other row's scale) and all members share their specs, clamp and
        layout (no bias)."""
        first = members[0]
        for m in members:
            if type(m) is not type(first):
                return f"mixed expert classes ({type(first).__name__}, {type(m).__name__})"
            if m.swiglu_limit != first.swiglu_limit:
                return f"swiglu_limit differs ({first.swiglu_limit} vs {m.swiglu_limit})"
            for name in QuantV4Expert.GROUPED_PROJECTIONS:
                lin, ref = getattr(m, name), getattr(first, name)
                if lin.bias is not None:
                    return f"{name} has a bias"
                q, q0 = lin.input_quantizer, ref.input_quantizer
                row_local = (q.mode == "off" or q.is_identity
                             or (q.spec.dynamic and q.spec.granularity in ("token", "group")))
                if not row_local:
                    return f"{name}'s input quantizer ({q.spec.granularity}, dynamic={q.spec.dynamic}) is not per row"
                if (q.mode, q.spec) != (q0.mode, q0.spec):
                    return f"{name}'s input quantizers differ between experts"
        return None

    @staticmethod
    def grouped_forward(members: list["QuantV4Expert"], x: torch.Tensor, weights: torch.Tensor | None,
                        w: dict[str, torch.Tensor], taps: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """Every member's forward at once, on given (fake-quant) weights.

        x [E, T, D] (member e's rows; zero rows pad), weights [E, T, 1] fp32 or None,
        w {"w1": [E, I, D], "w3": [E, I, D], "w2": [E, D, I]} -> [E, T, D]. The math of
        :meth:`forward` (clamp-then-silu, the per-channel up limit, the routing weight before
        w2), batched with bmm; valid only where :meth:`grouped_forward_blocker` is None.
        ``taps``: filled with each projection's input before its input quantizer ([E, T, in],
        what a forward pre-hook on the member's projection sees; clipping's channel statistics)."""
        m0 = members[0]

        def quant_in(name: str, a: torch.Tensor) -> torch.Tensor:   # the members' shared row-wise quantizer
            return getattr(m0, name).input_quantizer(a.reshape(-1, a.shape[-1])).reshape(a.shape)

        if taps is not None:
            taps["w1"] = taps["w3"] = x
        gate = torch.bmm(quant_in("w1", x), w["w1"].transpose(1, 2)).float()        # [E, T, I]
        up = torch.bmm(quant_in("w3", x), w["w3"].transpose(1, 2)).float()
        limit = m0.swiglu_limit
        if any(m.up_limit is not None for m in members):
            # members without a per-channel limit clamp at the scalar one: the same numbers
            lim = torch.stack([m.up_limit.to(up.device) if m.up_limit is not None else
                               torch.full((up.shape[-1],), float(limit), dtype=torch.float32, device=up.device)
                               for m in members]).unsqueeze(1)                          # [E, 1, I]
            up = torch.minimum(torch.maximum(up, -lim), lim)
            gate = gate.clamp(max=limit)
        elif limit > 0:
            up = up.clamp(-limit, limit)
            gate = gate.clamp(max=limit)
        h = torch.nn.functional.silu(gate) * up
        if weights is not None:
            h = h * weights
        h = h.to(x.dtype)
        if taps is not None:
            taps["w2"] = h
        return torch.bmm(quant_in("w2", h), w["w2"].transpose(1, 2))   # [E, T, D]

    @torch.no_grad()
    def scale_up_limit(self, s: torch.Tensor) -> None:
        """w3's rows were divided by ``s``: divide the up clamp limit per channel alike."""
        if self.swiglu_limit <= 0:
            return  # no clamp: scaling w3 rows is exact as it is
        base = self.up_limit if self.up_limit is not None else torch.full(
            (self.w3.out_features,), float(self.swiglu_limit), dtype=torch.float32, device=s.device)
        self.up_limit = base.to(s.device) / s.float()
        self.w3.invalidate_cache()  # bumps QuantLinear.generation: the MoE re-plans its path

    def extra_ptq_params(self) -> dict[str, torch.Tensor]:
        return {} if self.up_limit is None else {"up_limit": self.up_limit}

    def snapshot_extra_state(self):
        base = super().snapshot_extra_state()
        limit = None if self.up_limit is None else self.up_limit.clone()

        def restore() -> None:
            base()
            self.up_limit = limit
            self.w3.invalidate_cache()
        return restore

    def smoothing_subgraphs(self) -> list[SmoothPair]:
        """w3 (its rows, with the per-channel clamp limit) -> w2's input columns. ffn_norm ->
        w1 / w3 is not a pair: the routers read the same normed hidden state."""
        return [SmoothPair("w3", ["w2"], producer="w3", producer_kind="up_rows", stat_module="w2")]

    def load_extra_ptq_params(self, params: dict[str, torch.Tensor]) -> None:
        if "up_limit" not in params:
            return
        value = params.pop("up_limit")
        if tuple(value.shape) != (self.w3.out_features,) or not bool(torch.isfinite(value).all() & (value > 0).all()):
            raise QuantConfigError(f"up_limit must be finite, positive and of shape ({self.w3.out_features},), "
                                   f"got shape {tuple(value.shape)}")
        if self.swiglu_limit <= 0:
            raise QuantConfigError("up_limit given for an expert without a SwiGLU clamp (swiglu_limit 0)")
        self.up_limit = value.detach().float().to(self.w3.weight.device).clone()
        self.w3.invalidate_cache()


class QuantV4MoE(MoE):
    """The float MoE (same forward, same routing) whose grouped-GEMM path also serves fake-quant
    experts: the experts' cached fake-quant weights are stacked once, and the per-token input
    quantization runs over all sorted rows at once -- the same numbers as each expert quantizing
    its own rows, because per-token scales depend on the row alone. Other input specs (static or
    per-tensor scales differ per expert) take the per-expert loop.

    The decision and the stacks form a plan, rebuilt only when some QuantLinear invalidated its
    cache (``QuantLinear.generation``: clip loaded or learned, quantizers switched, module moved)
    or the expert list changed -- not on every forward (256 experts x 3 checks cost milliseconds
    of host time)."""

    _plan: tuple | None = None

    @classmethod
    def from_float(cls, moe: MoE) -> "QuantV4MoE":
        q = _rebind(cls, moe)
        q._plan = None
        return q

    def _current_plan(self, flat: torch.Tensor) -> tuple:
        """(generation, experts list, quantized?, groupable?, stacks or None, smoothed?, chunks or
        None: the expert ranges the fake-quant weights are made in when the stacks do not fit)."""
        plan = self._plan
        if plan is not None and plan[0] == QuantLinear.generation and plan[1] is self.experts:
            return plan
        experts = list(self.experts)
        quantized = any(getattr(e, "quantized", False) for e in experts)
        # per-channel up limits (w3 -> w2 smoothing): the grouped kernels clamp with one scalar
        smoothed = any(getattr(e, "up_limit", None) is not None for e in experts)
        stacks, groupable, chunks = None, False, None
        if quantized and not smoothed and all(isinstance(e, QuantV4Expert) and e.quantized for e in experts):
            w = experts[0].w1.weight
            groupable = _grouped_mm_supported(w) and all(
                _row_wise(getattr(e, proj).input_quantizer.spec)
                and getattr(e, proj).input_quantizer.spec == getattr(experts[0], proj).input_quantizer.spec
                for e in experts for proj in ("w1", "w3", "w2"))
            groupable = groupable and experts[0].w1.input_quantizer.spec == experts[0].w3.input_quantizer.spec
            if groupable:
                stacks = self._on_grid_stacks(experts)
                if stacks is None:
                    chunks = self._fake_quant_chunks(experts)
                    stacks = _fake_quant_stacks(experts) if chunks is None else None
        self._plan = (QuantLinear.generation, self.experts, quantized, groupable, stacks, smoothed, chunks)
        return self._plan

    def _on_grid_stacks(self, experts) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The packed weight stacks themselves, where they back every expert and every weight is
        its own fake-quant value (``QuantLinear.weight_on_grid``: folded into fixed grids by the
        turns, checked bit for bit): no copy and no fake-quant pass (a V4-Pro layer's propagate
        remade 47 GiB of them every forward, casebook i34-15). Else None."""
        if not all(getattr(e, p).weight_on_grid() for e in experts for p in ("w1", "w3", "w2")):
            return None
        return self.packed_backing()

    #: the share of the device's memory the experts' fake-quant stacks may take at once; above it
    #: they are made a chunk of experts at a time, every forward (a V4-Pro layer's are 47 GiB
    #: beside its 53 GiB of weights). None on the CPU (no device budget)
    STACK_SHARE = 0.25
    #: a chunk's fake-quant weights (bytes) where the stacks do not fit
    CHUNK_BYTES = 2 << 30

    def _fake_quant_chunks(self, experts) -> list[tuple[int, int]] | None:
        """None where the fake-quant stacks of all experts fit ``stack_budget_bytes`` (made once
        and kept), else the expert ranges of the chunks they are made in."""
        w1, w2 = experts[0].w1.weight, experts[0].w2.weight
        per_expert = (2 * w1.numel() + w2.numel()) * w1.element_size()
        budget = self.stack_budget_bytes(w1.device)
        if budget is None or per_expert * len(experts) <= budget:
            return None
        return chunk_bounds(len(experts), per_expert, min(self.CHUNK_BYTES, budget))

    def stack_budget_bytes(self, device: torch.device) -> int | None:
        total = devmod.total_memory_bytes(device)
        return None if total is None else int(total * self.STACK_SHARE)

    def _can_group_quant(self, flat: torch.Tensor) -> bool:
        if not self.grouped:
            return False
        _, _, quantized, groupable, stacks, smoothed, _ = self._current_plan(flat)
        if not quantized:
            return not smoothed and super()._can_group(flat)
        if torch.is_grad_enabled():
            return False  # the stacked fake-quant weights are detached: gradients need the loop
        where = stacks[0].device if stacks is not None else self.experts[0].w1.weight.device
        return groupable and where == flat.device

    def grouped_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._plan
        return plan[4] if plan is not None and plan[2] else super().grouped_weights()

    def grouped_chunks(self):
        plan = self._plan
        if plan is None or not plan[2] or plan[6] is None:
            return None
        experts = list(self.experts)
        return [(e0, e1, functools.partial(_fake_quant_stacks, experts[e0:e1])) for e0, e1 in plan[6]]

    def grouped_rows(self, rows: torch.Tensor, projection: str) -> torch.Tensor:
        plan = self._plan
        if plan is None or not plan[2]:
            return rows
        return getattr(self.experts[0], projection).input_quantizer(rows)

    def _apply(self, fn, *args, **kwargs):
        self._plan = None
        return super()._apply(fn, *args, **kwargs)

    # -- block-wise rounding: the routed experts' learnable state, stacked ---------------------
    #: (w13 stack, w2 stack, the chunks run without checkpointing) while block-wise rounding
    #: tunes the experts, else None
    _leaf_stacks: tuple | None = None

    def attach_leaf_stacks(self, learn_clip: bool, clip_min: float, chunk_bytes: int, recompute: bool,
                           offset_dtype: torch.dtype = torch.float32, step: SignStep | None = None,
                           hold_bytes: int = 0) -> list[LeafStack]:
        """Stack the routed experts' rounding offsets (and clips) chunk by chunk, every leaf's own
        state a view into its chunk, and route through :meth:`route_stacked` until
        :meth:`detach_leaf_stacks`. [] (nothing changed) where the experts cannot be stacked:
        per-channel up limits, input quantizers that are not per row, mixed or non-integer specs.

        ``recompute``: each chunk under activation checkpointing, except the first chunks whose
        fake-quant weights fit ``hold_bytes`` together: those keep their intermediates for the
        backward (no second fake-quant forward, no second GEMM; the same numbers)."""
        if not self._stackable():
            return []
        experts = list(self.experts)
        turns = self._turns
        if turns is not None:   # the current turn's experts, on the device while it lasts
            e0, e1 = turns.current
            experts = experts[e0:e1]
            w13, w2 = turns.device_stacks
        else:
            w13, w2 = self._packed_quant_weights()
        inter = w2.shape[-1]
        s13 = stack_leaves(w13, [StackMember(e.w1, k, (0, inter)) for k, e in enumerate(experts)]
                           + [StackMember(e.w3, k, (inter, 2 * inter)) for k, e in enumerate(experts)])
        s2 = stack_leaves(w2, [StackMember(e.w2, k, (0, w2.shape[1])) for k, e in enumerate(experts)])
        if s13 is None or s2 is None:
            return []
        # one expert's offsets (float32) in both stacks: the two stacks share their chunks
        item = torch.empty((), dtype=offset_dtype).element_size()
        bounds = chunk_bounds(len(experts), (w13[0].numel() + w2[0].numel()) * item, chunk_bytes)
        s13.bind(learn_clip, clip_min, bounds, offset_dtype, step)
        s2.bind(learn_clip, clip_min, bounds, offset_dtype, step)
        for e in experts:
            for lin in (e.w1, e.w3, e.w2):
                lin.invalidate_cache()
        held = held_chunks(bounds, (w13[0].numel() + w2[0].numel()) * w13.element_size(), hold_bytes) \
            if recompute else frozenset(range(len(bounds)))
        self._leaf_stacks = (s13, s2, held)
        return [s13, s2]

    def detach_leaf_stacks(self) -> None:
        """Back to the usual paths (or, between turns, to every expert from its codes); the
        leaves keep their (view) state."""
        self._leaf_stacks = None if self._turns is None else (None, None, frozenset())
        self._plan = None

    def _stackable(self) -> bool:
        """The routed experts can be tuned through stacked state (and in turns)."""
        experts = list(self.experts)
        if not experts or not all(isinstance(e, QuantV4Expert) for e in experts):
            return False
        if QuantV4Expert.grouped_forward_blocker(experts) is not None or any(e.up_limit is not None for e in experts):
            return False
        first = experts[0]
        return (first.w1.input_quantizer.spec == first.w3.input_quantizer.spec
                and all(stackable(getattr(e, p).weight_quantizer.spec) and getattr(e, p).weight_quantizer.roundable
                        for e in experts for p in ("w1", "w3", "w2")))

    # -- block-wise rounding in turns (expert_turns.py): where the experts do not fit at once --
    _turns: ExpertTurns | None = None
    #: the decoded weights of one chunk of experts outside the turn (bytes)
    FROZEN_CHUNK_BYTES = 1 << 29

    def leaf_turn_bytes(self, offset_dtype: torch.dtype) -> int:
        """What tuning every routed expert at once holds on the device: the float weights and
        their offsets (0 where the experts cannot be stacked)."""
        if not self._stackable():
            return 0
        n = sum(getattr(e, p).weight.numel() for e in self.experts for p in ("w1", "w3", "w2"))
        return n * (self.experts[0].w1.weight.element_size() + offset_dtype.itemsize)

    def turn_leaves(self) -> list[nn.Module]:
        """The leaves tuned in turns: every routed expert's projections."""
        return [getattr(e, p) for e in self.experts for p in ("w1", "w3", "w2")]

    def turn_current(self) -> tuple[int, int] | None:
        return None if self._turns is None else self._turns.current

    def abort_leaf_turns(self) -> None:
        """After an error: every expert back on the device as it began (no-op outside turns)."""
        turns, self._turns = self._turns, None
        if turns is not None:
            self._leaf_stacks, self._plan = None, None
            turns.abort()

    def begin_leaf_turns(self, n_turns: int) -> int:
        """Codes of every expert; their float weights to the host; returns the turns."""
        self._turns = ExpertTurns(self, n_turns, self.FROZEN_CHUNK_BYTES)
        self._leaf_stacks = (None, None, frozenset())   # every expert from its codes until a turn begins
        self._plan = None
        return len(self._turns.turns)

    def parked_bytes(self) -> int:
        """Host bytes the experts' float weights take while they wait for their turns."""
        return self._turns.host13.nbytes() + self._turns.host2.nbytes()

    def begin_leaf_turn(self, j: int) -> tuple[int, int]:
        return self._turns.begin(j)

    def end_leaf_turn(self) -> None:
        self._turns.end()

    def end_leaf_turns(self, keep: bool) -> dict[int, tuple[int, bool]]:
        """Every weight back on the device (folded into its grid with ``keep``); {id(leaf):
        (offsets moved off zero in its expert, folded)} for the unit results."""
        turns, self._turns = self._turns, None
        self._leaf_stacks, self._plan = None, None
        moved = list(turns.moved)
        leaves = [(e, lin) for e, lin, _, _ in turns.leaves()]
        turns.finish(keep)
        return {id(lin): (moved[e], keep) for e, lin in leaves}

    def _packed_quant_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, D], w2 [E, D, I]) that every expert's weights are views of: the float
        MoE's packed stacks when they still back the experts, else packed now (the weights
        copied into new stacks, each leaf's Parameter rebound to its view)."""
        backed = self.packed_backing()
        if backed is not None:
            return backed
        w1 = self.experts[0].w1.weight
        w13, w2 = self._new_stacks(w1.dtype, w1.device)
        with torch.no_grad():
            self._bind_stacks(w13, w2, copy=True)
        for e in self.experts:
            for lin in (e.w1, e.w3, e.w2):
                lin.invalidate_cache()
        return w13, w2

    def _can_group(self, flat: torch.Tensor) -> bool:
        return self._leaf_stacks is None and self._can_group_quant(flat)

    def route(self, flat: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        if self._leaf_stacks is not None:
            return self.route_stacked(flat, weights, indices)
        return super().route(flat, weights, indices)

    def route_stacked(self, flat: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """``route`` + every expert's forward, the experts chunk by chunk from the stacked
        learnable state: per chunk, the fake-quant weights by one op and the projections by
        grouped GEMMs (under autograd: recomputed in the backward, with ``recompute``). Each
        token sums its k rows in expert order, as ``route`` does."""
        slots = indices.flatten()
        order = slots.argsort(stable=True)
        counts = torch.bincount(slots, minlength=self.n_routed_experts).tolist()   # one host sync
        token_of_row = order // indices.shape[1]
        xs = self.experts[0].w1.input_quantizer(flat[token_of_row])
        slot_weights = weights.flatten()[order].unsqueeze(-1)
        ys, start = [], 0
        for e0, e1, run, recompute in self._segments():
            n = sum(counts[e0:e1])
            if n == 0:
                continue
            run = functools.partial(run, counts[e0:e1])
            rows, rw = xs[start:start + n], slot_weights[start:start + n]
            if recompute and torch.is_grad_enabled():
                ys.append(checkpoint(run, rows, rw, use_reentrant=False))
            else:
                ys.append(run(rows, rw))
            start += n
        y = torch.cat(ys)
        # fp32 sums in expert order, as route and route_grouped; its own backward (one gather)
        return combine_slots(y, slot_rows(order, indices.shape[1]), token_of_row)

    def _segments(self):
        """(e0, e1, run(counts, rows, slot weights), recomputed under autograd?) for every range
        of experts in order: the stacks' chunks; in turns, the current turn's chunks between the
        chunks of experts decoded from their codes (always recomputed: held, their decoded
        weights would add up to the float stacks the turns keep off the device)."""
        s13, _, held = self._leaf_stacks
        tuned, base = [], 0
        if s13 is not None:
            base = 0 if self._turns is None else self._turns.current[0]
            tuned = [(base + e0, base + e1, functools.partial(self._stacked_chunk, k), k not in held)
                     for k, (e0, e1) in enumerate(s13.bounds)]
        if self._turns is None:
            return tuned
        lo, hi = (tuned[0][0], tuned[-1][1]) if tuned else (0, 0)
        frozen = []
        for f0, f1 in self._turns.frozen_bounds:   # the frozen ranges, cut around the turn
            for a, b in ((f0, min(f1, lo)), (max(f0, hi), f1)):
                if a < b:
                    frozen.append((a, b, functools.partial(self._frozen_chunk, a, b), True))
        return sorted(frozen + tuned, key=lambda seg: seg[0])

    def _frozen_chunk(self, e0: int, e1: int, counts: list[int], x: torch.Tensor,
                      slot_weights: torch.Tensor) -> torch.Tensor:
        """Experts e0:e1 outside the turn at their current fake-quant weights (from the codes)."""
        t = self._turns
        return self._expert_rows(x, slot_weights, counts, lambda: t.codes13.decode(e0, e1, t.dtype),
                                 lambda: t.codes2.decode(e0, e1, t.dtype))

    def _stacked_chunk(self, k: int, counts: list[int], x: torch.Tensor, slot_weights: torch.Tensor) -> torch.Tensor:
        """Chunk k's experts on their rows ``x`` (sorted, ``counts`` per expert): Expert.forward's math."""
        s13, s2, _ = self._leaf_stacks
        return self._expert_rows(x, slot_weights, counts, lambda: s13.fake_quant(k), lambda: s2.fake_quant(k))

    def _expert_rows(self, x, slot_weights, counts, w13_of, w2_of) -> torch.Tensor:
        """Expert.forward's math on sorted rows, grouped: ``w13_of()`` / ``w2_of()`` give the
        weights, each made only when its GEMM runs (the first can be freed before the second)."""
        m0 = self.experts[0]
        h = grouped_linear(x, w13_of(), counts)                                 # [n, 2I]
        inter = h.shape[-1] // 2
        gate, up = h[:, :inter].float(), h[:, inter:].float()
        limit = m0.swiglu_limit
        if limit > 0:
            up = up.clamp(-limit, limit)
            gate = gate.clamp(max=limit)
        h = (torch.nn.functional.silu(gate) * up * slot_weights).to(x.dtype)
        return grouped_linear(m0.w2.input_quantizer(h), w2_of(), counts)


@torch.no_grad()
def _fake_quant_stacks(experts) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, D], w2 [E, D, I]): every expert's fake-quant weights, the values
    ``quantized_weight()`` returns, written one expert at a time into stacks allocated once.
    Neither through the leaves' caches nor through ``torch.stack`` of a list: either holds a
    second copy of all of them, 12.3 GiB on a V4-Flash layer (casebook i24-br3)."""
    w1 = experts[0].w1.weight
    inter, dim = w1.shape
    w13 = torch.empty(len(experts), 2 * inter, dim, dtype=w1.dtype, device=w1.device)
    w2 = torch.empty(len(experts), dim, inter, dtype=w1.dtype, device=w1.device)
    for k, e in enumerate(experts):
        w13[k, :inter].copy_(e.w1.weight_quantizer(e.w1.weight))
        w13[k, inter:].copy_(e.w3.weight_quantizer(e.w3.weight))
        w2[k].copy_(e.w2.weight_quantizer(e.w2.weight))
    return w13, w2


def _row_wise(spec) -> bool:
    """Input specs whose scales depend on the row alone (or no quantization at all)."""
    return spec is None or (spec.dynamic and (spec.granularity in ("token", "group") or spec.format in ("mxfp8", "mxfp4")))


# ------------------------------------------------------------------------- block-level API
def quantize_block(block: Block, scheme: QuantScheme, targets: list[str] | str) -> Block:
    """Wrap ``block`` in place for ``targets`` and return it. Parameters are shared, never cast.

    Activation quantizers start in 'quant' mode for dynamic specs and 'observe' for static ones
    (those need a calibration pass, then ``set_activation_mode(block, 'quant')``)."""
    targets = parse_targets(targets)
    scheme.check_targets(targets)
    if any(t in targets for t in ATTN_TARGETS):
        if isinstance(block.attn, QuantV4Attention):
            raise QuantConfigError(f"layer {block.layer_id}: attention is already quantized")
        block.attn = QuantV4Attention.from_float(block.attn, scheme, targets)
        block.attn.set_input_norm(block.attn_norm)
    if "moe" in targets:
        ts = scheme.target("moe")
        wspec, aspec = (ts.weight, ts.input) if ts is not None else (None, None)
        ffn = block.ffn
        if any(isinstance(e, QuantV4Expert) for e in ffn.experts):
            raise QuantConfigError(f"layer {block.layer_id}: experts are already quantized")
        ffn = block.ffn = QuantV4MoE.from_float(ffn)
        ffn.experts = nn.ModuleList(QuantV4Expert(e, wspec, aspec) for e in ffn.experts)
        if ffn.shared_experts is not None:
            ffn.shared_experts = QuantV4Expert(ffn.shared_experts, wspec, aspec)
    for module in block.modules():
        if isinstance(module, ActivationQuantizer) and not module.is_identity:
            module.mode = "observe" if module.is_static else "quant"
    # new wrapper modules start in training mode; an eval block must stay eval (QuantLinear caches
    # its fake-quant weight only in eval mode -- otherwise every forward re-quantizes every weight)
    return block.train(block.training)


def iter_block_ptq_units(block: Block, layer_idx: int, targets: list[str] | str) -> Iterator[PtqUnit]:
    """attn-linear / attn-cache: one 'attn' unit; moe: one unit per routed expert + the shared one."""
    targets = parse_targets(targets)
    prefix = f"layers.{layer_idx}"
    # ``reads``: the tensor a unit reads (ptq_units.parallel_groups): the routed and the shared
    # experts all read the FFN's input, so none feeds another
    if any(t in targets for t in ATTN_TARGETS):
        yield make_ptq_unit("attn", f"{prefix}.attn", layer_idx, block.attn, ratio=block.attn.ratio,
                            reads="attn_input")
    if "moe" in targets:
        for u in iter_indexed_units("expert", f"{prefix}.ffn.experts", layer_idx, block.ffn.experts, "expert_idx"):
            u.metadata["reads"] = "ffn_input"
            yield u
        if block.ffn.shared_experts is not None:
            yield make_ptq_unit("shared_expert", f"{prefix}.ffn.shared_experts", layer_idx, block.ffn.shared_experts,
                                reads="ffn_input")


def set_quant_enabled(module: nn.Module, enabled: bool) -> None:
    """Switch every quantized leaf inside ``module`` off (bit-identical float math) or on."""
    for leaf in module.modules():
        if isinstance(leaf, QUANT_LEAVES):
            leaf.enabled = enabled
            if isinstance(leaf, QuantLinear):
                leaf.invalidate_cache()


def set_activation_mode(module: nn.Module, mode: str) -> None:
    """'off' | 'observe' | 'quant' for every non-identity activation quantizer inside ``module``."""
    for leaf in module.modules():
        if isinstance(leaf, ActivationQuantizer) and not leaf.is_identity:
            leaf.mode = mode


def count_quant_modules(module: nn.Module) -> dict[str, int]:
    """How many QuantLinear / ActivationQuantizer / QuantMatmul / WoAQuant a module holds."""
    counts = collections.Counter(type(m).__name__ for m in module.modules())
    return {name: counts.get(name, 0) for name in ("QuantLinear", "ActivationQuantizer", "QuantMatmul", "WoAQuant")}
