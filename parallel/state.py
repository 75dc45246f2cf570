"""The parallel layout and its process groups (megatron-core parallel_state is the source of groups).

A layout is validated from the config and the world size alone, on every rank, before any collective,
so an invalid one fails fast with the same message everywhere. Expert parallelism uses MoE parallel
folding with expert tensor parallel 1: the expert-parallel group spans data-parallel ranks, and
expert parameters are reduced over the expert-data-parallel group.
"""

import logging
import math
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from moe_pretrain.config import Config, ConfigError
from moe_pretrain.config.stage import Stage, derived_micro_batches, resolve_stages
from parallel.collectives import gather_objects
from parallel.context_parallel import held_positions
from parallel.layout_rules import layout_problems
from parallel.node_groups import check_node_hosts, expert_node_groups
from parallel.torch_compat import pairs_in_pipelines

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1
    vpp: int = 1
    stages: tuple[Stage, ...] = ()
    """The run's stages, resolved (config/stage.py): data.*'s one, or one per entry of config.stages."""

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: ranks holding the same experts (expert tensor parallel = 1)."""
        return self.world_size // (self.pp * self.ep)

    def dp_at(self, cp: int) -> int:
        """Data-parallel size when a stage runs context parallel cp (tp, pp fixed: dp x cp is constant)."""
        return self.world_size // (self.tp * self.pp * cp)

    def describe(self) -> str:
        return f"world {self.world_size} = dp {self.dp} x tp {self.tp} x pp {self.pp} x cp {self.cp}; ep {self.ep}"


def resolve_layout(cfg: Config, world_size: int) -> ParallelLayout:
    """Check the config's parallel section against the world size and the model; no collectives. The
    layout carries the run's stages, resolved once here (config/stage.py; the config is not changed)."""
    p, m = cfg.parallel, cfg.model
    stages = resolve_stages(cfg)
    layout = ParallelLayout(world_size, p.tp, p.pp, p.ep, p.cp, p.vpp, stages)
    problems = []
    if all(stage.keys.cp != "parallel.cp" for stage in stages) and world_size % (p.tp * p.pp * p.cp):
        # the model is built at parallel.cp even when every stage sets its own
        problems.append(f"world size {world_size} is not divisible by parallel.tp x parallel.pp x parallel.cp = "
                        f"{p.tp} x {p.pp} x {p.cp}")
    problems += layout_problems(m, world_size, p.tp, p.pp, p.ep, p.vpp, stages)
    chunks = p.pp * p.vpp
    if p.pipeline_layers and (len(p.pipeline_layers) != chunks or sum(p.pipeline_layers) != m.num_layers
                              or min(p.pipeline_layers) < 1):
        problems.append(f"parallel.pipeline_layers={p.pipeline_layers} must hold {chunks} counts >= 1 "
                        f"(parallel.pp x parallel.vpp) summing to model.num_layers={m.num_layers}")
    if p.vpp > 1 and p.pipeline_schedule not in ("interleaved_1f1b", "zero_bubble"):
        problems.append(f"parallel.vpp={p.vpp} needs parallel.pipeline_schedule=interleaved_1f1b or zero_bubble, "
                        f"not {p.pipeline_schedule}")
    if p.overlap_micro_batches and p.pp > 1 and p.pipeline_schedule != "1f1b":
        problems.append(f"parallel.overlap_micro_batches pairs the 1f1b schedule's steady state, not "
                        f"parallel.pipeline_schedule={p.pipeline_schedule}")
    if p.overlap_micro_batches and p.pp > 1 and not pairs_in_pipelines():
        problems.append(f"parallel.overlap_micro_batches with parallel.pp > 1 needs torch >= 2.10 (this is "
                        f"{torch.__version__}): its pipelining runs no function of ours for a pair")
    if p.pp > 1 and m.moe.balancing == "aux_loss":
        problems.append("model.moe.balancing=aux_loss is not supported with parallel.pp > 1 (use qb or aux_free)")
    if problems:
        raise ConfigError("invalid parallel layout: " + "; ".join(problems))
    return layout


def context_sizes(cfg: Config) -> list[int]:
    """Every context-parallel size the run uses: parallel.cp and each stage's."""
    return sorted({cfg.parallel.cp, *(stage.cp for stage in cfg.stages if stage.cp)})


