"""Kimi Delta Attention's spec (model/mixer_spec.py): what the system knows of a KDA layer without building it.

Shape legend: d hidden, H heads, K = V head dim, C chunk, k conv taps.
- Parameters: q, k, v projections (3 d H K), their short convolutions (3 H K k), the low-rank decay logits
  (d K + K H K), A_log and dt_bias (H + H K), beta (d H), the output gate (d H K), the output norm (K) and
  projection (H K d).
- Mixing FLOPs per token, training: the chunked algorithm per head, 3 (2 C K + C (K + V) + C V + 6 K V).
- Saved elements per token (measured: planning/step_activations.py says how): the projections, convolutions
  and gates ~29 H K; the chunked op's intermediates, fp32 in any dtype: ~13 H K, the per-chunk C x C products
  and solves (3 H C) and the chunk chain's K x K / K x V states (3 H K^2 / C). kda_pre's region gives back
  15 H K + 2 H + 8.5, core's the op's intermediates, with kda_pre also the op's inputs (4 H K).
- Tensor parallelism: the normed input gathered once for its five column projections, the decay's K-wide
  low-rank input gathered for f_b, the output reduce-scattered: 2 d + K values per position.
"""

from gpu_kernels.choice import Kernels
from moe_pretrain.config import ModelConfig
from moe_pretrain.model.kda import KimiDeltaAttention
from moe_pretrain.model.mixer_spec import MixerSpec, Region, ReleaseTensor


class KDASpec(MixerSpec):
    kind = "kda"
    module = KimiDeltaAttention
    plan = (("q_proj", "column"), ("k_proj", "column"), ("v_proj", "column"), ("f_b_proj", "column"),
            ("b_proj", "column"), ("g_proj", "column"), ("o_proj", "row"),
            # Per-head decay parameters and short convolutions: the heads a rank holds.
            ("q_conv", "heads"), ("k_conv", "heads"), ("v_conv", "heads"), ("A_log", "heads"), ("dt_bias", "heads"))
    replicated = ("f_a_proj", "o_norm_weight")  # the decay's low-rank input; one output norm shared by the heads
    release_layers = "kda_layers"

    def build(self, d: int, m: ModelConfig, *, init_std: float, out_std: float, kernels: Kernels
              ) -> KimiDeltaAttention:
        return KimiDeltaAttention(d, m.kda, norm_eps=m.norm_eps, init_std=init_std, out_std=out_std, kernels=kernels)

    def params(self, m: ModelConfig) -> int:
        d, c = m.hidden_size, m.kda
        H, K = c.num_heads, c.head_dim
        inner = H * K
        return 3 * d * inner + 3 * inner * c.conv_size + d * K + K * inner + H + inner + d * H + d * inner + K \
            + inner * d

    def mixing_flops(self, m: ModelConfig, seq_len: int, keys: float | None) -> float:
        k = m.kda
        C, K, V = k.chunk_size, k.head_dim, k.head_dim
        return 3 * k.num_heads * (2 * C * K + C * (K + V) + C * V + 6 * K * V)

    def tp_widths(self, m: ModelConfig) -> int:
        return 2 * m.hidden_size + m.kda.head_dim

    def activations(self, m: ModelConfig, exchange: str, cp: int, tp: int) -> tuple[float, float]:
        k, d = m.kda, m.hidden_size
        H, K, C = k.num_heads, k.head_dim, k.chunk_size
        core = 13.08 * H * K + 2.98 * H * C + 2.89 * H * K * K / C + 17
        return core, 28.87 * H * K + 1.18 * d + 13

    def regions(self, m: ModelConfig, modules: frozenset[str], exchange: str, core: float) -> list[Region]:
        k = m.kda
        HK = k.num_heads * k.head_dim
        pre = 15 * HK + 2 * k.num_heads + 8.5 if "kda_pre" in modules else 0.0
        if "core" in modules:
            inputs = 4 * HK if pre else 0.0
            return [Region(core=core, rest=pre + inputs, mixer=pre + inputs)]
        return [Region(rest=pre, mixer=pre)] if pre else []

    def muon_head_rows(self, m: ModelConfig) -> dict[str, int]:
        return dict.fromkeys(("q_proj.weight", "k_proj.weight", "v_proj.weight"), m.kda.head_dim)

    def release_tensors(self, m: ModelConfig) -> list[ReleaseTensor]:
        d, k = m.hidden_size, m.kda
        proj = k.num_heads * k.head_dim
        return [ReleaseTensor("q_proj.weight", "q_proj.weight", (proj, d)),
                ReleaseTensor("q_conv.weight", "q_conv1d.weight", (proj, 1, k.conv_size), "conv"),
                ReleaseTensor("k_proj.weight", "k_proj.weight", (proj, d)),
                ReleaseTensor("k_conv.weight", "k_conv1d.weight", (proj, 1, k.conv_size), "conv"),
                ReleaseTensor("v_proj.weight", "v_proj.weight", (proj, d)),
                ReleaseTensor("v_conv.weight", "v_conv1d.weight", (proj, 1, k.conv_size), "conv"),
                ReleaseTensor("f_a_proj.weight", "f_a_proj.weight", (k.head_dim, d)),
                ReleaseTensor("f_b_proj.weight", "f_b_proj.weight", (proj, k.head_dim)),
                ReleaseTensor("A_log", "A_log", (k.num_heads,), "a_log"),
                ReleaseTensor("dt_bias", "dt_bias", (proj,)),
                ReleaseTensor("b_proj.weight", "b_proj.weight", (k.num_heads, d)),
                ReleaseTensor("g_proj.weight", "g_proj.weight", (proj, d)),
                ReleaseTensor("o_norm_weight", "o_norm.weight", (k.head_dim,)),
                ReleaseTensor("o_proj.weight", "o_proj.weight", (d, proj))]

    def fast_paths(self, module: KimiDeltaAttention, off) -> dict[str, str]:
        return {"KDA": "fla chunk_kda (Triton)" if module.fla else off("kda", "PyTorch chunk form")}


KDA = KDASpec()
