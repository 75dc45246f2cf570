"""The released Kimi K3 checkpoint's tensor layout, and where each of its tensors lives in our model.

Public references: NeMo AutoModel's kimi_k3 state-dict adapter (the `language_model.` namespace,
`block_sparse_moe`, routed experts as per-expert w1 / w3 / w2, KDA's A_log zero-padded to a multiple of
128 entries) and published per-layer tensor tables of the release (names, shapes and dtypes: matrices
and norms bf16; the short convolutions, A_log, dt_bias, the KDA output norm and the router's correction
bias float32). The two shared experts are stored as one MLP of twice the intermediate size, which is how
our model holds them too (the sum of two GLU MLPs is one with their units side by side).

The release's vision tower and projector (`vision_tower.*`, `mm_projector.*`, 168 tensors, bf16) are ours
under the same names (model/vision_tower.py follows them), so they travel as they are.

The routed experts are MXFP4 in the release (compressed-tensors "mxfp4-pack-quantized": each expert's w1 / w2 /
w3 as `weight_packed` uint8 [out, in / 2] and `weight_scale` uint8 [out, in / 32], checkpoint/mxfp4.py); the
`bf16` variant stores them as `weight` instead (for training-side tools). The release's files: one per layer, then
the language model's embeddings, final mix, norm and head, then the projector, then the tower, named
model-{k:05d}-of-{n:06d}.safetensors (five digits, then six, as published).
"""

from dataclasses import dataclass

import torch

from moe_pretrain.checkpoint import mxfp4
from moe_pretrain.config import ModelConfig
from moe_pretrain.model.meta import meta_model
from moe_pretrain.model.mixers import mixer_spec

PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
A_LOG_MULTIPLE = 128
FLOAT32_SUFFIXES = ("conv1d.weight", ".A_log", ".dt_bias", "o_norm.weight", "e_score_correction_bias")
"""Tensors the release keeps in float32; everything else is bf16 (or MXFP4's uint8)."""
EXPERT_FORMATS = ("mxfp4", "bf16")
MXFP4_KINDS = ("mxfp4_packed", "mxfp4_scale")


@dataclass(frozen=True)
class HFTensor:
    """One tensor of the released layout and its source in our model."""

    name: str
    ours: str
    """Our model's state-dict key (no "model." prefix)."""
    expert: int | None
    """Index along dim 0 of our stacked expert weights; None: the whole tensor."""
    shape: tuple[int, ...]
    kind: str = "same"
    """same | conv (our [C, K] is their [C, 1, K]) | a_log (theirs is zero-padded to A_LOG_MULTIPLE) |
    mxfp4_packed / mxfp4_scale (an expert weight's MXFP4 codes / scales)."""

    @property
    def dtype(self) -> torch.dtype:
        if self.kind in MXFP4_KINDS:
            return torch.uint8
        return torch.float32 if self.name.endswith(FLOAT32_SUFFIXES) else torch.bfloat16

    def to_hf(self, ours: torch.Tensor) -> torch.Tensor:
        """Our tensor (the expert's slice when `expert` is set) in the released form (MXFP4 pairs: to_release)."""
        if self.kind in MXFP4_KINDS:
            raise ValueError(f"{self.name}: MXFP4 codes and scales come from one encoding (kimi_k3.to_release)")
        if self.kind == "conv":
            ours = ours.unsqueeze(1)
        elif self.kind == "a_log":
            ours = torch.cat([ours, ours.new_zeros(self.shape[0] - ours.shape[0])])
        return ours.to(self.dtype).contiguous()

    def from_hf(self, theirs: torch.Tensor, heads: int, dtype: torch.dtype) -> torch.Tensor:
        """The released tensor in our form and `dtype`; refuses a non-zero A_log padding (not ours)."""
        if tuple(theirs.shape) != self.shape:
            raise ValueError(f"{self.name}: shape {tuple(theirs.shape)}, the config gives {self.shape}")
        if self.kind == "conv":
            theirs = theirs.squeeze(1)
        elif self.kind == "a_log":
            if theirs[heads:].any():
                raise ValueError(f"{self.name}: non-zero padding after its {heads} heads")
            theirs = theirs[:heads]
        return theirs.to(dtype)


