"""The kernel seam (gpu_kernels/choice.py, gpu_kernels/fast_paths.py): a run's kernels are resolved once, forced choices
this machine cannot run are refused naming their key, the model's modules are built with the choices (no process
state: two models with different choices run side by side), and the report reads them from the built model."""

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from gpu_kernels.choice import Kernels
from gpu_kernels.fast_paths import describe, resolve, resolve_for_gpu
from gpu_kernels.kda import fla_backend
from gpu_kernels.kda.fla_backend import fla_unavailable_reason, safe_gate_reason
from moe_pretrain.config import ConfigError
from moe_pretrain.fp8 import RECIPES
from moe_pretrain.fp8.scaled_grouped_mm import scaled_grouped_mm_unavailable_reason
from moe_pretrain.gpus import GPUS
from moe_pretrain.model.experts import GroupedExperts
from moe_pretrain.model.init import initialize
from moe_pretrain.ops.host_values import AssumedHostValues
from moe_pretrain.planning.assumed_values import AssumedValues
from moe_pretrain.planning.calibration import calibration_for
from moe_pretrain.planning.compute_sites import ComputeSites
from moe_pretrain.planning.host_reads import HostReads
from moe_pretrain.planning.op_census import OpCensus
from parallel.parallelize import build_model
from tests.models import tiny_config

CPU = torch.device("cpu")


def test_forced_fast_paths_that_cannot_run_are_refused_naming_the_key(monkeypatch):
    with pytest.raises(ConfigError, match=r"kernels\.grouped_gemm=grouped cannot run here: .*float64"):
        resolve(tiny_config("kernels.grouped_gemm=grouped", "train.dtype=float64"), CPU, torch.float64)
    with pytest.raises(ConfigError, match=r"kernels\.kda=fla cannot run here: fla's chunk_kda takes model.kda.head"):
        resolve(tiny_config("kernels.kda=fla"), CPU, torch.float32)  # the interpreter runs fla here (tests)
    with pytest.raises(ConfigError, match=r"kernels\.attention=flex cannot run here: FlexAttention has no backward"):
        resolve(tiny_config("kernels.attention=flex"), CPU, torch.float32)
    with pytest.raises(ConfigError, match=r"kernels\.fp8_gemm=transformer_engine cannot run precision\.fp8="
                                          r"tensorwise here: Transformer Engine needs CUDA"):
        resolve(tiny_config("precision.fp8=tensorwise", "kernels.fp8_gemm=transformer_engine"), CPU, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match=r"kernels\.triton=triton cannot run here: device cpu needs TRITON_INTERPRET"):
        resolve(tiny_config("kernels.triton=triton"), CPU, torch.float32)
    with pytest.raises(ConfigError, match=r"kernels\.kda=fla cannot run here: fla's Triton kernels need CUDA \(or "
                                          r"TRITON_INTERPRET=1 and pinned configs\); device cpu"):
        resolve(tiny_config("kernels.kda=fla", "model.kda.head_dim=16", "model.kda.chunk_size=32"), CPU, torch.float32)


def test_the_fp8_engines_take_the_recipes_and_machines_they_run():
    """Without TE, torch's grouped FP8 GEMM takes the single-scale recipes on compute capability 9.0 / 10.0 only;
    on CPU every recipe resolves to torch's loop / the exact emulation."""
    cuda = torch.device("cuda")
    for name in ("tensorwise", "delayed"):
        assert scaled_grouped_mm_unavailable_reason(RECIPES[name], cuda, capability=(9, 0)) is None
        assert scaled_grouped_mm_unavailable_reason(RECIPES[name], cuda, capability=(10, 0)) is None
        assert "9.0 / 10.0" in scaled_grouped_mm_unavailable_reason(RECIPES[name], cuda, capability=(8, 9))
    assert "block scales" in scaled_grouped_mm_unavailable_reason(RECIPES["blockwise"], cuda, capability=(9, 0))
    for name in RECIPES:
        kernels = resolve(tiny_config(f"precision.fp8={name}"), CPU, torch.float32)
        assert kernels.fp8.recipe is RECIPES[name] and kernels.fp8.engine == "torch"


