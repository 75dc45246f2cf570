"""Model configuration: one small dataclass per component (STYLE.md rule 7), each validating itself.

Defaults are the full-size values of docs/model.md; configs/smoke.yaml shrinks them. Cross-field checks
that span components live in ModelConfig.__post_init__ and name every key involved.
"""

from dataclasses import dataclass, field
from typing import Literal

from moe_pretrain.config.errors import require, require_positive


@dataclass
class KDAConfig:
    """Kimi Delta Attention layers (docs/model.md, "KDA")."""

    num_heads: int = 96
    """Heads; each keeps a head_dim x head_dim state."""
    head_dim: int = 128
    """d_k = d_v per head."""
    conv_size: int = 4
    """Kernel of the depthwise causal short convolutions on q, k, v."""
    gate: Literal["lower_bound", "softplus"] = "lower_bound"
    """Decay form: lower_bound * sigmoid(exp(A_log) * (f + dt_bias)), or fla's -exp(A_log) * softplus(f + dt_bias)."""
    lower_bound: float = -5.0
    """Most negative log decay per step in the lower_bound form (alpha >= exp(-5) ~ 0.0067)."""
    chunk_size: int = 64
    """Chunk of the WY/UT chunked algorithm."""

    def __post_init__(self) -> None:
        require_positive("model.kda", num_heads=self.num_heads, head_dim=self.head_dim,
                  conv_size=self.conv_size, chunk_size=self.chunk_size)
        require(self.lower_bound < 0, f"model.kda.lower_bound={self.lower_bound} must be < 0 (a log decay)")


@dataclass
class MLAConfig:
    """Gated Multi-head Latent Attention layers (docs/model.md, "Gated MLA")."""

    num_heads: int = 96
    """Attention heads (split over tensor-parallel ranks)."""
    q_lora_rank: int = 1536
    """Width of the query's low-rank latent (q_down: d -> q_lora_rank, normed, then q_up to the heads)."""
    kv_lora_rank: int = 512
    """Width of the shared key-value latent (kv_down: d -> kv_lora_rank + qk_rope_head_dim); what the latent
    exchange under context parallelism sends."""
    qk_nope_head_dim: int = 128
    """Per-head query / key dims without rotation."""
    qk_rope_head_dim: int = 64
    """Per-head query / key dims rotated under position=rope (even; the key's are shared by all heads)."""
    v_head_dim: int = 128
    """Per-head value width."""
    position: Literal["nope", "rope"] = "nope"
    """nope (full size: the rope dims are never rotated, position comes from KDA) or rope (ablations)."""
    rope_theta: float = 10000.0
    """RoPE base under position=rope (a stage may set its own: stages[i].rope_theta)."""
    lora_norm_eps: float = 1e-6
    """eps of the RMSNorms on the q and kv latents."""

    def __post_init__(self) -> None:
        require_positive("model.mla", num_heads=self.num_heads, q_lora_rank=self.q_lora_rank,
                  kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                  v_head_dim=self.v_head_dim, rope_theta=self.rope_theta)
        require(self.qk_rope_head_dim >= 0 and self.qk_rope_head_dim % 2 == 0,
                 f"model.mla.qk_rope_head_dim={self.qk_rope_head_dim} must be even and >= 0 (rotary pairs)")


