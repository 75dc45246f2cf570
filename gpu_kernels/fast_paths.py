"""Which fast paths a run's model is built with, and what they are: resolved once, then read from the model.

resolve() turns the kernels and precision sections into a Kernels value (gpu_kernels/choice.py) for the run's
device and compute dtype: auto picks the fast path where it runs, and a forced fast path or an FP8 recipe
this machine cannot run is a ConfigError naming its key (never a silent fallback). The model is built with
it (parallel/parallelize.build_model), and fast_paths() reads the choices back from the built modules, so
a job log says what the expensive parts actually run on: fla / Triton / grouped-GEMM / FP8 kernels or the
PyTorch references.
"""

import torch
from torch import nn

from gpu_kernels.choice import Kernels
from gpu_kernels.flex_attention import flex_unavailable_reason
from gpu_kernels.kda import fla_unavailable_reason
from gpu_kernels.kda.fla_backend import fla_config_reason
from gpu_kernels.triton_support import triton_installed, triton_unavailable_reason
from moe_pretrain.config import Config, ConfigError
from moe_pretrain.fp8 import RECIPES, fp8_unavailable_reason
from moe_pretrain.fp8.scaled_grouped_mm import scaled_grouped_mm_unavailable_reason
from moe_pretrain.fp8.settings import Engine, Fp8Settings
from moe_pretrain.fp8.transformer_engine import te_unavailable_reason
from moe_pretrain.model.attn_res import AttnResMix
from moe_pretrain.model.experts import GroupedExperts
from moe_pretrain.model.mixers import spec_of_module
from moe_pretrain.model.mlp import SiTUGLUMLP
from moe_pretrain.model.moe import LatentMoE
from moe_pretrain.model.norm import RMSNorm
from moe_pretrain.model.short_conv import ShortConvolution
from moe_pretrain.ops.grouped_mm import grouped_kernel_unavailable_reason


