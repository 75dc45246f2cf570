"""Per-rank state memory of a layout, from the sharding plan and the meta model: nothing is allocated.

For each pipeline rank (stage), the worst rank of that stage holds: parameters (its tensor / expert shards
of the stage's layers, in the parameter dtype: fp32 under bf16 training), gradients (one buffer of the same
size: parallel/optimizer.py keeps them flat), and Adam's two moments for its ZeRO-1 slice, i.e. each
parameter's moments divided over its gradient-reduce group (data parallel for tensor shards, tensor x data
parallel for replicated parameters, expert-data parallel for routed experts); with optim.name=muon, one
momentum for the parameters Muon takes (training/muon_params.py), and Muon's work per step: its Newton-Schulz
FLOPs and the bytes its exchange sends (parallel/muon.py), both per rank of the stage. The optimizer's master slice
is a view of the parameters and costs nothing. Under bf16 autocast the matmuls' weights are also held in bf16
through each step's forwards and backwards: every linear layer's but the routers' (which run in fp32) in
autocast's cast cache, which lives as long as the trainer's autocast region around the whole step, and the
routed experts' stacked weights (step_reuse.py: cast once, reused by every
micro-batch), with their FP8 copies besides under FP8: "compute_copy_bytes", apart from the state because
they are dropped before the optimizer step (in effect megatron-core's bf16 parameters beside fp32 masters).
Under train.param_dtype=bfloat16 those weights are held in bf16 and take no step copy (FP8's stay): their
parameters cost 2 bytes an element, their gradients train.grad_dtype's, and the optimizer holds the fp32
master of its slice beside the moments; the edp / dp all-gathers send bf16.
The reduce-scattered gradient shards the optimizer steps with ("grad_shard_bytes") live from the last
backward to the step's end. Activations, communication buffers and the allocator's
slack are not counted. Within a stage every rank holds the same amounts (even splits), so a stage's worst
rank is any of them; the first global rank of the stage is reported (megatron-core orders ranks
tp-cp-ep-dp-pp, so pipeline rank p starts at p x world / pp).
"""

import copy
import math

import torch

from moe_pretrain.config import Config, ConfigError
from moe_pretrain.dtypes import parameter_bytes
from moe_pretrain.model.linear import cast_weight_names
from moe_pretrain.model.meta import meta_model
from moe_pretrain.ops.newton_schulz import STEPS
from moe_pretrain.training.muon_params import as_matrices, muon_rule
from parallel.plan import ShardingPlan, chunks_of_rank, pipeline_chunks, pipeline_rank_of
from parallel.state import ParallelLayout, resolve_layout

FP8_COPY_BYTES = 2
"""Bytes per routed-expert weight element of its FP8 copies: one for the forward, one for the transposed copy
the backward's dx = dy W reads (fp8/experts.py); scales are ignored. Not yet checked by a dry run."""


def compute_copy_width(cfg: Config) -> int:
    """Bytes each routed-expert weight element's per-step compute copies take (see the module docstring): a bf16
    copy unless the weights are held in bf16 already (train.param_dtype), and FP8's beside either."""
    if cfg.train.dtype != "bfloat16":
        return 0
    return (2 if cfg.train.param_dtype == "float32" else 0) + (FP8_COPY_BYTES if cfg.precision.fp8 != "off" else 0)


def parse_layout(text: str) -> dict[str, int]:
    """'tp=8,pp=16,ep=128,dp=32' -> {'tp': 8, ...}; cp and vpp default to 1."""
    sizes = {"tp": 1, "pp": 1, "ep": 1, "dp": 1, "cp": 1, "vpp": 1}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key.strip() not in sizes or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"--layout {text!r}: expected comma-separated tp=, pp=, ep=, dp=, cp=, vpp= "
                              f"positive integers, got {item!r}")
        sizes[key.strip()] = int(value)
    return sizes


def per_rank_bytes(cfg: Config, layout_text: str) -> dict:
    sizes = parse_layout(layout_text)
    cfg = copy.deepcopy(cfg)
    for key in ("tp", "pp", "ep", "cp", "vpp"):
        setattr(cfg.parallel, key, sizes[key])
    world = sizes["tp"] * sizes["pp"] * sizes["cp"] * sizes["dp"]
    layout = resolve_layout(cfg, world)
    shapes = parameter_shapes(cfg)
    problems = ShardingPlan().check_divisible(shapes, layout.tp, layout.ep)
    if problems:
        raise ConfigError("invalid parallel layout for this model: " + "; ".join(problems))
    stages = stage_state_bytes(cfg, shapes, layout)
    worst = max(stages, key=lambda s: s["total_bytes"])
    return {"layout": {**sizes, "world_size": world, "edp": layout.edp},
            "param_dtype_bytes": parameter_bytes(cfg.train.dtype), "stages": stages, "worst": worst}