def test_the_report_reads_each_fast_path_from_the_built_model_and_says_why_it_is_off():
    cfg = tiny_config("precision.fp8=blockwise", "kernels.triton=torch", "kernels.kda=torch")
    text = describe(build_model(cfg))
    assert "KDA: PyTorch chunk form (kernels.kda=torch)" in text
    assert "FP8: blockwise on the routed experts' GEMMs via exact CPU emulation" in text
    assert "grouped GEMM: torch._grouped_mm, forward and backward (unused: the FP8 engine" in text
    assert "Triton SiTU-GLU: off: PyTorch reference (kernels.triton=torch)" in text
    assert "Triton MoE permute: off: PyTorch reference (kernels.triton=torch)" in text
    assert "Triton AttnRes mix: off: PyTorch reference (kernels.triton=torch)" in text
    assert "Triton RMSNorm: off: PyTorch reference (kernels.triton=torch)" in text
    assert "Triton short convolution: off: PyTorch reference (kernels.triton=torch)" in text
    loop = describe(build_model(tiny_config("kernels.grouped_gemm=loop")))
    assert "grouped GEMM: one matmul per expert (kernels.grouped_gemm=loop)" in loop
    assert "KDA: PyTorch chunk form (fla's chunk_kda takes model.kda.head_dim >= 16 (its tl.dot tiles), not 8)" in loop
    assert "MLA attention: one SDPA per document (FlexAttention has no backward on cpu)" in loop


def test_two_models_with_different_kernels_run_side_by_side_in_one_process():
    """The choice lives in the modules: the loop reads the counts on the host, the grouped kernel does not,
    whichever ran last; both agree to fp32 accumulation order."""
    experts = {}
    for kernel in ("loop", "grouped"):
        module = GroupedExperts(4, 16, 32, beta=4.0, linear_beta=25.0, init_std=0.02, out_std=0.02,
                                kernels=Kernels(grouped_gemm=kernel))
        experts[kernel] = initialize(module, 0)
    x, counts = torch.randn(11, 16, generator=torch.Generator().manual_seed(0)), torch.tensor([3, 0, 6, 2])
    outputs, reads = {}, {}
    for kernel in ("loop", "grouped", "loop"):
        with HostReads() as host:
            outputs[kernel] = experts[kernel](x, counts)
        reads[kernel] = host.total
    assert reads == {"loop": 3, "grouped": 0}  # the loop reads them for each of its three GEMMs
    torch.testing.assert_close(outputs["loop"], outputs["grouped"], rtol=1e-5, atol=1e-6)


def test_fla_takes_only_the_gate_floors_its_safe_gate_is_exact_for(monkeypatch):
    """fla's safe gate assumes lower_bound in [-5, 0): outside it, forcing fla is refused naming
    model.kda.lower_bound (on any machine), auto stays on the reference (on a GPU too) and says why."""
    assert safe_gate_reason(-5.0) is None and safe_gate_reason(-0.5) is None and safe_gate_reason(None) is None
    cuda = torch.device("cuda")
    with monkeypatch.context() as patch:
        patch.setattr(fla_backend, "_fla_installed", lambda: True)  # as on a GPU machine with fla
        assert fla_unavailable_reason(cuda, -5.0) is None
        assert "model.kda.lower_bound in [-5, 0), not -6" in fla_unavailable_reason(cuda, -6.0)
        assert fla_unavailable_reason(cuda, None) is None  # the softplus gate: no safe gate, no floor
        # a head narrower than fla's tl.dot tiles fails to compile on the GPU (seen on an H200): auto says why
        assert "model.kda.head_dim >= 16 (its tl.dot tiles), not 8" in fla_unavailable_reason(cuda, -5.0, 8)
    with pytest.raises(ConfigError, match=r"kernels\.kda=fla cannot run here: fla's safe gate takes "
                                          r"model\.kda\.lower_bound in \[-5, 0\), not -6"):
        resolve(tiny_config("kernels.kda=fla", "model.kda.lower_bound=-6"), CPU, torch.float32)
    assert "KDA: PyTorch chunk form (fla's safe gate takes model.kda.lower_bound" in describe(
        build_model(tiny_config("model.kda.lower_bound=-6")))


