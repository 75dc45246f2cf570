"""The sizing command, `python -m moe_pretrain.planning.sizing CONFIG --json`: the model's parameter and FLOP
counts (moe_pretrain/model/counts.py); with `--layout tp=8,pp=16,ep=128,dp=32`, also each pipeline stage's
per-rank state bytes (rank_state.py). Also a pipeline stage's training FLOPs per token under a stage's
recomputation and context-parallel exchange, for the plan's step time (stage_flops_per_token).
"""

import argparse
import dataclasses
import json
import sys

from moe_pretrain.config import (
    EX_CONFIG,
    ConfigError,
    ModelConfig,
    add_config_arguments,
    load_config_or_exit,
)
from moe_pretrain.config.recompute import recompute_modules
from moe_pretrain.config.stage import Stage
from moe_pretrain.model.counts import (
    count,
    ends_params,
    layer_flops_per_token,
    routed_expert_params,
    total_parts,
)
from moe_pretrain.model.mixers import mixer_spec
from moe_pretrain.planning.context_parallel_costs import context_parallel_cost


def final_projection_params(cfg: ModelConfig, index: int) -> int:
    """The weights of layer `index`'s last matmul: the dense MLP's or the shared experts' down projection, or
    the MoE's latent up projection without shared experts."""
    d = cfg.hidden_size
    if not cfg.is_moe_layer(index):
        return cfg.dense_intermediate * d
    if cfg.moe.num_shared_experts:
        return cfg.moe.num_shared_experts * cfg.moe.shared_intermediate * d
    return cfg.moe.latent_size * d


@dataclasses.dataclass(frozen=True)
class ExchangeSpan:
    """What MLA's latent exchange does for one cp rank under a stage's documents (planning/documents.
    exchange_spans), per local token: the keys it expands (the key blocks of its compact key sequence some
    query tile of its may see), the keys of the blocks its query's tile meets, and the keys it sends (its
    fragments to each rank that sees them) and receives (parallel/latent_route.py). With one document per row
    the busiest ranks expand cp keys a local token and send and receive cp - 1."""
    expanded_keys: float
    tile_keys: float
    sent_keys: float
    received_keys: float


@dataclasses.dataclass(frozen=True)
class StageDocuments:
    """What a stage's documents make of MLA's attention (planning/documents.py), for the plan set beside a dry
    run: the keys a query attends to (attention stays inside a document), and under the latent exchange what
    the exchange does on each cp rank (empty: no exchange). Without it the plan prices one document per row, the
    bound. cp_rank: whose exchange the plan prices (a traced rank's); None: the busiest figures of any rank."""
    keys: float
    spans: tuple[ExchangeSpan, ...] = ()
    cp_rank: int | None = None

    def span(self) -> ExchangeSpan | None:
        if not self.spans:
            return None
        if self.cp_rank is not None:
            return self.spans[self.cp_rank]
        return ExchangeSpan(*(max(values) for values in zip(*(dataclasses.astuple(s) for s in self.spans))))


def module_recompute_flops_per_token(cfg: ModelConfig, index: int, seq_len: int, modules: frozenset[str],
                                     mla: str = "ulysses", keys: float | None = None) -> float:
    """The FLOPs train.recompute's modules (model/recompute.py) run again per token of layer `index`: its sequence
    mixer's (its spec's recompute_flops: a recomputed core's forward, MLA's up-projections), the routed experts'
    three GEMMs; the mixes, norms, KDA's pre-ops and the SiTU-GLU activation are elementwise (their time is the
    dry run's, not a FLOP count). mla: MLA's context-parallel exchange in force."""
    flops = mixer_spec(cfg, index).recompute_flops(cfg, seq_len, modules, mla, keys)
    if "experts" in modules and cfg.is_moe_layer(index):
        flops += 2 * cfg.moe.top_k * routed_expert_params(cfg.moe)
    return flops


def stage_flops_per_token(cfg: ModelConfig, layers: list[int], last: bool, stage: Stage, rows: int = 1,
                          documents: StageDocuments | None = None) -> float:
    """FLOPs a pipeline stage spends per token of its micro-batches under `stage`: its layers', and the last
    stage's ends. Full recomputation runs each layer's forward again up to its last saved input
    (torch.utils.checkpoint stops early), i.e. all but the last matmul; recomputation by module (selective too)
    adds module_recompute_flops_per_token; a mixer's backward may recompute what its forward did not keep (its
    spec's rescoring_flops), and its context-parallel strategy may add FLOPs (planning/context_parallel_costs.py;
    `rows`: the micro-batch's sequences). documents: attention priced by the stage's documents (None: one per
    row)."""
    keys = documents.keys if documents else None
    seq_len, recompute = stage.seq_len, stage.recompute
    flops = sum(layer_flops_per_token(cfg, i, seq_len, keys) for i in layers)
    if recompute == "full":
        flops += sum(layer_flops_per_token(cfg, i, seq_len, keys) / 3 - 2 * final_projection_params(cfg, i)
                     for i in layers)
    else:
        modules = recompute_modules(recompute)
        flops += sum(module_recompute_flops_per_token(cfg, i, seq_len, modules, stage.cp_mla, keys) for i in layers)
    flops += sum(mixer_spec(cfg, i).rescoring_flops(cfg, seq_len, keys) for i in layers)
    if stage.cp > 1:
        flops += sum(context_parallel_cost(cfg, i).flops(cfg, stage, rows, documents) for i in layers)
    return flops + 6 * ends_params(cfg, last)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--layout", metavar="tp=A,pp=B,ep=C,dp=D",
                        help="add each pipeline stage's worst rank's parameter, gradient and optimizer bytes")
    args = parser.parse_intermixed_args(argv)
    cfg = load_config_or_exit(args)
    result = count(cfg.model, cfg.data.seq_len)
    if args.layout:
        from moe_pretrain.planning.rank_state import describe, per_rank_bytes

        try:
            result["per_rank"] = per_rank_bytes(cfg, args.layout)
        except ConfigError as err:
            print(f"sizing: {err}", file=sys.stderr)
            return EX_CONFIG
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"total params   {result['total_params']:.4e} ({total_parts(cfg.model, cfg.data.seq_len)})")
        print(f"active params  {result['active_params']:.4e}")
        print(f"train FLOPs/token at T={result['seq_len']}  {result['flops_per_token']:.4e}")
        for key, value in result["breakdown"].items():
            print(f"  {key:22s} {value:.4e}")
        if args.layout:
            print(describe(result["per_rank"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
