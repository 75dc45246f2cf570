"""The whole model built on the meta device: every parameter's name and global shape, nothing allocated.

The one build that shape questions ask: the parallel set-up shards it into a rank's model
(parallel/parallelize.build_model), the memory plan reads its shapes (planning/rank_state.py), the release's
tensor list reads the vision tower's (checkpoint/kimi_k3.py), the checkpoint import plans its tensors from it.
"""

import torch

from gpu_kernels.choice import REFERENCES, Kernels
from moe_pretrain.config import ModelConfig
from moe_pretrain.model.transformer import MoETransformer


def meta_model(m: ModelConfig, kernels: Kernels = REFERENCES) -> MoETransformer:
    """A fresh model of config `m` on the meta device (its modules as `kernels` choose: the parameters are the
    same for every choice)."""
    with torch.device("meta"):
        return MoETransformer(m, kernels)
