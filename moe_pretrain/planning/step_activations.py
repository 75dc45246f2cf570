"""Saved activations of a training step, per token and per layer, from the model's dims.

Shape legend: d hidden, H heads, K / V KDA head dims, C KDA chunk, Dqk / Dv MLA head dims, E experts,
k top-k, L latent, F expert intermediate, S shared intermediate, n AttnRes entries a mix reads.

The coefficients are elements autograd keeps per token, measured on this implementation (saved-tensor
hooks over the tiny model while one dimension at a time was varied, at T = 1024, fp32; least-squares fits
within 0.5% for KDA and the MLPs, 3.4% for MLA) and rounded; recomputing regions keep their inputs only.
They are checked against the live tensor bytes of a step at several lengths (tests/unit/test_activation_memory.py).
What they count, by component:
- The sequence mixer: its spec's activations and regions (model/kda_spec.py, model/mla_spec.py: KDA's chunked
  op keeps fp32 intermediates in any dtype, its `fp32_core`).
- MoE: router scores (fp32, E), k routed copies of the latent rows and of the experts' gate / up /
  activation (3 F each; selective recomputes the experts' MLP), latent norm, shared experts (3 S).
- Each AttnRes mix over n >= 2 entries: 3 d + 2 per entry; each pre-norm 2 d + 1.
- Recomputation by module (train.recompute lists them; measured as the rest, by removing one module at a time
  over 12 shapes of the tiny model, every coefficient exact to 0.5 elements): what each region no longer keeps
  per token (module_savings): attn_res, each mix over n >= 2 entries (3 d + 2) n - d (the region keeps its
  newest entry, the partial sum, alive); norms, each pre-norm d + 1 (it keeps its input); both, one region,
  (3 d + 2) n + d + 1 (and d + 1 for a one-entry mix's norm); the mixer's regions (kda_pre, mla_up, core) its
  spec's; experts as selective; expert_act the SiTU-GLU outputs,
  k F + n_s S per MoE layer (n_s S inside experts), the dense MLP's intermediate. One region at a time is
  re-materialised in backward (the transient: the largest).
- Full recomputation: each layer keeps its inputs, d per token: the partial block sum, or at a block's
  first layer the bank entry it closes (each entry saved once: model/saved_inputs.py's ledger counts
  exactly d per token per layer); train.saved_inputs keeps them on the host or in FP8 (saved_input_bytes).
  Without repeating the expert exchanges (train.recompute_exchanges=false) an MoE layer also keeps what
  they received, 2 k L + L + d and its indices (exchanges_kept).
- The vision tower (vision_activations), per patch: each block 6 D + 5.06 W + 1.88 Dh + 2 I + 4 (D its width, W
  heads x head dim, I its MLP width: norms, wqkv, rotary q / k, attention with its log-sum-exp, wo, the tanh-GELU
  MLP), plus 5 D + d / 2 + 1.25 outside the blocks (patch embedding and positions, final norm, merge, projector:
  d / 2 is the projector's per-token d shared by the merge's 4 patches); an exact fit over 9 tower shapes (every
  residual 0 elements). Full recomputation keeps each block's input (D) and 5.5 D + d / 2 + 1.25 outside. Both
  add the patch itself (C p^2, the patch embedding keeps its input for its weight gradient; the rank copies it
  to the device for its images only, data.Batch.to).
Under bf16 autocast the KDA op's intermediates stay fp32 (ops.norms.compute_dtype) while the rest is bf16:
fp32_core elements are 4 bytes, the others the activation dtype's (not yet measured on a GPU).
"""

from collections.abc import Callable
from dataclasses import dataclass

from moe_pretrain.config import ModelConfig, VisionConfig
from moe_pretrain.config.recompute import recompute_modules
from moe_pretrain.model.mixer_spec import Region
from moe_pretrain.model.mixers import mixer_spec
from moe_pretrain.model.saved_inputs import PREFETCH_LAYERS, SavedInputsPolicy, saved_input_bytes

Recompute = str
"""none, selective, full or a comma-separated list of modules (config/recompute.py)."""


@dataclass(frozen=True)
class LayerActivations:
    """Saved elements per token of one layer: the sequence mixer's fp32 core (KDA's chunked op), the mixer's
    other elements, everything else; and what one recomputation re-materialises at a time in backward."""

    fp32_core: float
    mixer: float
    other: float
    transient: float
    transient_core: float = 0.0
    """Of the transient, the mixer's fp32 core (4 bytes an element; the rest in the activation dtype)."""
    exchanges_kept: float = 0.0
    """Under full recomputation that does not repeat the expert exchanges, what the MoE layer keeps on the
    device beside the layer's inputs (exchanges_kept)."""

    @property
    def total(self) -> float:
        return self.fp32_core + self.mixer + self.other


