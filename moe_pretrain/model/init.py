"""Layout-independent initialisation: every initial value is a function of (seed, global parameter name,
global element index) only, so a rank can draw exactly its shard and any layout starts from the same model.

Each module declares how its parameters start (`param_init`: leaf name -> distribution); nothing is drawn
when a module is built (models are built on the meta device). A parameter's values come from its own
Philox stream (numpy's counter-based generator, keyed by a hash of seed and name): element i of the
flattened global tensor is the i-th uniform double of that stream, mapped to the distribution through an
inverse CDF, so each element uses exactly one draw and a shard seeks straight to its elements (Philox's
counter c yields words 4c .. 4c + 3). A box of a tensor is drawn as its contiguous runs in row-major order:
one run for a dimension-0 shard, one per row for a column shard.
"""

import hashlib
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

HALF_ULP = 2.0 ** -54
"""Added to numpy's uniforms k * 2^-53 so they lie strictly inside (0, 1): the inverse CDFs stay finite."""


@dataclass(frozen=True)
class Normal:
    std: float

    def from_uniform(self, u: torch.Tensor) -> torch.Tensor:
        return self.std * torch.special.ndtri(u)


@dataclass(frozen=True)
class Uniform:
    low: float
    high: float

    def from_uniform(self, u: torch.Tensor) -> torch.Tensor:
        return self.low + (self.high - self.low) * u


@dataclass(frozen=True)
class LogUniform:
    """exp(U(log low, log high)); the log of it with `log=True` (A_log under fla's softplus gate)."""

    low: float
    high: float
    log: bool = False

    def from_uniform(self, u: torch.Tensor) -> torch.Tensor:
        logs = math.log(self.low) + (math.log(self.high) - math.log(self.low)) * u
        return logs if self.log else logs.exp()


@dataclass(frozen=True)
class InverseSoftplusLogUniform:
    """softplus^-1(dt) with dt log-uniform in [low, high] (KDA's dt_bias, docs/model.md)."""

    low: float
    high: float

    def from_uniform(self, u: torch.Tensor) -> torch.Tensor:
        dt = LogUniform(self.low, self.high).from_uniform(u)
        return dt + torch.log(-torch.expm1(-dt))


@dataclass(frozen=True)
class Constant:
    value: float


Init = Normal | Uniform | LogUniform | InverseSoftplusLogUniform | Constant


def philox_key(seed: int, name: str) -> np.ndarray:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=16).digest()
    return np.frombuffer(digest, dtype=np.uint64).copy()


def uniform_run(key: np.ndarray, start: int, count: int) -> np.ndarray:
    """Uniform doubles start .. start + count - 1 of the stream with this key."""
    generator = np.random.Generator(np.random.Philox(key=key, counter=start // 4))
    return generator.random(count + start % 4)[start % 4:]


def box_uniforms(seed: int, name: str, shape: tuple[int, ...], offsets: tuple[int, ...],
                 sizes: tuple[int, ...]) -> torch.Tensor:
    """The uniforms of the box [offsets, offsets + sizes) of a tensor of `shape`, float64 [sizes]."""
    key = philox_key(seed, name)
    ndim = len(shape)
    # The innermost dimension k such that every dimension after k is whole: runs cover dims k.. .
    k = ndim - 1
    while k > 0 and sizes[k] == shape[k] and offsets[k] == 0:
        k -= 1
    strides = [math.prod(shape[j + 1:]) for j in range(ndim)]
    run = sizes[k] * strides[k] if ndim else 1
    out = np.empty(math.prod(sizes), dtype=np.float64)
    if out.size:
        for i, index in enumerate(np.ndindex(*sizes[:k])):
            start = sum((offsets[j] + index[j]) * strides[j] for j in range(k)) + offsets[k] * strides[k]
            out[i * run:(i + 1) * run] = uniform_run(key, start, run)
    return torch.from_numpy(out + HALF_ULP).reshape(sizes)


def draw(init: Init, seed: int, name: str, shape: tuple[int, ...], offsets: tuple[int, ...] | None = None,
         sizes: tuple[int, ...] | None = None) -> torch.Tensor:
    """Initial values of the box (default: the whole tensor) of parameter `name`, float64."""
    offsets = offsets if offsets is not None else (0,) * len(shape)
    sizes = sizes if sizes is not None else tuple(shape)
    if isinstance(init, Constant):
        return torch.full(sizes, init.value, dtype=torch.float64)
    return init.from_uniform(box_uniforms(seed, name, tuple(shape), tuple(offsets), tuple(sizes)))


def parameter_inits(model: nn.Module) -> dict[str, Init]:
    """Every parameter's declared distribution, by name; a parameter without one is a model bug."""
    inits = {}
    for module_name, module in model.named_modules():
        declared = getattr(module, "param_init", {})
        for leaf, _ in module.named_parameters(recurse=False):
            name = f"{module_name}.{leaf}" if module_name else leaf
            if leaf not in declared:
                raise TypeError(f"parameter {name} ({type(module).__name__}.{leaf}) declares no initialisation "
                                "(param_init)")
            inits[name] = declared[leaf]
    return inits


@torch.no_grad()
def initialize(model: nn.Module, seed: int) -> nn.Module:
    """Fill every parameter of a whole (unsharded, materialised) model from its declared distribution;
    buffers are left as built. The sharded path (parallel/parallelize.py) draws the same values."""
    for name, init in parameter_inits(model).items():
        param = model.get_parameter(name)
        param.copy_(draw(init, seed, name, tuple(param.shape)))
    return model
