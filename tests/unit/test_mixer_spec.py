"""The sequence mixers as entries (model/mixer_spec.py, model/mixers.py): KDA's and MLA's specs against their
built modules, and docs/extension.md's worked example, a plain attention added as a third mixer
(tests/plain_attention.py), through everything a spec feeds: the build, the counts, the sharding plan, Muon's
rules, the saved activations, the refusals where it has no entry (context parallelism, the release format)."""

import dataclasses
import types

import pytest
import torch

from gpu_kernels.choice import REFERENCES
from moe_pretrain.checkpoint.kimi_k3 import kimi_k3_tensors
from moe_pretrain.config import ConfigError
from moe_pretrain.config.stage import resolve_stages
from moe_pretrain.model.counts import count
from moe_pretrain.model.layout import DocumentLayout
from moe_pretrain.model.mixers import MIXERS, mixer_spec, spec_of_module
from moe_pretrain.model.transformer import MoETransformer
from moe_pretrain.planning.stage_memory import MemoryPlanner, RunLayout
from moe_pretrain.planning.step_activations import layer_activations
from moe_pretrain.training.muon_params import muon_rule
from parallel.context_parallel_mixers import place_mixer
from parallel.plan import ShardingPlan
from parallel.sequence import NoSequenceParallel
from parallel.state import resolve_layout
from tests.models import tiny_config
from tests.plain_attention import PlainAttention, registered

PATTERN = "model.layer_pattern=KAMKAM"


def test_each_layer_is_built_from_its_kinds_spec_and_counted_by_it():
    """Every decoder layer's mixer is its kind's module, with its spec's parameter count; the spec's release
    names cover every parameter of KDA and MLA once."""
    m = tiny_config().model
    model = MoETransformer(m)
    for index, layer in model.decoder_layers().items():
        spec = mixer_spec(m, index)
        assert spec_of_module(layer.mixer) is spec and isinstance(layer.mixer, spec.module)
        assert spec.params(m) == sum(p.numel() for p in layer.mixer.parameters())
        assert sorted(t.ours for t in spec.release_tensors(m)) == sorted(n for n, _ in layer.mixer.named_parameters())


def test_a_new_mixer_is_built_counted_sharded_and_orthogonalised_from_its_spec():
    with registered() as spec:
        cfg = tiny_config(PATTERN)
        m = cfg.model
        model = MoETransformer(m)
        assert [type(model.decoder_layers()[i].mixer) for i in (1, 4)] == [PlainAttention] * 2
        assert count(m, 96)["total_params"] == sum(p.numel() for p in model.parameters())
        assert count(m, 96)["breakdown"]["mha"] == 2 * spec.params(m)
        names = [name for name, _ in model.named_parameters()]
        plan = ShardingPlan()
        assert plan.unplanned(names) == [] and not [rule for rule in plan.unused(names) if ".mixer." in rule]
        assert plan.style("layers.1.mixer.q_proj") == "column" and plan.style("layers.1.mixer.o_proj") == "row"
        weight = torch.empty(16, 32)
        assert muon_rule("layers.1.mixer.k_proj.weight", weight, m).head_rows == m.mla.v_head_dim
        assert muon_rule("layers.1.mixer.o_proj.weight", weight, m).head_rows == 0
        assert muon_rule("layers.0.mixer.k_proj.weight", weight, m).head_rows == m.kda.head_dim  # KDA's own
    with pytest.raises(ConfigError, match=r"model.layer_pattern may hold only K \(kda\), M \(mla\), found \['A'\]"):
        tiny_config(PATTERN)  # outside the block the letter is unknown again


