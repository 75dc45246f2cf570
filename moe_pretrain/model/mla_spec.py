"""Gated Multi-head Latent Attention's spec (model/mixer_spec.py): what the system knows of an MLA layer without
building it.

Shape legend: d hidden, H heads, Dn / Dr / Dv nope, rope and value head dims (Dqk = Dn + Dr), r_q / r_kv the
query and key-value latent ranks.
- Parameters: the low-rank query (d r_q + r_q + r_q H Dqk) and key-value (d (r_kv + Dr) + r_kv + r_kv H (Dn + Dv))
  projections with their norms, the output gate (d H Dv) and projection (H Dv d).
- Mixing FLOPs per token, training: causal attention over `keys` keys (T / 2 for one document per row),
  3 x 2 H (Dqk + Dv) keys; the backward recomputes the scores, half a forward more (rescoring_flops).
- Saved elements per token (measured: planning/step_activations.py says how): the low-rank projections, heads
  (q, k, v zero-padded to one width, output) and the gate; the attention core saves q, k, v, output and the
  log-sum-exp (flash), never T x T. Under the latent exchange (ops/latent_attention.py) the keys and values are
  never expanded: (2 Dqk + 2 Dv) H + 2 r_kv fewer, then the gathered latent of the other cp - 1 ranks'
  positions (r_kv + Dr each), the log-sum-exp (fp32, H) and three int64 index vectors (2 + cp entries, counted
  as 2 fp32 elements each). mla_up's region gives back 2 r_q + 2 r_kv + 1 (the latent norms' and
  up-projections' inputs; 2 r_q + 1 under the latent exchange, which expands the keys itself), with core also
  the expanded heads, H (3 Dn + 2 Dr + Dv); core's region what selective recomputation gives back.
- Tensor parallelism: the normed input gathered for the gate, the query and key-value latents (after their
  norms) and the shared rotary key gathered, the output reduce-scattered: 2 d + r_q + r_kv + Dr per position.
"""

from gpu_kernels.choice import Kernels
from moe_pretrain.config import ModelConfig
from moe_pretrain.model.mixer_spec import MixerSpec, Region, ReleaseTensor
from moe_pretrain.model.mla import GatedMLA


def saved_elements(m: ModelConfig, selective: bool = False) -> float:
    """Elements an MLA layer keeps per token (all heads) without recomputation, or with its core recomputed."""
    a, d = m.mla, m.hidden_size
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    if selective:
        return 3.66 * a.num_heads * qk + 3.38 * a.num_heads * a.v_head_dim + 3.06 * a.q_lora_rank \
            + 3.04 * a.kv_lora_rank + 1.05 * d + 2
    return 4.15 * a.num_heads * qk + 4.03 * a.num_heads * a.v_head_dim + 3.02 * a.q_lora_rank \
        + 2.96 * a.kv_lora_rank + 2.52 * a.qk_rope_head_dim + 1.04 * d


def saved_by_latent(m: ModelConfig, cp: int, tp: int) -> tuple[float, float]:
    """(fp32 elements, activation-dtype elements) per local token under the latent exchange (the module
    docstring), measured against the document-attention path with saved-tensor hooks (d 64, H 2 / 8, r_kv
    32 / 64, at one rank; within 5 elements). The latent is not split over tensor parallel (every tp rank
    gathers all of it): its share is multiplied by tp here, because the planner divides every count by tp."""
    a = m.mla
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    kept = saved_elements(m) - (2 * qk + 2 * a.v_head_dim) * a.num_heads - 2 * a.kv_lora_rank
    return a.num_heads + 2 * (2 + cp) * tp, kept + (cp - 1) * (a.kv_lora_rank + a.qk_rope_head_dim) * tp


