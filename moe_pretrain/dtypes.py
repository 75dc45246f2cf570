"""train.dtype's names in one table: the dtype a run computes in, the one its parameters are built in, and
their bytes (what the memory plan counts per element).

bf16 keeps fp32 master weights and runs the matmuls under autocast (Megatron's recipe); fp32 and fp64 run the
whole model in that dtype. train.param_dtype=bfloat16 then holds the matmuls' weights in bf16 beside their fp32
masters (model/linear.py, planning/rank_state.py).
"""

import torch

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
"""train.dtype -> the compute dtype (bf16: autocast's)."""


def parameter_dtype(name: str) -> torch.dtype:
    """The dtype a model of train.dtype=`name` builds its parameters in (fp32 under bf16 autocast)."""
    dtype = DTYPES[name]
    return torch.float32 if dtype == torch.bfloat16 else dtype


def compute_bytes(name: str) -> int:
    """Bytes of an activation element under train.dtype=`name`."""
    return DTYPES[name].itemsize


def parameter_bytes(name: str) -> int:
    """Bytes of a parameter element as built under train.dtype=`name`."""
    return parameter_dtype(name).itemsize