def test_the_new_mixer_attends_within_documents_as_a_float64_reference_does():
    torch.manual_seed(0)
    with registered():
        m = tiny_config(PATTERN).model
        layer = MIXERS["mha"].build(m.hidden_size, m, init_std=0.02, out_std=0.02, kernels=REFERENCES).double()
    x = torch.randn(2, 12, m.hidden_size, dtype=torch.float64)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    got = layer(x, DocumentLayout.from_doc_ids(doc_ids))
    H, Dh = m.mla.num_heads, m.mla.v_head_dim
    q, k, v = (proj(x).reshape(2, 12, H, Dh) for proj in (layer.q_proj, layer.k_proj, layer.v_proj))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / Dh**0.5
    position = torch.arange(12)
    visible = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (position[None, :, None] >= position[None, None, :])
    attended = torch.einsum("bhqk,bkhd->bqhd", scores.masked_fill(~visible[:, None], -torch.inf).softmax(-1), v)
    assert torch.allclose(got, layer.o_proj(attended.reshape(2, 12, H * Dh)), rtol=0, atol=1e-12)


def saved_elements_per_token(mixer: torch.nn.Module, d: int, tokens: int) -> float:
    """Elements of the distinct storages autograd saves in the mixer's forward, per token (two documents a row);
    its weights, which the projections save for their input gradients, are parameters, not activations."""
    x = torch.randn(2, tokens, d, requires_grad=True)
    doc_ids = torch.zeros(2, tokens, dtype=torch.long)
    doc_ids[:, tokens // 2:] = 1
    weights = {p.untyped_storage().data_ptr() for p in mixer.parameters()}
    storages = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mixer(x, DocumentLayout.from_doc_ids(doc_ids))
    return sum(storages.values()) / (2 * tokens)


@pytest.mark.parametrize("shape", [(2, 8, 32), (4, 8, 32), (2, 16, 64)])
def test_the_new_mixers_saved_activations_are_its_specs(shape):
    """The spec's activations and its core region against saved-tensor hooks on the layer alone, exactly; the
    plan's layer figure reads them (layer 1 is an attention layer)."""
    heads, head_dim, d = shape
    with registered() as spec:
        m = tiny_config(PATTERN, f"model.mla.num_heads={heads}", f"model.mla.v_head_dim={head_dim}",
                        f"model.hidden_size={d}").model
        mixer = spec.build(d, m, init_std=0.02, out_std=0.02, kernels=REFERENCES)
        _, kept = spec.activations(m, "ulysses", 1, 1)
        assert saved_elements_per_token(mixer, d, 256) == kept
        mixer.set_recompute(frozenset({"core"}))
        (region,) = spec.regions(m, frozenset({"core"}), "ulysses", 0.0)
        assert saved_elements_per_token(mixer, d, 256) == kept - region.mixer
        assert layer_activations(m, 1, "none").mixer == kept
        assert layer_activations(m, 1, "core").mixer == kept - region.mixer


def test_where_the_new_mixer_has_no_entry_it_is_refused_by_name():
    """Context parallelism at start-up (the layout check, which the planner's search reads too) and at the build;
    the release export."""
    with registered():
        with pytest.raises(ConfigError, match=r"parallel.cp=2: model.layer_pattern's mha layers have no "
                                              r"context-parallel strategy"):
            resolve_layout(tiny_config(PATTERN, "parallel.cp=2"), 2)
        cfg = tiny_config(PATTERN)
        at_cp2 = dataclasses.replace(resolve_stages(cfg)[0], cp=2)
        assert any("mha layers have no context-parallel strategy" in problem
                   for problem in MemoryPlanner(cfg).problems(RunLayout(2, 1, 1, 1), at_cp2))
        m = cfg.model
        mixer = MIXERS["mha"].build(m.hidden_size, m, init_std=0.02, out_std=0.02, kernels=REFERENCES)
        place_mixer(mixer, NoSequenceParallel(), types.SimpleNamespace(size=1, exchanges_latent=False))
        with pytest.raises(ConfigError, match=r"parallel.cp=2: the mha mixer has no context-parallel strategy"):
            place_mixer(mixer, NoSequenceParallel(), types.SimpleNamespace(size=2, exchanges_latent=False))
        with pytest.raises(ValueError, match=r"layer 1 is a mha layer, which the release format does not hold"):
            kimi_k3_tensors(m)