def test_a_dry_run_builds_the_gpu_kernels_and_counts_each_as_one_launch():
    """resolve_for_gpu takes what a CUDA GPU resolves (Triton kernels, grouped GEMM, fla's chunk KDA) and says
    which GPU paths a dry run plays by their references; the model built with it runs forward and backward on
    fake tensors, each Triton kernel through its custom op's fake implementation, one launch per call, fla's
    chunk KDA as the kernels it launches (gpu_kernels/kda/fla_launches.py)."""
    cfg = tiny_config("train.dtype=bfloat16", "model.moe.num_experts=4", "model.kda.head_dim=16",
                      "model.kda.chunk_size=32")  # the smallest KDA fla takes
    kernels = resolve_for_gpu(cfg, torch.bfloat16)
    assert (kernels.triton, kernels.grouped_gemm, kernels.kda, kernels.attention) == (True, "grouped", "fla", "sdpa")
    assert set(dict(kernels.why_not)) == {"attention"}
    narrow = resolve_for_gpu(tiny_config("model.kda.head_dim=16"), torch.bfloat16)  # a chunk of 16
    assert narrow.kda == "torch" and "model.kda.chunk_size in (32, 64), not 16" in narrow.reason("kda")
    model = build_model(cfg, kernels=dataclasses.replace(kernels, host=AssumedHostValues(AssumedValues())))
    assert "MLA attention: one SDPA per document (in a dry run: FlexAttention refuses a backward" in describe(model)
    assert all(f"Triton {name}: on" in describe(model) for name in ("SiTU-GLU", "MoE permute", "AttnRes mix",
                                                                         "RMSNorm", "short convolution"))
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    doc_ids = torch.zeros_like(tokens)  # real, as the data loader's are in a dry run: one document a row
    with FakeTensorMode(allow_non_fake_inputs=True), ComputeSites() as sites, \
            OpCensus(GPUS["h200"], sites=sites, calibration=calibration_for("h200")) as ops, \
            torch.autocast("cpu", torch.bfloat16):
        logits, balance = model(tokens, doc_ids)
        (logits.float().logsumexp(-1).mean() + balance).backward()
    # Priced both ways: no component's estimate under its roofline bound, and none under the GPU's floor a launch.
    assert all(estimate >= max(bound, launches * 1e-6) * (1 - 1e-9) for launches, _, bound, estimate in
               sites.by_component().values())
    assert ops.estimate_s >= ops.roofline_s > 0
    moe_layers = cfg.model.num_layers - cfg.model.dense_layers
    launched = ops.launches_by_op
    # One dispatch and one combine per MoE layer; permute's backward is an unweighted unpermute.
    assert (launched["permute"], launched["unpermute"], launched["unpermute_backward"]) == (
        moe_layers, 2 * moe_layers, moe_layers), launched
    # Every AttnRes mix of more than one entry (all but layer 0's attention mix): one kernel each way, its FLOPs
    # the reference's score products (2 per bank element forward, 4 backward).
    mixes = 2 * cfg.model.num_layers - 1 + 1 + 2 * cfg.model.mtp.layers  # the final mix; each MTP layer's two
    assert launched["attn_res_mix"] == launched["attn_res_mix_backward"] == mixes, launched
    assert ops.flops_by_op["attn_res_mix_backward"] == 2 * ops.flops_by_op["attn_res_mix"] > 0
    mla_layers = sum(cfg.model.layer_kind(i) == "mla" for i in range(cfg.model.num_layers))
    # Every RMSNorm that runs (two per layer, MLA's low-rank norms, KDA's output norm, the latent norms, the final
    # norm; the vision tower's have no image here; KDA's q and k L2 norms on the same kernel), one kernel each way.
    kda_layers = cfg.model.num_layers - mla_layers
    norms = 2 * cfg.model.num_layers + 2 * mla_layers + 3 * kda_layers + moe_layers + 1
    assert launched["rms_norm"] == launched["rms_norm_backward"] == norms, launched
    # KDA's three short convolutions with their SiLU, one kernel each way.
    assert launched["short_conv"] == launched["short_conv_backward"] == 3 * kda_layers, launched
    # fla's chunk KDA: its forward's inter-chunk solve once a KDA layer, its backward's intra-chunk gradients once;
    # none of the PyTorch chunk form's triangular solves.
    assert launched["fla.chunk_kda_fwd_kernel_inter_solve_fused"] == kda_layers, launched
    assert launched["fla.chunk_kda_bwd_kernel_intra"] == kda_layers, launched
    assert "linalg_solve_triangular" not in launched
    # SiTU-GLU in every MLP (routed experts, shared experts, the dense layers, the vision tower's), once each way.
    assert launched["situ_glu"] == launched["situ_glu_backward"] >= 2 * moe_layers + cfg.model.dense_layers


def test_the_report_says_a_node_dispatch_calls_no_permute_kernel():
    """The node dispatch gathers its rows by index: with Kernels.triton on, the report says the permute kernels
    are not called rather than on."""
    from moe_pretrain.model.moe import LatentMoE
    from parallel.node_dispatch import NodeTokenDispatcher

    cfg = tiny_config("train.dtype=bfloat16", "model.moe.num_experts=4")
    model = build_model(cfg, kernels=resolve_for_gpu(cfg, torch.bfloat16))
    for module in model.modules():
        if isinstance(module, LatentMoE):
            module.dispatcher = NodeTokenDispatcher(4, 0, None, None, fused=True)
    text = describe(model)
    assert "Triton MoE permute: not called (NodeTokenDispatcher gathers its rows by index)" in text
    assert "Triton SiTU-GLU: on" in text
