"""Recomputation by module (train.recompute lists modules; model/recompute.py): the same numbers as none, the bytes
the plan says each module no longer keeps, no GEMM run twice by expert_act, and the FLOPs the plan adds counted
by torch's FLOP counter."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from moe_pretrain.config import ConfigError
from moe_pretrain.planning.measured import LiveTensorBytes
from moe_pretrain.planning.sizing import module_recompute_flops_per_token
from parallel.parallelize import build_model
from tests.models import tiny_config

ALL = "attn_res,norms,kda_pre,mla_up,core,expert_act"
SETS = ["attn_res", "norms", "attn_res,norms", "kda_pre", "kda_pre,core", "mla_up", "mla_up,core", "expert_act",
        "experts,expert_act", ALL]
BENCH = Path(__file__).resolve().parents[2] / "bench" / "activation_memory.py"


def step(mode: str, dtype: str, T: int = 96):
    """One forward + loss + backward of the tiny model (two rows of T tokens, two documents each) -> (loss, the
    gradients, live tensor bytes after the forward)."""
    torch.manual_seed(0)
    cfg = tiny_config(f"train.dtype={dtype}")
    model = build_model(cfg)
    model.set_recompute(mode)
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, cfg.model.vocab_size, (2, T), generator=gen) for _ in range(2))
    doc_ids = (torch.arange(T) >= T // 3).long().expand(2, T)
    with LiveTensorBytes() as live, torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        logits, balance = model(tokens, doc_ids)
        saved = live.live
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()) + balance
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, saved


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_every_module_set_computes_bitwise_what_none_does(dtype):
    """In float64 and under bf16 autocast each set gives bitwise the loss and every gradient of no recomputation
    (a recomputed region runs the same ops on the same inputs), and keeps fewer bytes after the forward."""
    want_loss, want_grads, want_saved = step("none", dtype)
    for mode in SETS:
        loss, grads, saved = step(mode, dtype)
        assert torch.equal(loss, want_loss), mode
        assert grads.keys() == want_grads.keys(), mode
        for name, grad in want_grads.items():
            assert torch.equal(grads[name], grad), (mode, name)
        assert saved < want_saved, (mode, saved, want_saved)


@pytest.mark.timeout(60)
def test_expert_act_rebuilds_the_activation_under_autocast_and_runs_no_gemm_twice(monkeypatch):
    """Under bf16 autocast expert_act keeps every SiTU-GLU output's bytes out of the forward's saved set (the
    routed experts' k F and the shared experts' n_s S per token of each MoE layer, the dense MLP's intermediate),
    runs the activation again in the backward, and each GEMM of the experts once."""
    import moe_pretrain.model.experts as experts
    import moe_pretrain.model.mlp as mlp

    calls = {"situ": 0, "gemm": 0}
    real_situ, real_mm = experts.situ_glu, experts.grouped_mm

    def situ(*args, **kwargs):
        calls["situ"] += 1
        return real_situ(*args, **kwargs)

    def gemm(*args, **kwargs):
        calls["gemm"] += 1
        return real_mm(*args, **kwargs)

    for module in (experts, mlp):
        monkeypatch.setattr(module, "situ_glu", situ)
    monkeypatch.setattr(experts, "grouped_mm", gemm)
    T, cfg = 96, tiny_config()
    _, _, none_saved = step("none", "bfloat16", T)
    runs = dict(calls)
    _, _, act_saved = step("expert_act", "bfloat16", T)
    m, e = cfg.model, cfg.model.moe
    moe = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    activations = moe * (e.top_k * e.expert_intermediate + e.num_shared_experts * e.shared_intermediate) \
        + (m.num_layers - moe) * m.dense_intermediate
    assert none_saved - act_saved == 2 * T * activations * 2  # bf16, two rows
    assert calls["situ"] - runs["situ"] == 2 * runs["situ"], calls  # once in the forward, once rebuilt
    assert calls["gemm"] - runs["gemm"] == runs["gemm"], calls  # no GEMM again


@pytest.mark.timeout(120)
def test_the_plan_prices_what_each_module_no_longer_keeps():
    """bench/activation_memory.py's probe at 2048 tokens (fp32, d = 64): the bytes each module removes from the
    forward's saved set are the plan's (module_savings) within 2%; with every module the plan's saved bytes and
    peak are within (0.8, 1.1) of the live ones (the plan's KDA core count is a little low, its transient the
    largest region whole)."""
    spec = importlib.util.spec_from_file_location("activation_memory_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    none = bench.probe("none", 2048)
    for mode in ["attn_res", "norms", "attn_res,norms", "kda_pre", "mla_up", "expert_act"]:
        r = bench.probe(mode, 2048)
        live = none["live_after_forward"] - r["live_after_forward"]
        plan = none["plan_saved"] - r["plan_saved"]
        assert live == pytest.approx(plan, rel=0.02), (mode, live, plan)
    r = bench.probe(ALL, 2048)
    assert 0.8 < r["live_after_forward"] / r["plan_saved"] < 1.1 and 0.8 < r["live_peak"] / r["plan_peak"] < 1.1, r


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("mode", "position", "rerun"), [("mla_up", "rope", True), ("mla_up", "nope", False),
                                                         ("experts", "nope", True)])
def test_the_plan_prices_the_flops_a_module_runs_again(mode, position, rerun):
    """torch's FLOP counter over a float64 forward + backward: what a module adds over none is the plan's
    module_recompute_flops_per_token over the layers, times the tokens. mla_up re-runs the query up-projection
    only where the rotary needs its output (rope), no GEMM under NoPE (the full-size model's); experts re-runs
    the routed experts' GEMMs (exactly k rows per token: no token is dropped at this capacity)."""
    cfg = tiny_config("train.dtype=float64", f"model.mla.position={position}")
    m, T = cfg.model, 96

    def counted(recompute: str) -> int:
        torch.manual_seed(0)
        model = build_model(cfg)
        model.set_recompute(recompute)
        tokens = torch.randint(0, m.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
        with FlopCounterMode(display=False) as counter:
            logits, balance = model(tokens)
            (logits.sum() + balance).backward()
        return counter.get_total_flops()

    layers = range(m.num_layers + m.mtp.layers)
    want = 2 * T * sum(module_recompute_flops_per_token(m, i, T, frozenset({mode})) for i in layers)
    assert (want > 0) == rerun
    assert counted(mode) - counted("none") == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize(("override", "key"), [
    ("train.recompute=attn_res,bogus", "train.recompute"),
    ("train.recompute=", "train.recompute"),
    ("stages=[{name: s, tokens: 768, seq_len: 96, batch_tokens: 384, recompute: 'norms,x'}]", "stages[0].recompute"),
])
def test_an_unknown_module_is_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        tiny_config(override)
    message = str(err.value)
    assert "\n" not in message and message.startswith(key) and "attn_res" in message, message
