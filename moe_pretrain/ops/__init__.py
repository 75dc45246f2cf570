"""The functional core: the model's math as plain functions over tensors (public API).

Later layers (parallel wrappers, kernels, tests) call these by name; keep the signatures stable.
"""

from moe_pretrain.ops.attn_res import attn_res_mix
from moe_pretrain.ops.grouped_mm import grouped_mm
from moe_pretrain.ops.kda import kda, kda_recurrent
from moe_pretrain.ops.norms import l2_norm, rms_norm
from moe_pretrain.ops.routing import (
    aux_free_update,
    expert_load,
    load_balancing_loss,
    quantile_balance_margins,
    quantile_balance_update,
    route,
    router_scores,
)
from moe_pretrain.ops.situ import situ, situ_glu

__all__ = [
    "attn_res_mix",
    "aux_free_update",
    "expert_load",
    "grouped_mm",
    "kda",
    "kda_recurrent",
    "l2_norm",
    "load_balancing_loss",
    "quantile_balance_margins",
    "quantile_balance_update",
    "rms_norm",
    "route",
    "router_scores",
    "situ",
    "situ_glu",
]