def grouped_gemm_reason(cfg: Config, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the routed experts' GEMMs (in and out of the latent width, in the compute dtype) cannot run as
    torch._grouped_mm."""
    moe = cfg.model.moe
    return grouped_kernel_unavailable_reason(device, dtype, moe.latent_size, moe.expert_intermediate)


def kda_gate_floor(cfg: Config) -> float | None:
    """The KDA decay's floor fla's safe gate is given (the bounded form's), None for the softplus form."""
    return cfg.model.kda.lower_bound if cfg.model.kda.gate == "lower_bound" else None


def _choose(key: str, choice: str, forced: str, reason: str | None, auto: bool) -> bool:
    """Whether the fast path `forced` of kernels.<key> is taken: forced and able, or auto and able (auto:
    whether auto takes it on this device at all). A forced path that cannot run is a ConfigError."""
    if choice == forced and reason:
        raise ConfigError(f"kernels.{key}={forced} cannot run here: {reason}; use kernels.{key}=auto")
    return reason is None and (choice == forced or (choice == "auto" and auto))


def fp8_engine(cfg: Config, device: torch.device) -> Engine:
    """The FP8 expert GEMMs' engine for precision.fp8's recipe on this device (kernels.fp8_gemm)."""
    name, choice = cfg.precision.fp8, cfg.kernels.fp8_gemm
    recipe = RECIPES[name]
    widths = (cfg.model.moe.latent_size, cfg.model.moe.expert_intermediate)
    te_reason = te_unavailable_reason(recipe, device, widths)
    if choice == "transformer_engine" and te_reason:
        raise ConfigError(f"kernels.fp8_gemm=transformer_engine cannot run precision.fp8={name} here: {te_reason}")
    if choice != "torch" and te_reason is None:
        return "transformer_engine"
    if reason := fp8_unavailable_reason(name, device):
        te_note = f" (Transformer Engine: {te_reason})" if choice == "auto" and device.type == "cuda" else ""
        raise ConfigError(f"precision.fp8={name} cannot run on {device}: {reason}{te_note}")
    return "scaled_grouped_mm" if scaled_grouped_mm_unavailable_reason(recipe, device, widths=widths) is None \
        else "torch"


def fp8_settings(cfg: Config, device: torch.device) -> Fp8Settings | None:
    """precision.fp8's recipe with its engine on this device; None when FP8 is off."""
    if cfg.precision.fp8 == "off":
        return None
    return Fp8Settings(RECIPES[cfg.precision.fp8], cfg.precision.fp8_amax_history, fp8_engine(cfg, device))


def _resolved(cfg: Config, reasons: dict[str, str | None], cuda: bool, fp8: Fp8Settings | None) -> Kernels:
    """The kernels.* choices against why each fast path cannot run (None: it can); auto takes Triton, fla and
    FlexAttention on CUDA only, the grouped GEMM wherever it runs. why_not keeps a reason for each path left
    on its reference."""
    k = cfg.kernels
    taken = {"triton": _choose("triton", k.triton, "triton", reasons["triton"], cuda),
             "grouped_gemm": _choose("grouped_gemm", k.grouped_gemm, "grouped", reasons["grouped_gemm"], True),
             "attention": _choose("attention", k.attention, "flex", reasons["attention"], cuda),
             "kda": _choose("kda", k.kda, "fla", reasons["kda"], cuda)}
    why_not = {key: f"kernels.{key}={getattr(k, key)}" if getattr(k, key) != "auto"
               else reasons[key] or "auto takes it on CUDA only" for key in taken if not taken[key]}
    return Kernels(triton=taken["triton"], grouped_gemm="grouped" if taken["grouped_gemm"] else "loop",
                   kda="fla" if taken["kda"] else "torch", attention="flex" if taken["attention"] else "sdpa",
                   fp8=fp8, why_not=tuple(why_not.items()))


def resolve(cfg: Config, device: torch.device, dtype: torch.dtype) -> Kernels:
    """The kernels a model for this run is built with, on this device and compute dtype (train.dtype's)."""
    mla = cfg.model.mla
    reasons = {
        "triton": triton_unavailable_reason(device),
        "grouped_gemm": grouped_gemm_reason(cfg, device, dtype),
        "attention": flex_unavailable_reason(device, True, mla.qk_nope_head_dim + mla.qk_rope_head_dim,
                                             mla.v_head_dim),
        "kda": fla_unavailable_reason(device, kda_gate_floor(cfg), cfg.model.kda.head_dim,
                                      cfg.model.kda.chunk_size),
    }
    return _resolved(cfg, reasons, device.type == "cuda", fp8_settings(cfg, device))


DRY_RUN_REFERENCES = {
    "attention": "in a dry run: FlexAttention refuses a backward on the CPU, where fake tensors live; same FLOPs",
}
"""The GPU paths a dry run cannot play, and why (the references run in their place)."""


def resolve_for_gpu(cfg: Config, dtype: torch.dtype) -> Kernels:
    """The kernels a CUDA GPU resolves for this run, as a dry run plays them on fake tensors: our Triton kernels
    through their custom ops' fake implementations, the experts' torch._grouped_mm through its meta
    implementation, fla's chunk KDA through its custom ops' fakes and launch profile (gpu_kernels/kda/fla_ops.py,
    fla_launches.py); FlexAttention cannot be played (DRY_RUN_REFERENCES); FP8 as this machine resolves it."""
    cpu = torch.device("cpu")
    reasons = {
        "triton": None if triton_installed() else "triton is not installed",
        "grouped_gemm": f"torch._grouped_mm on CUDA takes bfloat16, not {dtype}" if dtype != torch.bfloat16
        else grouped_gemm_reason(cfg, cpu, dtype),
        "kda": fla_config_reason(kda_gate_floor(cfg), cfg.model.kda.head_dim, cfg.model.kda.chunk_size),
        **DRY_RUN_REFERENCES,
    }
    return _resolved(cfg, reasons, True, fp8_settings(cfg, cpu))


def state_kernels(cfg: Config) -> Kernels:
    """The references, with the run's FP8 state (delayed scaling's histories): for tools that build a model to
    move its state (resharding), not to run it, on a machine that may not run the run's fast paths."""
    if cfg.precision.fp8 == "off":
        return Kernels()
    return Kernels(fp8=Fp8Settings(RECIPES[cfg.precision.fp8], cfg.precision.fp8_amax_history))


_ENGINES = {"transformer_engine": "Transformer Engine's grouped GEMM (general_grouped_gemm) and quantizers",
            "scaled_grouped_mm": "torch._scaled_grouped_mm forward (one call), torch._scaled_mm backward per expert",
            "torch": "torch._scaled_mm per expert"}


def _fp8(settings: Fp8Settings | None) -> str:
    if settings is None:
        return "off (precision.fp8)"
    engine = _ENGINES[settings.engine]
    if settings.engine == "torch" and not settings.recipe.tensorwise:
        engine = "exact CPU emulation (quantize to FP8, fp32-accumulated GEMM)"
    return f"{settings.recipe.name} on the routed experts' GEMMs via {engine}"


def _module_states(model: nn.Module) -> dict[str, set[str]]:
    """Each fast path's state in words, as every module that runs it was built."""
    notes = dict(model.kernels.why_not) if isinstance(getattr(model, "kernels", None), Kernels) else {}

    def off(key: str, reference: str) -> str:
        return f"{reference} ({notes[key]})" if key in notes else reference

    states: dict[str, set[str]] = {}
    for module in model.modules():
        found: dict[str, str] = {}
        mixer = spec_of_module(module)
        if mixer is not None:
            found.update(mixer.fast_paths(module, off))
        elif isinstance(module, GroupedExperts):
            found["FP8"] = _fp8(module.fp8_settings)
            gemm = {"grouped": "torch._grouped_mm, forward and backward",
                    "loop": off("grouped_gemm", "one matmul per expert"),
                    "auto": "torch._grouped_mm where the operands allow, else one matmul per expert",
                    }[module.grouped_gemm]
            if module.fp8_settings is not None:
                gemm += " (unused: the FP8 engine runs the expert GEMMs)"
            found["grouped GEMM"] = gemm
        if isinstance(module, (GroupedExperts, SiTUGLUMLP)):
            found["Triton SiTU-GLU"] = "on" if module.fused else off("triton", "off: PyTorch reference")
        elif isinstance(module, ShortConvolution):
            found["Triton short convolution"] = "on" if module.fused else off("triton", "off: PyTorch reference")
        elif isinstance(module, RMSNorm):
            found["Triton RMSNorm"] = "on" if module.fused else off("triton", "off: PyTorch reference")
        elif isinstance(module, AttnResMix):
            found["Triton AttnRes mix"] = "on" if module.fused else off("triton", "off: PyTorch reference")
        elif isinstance(module, LatentMoE):
            dispatcher = module.dispatcher
            found["Triton MoE permute"] = (
                ("on" if dispatcher.fused else off("triton", "off: PyTorch reference")) if dispatcher.permutes
                else f"not called ({type(dispatcher).__name__} gathers its rows by index)")
        for path, state in found.items():
            states.setdefault(path, set()).add(state)
    return states


def fast_paths(model: nn.Module) -> dict[str, str]:
    """Each fast path's state for this model, in words, read from its modules (a path whose modules were
    built differently lists each way)."""
    return {path: "; ".join(sorted(states)) for path, states in _module_states(model).items()}


def describe(model: nn.Module) -> str:
    return "fast paths: " + "; ".join(f"{name}: {state}" for name, state in fast_paths(model).items())