_MODEL_FACTS: dict[str, tuple[dict[str, tuple[int, ...]], frozenset[str]]] = {}
"""Per model config's text: its parameters' shapes and autocast's weights, from one meta build (the layout
search asks once per run layout)."""


def _model_facts(cfg: Config) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    key = repr(cfg.model)
    if key not in _MODEL_FACTS:
        model = meta_model(cfg.model)
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        _MODEL_FACTS[key] = shapes, cast_weight_names(model)
    return _MODEL_FACTS[key]


def parameter_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Every parameter's global shape, from the meta model (nothing allocated)."""
    return dict(_model_facts(cfg)[0])


def autocast_weights(cfg: Config) -> frozenset[str]:
    """Names of the parameters the matmuls read as autocast's copies (model/linear.py cast_weight_names): every
    linear layer's weight and bias but the routers', the routed experts' (see the module docstring)."""
    return _model_facts(cfg)[1]


def stage_state_bytes(cfg: Config, shapes: dict[str, tuple[int, ...]], layout: ParallelLayout) -> list[dict]:
    """Per pipeline rank: parameters, gradients and ZeRO-1 Adam moments of its worst (any) rank."""
    plan = ShardingPlan()
    # Gradients reduce (and ZeRO-1 shards) over data x context parallel ranks: each cp rank saw other positions.
    group_size = {"dp_group": layout.dp * layout.cp, "tp_dp_group": layout.tp * layout.dp * layout.cp,
                  "edp_group": layout.edp}
    width = parameter_bytes(cfg.train.dtype)
    held = 2 if cfg.train.param_dtype == "bfloat16" else width
    """Bytes of a cast weight's element as held (train.param_dtype), and of its gradient (train.grad_dtype)."""
    grad = 2 if cfg.train.grad_dtype == "bfloat16" else width
    chunks = pipeline_chunks(cfg)
    params = [0] * layout.pp
    experts = [0] * layout.pp
    """Per stage: routed-expert weight elements (their compute copies)."""
    copied = [0] * layout.pp
    """Per stage: the other cast weights' elements (autocast's copies)."""
    cast = autocast_weights(cfg) if cfg.train.dtype == "bfloat16" else frozenset()
    linear = cast if held == width else frozenset()
    """Weights copied for each step: the cast ones, unless they are held in the compute dtype already."""
    low = [dict.fromkeys(group_size, 0) for _ in range(layout.pp)]
    """Per stage and reduction group: elements held in bf16 (an fp32 master of the slice in the optimizer)."""
    reduced = [dict.fromkeys(group_size, 0) for _ in range(layout.pp)]
    muon = [dict.fromkeys(group_size, 0) for _ in range(layout.pp)]
    """Per stage and reduction group: elements Muon takes (one momentum instead of two moments)."""
    flops = [0.0] * layout.pp
    """Per stage: Newton-Schulz FLOPs of a step, per rank (owners balance the group's matrices)."""
    joins = [0.0] * layout.pp
    """Per stage: elements a rank receives joining tensor-parallel slices of whole-matrix rules."""
    for name, shape in shapes.items():
        pp_rank = pipeline_rank_of(name, chunks, layout.pp)
        placement = plan.placement(name)
        local = placement.local_shape(shape, layout.tp, layout.ep)
        numel = math.prod(local)
        params[pp_rank] += numel
        experts[pp_rank] += numel if placement.expert_dim is not None else 0
        copied[pp_rank] += numel if name in linear and placement.expert_dim is None else 0
        reduced[pp_rank][placement.reduce_group] += numel
        low[pp_rank][placement.reduce_group] += numel if held != width and name in cast else 0
        rule = muon_rule(name, torch.empty(local, device="meta"), cfg.model) if cfg.optim.name == "muon" else None
        if rule is not None:
            muon[pp_rank][placement.reduce_group] += numel
            joined = placement.tensor_dim is not None and rule.head_rows == 0
            matrices = as_matrices(torch.empty(shape if joined else local, device="meta"))
            rows, columns = matrices.shape[-2:]
            blocks = math.prod(matrices.shape[:-2]) * (rows // (rule.head_rows or rows))
            # A joined matrix is orthogonalised whole on each of its tp owners: its cost is not divided by tp.
            flops[pp_rank] += blocks * newton_schulz_flops(rule.head_rows or rows, columns) / group_size[
                placement.reduce_group]
            if joined and layout.tp > 1:
                joins[pp_rank] += numel * (layout.tp - 1) / group_size[placement.reduce_group]
    stages = []
    for pp_rank in range(layout.pp):
        moments = sum(2 * math.ceil(n / group_size[g]) - math.ceil(muon[pp_rank][g] / group_size[g])
                      for g, n in reduced[pp_rank].items())
        # Each all-to-all sends the slice's pieces owned elsewhere, (size - 1) / size of it, twice a step (the dp
        # column); the joins (the tp column) all-gather the tp slices of the whole-matrix rules' matrices it owns.
        exchange = sum(2 * math.ceil(n / size) * (size - 1) / size
                       for g, n in muon[pp_rank].items() if (size := group_size[g]) > 1)
        lows = sum(low[pp_rank].values())
        masters = sum(math.ceil(n / group_size[g]) for g, n in low[pp_rank].items())
        stage = {"pp_rank": pp_rank, "rank": pp_rank * layout.world_size // layout.pp,
                 "layers": [i for c in chunks_of_rank(len(chunks), layout.pp, pp_rank) for i in chunks[c]],
                 "params": params[pp_rank], "param_bytes": (params[pp_rank] - lows) * width + lows * held,
                 "grad_bytes": (params[pp_rank] - lows) * width + lows * grad,
                 "optimizer_bytes": (moments + masters) * width,
                 # What a save writes: the parameters held in their own dtype, the masters of the others, moments.
                 "checkpoint_bytes": (params[pp_rank] - lows + moments + masters) * width,
                 "muon_flops": flops[pp_rank], "muon_exchange_bytes": exchange * width,
                 "muon_join_bytes": joins[pp_rank] * width,
                 "muon_momentum_bytes": sum(math.ceil(n / group_size[g]) for g, n in muon[pp_rank].items()) * width,
                 "compute_copy_bytes": experts[pp_rank] * compute_copy_width(cfg) + copied[pp_rank] * 2,
                 # Per group: (size, bytes reduce-scattered, bytes all-gathered) a step.
                 "reduce_groups": [(group_size[g], (n - low[pp_rank][g]) * width + low[pp_rank][g] * grad,
                                    (n - low[pp_rank][g]) * width + low[pp_rank][g] * held)
                                   for g, n in reduced[pp_rank].items()],
                 "grad_shard_bytes": sum(math.ceil(n / group_size[g]) for g, n in reduced[pp_rank].items()) * width}
        stage["total_bytes"] = stage["param_bytes"] + stage["grad_bytes"] + stage["optimizer_bytes"]
        stages.append(stage)
    return stages


def newton_schulz_flops(rows: int, columns: int) -> float:
    """FLOPs of Newton-Schulz on one [rows, columns] matrix (ops/newton_schulz.py): per step the Gram matrix
    (2 m^2 n), its square (2 m^3) and the product with X (2 m^2 n), m <= n the sides."""
    m, n = sorted((rows, columns))
    return STEPS * (4 * m * m * n + 2 * m**3)


def describe(result: dict) -> str:
    gb = 1e9
    lay = result["layout"]
    lines = [f"layout tp={lay['tp']} pp={lay['pp']} ep={lay['ep']} dp={lay['dp']} (world {lay['world_size']}, "
             f"expert-data parallel {lay['edp']}); per rank, GB (1e9 B): params + grads + Adam moments",
             f"{'stage':>5} {'rank':>6} {'layers':>9} {'params':>12} {'params':>8} {'grads':>8} {'optim':>8} "
             f"{'total':>8}"]
    for s in result["stages"]:
        layers = f"{s['layers'][0]}-{s['layers'][-1]}" if s["layers"] else "-"
        lines.append(f"{s['pp_rank']:>5} {s['rank']:>6} {layers:>9} {s['params']:>12.4e} "
                     f"{s['param_bytes'] / gb:>8.2f} {s['grad_bytes'] / gb:>8.2f} {s['optimizer_bytes'] / gb:>8.2f} "
                     f"{s['total_bytes'] / gb:>8.2f}")
    w = result["worst"]
    lines.append(f"worst: rank {w['rank']} (pipeline stage {w['pp_rank']}), {w['total_bytes'] / gb:.2f} GB")
    return "\n".join(lines)
