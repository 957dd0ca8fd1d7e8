"""The model contract of amct_ext/base.py is the whole of what the framework asks of a model:
every adapter attribute amct_ext/ reads is declared on BaseModel (no `getattr(adapter, ...)`
probing of undeclared hooks), every binding attribute on ModelBinding; DeepSeek-V4 fulfils the
declared unit hooks (GatedProjections, SmoothableUnit) and declares its smoothing pairs."""
import ast

import torch

from amct_ext.base import BaseModel, GatedProjections, ModelBinding, SmoothableUnit, known_smoothing_pairs
from tests.conftest import REPO

PKG = REPO / "amct_ext"
#: instance attributes BaseModel.__init__ sets
BASE_INSTANCE = {"run", "model_path", "device", "sample_state"}


def _receiver(node: ast.Attribute) -> str | None:
    """'adapter' for ``adapter.x`` and ``self.adapter.x``; 'binding' likewise."""
    v = node.value
    if isinstance(v, ast.Name):
        return v.id
    if isinstance(v, ast.Attribute):
        return v.attr
    return None


def test_every_adapter_and_binding_attribute_the_framework_reads_is_declared():
    declared = {"adapter": set(dir(BaseModel)) | BASE_INSTANCE, "binding": set(dir(ModelBinding))}
    undeclared, probes = [], []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(REPO)
        for n in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(n, ast.Attribute) and _receiver(n) in declared and n.attr not in declared[_receiver(n)]:
                undeclared.append(f"{rel}:{n.lineno} {_receiver(n)}.{n.attr}")
            if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")
                    and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id in declared):
                probes.append(f"{rel}:{n.lineno} {n.func.id}({n.args[0].id}, ...)")
    assert undeclared == [], "declare these hooks on BaseModel / ModelBinding (amct_ext/base.py)"
    assert probes == [], "an undeclared hook probed with getattr / hasattr: declare it with a default"


def test_the_optional_hooks_have_defaults_a_model_without_them_gets():
    class Bare(BaseModel):          # only the abstract hooks
        num_layers = 3

        def empty_weights_model(self): ...
        def load_embed_state_dict(self): ...
        def block(self, layer_idx, sharded=False, device=None): ...
        def do_embedding_forward(self, samples): ...
        def do_head_forward(self, hidden): ...
        def iter_ptq_units(self, block, layer_idx, targets): ...
        def quantize_block(self, block, scheme, targets): ...
        def set_quant_enabled(self, module, enabled): ...

    from amct_ext.base import RunConfig

    bare = Bare(RunConfig("some/ckpt", device="cpu", progress=False))
    assert bare.max_seq_len is None and bare.mtp_layer_ids() == [] and bare.layer_name(2) == "layers.2"
    assert bare.model_id() == {"name": "some/ckpt"}
    assert bare.extra_layers == "" and ModelBinding.extra_layers == "" and ModelBinding.gated_projections == {}
    assert ModelBinding.build_extra_layer(None, None, None, 0, torch.float32, torch.device("cpu")) is None


def test_v4_fulfils_the_unit_hooks_and_declares_its_pairs(tiny_adapter):
    import models.deepseek_v4  # noqa: F401  (registers the binding)
    from amct_ext.quant.schemes import load_scheme
    from models.deepseek_v4.binding import V4_BINDING

    assert tiny_adapter.layer_name(1) == "layers.1"
    assert tiny_adapter.layer_name(tiny_adapter.num_layers) == "mtp.0"
    # the extra layers' name is the prefix of layer_name's extra layers, the same for adapter and binding
    assert tiny_adapter.extra_layers == V4_BINDING.extra_layers == "mtp"
    assert tiny_adapter.max_seq_len > 0
    names, experts = [], 0
    for i in range(tiny_adapter.num_layers):
        block = tiny_adapter.quantize_block(tiny_adapter.block(i), load_scheme("w8a8"), ["attn-linear", "moe"])
        for u in tiny_adapter.iter_ptq_units(block, i, ["attn-linear", "moe"]):
            assert isinstance(u.module, SmoothableUnit), u.name
            names += [p.name for p in u.module.smoothing_subgraphs()]
            if isinstance(u.module, GatedProjections):
                experts += 1
                roles = u.module.PROJECTIONS
                assert set(roles) == {"gate", "up", "down"}
                assert all(u.module.projection(r) is getattr(u.module, roles[r]) for r in roles)
                assert roles == V4_BINDING.gated_projections     # the export's leaf names agree
        tiny_adapter.release_block(block)
    assert experts > 0
    # the names a recipe may give are exactly those the units offer
    assert set(names) == set(V4_BINDING.smoothing_pairs)
    assert set(V4_BINDING.smoothing_pairs) <= set(known_smoothing_pairs())


def test_an_undeclared_mtp_hook_is_one_contract_error():
    """A port listing MTP layers without their hooks gets one line naming the model and the hook
    (a ModelContractError, not a bare NotImplementedError)."""
    import pytest
    import torch

    from amct_ext.base import BaseModel
    from amct_ext.errors import ModelContractError

    class HalfPort:
        def mtp_layer_ids(self):
            return [4]

    with pytest.raises(ModelContractError, match=r"HalfPort\.mtp_logits: not implemented, but the model lists MTP layers \[4\]"):
        BaseModel.mtp_logits(HalfPort(), 4, torch.zeros(1))
    with pytest.raises(ModelContractError, match=r"HalfPort\.mtp_block_inputs"):
        BaseModel.mtp_block_inputs(HalfPort(), 4, [], [])