def _mlp(m: ModelConfig, index: int, recompute: Recompute) -> float:
    d = m.hidden_size
    if not m.is_moe_layer(index):
        return 1.14 * d + 3.19 * m.dense_intermediate
    e = m.moe
    shared = 3.19 * e.num_shared_experts * e.shared_intermediate
    if recompute == "selective":
        return 1.14 * d + 2.06 * e.num_experts + 3.14 * e.top_k * e.latent_size + 5.77 * e.top_k \
            + 2.85 * e.latent_size + shared
    return 1.14 * d + 2.81 * e.num_experts + 3.25 * e.top_k * e.latent_size + 3.19 * e.top_k * e.expert_intermediate \
        + 0.97 * e.top_k + 3.0 * e.latent_size + shared


def _mix(d: int, entries: int) -> float:
    return (3 * d + 2) * entries if entries >= 2 else 0.0


def mix_entries(m: ModelConfig, index: int) -> tuple[int, int]:
    """Entries the attention-side and MLP-side AttnRes mixes of layer `index` read (bank + partial)."""
    block = m.attn_res.block_size
    bank = 1 + index // block
    return bank + (index % block != 0), bank + 1


def exchanges_kept(m: ModelConfig) -> float:
    """Elements per token an MoE layer keeps under full recomputation that runs its expert exchanges once
    (train.recompute_exchanges=false, model/decoder_layer.py): the MoE's input (d: routing, the latent
    projection and the shared experts start from it), the routed experts' input rows as received (k L) and
    their outputs as returned (k L: the routing weights take their gradient from them), the combined latent
    rows (L), and the dispatch's indices (int64, about 2 k elements' worth)."""
    e = m.moe
    return m.hidden_size + 2 * e.top_k * e.latent_size + e.latent_size + 2 * e.top_k


def layer_activations(m: ModelConfig, index: int, recompute: Recompute, mla_exchange: str = "ulysses",
                      cp: int = 1, tp: int = 1, exchanges: bool = True) -> LayerActivations:
    """Saved elements per token of layer `index` (all heads: divide by tp for a tensor-parallel rank);
    mla_exchange: how an MLA layer attends across cp ranks (the spec's activations); exchanges: whether full
    recomputation repeats the MoE layer's expert exchanges (train.recompute_exchanges)."""
    d = m.hidden_size
    attn_entries, mlp_entries = mix_entries(m, index)
    norms_and_mixes = 2 * (2 * d + 1) + _mix(d, attn_entries) + _mix(d, mlp_entries)
    core, mixer = mixer_spec(m, index).activations(m, mla_exchange, cp, tp)
    other = norms_and_mixes + _mlp(m, index, "none")
    if recompute == "none":
        return LayerActivations(core, mixer, other, 0.0)
    if recompute == "full":
        # The layer keeps its inputs (the running partial sum, or the bank entry a block's first layer
        # closes: d per token per layer) and backward re-runs it whole, one layer at a time.
        kept = 0.0 if exchanges or not m.is_moe_layer(index) else exchanges_kept(m)
        return LayerActivations(0.0, 0.0, d, core + mixer + other, core, kept)
    regions = module_savings(m, index, recompute_modules(recompute), mla_exchange, core)
    # A region's transient is what it no longer keeps; the largest is picked by its bytes at bf16 (core
    # elements are fp32 in any dtype), the training dtype at full size.
    saved_core = core - sum(r.core for r in regions)
    largest = max(regions, key=lambda r: r.core * 4 + r.rest * 2, default=Region())
    return LayerActivations(saved_core, mixer - sum(r.mixer for r in regions),
                            other - sum(r.rest - r.mixer for r in regions), largest.core + largest.rest, largest.core)


def module_savings(m: ModelConfig, index: int, modules: frozenset[str], mla_exchange: str = "ulysses",
                   core: float = 0.0) -> list[Region]:
    """The regions train.recompute's modules make in layer `index` (model/recompute.py), each with what it no
    longer keeps (the module docstring's measured counts; the mixer's from its spec, with `core` its fp32 core
    elements and mla_exchange MLA's context-parallel exchange)."""
    d, regions = m.hidden_size, []
    for entries in mix_entries(m, index):
        mixes, norms = "attn_res" in modules and entries >= 2, "norms" in modules
        if mixes and norms:
            regions.append(Region(rest=_mix(d, entries) + d + 1))
        elif mixes:
            regions.append(Region(rest=_mix(d, entries) - d))
        elif norms:
            regions.append(Region(rest=d + 1))
    regions += mixer_spec(m, index).regions(m, modules, mla_exchange, core)
    if "experts" in modules and m.is_moe_layer(index):
        regions.append(Region(rest=_mlp(m, index, "none") - _mlp(m, index, "selective")))
    if "expert_act" in modules:
        e = m.moe
        if not m.is_moe_layer(index):
            regions.append(Region(rest=m.dense_intermediate))
        else:
            routed = 0 if "experts" in modules else e.top_k * e.expert_intermediate
            regions.append(Region(rest=routed + e.num_shared_experts * e.shared_intermediate))
    return regions


def vision_block_activations(v: VisionConfig) -> float:
    """Saved elements per patch of one vision tower block (recompute none)."""
    e = v.encoder
    return 6 * e.hidden_size + 5.0625 * e.num_heads * e.head_dim + 1.875 * e.head_dim + 2 * e.intermediate_size + 4


