"""The sharding plan covers the model: every rule places something of the full-size model, every parameter is
placed by a rule or declared replicated, and a renamed module is caught (not silently replicated)."""

import pytest

from moe_pretrain.config import load_config
from moe_pretrain.model.meta import meta_model
from parallel.parallelize import build_model, describe_parameters
from parallel.plan import ShardingPlan, model_plan, replicated_modules
from tests.models import tiny_config


@pytest.fixture(scope="module")
def full_size_names() -> list[str]:
    """Every parameter of configs/full.yaml's model (built on the meta device: every component is there)."""
    parameters = describe_parameters(meta_model(load_config("configs/full.yaml").model))
    return list(parameters)


def test_every_rule_places_something_and_every_parameter_is_planned(full_size_names):
    plan = ShardingPlan()
    assert plan.unused(full_size_names) == []
    assert plan.unplanned(full_size_names) == []
    # 93 layers: the full model's names, not a stage's; 168 of them the vision tower's and projector's (the release's);
    # 28 the multi-token-prediction block's (an MLA + MoE layer, placed by the layers' rules, and 4 of its own)
    assert len(full_size_names) == 2840
    assert sum(name.startswith("mtp.0.") for name in full_size_names) == 28
    assert sum(name.startswith(("vision_tower.", "mm_projector.")) for name in full_size_names) == 168


def test_a_renamed_module_fails_the_check(full_size_names):
    """q_proj renamed query_proj: its rule places nothing and its weights are neither placed nor replicated
    (before the check they silently stayed whole on every tensor-parallel rank)."""
    renamed = [name.replace("mixer.q_proj", "mixer.query_proj") for name in full_size_names]
    plan = ShardingPlan()
    assert plan.unused(renamed) == ["layers.*.mixer.q_proj"]
    unplanned = plan.unplanned(renamed)
    assert unplanned and all(name.endswith("mixer.query_proj.weight") for name in unplanned)
    assert len(unplanned) == 69  # every KDA layer's


def test_building_a_model_refuses_unplanned_parameters():
    plan = ShardingPlan(model_plan(), tuple(p for p in replicated_modules() if p != "layers.*.mlp.router.gate"))
    with pytest.raises(RuntimeError, match=r"neither places nor declares replicated .*layers\.1\.mlp\.router\.gate"
                                           r"\.weight"):
        build_model(tiny_config(), plan=plan)