@dataclass
class MoEConfig:
    """Stable LatentMoE with SiTU-GLU experts and its balancing (docs/model.md)."""

    num_experts: int = 896
    """Routed experts per MoE layer (split over parallel.ep ranks)."""
    top_k: int = 16
    """Experts each token is routed to (< num_experts)."""
    expert_intermediate: int = 3072
    """SiTU-GLU intermediate width of each routed expert (which works in the latent dim)."""
    latent_size: int = 3584
    """l: routed experts read and write l-dim vectors (W_down: d -> l, W_up: l -> d)."""
    num_shared_experts: int = 2
    """Shared SiTU-GLU experts every token goes through (in full d); 0 = none."""
    shared_intermediate: int = 3072
    """Intermediate width of each shared expert (in full d)."""
    routed_scaling: float = 1.0
    """The routing weights of a token (its selected raw scores, renormalised) sum to this."""
    balancing: Literal["qb", "aux_free", "aux_loss"] = "qb"
    """qb: quantile balancing; aux_free: DeepSeek sign update; aux_loss: classic auxiliary loss."""
    qb_rate: float = 1.0
    """Quantile balancing's step: b_j <- b_j - qb_rate * c_j (1.0: the whole correction each step)."""
    qb_quantile: Literal["histogram", "exact"] = "histogram"
    """How quantile balancing finds each expert's margin quantile over the step's global batch. histogram: from
    integer counts of model.moe.qb_bins bins per expert, every forward's scores dropped once counted (a few MB
    per layer, one collective per pipeline stage per step, error a fraction of a bin: ops/margin_histogram.py).
    exact: every score of the step kept until it ends and the exact quantile found by bisection (the reference;
    at full size ~1.9 GB per MoE layer per rank, 32 collectives per layer)."""
    qb_bins: int = 1000
    """Histogram bins per expert (model.moe.qb_quantile=histogram): width (2 + bias range) / qb_bins."""
    aux_free_rate: float = 1e-3
    """balancing=aux_free: the bias step u of b_i += u * sign(mean load - load_i)."""
    aux_loss_coef: float = 1e-2
    """balancing=aux_loss: the auxiliary load-balancing loss's weight in the loss."""
    situ_beta: float = 4.0
    """SiTU's bound b: SiTU_b(g) = b * tanh(g / b) * sigmoid(g)."""
    situ_linear_beta: float = 25.0
    """The linear branch's bound b_lin: u' = b_lin * tanh(u / b_lin)."""

    def __post_init__(self) -> None:
        require_positive("model.moe", num_experts=self.num_experts, top_k=self.top_k,
                  expert_intermediate=self.expert_intermediate, latent_size=self.latent_size,
                  situ_beta=self.situ_beta, situ_linear_beta=self.situ_linear_beta)
        require(self.qb_bins >= 2, f"model.moe.qb_bins={self.qb_bins} must be >= 2")
        require(self.top_k < self.num_experts,
                 f"model.moe.top_k={self.top_k} must be < model.moe.num_experts={self.num_experts}")
        require(self.num_shared_experts >= 0, f"model.moe.num_shared_experts={self.num_shared_experts} must be >= 0")
        require(self.num_shared_experts == 0 or self.shared_intermediate > 0,
                 "model.moe.shared_intermediate must be > 0 when model.moe.num_shared_experts > 0")


@dataclass
class AttnResConfig:
    """Attention Residuals, block variant (docs/model.md, "AttnRes")."""

    block_size: int = 12
    """Layers per block: each completed block becomes one bank entry."""

    def __post_init__(self) -> None:
        require(self.block_size >= 1, f"model.attn_res.block_size={self.block_size} must be >= 1")


@dataclass
class VisionEncoderConfig:
    """The MoonViT-style vision tower and projector of the model class (model/vision_tower.py). Defaults: the
    released checkpoint's (401,214,464 tower + 46,144,512 projector parameters with hidden_size 7168)."""

    num_layers: int = 27
    """Transformer blocks of the vision tower."""
    hidden_size: int = 1024
    """The tower's width."""
    num_heads: int = 12
    """Attention heads per block."""
    head_dim: int = 128
    """q / k / v width per head: wqkv is hidden_size -> 3 * num_heads * head_dim (4608)."""
    intermediate_size: int = 4096
    """The blocks' MLP width."""
    pos_grid: int = 64
    """The learned position table is pos_grid x pos_grid, resized to each image's patch grid."""
    pos_interpolation: Literal["bilinear", "bicubic"] = "bilinear"
    """How the position table is resized to an image's patch grid."""
    max_frames: int = 4
    """A clip holds at most this many frames (t); the sin/cos time embedding covers them."""
    merge: int = 2
    """merge x merge neighbouring patches become one language-model token (their features concatenated)."""
    rope_theta: float = 10000.0
    """Base of the tower's 2-D rotary embedding."""
    norm_eps: float = 1e-6
    """eps of the tower's norms."""

    def __post_init__(self) -> None:
        require_positive("model.vision.encoder", num_layers=self.num_layers, hidden_size=self.hidden_size,
                         num_heads=self.num_heads, head_dim=self.head_dim, intermediate_size=self.intermediate_size,
                         pos_grid=self.pos_grid, max_frames=self.max_frames, merge=self.merge,
                         rope_theta=self.rope_theta, norm_eps=self.norm_eps)
        require(self.head_dim % 4 == 0, f"model.vision.encoder.head_dim={self.head_dim} must be a multiple of 4 "
                                        "(2-D rotary: x and y frequencies interleaved)")
        require(self.hidden_size % 2 == 0,
                f"model.vision.encoder.hidden_size={self.hidden_size} must be even (sin/cos time embedding)")

    @property
    def merged_size(self) -> int:
        """Width of one merged token: merge x merge patches' features concatenated."""
        return self.merge * self.merge * self.hidden_size


