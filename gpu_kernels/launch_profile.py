"""The kernels one custom op launches, for ops that stand for several (a library's fused chain: fla's chunk KDA).

The op census (moe_pretrain/planning/op_census.py) counts a custom op as one launch that reads its arguments and
writes its results, which is what our own Triton ops are. A library entry point that runs several kernels and
keeps tensors between them in memory registers here instead what it launches: each kernel with its FLOPs and
the bytes of the tensors it is handed, from the op's shapes. The census, fake or real, then prices the op as
the library runs it. Each profile is checked against the library's own code (tests/unit/test_fla_ops.py counts
fla's Triton launches under fake tensors).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Launch:
    kernel: str
    flops: int
    bytes: int
    """Bytes of the tensors the kernel is handed (read or written), as the census counts an op's."""


Profile = Callable[..., list[Launch]]
"""(op's args..., out=op's results) -> its launches in order."""

PROFILES: dict[object, Profile] = {}
"""The custom ops (by overload packet) priced by their launches rather than as one."""


def register_launches(op: torch._ops.OpOverloadPacket) -> Callable[[Profile], Profile]:
    def register(profile: Profile) -> Profile:
        PROFILES[op] = profile
        return profile

    return register