def _pad(n: int) -> int:
    return -(-n // A_LOG_MULTIPLE) * A_LOG_MULTIPLE


def _mixer(m: ModelConfig, index: int, ours: str, theirs: str) -> list[HFTensor]:
    """Layer `index`'s sequence mixer's tensors, named by its spec (release_tensors); A_log zero-padded."""
    spec = mixer_spec(m, index)
    if spec.release_layers is None:
        raise ValueError(f"model.layer_pattern: layer {index} is a {spec.kind} layer, which the release format "
                         "does not hold")
    return [HFTensor(f"{theirs}.self_attn.{t.theirs}", f"{ours}.mixer.{t.ours}", None,
                     (_pad(t.shape[0]),) if t.kind == "a_log" else t.shape, t.kind)
            for t in spec.release_tensors(m)]


def _glu(ours: str, theirs: str, d: int, intermediate: int) -> list[HFTensor]:
    return [HFTensor(f"{theirs}.gate_proj.weight", f"{ours}.gate_proj.weight", None, (intermediate, d)),
            HFTensor(f"{theirs}.up_proj.weight", f"{ours}.up_proj.weight", None, (intermediate, d)),
            HFTensor(f"{theirs}.down_proj.weight", f"{ours}.down_proj.weight", None, (d, intermediate))]


def _expert_tensors(name: str, expert: int, ours: str, shape: tuple[int, int], experts: str) -> list[HFTensor]:
    """One expert weight: `name.weight` (bf16), or its MXFP4 codes and scales."""
    if experts == "bf16":
        return [HFTensor(f"{name}.weight", ours, expert, shape)]
    out, inputs = shape
    return [HFTensor(f"{name}.weight_packed", ours, expert, (out, inputs // 2), "mxfp4_packed"),
            HFTensor(f"{name}.weight_scale", ours, expert, (out, inputs // mxfp4.GROUP), "mxfp4_scale")]


def _moe(m: ModelConfig, ours: str, theirs: str, experts: str) -> list[HFTensor]:
    d, e = m.hidden_size, m.moe
    moe = f"{theirs}.block_sparse_moe"
    tensors = [HFTensor(f"{moe}.gate.weight", f"{ours}.mlp.router.gate.weight", None, (e.num_experts, d)),
               HFTensor(f"{moe}.gate.e_score_correction_bias", f"{ours}.mlp.router.expert_bias", None,
                        (e.num_experts,)),
               HFTensor(f"{moe}.routed_expert_down_proj.weight", f"{ours}.mlp.latent_down.weight", None,
                        (e.latent_size, d)),
               HFTensor(f"{moe}.routed_expert_norm.weight", f"{ours}.mlp.latent_norm.weight", None, (e.latent_size,)),
               HFTensor(f"{moe}.routed_expert_up_proj.weight", f"{ours}.mlp.latent_up.weight", None,
                        (d, e.latent_size))]
    if e.num_shared_experts:
        tensors += _glu(f"{ours}.mlp.shared", f"{moe}.shared_experts", d, e.num_shared_experts * e.shared_intermediate)
    for expert in range(e.num_experts):
        for name, hf, shape in (("w_gate", "w1", (e.expert_intermediate, e.latent_size)),
                                ("w_down", "w2", (e.latent_size, e.expert_intermediate)),
                                ("w_up", "w3", (e.expert_intermediate, e.latent_size))):
            tensors += _expert_tensors(f"{moe}.experts.{expert}.{hf}", expert, f"{ours}.mlp.experts.{name}", shape,
                                       experts)
    return tensors


def _mix(ours: str, theirs: str, d: int) -> list[HFTensor]:
    """An AttnRes mix: RMSNorm weight over the bank, and the pseudo-query w (Linear(d, 1))."""
    return [HFTensor(f"{theirs}_norm.weight", f"{ours}.norm_weight", None, (d,)),
            HFTensor(f"{theirs}_proj.weight", f"{ours}.pseudo_query.weight", None, (1, d))]


def layer_tensors(m: ModelConfig, index: int, experts: str = "mxfp4") -> list[HFTensor]:
    """Layer `index`'s tensors in the released layout, in its order."""
    d, ours, theirs = m.hidden_size, f"layers.{index}", f"{PREFIX}layers.{index}"
    tensors = [*_mix(f"{ours}.attn_mix", f"{theirs}.self_attention_res", d),
               HFTensor(f"{theirs}.input_layernorm.weight", f"{ours}.attn_norm.weight", None, (d,))]
    tensors += _mixer(m, index, ours, theirs)
    tensors += [*_mix(f"{ours}.mlp_mix", f"{theirs}.mlp_res", d),
                HFTensor(f"{theirs}.post_attention_layernorm.weight", f"{ours}.mlp_norm.weight", None, (d,))]
    if m.is_moe_layer(index):
        return tensors + _moe(m, ours, theirs, experts)
    return tensors + _glu(f"{ours}.mlp", f"{theirs}.mlp", d, m.dense_intermediate)


def vision_tensors(m: ModelConfig) -> list[HFTensor]:
    """The vision tower's and projector's tensors: the release's names are ours (shapes from the meta model)."""
    return [HFTensor(name, name, None, tuple(p.shape)) for name, p in meta_model(m).named_parameters()
            if name.startswith(("vision_tower.", "mm_projector."))]


def kimi_k3_tensors(m: ModelConfig, experts: str = "mxfp4") -> list[HFTensor]:
    """Every tensor of the released model for config `m`, in order: the vision tower and projector, then the
    language model; routed experts in `experts` (EXPERT_FORMATS)."""
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts={experts!r}: one of {', '.join(EXPERT_FORMATS)}")
    d = m.hidden_size
    tensors = [*vision_tensors(m),
               HFTensor(f"{PREFIX}embed_tokens.weight", "embedding.weight", None, (m.vocab_size, d))]
    for index in range(m.num_layers):
        tensors += layer_tensors(m, index, experts)
    tensors += [*_mix("final_mix", f"{PREFIX}output_attn_res", d),
                HFTensor(f"{PREFIX}norm.weight", "final_norm.weight", None, (d,)),
                HFTensor(LM_HEAD, "head.weight", None, (m.vocab_size, d))]
    return tensors


def to_release(made: list[HFTensor], ours: torch.Tensor) -> dict[str, torch.Tensor]:
    """The released tensors made from one of our tensors (or one expert's slice of it), by name: an expert's
    MXFP4 codes and scales from one encoding (`made`: HFTensors, or export's SameTensors, which have to_hf too)."""
    encoded = mxfp4.encode(ours) if any(t.kind in MXFP4_KINDS for t in made) else None
    return {t.name: encoded[MXFP4_KINDS.index(t.kind)] if t.kind in MXFP4_KINDS else t.to_hf(ours) for t in made}


def by_source(tensors: list[HFTensor]) -> dict[str, list[HFTensor]]:
    """Our key -> the released tensors made from it."""
    grouped: dict[str, list[HFTensor]] = {}
    for tensor in tensors:
        grouped.setdefault(tensor.ours, []).append(tensor)
    return grouped


def release_files(tensors: list[HFTensor]) -> list[list[HFTensor]]:
    """The release's files: one per layer in layer order, then the language model's other tensors, then the
    projector's, then the tower's."""
    groups: dict[tuple[int, int], list[HFTensor]] = {}
    for tensor in tensors:
        if tensor.name.startswith(f"{PREFIX}layers."):
            key = (0, int(tensor.name[len(f"{PREFIX}layers."):].split(".")[0]))
        else:
            key = (2, 0) if tensor.name.startswith("mm_projector.") else \
                (3, 0) if tensor.name.startswith("vision_tower.") else (1, 0)
        groups.setdefault(key, []).append(tensor)
    return [groups[key] for key in sorted(groups)]


def release_file_name(index: int, count: int) -> str:
    """The release's shard name for file `index` (1-based) of `count`."""
    return f"model-{index:05d}-of-{count:06d}.safetensors"

