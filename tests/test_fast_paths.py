"""Start-up checks and report of the fast paths (kernels/fast_paths.py): forced choices this machine cannot run
are refused naming their key; the report says what each hot path runs on."""

import pytest
import torch

from kernels import selection
from kernels.fast_paths import configure, describe
from kernels.kda import fla_backend
from kernels.kda.fla_backend import fla_unavailable_reason, safe_gate_reason
from moe_pretrain.config import ConfigError
from tests.models import tiny_config

CPU = torch.device("cpu")


def test_forced_fast_paths_that_cannot_run_are_refused_naming_the_key(monkeypatch):
    with pytest.raises(ConfigError, match=r"kernels\.grouped_gemm=grouped cannot run here: .*float64"):
        configure(tiny_config("kernels.grouped_gemm=grouped", "train.dtype=float64"), CPU, torch.float64)
    with pytest.raises(ConfigError, match=r"kernels\.kda=fla cannot run here: fla's Triton kernels need CUDA"):
        configure(tiny_config("kernels.kda=fla"), CPU, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match=r"kernels\.triton=triton cannot run here: device cpu needs TRITON_INTERPRET"):
        configure(tiny_config("kernels.triton=triton"), CPU, torch.float32)


def test_the_report_names_each_fast_path_and_why_it_is_off():
    cfg = tiny_config("precision.fp8=blockwise", "kernels.triton=torch", "kernels.kda=torch")
    with selection.choosing():
        configure(cfg, CPU, torch.float32)
        text = describe(cfg, CPU, torch.float32)
    assert "KDA: PyTorch chunk form (kernels.kda=torch)" in text
    assert "FP8: blockwise on the routed experts' GEMMs via exact CPU emulation" in text
    assert "grouped GEMM: torch._grouped_mm, forward and backward (unused by the FP8 expert GEMMs" in text
    assert "Triton kernels (SiTU-GLU, MoE permute): off (kernels.triton=torch)" in text
    loop = tiny_config("kernels.grouped_gemm=loop")
    assert "grouped GEMM: off (kernels.grouped_gemm=loop): one matmul per expert" in describe(loop, CPU, torch.float32)
    assert "KDA: PyTorch chunk form (fla's Triton kernels need CUDA; device cpu)" in describe(loop, CPU, torch.float32)


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
    with pytest.raises(ConfigError, match=r"kernels\.kda=fla cannot run here: fla's safe gate takes "
                                          r"model\.kda\.lower_bound in \[-5, 0\), not -6"):
        configure(tiny_config("kernels.kda=fla", "model.kda.lower_bound=-6"), CPU, torch.float32)
    assert "KDA: PyTorch chunk form (fla's safe gate takes model.kda.lower_bound" in describe(
        tiny_config("model.kda.lower_bound=-6"), CPU, torch.float32)
