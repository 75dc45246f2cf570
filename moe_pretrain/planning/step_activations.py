"""Saved activations of a training step, per token and per layer, from the model's dims.

Shape legend: d hidden, H heads, K / V KDA head dims, C KDA chunk, Dqk / Dv MLA head dims, E experts,
k top-k, L latent, F expert intermediate, S shared intermediate, n AttnRes entries a mix reads.

The coefficients are elements autograd keeps per token, measured on this implementation (saved-tensor
hooks over the tiny model while one dimension at a time was varied, at T = 1024, fp32; least-squares fits
within 0.5% for KDA and the MLPs, 3.4% for MLA) and rounded; recomputing regions keep their inputs only.
They are checked against the live tensor bytes of a step at several lengths (tests/unit/test_activation_memory.py).
What they count, by component:
- KDA, none: the projections, short convolutions and gates (~29 H K) and the chunked op's intermediates:
  ~13 H K, the per-chunk C x C products and solves (3 H C) and the chunk chain's K x K / K x V states
  (3 H K^2 / C, about K V / C each); selective keeps the op's inputs instead of its intermediates.
- MLA: the low-rank projections, heads (q, k, v zero-padded to one width, output) and the gate; the
  attention core itself saves q, k, v, output and the log-sum-exp (flash), never L x L.
- MoE: router scores (fp32, E), k routed copies of the latent rows and of the experts' gate / up /
  activation (3 F each; selective recomputes the experts' MLP), latent norm, shared experts (3 S).
- Each AttnRes mix over n >= 2 entries: 3 d + 2 per entry; each pre-norm 2 d + 1.
- Recomputation by module (train.recompute lists them; measured as the rest, by removing one module at a time
  over 12 shapes of the tiny model, every coefficient exact to 0.5 elements): what each region no longer keeps
  per token (module_savings): attn_res, each mix over n >= 2 entries (3 d + 2) n - d (the region keeps its
  newest entry, the partial sum, alive); norms, each pre-norm d + 1 (it keeps its input); both, one region,
  (3 d + 2) n + d + 1 (and d + 1 for a one-entry mix's norm); kda_pre 15 H K + 2 H + 8.5, with core also the
  op's inputs, 4 H K; mla_up 2 r_q + 2 r_kv + 1 (the latent norms' and up-projections' inputs), with core also the
  expanded heads, H (3 Dn + 2 Dr + Dv); core as selective; experts as selective; expert_act the SiTU-GLU outputs,
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
kda_core elements are 4 bytes, the others the activation dtype's (not yet measured on a GPU).
"""

from collections.abc import Callable
from dataclasses import dataclass

from moe_pretrain.config import ModelConfig, VisionConfig
from moe_pretrain.config.recompute import recompute_modules
from moe_pretrain.model.saved_inputs import PREFETCH_LAYERS, SavedInputsPolicy, saved_input_bytes

Recompute = str
"""none, selective, full or a comma-separated list of modules (config/recompute.py)."""


@dataclass(frozen=True)
class LayerActivations:
    """Saved elements per token of one layer: the sequence mixer's fp32 core (KDA's chunked op), the mixer's
    other elements, everything else; and what one recomputation re-materialises at a time in backward."""

    kda_core: float
    mixer: float
    other: float
    transient: float
    transient_core: float = 0.0
    """Of the transient, KDA's fp32 core (4 bytes an element; the rest in the activation dtype)."""
    exchanges_kept: float = 0.0
    """Under full recomputation that does not repeat the expert exchanges, what the MoE layer keeps on the
    device beside the layer's inputs (exchanges_kept)."""

    @property
    def total(self) -> float:
        return self.kda_core + self.mixer + self.other


def _kda(m: ModelConfig) -> tuple[float, float]:
    """(core, rest) for recompute none."""
    k, d = m.kda, m.hidden_size
    H, K, C = k.num_heads, k.head_dim, k.chunk_size
    rest = 28.87 * H * K + 1.18 * d + 13
    core = 13.08 * H * K + 2.98 * H * C + 2.89 * H * K * K / C + 17
    return core, rest


def _mla(m: ModelConfig, recompute: Recompute) -> float:
    a, d = m.mla, m.hidden_size
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    if recompute == "selective":
        return 3.66 * a.num_heads * qk + 3.38 * a.num_heads * a.v_head_dim + 3.06 * a.q_lora_rank \
            + 3.04 * a.kv_lora_rank + 1.05 * d + 2
    return 4.15 * a.num_heads * qk + 4.03 * a.num_heads * a.v_head_dim + 3.02 * a.q_lora_rank \
        + 2.96 * a.kv_lora_rank + 2.52 * a.qk_rope_head_dim + 1.04 * d