@dataclass(frozen=True)
class ContextGroup:
    """This rank's place when the run uses context parallel `size` (a stage may change it)."""

    size: int
    group: dist.ProcessGroup | None
    """The ranks splitting this rank's sequences (None for size 1)."""
    rank: int
    dp_rank: int
    """Which slice of the global batch this rank reads at this size."""
    dp_size: int

    def local(self, x_BT_: torch.Tensor) -> torch.Tensor:
        """This rank's positions [B, T / size, ...] of a tensor over every position (the labels)."""
        return held_positions(x_BT_, self.size, self.rank)


@dataclass
class ParallelContext:
    """This rank's place in the layout and the groups it talks over (None on a single process)."""

    layout: ParallelLayout
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dp_group: dist.ProcessGroup | None = None
    """Data parallel x context parallel: ranks with different tokens; tensor-parallel weights reduce here."""
    tp_group: dist.ProcessGroup | None = None
    tp_dp_group: dist.ProcessGroup | None = None
    """Tensor x data parallel: every token of the global batch; replicated weights reduce here."""
    ep_group: dist.ProcessGroup | None = None
    ep_rail_group: dist.ProcessGroup | None = None
    """parallel.expert_dispatch=node: this rank's peers of its expert-parallel group, one per node (node_groups.py)."""
    ep_node_group: dist.ProcessGroup | None = None
    """parallel.expert_dispatch=node: the ranks of its expert-parallel group on this rank's node."""
    expert_dispatch: str = "flat"
    dispatch_fp8: bool = False
    dispatch_chunks: int = 1
    edp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    dp_rank: int = 0
    """Data-parallel rank at parallel.cp (stages may change cp and with it this: context())."""
    tp_rank: int = 0
    ep_rank: int = 0
    pp_rank: int = 0
    context_groups: dict[int, ContextGroup] = field(default_factory=dict)
    """Per context-parallel size the run uses (context_sizes)."""
    store: dist.Store | None = None
    """The launcher's store (torchrun's, through this attempt's prefix: elastic_attempt_store); None outside
    torchrun. The ranks meet there when a collective fails (parallel/lost_peers.py)."""

    @classmethod
    def single(cls, device: torch.device | str = "cpu", layout: ParallelLayout | None = None) -> "ParallelContext":
        return cls(layout or ParallelLayout(world_size=1), device=torch.device(device),
                   context_groups={1: ContextGroup(1, None, 0, 0, 1)})

    def context(self, cp: int) -> ContextGroup:
        if cp not in self.context_groups:
            raise ValueError(f"context parallel size {cp} was not set up (sizes: {sorted(self.context_groups)})")
        return self.context_groups[cp]

    @property
    def distributed(self) -> bool:
        return self.layout.world_size > 1

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0

    def named_groups(self) -> dict[str, dist.ProcessGroup | None]:
        """This rank's groups by name, in the order that settles a group playing two roles (its first name): the
        dry run's communication columns, and the straggler telemetry's blocked time (which folds the names)."""
        groups = {"tp": self.tp_group, "ep": self.ep_group, "ep rail": self.ep_rail_group,
                  "ep node": self.ep_node_group, "pp": self.pp_group, "dp": self.dp_group,
                  "tp x dp": self.tp_dp_group, "edp": self.edp_group}
        groups.update({f"cp{size}": c.group for size, c in self.context_groups.items() if c.group is not None})
        if self.distributed:
            groups["world"] = dist.group.WORLD
        return groups


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def elastic_attempt_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """Under torchrun, its rendezvous store seen through a prefix unique to this restart attempt.

    After torchrun restarts the workers (--max-restarts), gloo's full-mesh connect reads peer addresses
    left in the shared store by the previous attempt and fails ("Connection refused"; measured with
    torch 2.13 on a ten-line all-reduce script, fixed by this prefix). None outside torchrun.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                         is_master=not agent_hosts_it and os.environ["RANK"] == "0", timeout=timeout)
    return dist.PrefixStore(f"moe_pretrain/attempt_{attempt}", base)


def select_device(cfg: Config, backend: str | None = None) -> tuple[str, torch.device]:
    """(backend, device) of this process, by one rule for one process and for many: parallel.backend (or
    the backend argument) decides, auto meaning nccl where CUDA is available; nccl -> the local rank's GPU,
    gloo -> CPU."""
    backend = backend or (cfg.parallel.backend if cfg.parallel.backend != "auto" else default_backend())
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("parallel.backend=nccl needs CUDA, and torch.cuda.is_available() is False here "
                          "(use parallel.backend=gloo or auto for a CPU run)")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return backend, torch.device(f"cuda:{local_rank}") if backend == "nccl" else torch.device("cpu")


def init_parallel(cfg: Config, backend: str | None = None) -> ParallelContext:
    """Join the torchrun world (RANK / WORLD_SIZE / MASTER_ADDR in the environment) and build the groups.

    With no WORLD_SIZE (or 1) this is the single-process context and creates no process group; its
    device follows the same rule as many processes' (select_device). A default group the caller made
    already (the dry run's fake one: launch/dryrun.py) fixes the world instead.
    """
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    layout = resolve_layout(cfg, world_size)
    derived = derived_micro_batches(cfg, layout.stages)
    if derived:  # the first start-up line
        log.info("config values derived because they were not set: " + ", ".join(derived))
    backend, device = select_device(cfg, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size == 1:
        return ParallelContext.single(device, layout)
    store = None
    if not dist.is_initialized():
        timeout = timedelta(seconds=cfg.parallel.timeout_s)
        store = elastic_attempt_store(world_size, timeout)
        rank_args = dict(store=store, rank=int(os.environ["RANK"]), world_size=world_size) if store else {}
        dist.init_process_group(backend, timeout=timeout, **rank_args)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=1,
        create_gloo_process_groups=False,
        distributed_timeout_minutes=max(1, math.ceil(cfg.parallel.timeout_s / 60)),
    )
    data_context = ps.get_data_parallel_group(with_context_parallel=True)
    context_groups = _context_groups(cfg, data_context)
    ep_group = ps.get_expert_model_parallel_group()
    rail, node = _expert_node_groups(cfg, ep_group) if cfg.parallel.expert_dispatch == "node" else (None, None)
    return ParallelContext(
        layout=layout,
        context_groups=context_groups,
        rank=dist.get_rank(),
        device=device,
        dp_group=data_context,
        tp_group=ps.get_tensor_model_parallel_group(),
        tp_dp_group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
        ep_group=ep_group,
        ep_rail_group=rail,
        ep_node_group=node,
        expert_dispatch=cfg.parallel.expert_dispatch,
        dispatch_fp8=cfg.parallel.dispatch_fp8,
        dispatch_chunks=cfg.parallel.dispatch_chunks,
        edp_group=ps.get_expert_data_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_rank=context_groups[layout.cp].dp_rank,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        store=store,
    )


def _context_groups(cfg: Config, data_context: dist.ProcessGroup) -> dict[int, ContextGroup]:
    """A ContextGroup per size in context_sizes(cfg), built on every rank (group creation is collective).

    With tp and pp fixed, the ranks that share parameters and differ in tokens (data x context parallel,
    megatron-core's data-parallel group with context parallel, cp fastest) are the same for every cp:
    a cp-size split takes consecutive blocks of that group; the block index is the data-parallel rank."""
    members = dist.get_process_group_ranks(data_context)
    everyone: list[list[int]] = gather_objects(members, dist.group.WORLD)
    all_groups = sorted({tuple(g) for g in everyone})
    position = members.index(dist.get_rank())
    groups = {}
    for size in context_sizes(cfg):
        blocks = [list(g[i:i + size]) for g in all_groups for i in range(0, len(g), size)]
        group = None
        if size > 1:
            group, _ = dist.new_subgroups_by_enumeration(blocks)
        groups[size] = ContextGroup(size, group, position % size, position // size, len(members) // size)
    return groups


def ranks_per_node(cfg: Config) -> int:
    """parallel.ranks_per_node, or the launcher's ranks per node (torchrun's LOCAL_WORLD_SIZE), else every
    rank on one node."""
    return cfg.parallel.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def _expert_node_groups(cfg: Config, ep_group: dist.ProcessGroup
                        ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """The node dispatch's groups, from every rank's expert-parallel group (gathered: creation is collective)."""
    members = dist.get_process_group_ranks(ep_group)
    everyone: list[tuple[list[int], str]] = gather_objects((members, socket.gethostname()), dist.group.WORLD)
    size = ranks_per_node(cfg)
    check_node_hosts([host for _, host in everyone], size)
    return expert_node_groups(sorted({tuple(group) for group, _ in everyone}), size, dist.get_rank())


def new_host_group(timeout: timedelta) -> dist.ProcessGroup:
    """A new group over every rank for host-side collectives (checkpoint I/O): gloo, apart from training's
    groups. Under the dry run's fake backend (launch/dryrun.py), a fake group: gloo cannot connect over
    the fake backend's store, and the dry run sends nothing."""
    backend = "fake" if dist.get_backend() == "fake" else "gloo"
    return dist.new_group(backend=backend, timeout=timeout)


def destroy_parallel() -> None:
    if dist.is_initialized():
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
        dist.destroy_process_group()