class MLASpec(MixerSpec):
    kind = "mla"
    module = GatedMLA
    plan = (("q_up", "column"), ("kv_up", "column"), ("g_proj", "column"), ("o_proj", "row"))
    replicated = ("q_down", "q_norm", "kv_down", "kv_norm")  # the low-rank down projections and their norms
    release_layers = "full_attn_layers"

    def build(self, d: int, m: ModelConfig, *, init_std: float, out_std: float, kernels: Kernels) -> GatedMLA:
        return GatedMLA(d, m.mla, init_std=init_std, out_std=out_std, kernels=kernels)

    def params(self, m: ModelConfig) -> int:
        d, c = m.hidden_size, m.mla
        H = c.num_heads
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        return d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * H * qk \
            + d * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank \
            + c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim) + d * H * c.v_head_dim + H * c.v_head_dim * d

    def mixing_flops(self, m: ModelConfig, seq_len: int, keys: float | None) -> float:
        a = m.mla
        keys = seq_len / 2 if keys is None else keys
        return 3 * 2 * a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim + a.v_head_dim) * keys

    def rescoring_flops(self, m: ModelConfig, seq_len: int, keys: float | None) -> float:
        # 2.5 forwards in the backward, not 2 (torch's FLOP formulas count it so).
        return self.mixing_flops(m, seq_len, keys) / 6

    def recompute_flops(self, m: ModelConfig, seq_len: int, modules: frozenset[str], exchange: str,
                        keys: float | None) -> float:
        """A recomputed core's forward (none under the latent exchange, which recomputes nothing more) and the
        up-projections mla_up runs again: a region stops once it has what the backward needs
        (torch.utils.checkpoint), so on its own mla_up's query region re-runs the up-projection only where the
        rotary reads it, the key-value region never."""
        a = m.mla
        with_core = "core" in modules and exchange != "latent"
        flops = self.mixing_flops(m, seq_len, keys) / 3 if with_core else 0.0
        if "mla_up" in modules:
            if with_core or (a.position == "rope" and a.qk_rope_head_dim > 0):
                flops += 2 * a.q_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
            if with_core:
                flops += 2 * a.kv_lora_rank * a.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
        return flops

    def tp_widths(self, m: ModelConfig) -> int:
        a = m.mla
        return 2 * m.hidden_size + a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim

    def activations(self, m: ModelConfig, exchange: str, cp: int, tp: int) -> tuple[float, float]:
        return saved_by_latent(m, cp, tp) if exchange == "latent" else (0.0, saved_elements(m))

    def regions(self, m: ModelConfig, modules: frozenset[str], exchange: str, core: float) -> list[Region]:
        a = m.mla
        if exchange == "latent":  # its core keeps only what its backward needs: recomputing it gives nothing back
            up, core = (2 * a.q_lora_rank + 1 if "mla_up" in modules else 0.0), 0.0
        else:
            up = 2 * a.q_lora_rank + 2 * a.kv_lora_rank + 1 if "mla_up" in modules else 0.0
            core = saved_elements(m) - saved_elements(m, selective=True) if "core" in modules else 0.0
            if up and core:
                core += a.num_heads * (3 * a.qk_nope_head_dim + 2 * a.qk_rope_head_dim + a.v_head_dim)
        return [Region(rest=up + core, mixer=up + core)] if up + core else []

    def muon_head_rows(self, m: ModelConfig) -> dict[str, int]:
        a = m.mla
        return {"q_up.weight": a.qk_nope_head_dim + a.qk_rope_head_dim,
                "kv_up.weight": a.qk_nope_head_dim + a.v_head_dim}

    def release_tensors(self, m: ModelConfig) -> list[ReleaseTensor]:
        d, a = m.hidden_size, m.mla
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        return [ReleaseTensor("q_down.weight", "q_a_proj.weight", (a.q_lora_rank, d)),
                ReleaseTensor("q_norm.weight", "q_a_layernorm.weight", (a.q_lora_rank,)),
                ReleaseTensor("q_up.weight", "q_b_proj.weight", (a.num_heads * qk, a.q_lora_rank)),
                ReleaseTensor("kv_down.weight", "kv_a_proj_with_mqa.weight", (a.kv_lora_rank + a.qk_rope_head_dim, d)),
                ReleaseTensor("kv_norm.weight", "kv_a_layernorm.weight", (a.kv_lora_rank,)),
                ReleaseTensor("kv_up.weight", "kv_b_proj.weight",
                              (a.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)),
                ReleaseTensor("g_proj.weight", "g_proj.weight", (a.num_heads * a.v_head_dim, d)),
                ReleaseTensor("o_proj.weight", "o_proj.weight", (d, a.num_heads * a.v_head_dim))]

    def fast_paths(self, module: GatedMLA, off) -> dict[str, str]:
        return {"MLA attention": "FlexAttention, one call per layer" if module.attention == "flex"
                else off("attention", "one SDPA per document")}


MLA = MLASpec()