def _mla_by_latent(m: ModelConfig, cp: int, tp: int) -> tuple[float, float]:
    """(fp32 elements, activation-dtype elements) per local token of an MLA layer under the latent exchange
    (ops.latent_attention). Measured against the document-attention path with saved-tensor hooks (d 64,
    H 2 / 8, kv_lora_rank 32 / 64, at one rank): it saves (2 qk + 2 Dv) H + 2 r fewer elements (no expanded
    keys and values, no normed latent; within 5 elements of the fit), and then the gathered latent of the
    other cp - 1 ranks' positions (r + Dr per position), the log-sum-exp (fp32, H) and three int64 index
    vectors (counted as 2 fp32 elements per entry: 2 + cp entries per local token). The latent is not split
    over tensor parallel (every tp rank gathers all of it): its share is multiplied by tp here, because
    activation_bytes divides every count by tp."""
    a = m.mla
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    kept = _mla(m, "none") - (2 * qk + 2 * a.v_head_dim) * a.num_heads - 2 * a.kv_lora_rank
    return a.num_heads + 2 * (2 + cp) * tp, kept + (cp - 1) * (a.kv_lora_rank + a.qk_rope_head_dim) * tp


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
    mla_exchange: how an MLA layer attends across cp ranks (latent: _mla_by_latent); exchanges: whether full
    recomputation repeats the MoE layer's expert exchanges (train.recompute_exchanges)."""
    d = m.hidden_size
    attn_entries, mlp_entries = mix_entries(m, index)
    norms_and_mixes = 2 * (2 * d + 1) + _mix(d, attn_entries) + _mix(d, mlp_entries)
    latent = m.layer_kind(index) == "mla" and mla_exchange == "latent"
    if m.layer_kind(index) == "kda":
        core, mixer = _kda(m)
    elif latent:
        core, mixer = _mla_by_latent(m, cp, tp)
    else:
        core, mixer = 0.0, _mla(m, "none")
    other = norms_and_mixes + _mlp(m, index, "none")
    if recompute == "none":
        return LayerActivations(core, mixer, other, 0.0)
    if recompute == "full":
        # The layer keeps its inputs (the running partial sum, or the bank entry a block's first layer
        # closes: d per token per layer) and backward re-runs it whole, one layer at a time.
        kept = 0.0 if exchanges or not m.is_moe_layer(index) else exchanges_kept(m)
        return LayerActivations(0.0, 0.0, d, core + mixer + other, core, kept)
    regions = module_savings(m, index, recompute_modules(recompute), latent, core)
    # A region's transient is what it no longer keeps; the largest is picked by its bytes at bf16 (KDA's core
    # elements are fp32 in any dtype), the training dtype at full size.
    saved_core = core - sum(r.core for r in regions)
    largest = max(regions, key=lambda r: r.core * 4 + r.rest * 2, default=Region())
    return LayerActivations(saved_core, mixer - sum(r.mixer for r in regions),
                            other - sum(r.rest - r.mixer for r in regions), largest.core + largest.rest, largest.core)


@dataclass(frozen=True)
class Region:
    """What one recomputed region no longer keeps per token: KDA's fp32 core elements, and the rest (of which
    `mixer` are the sequence mixer's)."""

    core: float = 0.0
    rest: float = 0.0
    mixer: float = 0.0


def module_savings(m: ModelConfig, index: int, modules: frozenset[str], latent: bool = False,
                   kda_core: float = 0.0) -> list[Region]:
    """The regions train.recompute's modules make in layer `index` (model/recompute.py), each with what it no
    longer keeps (the module docstring's measured counts); latent: MLA under the latent exchange, whose core
    keeps only what its backward needs (core adds nothing) and whose keys are expanded by the exchange
    (mla_up recomputes the queries' side only: 2 r_q + 1, counted, not measured)."""
    d, regions = m.hidden_size, []
    for entries in mix_entries(m, index):
        mixes, norms = "attn_res" in modules and entries >= 2, "norms" in modules
        if mixes and norms:
            regions.append(Region(rest=_mix(d, entries) + d + 1))
        elif mixes:
            regions.append(Region(rest=_mix(d, entries) - d))
        elif norms:
            regions.append(Region(rest=d + 1))
    if m.layer_kind(index) == "kda":
        k = m.kda
        HK = k.num_heads * k.head_dim
        pre = 15 * HK + 2 * k.num_heads + 8.5 if "kda_pre" in modules else 0.0
        if "core" in modules:
            inputs = 4 * HK if pre else 0.0
            regions.append(Region(core=kda_core, rest=pre + inputs, mixer=pre + inputs))
        elif pre:
            regions.append(Region(rest=pre, mixer=pre))
    else:
        a = m.mla
        if latent:
            up = 2 * a.q_lora_rank + 1 if "mla_up" in modules else 0.0
            core = 0.0
        else:
            up = 2 * a.q_lora_rank + 2 * a.kv_lora_rank + 1 if "mla_up" in modules else 0.0
            core = _mla(m, "none") - _mla(m, "selective") if "core" in modules else 0.0
            if up and core:
                core += a.num_heads * (3 * a.qk_nope_head_dim + 2 * a.qk_rope_head_dim + a.v_head_dim)
        if up + core:
            regions.append(Region(rest=up + core, mixer=up + core))
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
    mixers = sum(a.kda_core * 4 + a.mixer * act_bytes for a in per_layer) * scale
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