@dataclass
class VisionConfig:
    """Native image input: each image at its own size, cut into patch_size x patch_size patches, encoded by the
    vision tower (`encoder`) and merged into language-model tokens by the projector."""

    patch_size: int = 14
    """Patches are patch_size x patch_size pixels."""
    channels: int = 3
    """Colour channels of an image."""
    encoder: VisionEncoderConfig = field(default_factory=VisionEncoderConfig)

    def __post_init__(self) -> None:
        require_positive("model.vision", patch_size=self.patch_size, channels=self.channels)

    @property
    def patch_dim(self) -> int:
        return self.patch_size * self.patch_size * self.channels


@dataclass
class MTPConfig:
    """Multi-token prediction (the K3 report's §4.1.4; DeepSeek-V3's sequential MTP modules): block k = 1..layers
    takes the previous block's output (the backbone's last hidden state for k = 1) and the embedding of token
    t + k, mixes them (two norms and a projection of their concatenation), runs one decoder layer of the
    backbone's structure (the kind of its last layer) and predicts token t + k + 1 through the shared output
    head. Trained with the model; serving and evaluation use the backbone only."""

    layers: int = 0
    """0: no multi-token prediction."""
    loss_weight: float = 0.1
    """Each block's mean cross-entropy is added to the loss times this (DeepSeek-V3: 0.3, then 0.1)."""

    def __post_init__(self) -> None:
        require(self.layers >= 0, f"model.mtp.layers={self.layers} must be >= 0 (0: off)")
        require(self.loss_weight >= 0, f"model.mtp.loss_weight={self.loss_weight} must be >= 0")


# The full-size stack: MLA at 1-based positions 4, 8, ..., 92 and 93 (docs/model.md).
FULL_LAYER_PATTERN = "KKKM" * 23 + "M"

MIXER_LETTERS: dict[str, str] = {"K": "kda", "M": "mla"}
"""model.layer_pattern's letters and the sequence mixer each names: K Kimi Delta Attention, M gated MLA. Each
kind has its spec in model/mixers.MIXERS (docs/extension.md, "A sequence mixer")."""


@dataclass
class ModelConfig:
    """The whole model; layer i's mixer is layer_pattern[i] (K = KDA, M = gated MLA)."""

    vocab_size: int = 163840
    """Tokens of the vocabulary (embedding and head rows; split over tensor-parallel ranks)."""
    hidden_size: int = 7168
    """d: the residual stream's width."""
    num_layers: int = 93
    """Decoder layers of the backbone (layer_pattern has one letter each)."""
    layer_pattern: str = FULL_LAYER_PATTERN
    """One letter per layer: K (Kimi Delta Attention) or M (gated MLA); full size KKKM x 23 + M."""
    dense_layers: int = 1
    """The first dense_layers layers use a dense SiTU-GLU MLP instead of the LatentMoE."""
    dense_intermediate: int = 33792
    """SiTU-GLU intermediate width of the dense layers' MLP."""
    norm_eps: float = 1e-5
    """eps of the RMSNorms."""
    init_std: float = 0.02
    """Std of the normal initialisation (output projections are scaled down by the depth)."""
    kda: KDAConfig = field(default_factory=KDAConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    attn_res: AttnResConfig = field(default_factory=AttnResConfig)
    vision: VisionConfig = field(default_factory=VisionConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)

    def __post_init__(self) -> None:
        require_positive("model", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                  num_layers=self.num_layers, norm_eps=self.norm_eps, init_std=self.init_std)
        require(len(self.layer_pattern) == self.num_layers,
                 f"model.layer_pattern has {len(self.layer_pattern)} letters but model.num_layers={self.num_layers}")
        bad = sorted(set(self.layer_pattern) - set(MIXER_LETTERS))
        known = ", ".join(f"{letter} ({kind})" for letter, kind in MIXER_LETTERS.items())
        require(not bad, f"model.layer_pattern may hold only {known}, found {bad}")
        require(0 <= self.dense_layers <= self.num_layers,
                 f"model.dense_layers={self.dense_layers} must be in [0, model.num_layers={self.num_layers}]")
        require(self.dense_layers == 0 or self.dense_intermediate > 0,
                 "model.dense_intermediate must be > 0 when model.dense_layers > 0")

    def layer_kind(self, index: int) -> str:
        """Layer index's mixer (MIXER_LETTERS); indices from num_layers on are the multi-token-prediction blocks'
        layers, which mirror the backbone's last."""
        return MIXER_LETTERS[self.layer_pattern[min(index, self.num_layers - 1)]]

    def is_moe_layer(self, index: int) -> bool:
        return index >= self.dense_layers