def vision_activations(m: ModelConfig, recompute: Recompute) -> tuple[float, float]:
    """(saved, transient) elements per patch of the vision tower and projector, on the rank that encodes the
    patch's image (the first pipeline stage; parallel/image_split.py deals the images over tp x cp).
    Any recomputation (model/transformer.set_recompute) keeps each block's input and re-runs one block at a time
    in backward (the transient)."""
    D, d, blocks = m.vision.encoder.hidden_size, m.hidden_size, m.vision.encoder.num_layers
    block = vision_block_activations(m.vision)
    outside = d / 2 + 1.25 + m.vision.patch_dim
    if recompute != "none":
        return blocks * D + 5.5 * D + outside, block
    return blocks * block + 5 * D + outside, 0.0


def largest_image_patches(m: ModelConfig, seq_len: int, max_pixels: int) -> tuple[int, int]:
    """(patches of the largest image a row admits, patches of a row filled with such images): the worst row
    a micro-batch can bring the first stage (a square image of max_pixels at most; single frames, since a
    clip's frames merge into the same tokens as one image but bring t times the patches: clips are counted
    at one frame here)."""
    v = m.vision
    unit = v.patch_size * v.encoder.merge
    side = int(max_pixels ** 0.5) // unit * unit
    tokens = (side // unit) ** 2
    per_image = tokens * v.encoder.merge ** 2
    return per_image, max((seq_len + 1) // (tokens + 2), 1) * per_image


def head_activations(m: ModelConfig, vocab_shard: int) -> float:
    """The final mix and norm, the head's input, the logits and the loss's fp32 log-probabilities, per token; and
    per multi-token-prediction block (its decoder layer is counted as a layer) its two input norms, their
    concatenation, the projection, the residual sum, its norm, logits and log-probabilities."""
    d = m.hidden_size
    final_entries = 1 + m.num_layers // m.attn_res.block_size + (m.num_layers % m.attn_res.block_size != 0)
    return _mix(d, final_entries) + 2 * d + 1 + 1.26 * d + 2 * vocab_shard \
        + m.mtp.layers * (7 * d + 2 * vocab_shard)


@dataclass(frozen=True)
class ActivationBytes:
    """One rank's activation bytes for a pipeline stage's layers."""

    mixers: float
    """Kept for backward by the sequence mixers: attention and KDA state."""
    other: float
    transient: float
    """One recomputed layer re-materialised in backward (0 without recomputation)."""
    head: float
    """Final mix and norm, head input, logits and the loss's log-probabilities (last stage only)."""
    host: float = 0.0
    """Saved layer inputs kept in host memory (train.saved_inputs=host), not on the GPU."""

    @property
    def saved(self) -> float:
        return self.mixers + self.other + self.head

    @property
    def peak(self) -> float:
        return self.saved + self.transient


def activation_bytes(m: ModelConfig, layers: list[int], recompute: Recompute, tokens: int, *, act_bytes: int,
                     tp: int = 1, in_flight: float = 1.0, last: bool = True,
                     layer_of: Callable[[int, Recompute], LayerActivations] | None = None,
                     saved_inputs: SavedInputsPolicy = "device", exchanges: bool = True) -> ActivationBytes:
    """Bytes for `tokens` positions of one micro-batch through `layers`, `in_flight` micro-batches kept at
    once, every per-token count divided over tensor (and sequence) parallel; KDA's core elements (saved, or
    re-materialised in the transient) are counted at 4 bytes (fp32 under autocast too), the rest at act_bytes
    (the recomputed layer's transient too: its activations and their gradients are in the compute dtype).
    Under full recomputation `other` is the layers' inputs, kept as saved_inputs says; the host policy keeps
    on the GPU the inputs of PREFETCH_LAYERS layers and every bank entry of the micro-batch in backward;
    what the MoE layers keep around their exchanges (exchanges=False) stays on the device."""
    per_layer = [(layer_of or (lambda i, r: layer_activations(m, i, r, exchanges=exchanges)))(i, recompute)
                 for i in layers]
    scale = tokens / tp * in_flight
    mixers = sum(a.fp32_core * 4 + a.mixer * act_bytes for a in per_layer) * scale
    other = sum(a.other for a in per_layer) * act_bytes * scale
    host = 0.0
    if recompute == "full":
        other, host = saved_input_bytes(saved_inputs, sum(a.other for a in per_layer) * scale, act_bytes)
        if saved_inputs == "host":
            window = min(len(layers), PREFETCH_LAYERS + m.num_layers // m.attn_res.block_size + 1)
            other = window * m.hidden_size * tokens / tp * act_bytes
        other += sum(a.exchanges_kept for a in per_layer) * act_bytes * scale
    transient = max((a.transient_core * 4 + (a.transient - a.transient_core) * act_bytes for a in per_layer),
                    default=0.0) * tokens / tp
    head = head_activations(m, m.vocab_size) * 4 * tokens / tp if last else 0.0
    return ActivationBytes(mixers, other, transient, head, host)
