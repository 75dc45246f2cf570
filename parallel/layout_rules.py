"""The layout rules, in one place: what a parallel layout must satisfy to run a model's stages.

Two callers, one set of rules: the run's own check before any collective (parallel/state.resolve_layout,
on every rank, for the config and the world size) and the plan's search over candidate layouts
(planning/stage_memory.MemoryPlanner.problems, for a GPU count). Messages name the config keys that set
each figure (a stage's own key where it sets one). The sharding plan checks the model's parameter shapes
against tp and ep once more when a model is built (parallel/plan.ShardingPlan.check_divisible): that is the
plan's check of itself against the model's code, which a config cannot get wrong.
"""

from moe_pretrain.config import ModelConfig
from moe_pretrain.config.stage import Stage
from parallel.context_parallel_mixers import PLACEMENTS


def layout_problems(model: ModelConfig, world_size: int, tp: int, pp: int, ep: int, vpp: int,
                    stages: tuple[Stage, ...]) -> list[str]:
    """Why tp x pp x ep (vpp chunks per pipeline rank) over world_size ranks cannot run these stages; empty
    when it can."""
    problems = []
    for stage in stages:
        if world_size % (tp * pp * stage.cp):
            problems.append(f"world size {world_size} is not divisible by parallel.tp x parallel.pp x "
                            f"{stage.keys.cp} = {tp} x {pp} x {stage.cp}")
        without_cp = sorted({model.layer_kind(i) for i in range(model.num_layers)} - set(PLACEMENTS)) \
            if stage.cp > 1 else []
        if without_cp:
            problems.append(f"{stage.keys.cp}={stage.cp}: model.layer_pattern's {', '.join(without_cp)} layers have "
                            "no context-parallel strategy (parallel/context_parallel_mixers.PLACEMENTS)")
    problems = list(dict.fromkeys(problems))  # stages taking parallel.cp name it once
    if (world_size // pp) % ep:
        problems.append(f"parallel.ep={ep} must divide the {world_size // pp} ranks of a pipeline stage "
                        f"(world size {world_size} / parallel.pp={pp})")
    if model.moe.num_experts % ep:
        problems.append(f"model.moe.num_experts={model.moe.num_experts} is not divisible by parallel.ep={ep}")
    tp_divisible = {"model.vocab_size": model.vocab_size, "model.dense_intermediate": model.dense_intermediate,
                    "model.moe.num_shared_experts x model.moe.shared_intermediate":
                        model.moe.num_shared_experts * model.moe.shared_intermediate,
                    "model.kda.num_heads": model.kda.num_heads, "model.mla.num_heads": model.mla.num_heads}
    for key, value in tp_divisible.items():
        if value % tp:
            problems.append(f"{key}={value} is not divisible by parallel.tp={tp}")
    if pp * vpp > model.num_layers:
        problems.append(f"parallel.pp x parallel.vpp = {pp * vpp} stages for model.num_layers={model.num_layers}")
    heads = model.mla.num_heads // tp
    for stage in stages:
        cp, micro = stage.cp, stage.micro_batches
        if cp > 1 and heads % cp and stage.cp_mla == "ulysses":
            problems.append(f"{stage.keys.cp}={cp} must divide the model.mla.num_heads={model.mla.num_heads} / "
                            f"parallel.tp={tp} attention heads of a tensor-parallel rank with {stage.keys.cp_mla}="
                            "ulysses (MLA trades heads for positions; latent or auto exchanges the latent)")
        if stage.seq_len % (2 * cp * tp):
            length = f"{stage.keys.seq_len}={stage.seq_len}"
            problems.append(f"{length} is not divisible by 2 x {stage.keys.cp} x parallel.tp = {2 * cp * tp} (two "
                            "fragments per context-parallel rank, each split over tensor parallel)" if cp > 1
                            else f"{length} is not divisible by parallel.tp={tp}")
        if not problems and stage.rows % (world_size // (tp * pp * cp) * micro):
            problems.append(f"{stage.keys.rows} must be divisible by data-parallel size "
                            f"{world_size // (tp * pp * cp)} x {stage.keys.micro_batches}={micro}")
        if pp > 1 and micro % pp:
            problems.append(f"{stage.keys.micro_batches}={micro} must be a multiple of parallel.pp={pp} "
                            "(pipeline schedules keep every stage busy with whole rounds of micro-batches)")
    return problems
