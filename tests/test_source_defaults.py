"""Recipes that know their source (issue 35.3): a released checkpoint (FP8 blocks, FP4 experts) may
have another default recipe than bf16 weights, chosen on the release testbed's whole split
(models/deepseek_v4/plan.py RELEASE_DEFAULTS). Only a named recipe follows the source; what the
user gave (--algo, --propagate) stays, and the report says where the default came from."""
from __future__ import annotations

import json

import pytest

import models.deepseek_v4  # noqa: F401  (registers the model)
from amct_ext.algorithms.recipe import named_recipe, parse_algo
from amct_ext.pipeline.options import PtqOptions, plan_job
from models.deepseek_v4.plan import RELEASE_DEFAULTS, DeepseekV4PlanSpec


def _plan(tmp_path, **kw):
    return plan_job(PtqOptions(output_dir=str(tmp_path / "out"), **kw))


def test_release_w8a8_default_is_the_release_choice(tmp_path):
    algo, prop = RELEASE_DEFAULTS["w8a8"]
    assert (algo, prop) != named_recipe("w8a8")          # it differs from the bf16 testbed's default
    job = _plan(tmp_path, model="tiny-trained-release", scheme="w8a8")
    assert job.spec.recipe.settings() == parse_algo(algo).settings() and job.spec.propagate == prop
    assert job.recipe_source == "default for w8a8's content from released FP8 / FP4 weights"
    best = _plan(tmp_path, model="tiny-trained-release", scheme="w8a8", recipe="best")   # w8a8's best is its default
    assert best.spec.recipe.settings() == parse_algo(algo).settings()


def test_bf16_weights_keep_the_table_default(tmp_path):
    job = _plan(tmp_path, model="tiny-trained", scheme="w8a8")
    d_algo, d_prop = named_recipe("w8a8")
    assert job.spec.recipe.settings() == parse_algo(d_algo).settings() and job.spec.propagate == d_prop
    assert job.recipe_source == "default for w8a8's content"


def test_what_the_user_gave_stays(tmp_path):
    job = _plan(tmp_path, model="tiny-trained-release", scheme="w8a8", algo="rtn")
    assert job.spec.recipe.settings() == parse_algo("rtn").settings() and job.recipe_source == "--algo"
    job = _plan(tmp_path, model="tiny-trained-release", scheme="w8a8", propagate="quant")
    assert job.spec.recipe.settings() == parse_algo(RELEASE_DEFAULTS["w8a8"][0]).settings()
    assert job.spec.propagate == "quant"


def test_schemes_without_a_release_choice_are_unchanged(tmp_path):
    job = _plan(tmp_path, model="tiny-trained-release", scheme="w4a16-g128")
    algo, prop = named_recipe("w4a16-g128")
    assert job.spec.recipe.settings() == parse_algo(algo).settings() and job.spec.propagate == prop
    assert job.recipe_source == "default for w4a16-g128's content"


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"quantization_config": 3}', '{"quantization_config": {"quant_method": "compressed-tensors"}}'])
def test_source_is_read_from_config_json_only(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    assert DeepseekV4PlanSpec().source_defaults(tmp_path) == ("", {})
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    label, defaults = DeepseekV4PlanSpec().source_defaults(tmp_path)
    assert label and defaults == RELEASE_DEFAULTS
    assert DeepseekV4PlanSpec().source_defaults(tmp_path / "missing") == ("", {})
