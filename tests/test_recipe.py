"""Recipes: --algo / --recipe parsing, the registry, clear errors; the rtn algorithm."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from amct_ext.algorithms import SolveContext, UnitData
from amct_ext.algorithms.base import Algorithm
from amct_ext.algorithms.recipe import (RecipeError, algorithm_class, load_recipe_file, parse_algo, register,
                                        resolve_recipe)
from amct_ext.pipeline.capture import UnitCall
from amct_ext.errors import ConfigError
from amct_ext.pipeline.ptq_units import make_ptq_unit
from amct_ext.quant.quant_linear import QuantLinear
from amct_ext.quant.schemes import TensorSpec


@register
@dataclass
class _Toy(Algorithm):
    name: ClassVar[str] = "toy-test"
    steps: int = 3
    rate: float = 0.5
    flag: bool = False
    mode: str = "a"

    def check(self) -> None:
        if self.steps < 0:
            raise ConfigError("steps must be >= 0")

    def apply(self, unit, data, ctx):
        return {"steps": self.steps}


def test_parse_algo_list_and_options():
    r = parse_algo("rtn,toy-test:steps=7:rate=1:flag=true:mode=xyz")
    assert r.names == ["rtn", "toy-test"]
    toy = r.algorithms[1]
    assert (toy.steps, toy.rate, toy.flag, toy.mode) == (7, 1.0, True, "xyz")
    assert isinstance(toy.rate, float)
    assert r.settings()[1] == {"name": "toy-test", "steps": 7, "rate": 1.0, "flag": True, "mode": "xyz"}


@pytest.mark.parametrize("spec, needle", [
    ("nope", "unknown algorithm 'nope'"),
    ("toy-test:colour=red", "has no field 'colour'"),
    ("toy-test:steps=1.5", "toy-test.steps = 1.5"),
    ("toy-test:flag=1", "toy-test.flag = 1"),
    ("toy-test:steps", "must be key=value"),
    ("rtn,,toy-test", "entry 1 is empty"),
    ("toy-test:steps=-1", "steps must be >= 0"),
    ("", "empty algorithm list"),
])
def test_parse_algo_errors(spec, needle):
    with pytest.raises(RecipeError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        parse_algo(spec)


def test_recipe_file_json(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"recipe": [{"algo": "toy-test", "steps": 2}, "rtn"]}))
    r = load_recipe_file(p)
    assert r.names == ["toy-test", "rtn"] and r.algorithms[0].steps == 2
    p.write_text(json.dumps([{"algo": "toy-test", "bogus": 1}]))
    with pytest.raises(RecipeError, match=r"r\.json entry 0 \(toy-test\).*no field 'bogus'"):
        load_recipe_file(p)
    p.write_text("{not json")
    with pytest.raises(RecipeError, match="invalid JSON"):
        load_recipe_file(p)
    p.write_text(json.dumps({"recipes": []}))
    with pytest.raises(RecipeError, match="unknown top-level key"):
        load_recipe_file(p)
    with pytest.raises(RecipeError, match="not found"):
        load_recipe_file(tmp_path / "missing.json")


def test_recipe_file_yaml(tmp_path):
    yaml = pytest.importorskip("yaml")  # YAML recipes exist only with PyYAML
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump({"recipe": [{"algo": "toy-test", "flag": True}]}))
    assert load_recipe_file(p).algorithms[0].flag is True


def test_resolve_recipe_precedence(tmp_path):
    assert resolve_recipe(None, None, default="rtn").names == ["rtn"]
    assert resolve_recipe("toy-test", None, default="rtn").names == ["toy-test"]
    with pytest.raises(RecipeError, match="not both"):
        resolve_recipe("rtn", tmp_path / "x.json")


def test_register_refuses_duplicates():
    with pytest.raises(TypeError, match="registered twice"):
        @register
        @dataclass
        class _Other(Algorithm):
            name: ClassVar[str] = "toy-test"
    assert algorithm_class("toy-test") is _Toy


def test_split_is_deterministic_and_disjoint():
    calls = list(range(10))
    train, held = SolveContext(holdout=0.25).split(calls)
    assert train == list(range(7)) and held == [7, 8, 9]
    assert SolveContext(holdout=0.0).split(calls) == (calls, [])
    assert SolveContext(holdout=0.5).split([1]) == ([1], [])


def test_rtn_reports_the_rtn_loss_and_changes_nothing():
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8, bias=False)
    q = QuantLinear.from_linear(lin, TensorSpec("int", 4, True, "channel"))
    x = torch.randn(5, 16)
    data = UnitData([UnitCall((x,), {}, lin(x).detach())])
    unit = make_ptq_unit("attn", "layers.0.attn", 0, q)
    before = lin.weight.detach().clone()
    stats = parse_algo("rtn").algorithms[0].apply(unit, data, SolveContext())
    with torch.no_grad():
        ref = (torch.nn.functional.linear(x, q.weight_quantizer(lin.weight)) - lin(x)).square().mean()
    assert stats["loss"] == pytest.approx(float(ref), rel=1e-6)
    assert torch.equal(lin.weight, before)


def test_unit_data_map_inputs_keeps_targets():
    out = torch.ones(2)
    d = UnitData([UnitCall((torch.zeros(2),), {"w": 1}, out)])
    d.map_inputs(lambda a, k: ((a[0] + 3,), k))
    assert torch.equal(d.calls[0].args[0], torch.full((2,), 3.0)) and d.calls[0].output is out


def test_cli_refuses_bad_recipes_before_any_work(tmp_path, capsys):
    from tools import run_ptq

    out = tmp_path / "out"
    for argv, needle in ((["--algo", "gptq,nope"], "unknown algorithm 'nope'"),
                         (["--algo", "gptq:act_ordr=true"], "has no field 'act_ordr'"),
                         (["--algo", "gptq", "--recipe", str(tmp_path / "r.json")], "not both"),
                         (["--recipe", str(tmp_path / "missing.json")], "not found"),
                         (["--legacy-solver", "--algo", "gptq"], "--legacy-solver")):
        code = run_ptq.main(["--model", "tiny-trained", "--output-dir", str(out), "--quiet", *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err[-1].startswith("error: ") and needle in err[-1], err
    assert not out.exists()


def test_every_builtin_scheme_has_a_default_recipe():
    from amct_ext.algorithms.recipe import DEFAULT_RECIPES, default_recipe
    from amct_ext.quant.schemes import builtin_schemes

    assert set(builtin_schemes()) <= set(DEFAULT_RECIPES)
    for name in builtin_schemes():
        algo, prop = default_recipe(name)
        assert prop in ("float", "quant")
        parse_algo(algo)       # every default parses (its algorithms are registered)


@pytest.mark.usefixtures("one_thread")
def test_recipe_run_resumes_bit_identically_with_quant_propagation(tiny_adapter, tmp_path):
    """gptq with propagate=quant: an interrupted run (mid-layer, mid-experts) resumed equals an
    uninterrupted one file for file (the resumed layers' units are reloaded so that later
    layers see the same quantized inputs)."""
    from amct_ext.base import PtqConfig
    from amct_ext.io.io_utils import safe_torch_load
    from amct_ext.quant.schemes import load_scheme
    from amct_ext.pipeline.ptq_spec import PtqSpec
    from amct_ext.pipeline.workflow import PARAMS_DIR, PtqRuntime, load_calib_windows, run_blockwise_ptq

    cfg = PtqConfig(n_samples=2, seq_len=32, batch_size=1, seed=0)
    calib = load_calib_windows(tiny_adapter, cfg)
    scheme, targets, layers = load_scheme("w8a8"), ["moe"], range(0, 2)
    recipe = parse_algo("gptq")

    def run(out, hook=None):
        return run_blockwise_ptq(tiny_adapter, PtqSpec(scheme, targets, cfg, recipe=recipe, propagate="quant"), out,
                                 layers=layers, calib_windows=calib, runtime=PtqRuntime(on_unit_done=hook))

    full = tmp_path / "full"
    run(full)

    class Interrupt(Exception):
        pass

    done = []

    def stop(r):
        done.append(r.name)
        if len(done) == 12:    # layer 1, mid-way through its routed experts
            raise Interrupt

    part = tmp_path / "part"
    with pytest.raises(Interrupt):
        run(part, stop)
    res = run(part)
    assert sum(u.resumed for u in res.units) == 12
    names = sorted(p.name for p in (full / PARAMS_DIR).glob("*.pt"))
    assert names == sorted(p.name for p in (part / PARAMS_DIR).glob("*.pt")) and len(names) == 18
    for name in names:
        a, b = safe_torch_load(full / PARAMS_DIR / name), safe_torch_load(part / PARAMS_DIR / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    meta = json.loads((full / PARAMS_DIR / "meta.json").read_text())
    assert meta["solver"]["recipe"][0]["name"] == "gptq" and meta["solver"]["propagate"] == "quant"
