"""Per-GPU memory and communication of each stage of a staged run, and a search for layouts that fit.

For a run layout (tp, pp, ep, vpp fixed for the run) and each stage's (cp, recompute, micro-batches), the
worst pipeline rank's bytes: parameters, gradients and ZeRO-1 Adam moments (rank_state.py, exact), saved
activations (step_activations.py: measured per-token coefficients, divided over tensor parallel, at
T / cp positions, times the micro-batches a 1F1B schedule keeps in flight on that rank), the attention
and KDA state among them, one recomputed layer's transient, the logits and loss, and the all-to-all
buffers of expert dispatch and of MLA's exchange (Ulysses' head-for-position all-to-all, or the latent
exchange's gathered latent, one expanded key block and one tile of scores); under full recomputation
the layers' inputs where train.saved_inputs keeps them (host memory is checked against
HOST_BYTES_PER_GPU, FP8 counts 1 + 4 / 128 bytes a value), and quantile balancing's statistics
(balancing_state.py: its histograms, or the exact mode's kept scores); on the first pipeline rank the vision
tower's activations for its in-flight micro-batches with every row filled with the largest image the run
admits (step_activations.vision_activations), the images dealt over the tp x cp ranks that share the rows
(parallel/image_split.py: a rank encodes at most its even share plus one largest image). Allocator slack,
NCCL buffers and CUDA context are not modelled; --propose asks for 10% headroom to cover them.
Communication: bytes each GPU sends per optimizer step for each group (ring collectives send
(n - 1) / n of the tensor; all-to-all sends (n - 1) / n of its rows).
"""

import copy
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from moe_pretrain.config import Config
from moe_pretrain.config.recompute import recompute_modules
from moe_pretrain.config.stage import Stage, StageKeys, mla_exchange, resolve_stages
from moe_pretrain.data.image_size import run_max_pixels
from moe_pretrain.dtypes import compute_bytes, parameter_bytes
from moe_pretrain.planning.balancing_state import balancing_bytes, reduced_bytes
from moe_pretrain.planning.context_parallel_costs import context_parallel_cost
from moe_pretrain.planning.expert_traffic import exchange_buffer_rows, expert_exchange_bytes
from moe_pretrain.planning.pipeline_traffic import pipeline_bytes
from moe_pretrain.planning.rank_state import parameter_shapes, stage_state_bytes
from moe_pretrain.planning.sizing import StageDocuments, stage_flops_per_token
from moe_pretrain.planning.step_activations import (
    LayerActivations,
    activation_bytes,
    largest_image_patches,
    layer_activations,
    vision_activations,
)
from moe_pretrain.planning.tensor_parallel_traffic import ring_share, tensor_parallel_bytes
from parallel.layout_rules import layout_problems
from parallel.muon import BATCH_ELEMENTS
from parallel.plan import chunks_of_rank, pipeline_chunks
from parallel.state import ParallelLayout

HEADROOM = 0.10
HOST_BYTES_PER_GPU = 2e12 / 8
"""Host memory for one GPU's offloaded layer inputs: an 8-GPU H100 / H200 node (DGX) has about 2 TB."""
MUON_STEP_BYTES = 8 * BATCH_ELEMENTS * 4
"""Muon's step beyond its direction and exchange buffers (3 x its momentum): a batch's stacked matrices, Newton-
Schulz's float32 iterate, Gram matrix and products (parallel/muon.py's BATCH_ELEMENTS), a few copies."""
"""ops.latent_attention's default query tile and key block."""


@dataclass(frozen=True)
class RunLayout:
    gpus: int
    tp: int
    pp: int
    ep: int
    vpp: int = 1

    def describe(self) -> str:
        return f"tp={self.tp} pp={self.pp} ep={self.ep}" + (f" vpp={self.vpp}" if self.vpp > 1 else "")


def pipeline_layers_of(layers: list[int], run: RunLayout) -> list[int]:
    """A config's parallel.pipeline_layers on a run layout: its split where it fits the run's pp x vpp, else empty
    (balanced automatically)."""
    return layers if len(layers) == run.pp * run.vpp else []


def within(result: dict, gpu_bytes: float, headroom: float = 0.0) -> bool:
    """A stage's plan (MemoryPlanner.stage) fits: the worst pipeline rank's GPU bytes within (1 - headroom) of
    the GPU, and the most any rank offloads within its share of the node's host memory (with layers split
    unevenly these can be different ranks)."""
    return result["worst"]["total_bytes"] <= (1 - headroom) * gpu_bytes and result["host_bytes"] <= HOST_BYTES_PER_GPU


class MemoryPlanner:
    """Plans one config; parameter shapes are read once (meta model), layouts are then arithmetic."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.shapes = parameter_shapes(cfg)
        self._runs: dict[RunLayout, tuple[Config, list[dict]]] = {}
        self._layers: dict[tuple, LayerActivations] = {}
        self._proposals: dict[tuple[int, float], tuple | None] = {}

    def _run_state(self, run: RunLayout) -> tuple[Config, list[dict]]:
        """The config with the run's layout, and its pipeline ranks' state bytes (the same for every
        stage: cp changes data parallel, not data x context parallel, which ZeRO-1 shards over). The config's
        parallel.pipeline_layers split holds where it fits the run's pp x vpp; other layouts split evenly."""
        if run not in self._runs:
            cfg = copy.deepcopy(self.cfg)
            cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.vpp = run.tp, run.pp, run.ep, run.vpp
            cfg.parallel.pipeline_layers = pipeline_layers_of(cfg.parallel.pipeline_layers, run)
            cfg.parallel.cp = 1
            layout = ParallelLayout(run.gpus, run.tp, run.pp, run.ep, 1, run.vpp)
            self._runs[run] = cfg, stage_state_bytes(cfg, self.shapes, layout)
        return self._runs[run]

    def _layer(self, index: int, recompute: str, mla: str = "ulysses", cp: int = 1, tp: int = 1) -> LayerActivations:
        key = (index, recompute, mla, cp, tp)
        if key not in self._layers:
            self._layers[key] = layer_activations(self.cfg.model, index, recompute, mla, cp, tp,
                                                  self.cfg.train.recompute_exchanges)
        return self._layers[key]

    def problems(self, run: RunLayout, stage: Stage) -> list[str]:
        """Why a layout cannot run a stage (parallel/layout_rules.py: the rules the run checks at start)."""
        keys = StageKeys("seq_len", f"{stage.rows} sequences per step", "micro_batches", "cp", "cp_mla")
        return layout_problems(self.cfg.model, run.gpus, run.tp, run.pp, run.ep, run.vpp,
                               (dataclasses.replace(stage, keys=keys),))

    def stage(self, run: RunLayout, stage: Stage,
              documents: StageDocuments | None = None) -> dict:
        """The worst pipeline rank's bytes (and every pipeline rank's: "ranks", each with its GPUs'
        communication) and the busiest pipeline rank's communication, for one stage. documents: MLA priced by
        the stage's documents (planning/documents.py; None: one document per row, the bound)."""
        cfg, states = self._run_state(run)
        m = cfg.model
        dp = ParallelLayout(run.gpus, run.tp, run.pp, run.ep, stage.cp, run.vpp).dp
        act_bytes = compute_bytes(cfg.train.dtype)
        rows = micro_batch_rows(run, stage)
        tokens = rows * stage.seq_len // stage.cp  # positions of one micro-batch on this rank
        worst, most_host, ranks = None, 0.0, []
        for state in states:
            p = state["pp_rank"]
            # 1F1B: the warm-up's forwards and the one before the first backward; paired (parallel.
            # overlap_micro_batches), one more: a forward runs while the backward beside it still holds its own.
            paired = cfg.parallel.overlap_micro_batches
            in_flight = min(stage.micro_batches, run.pp - p + paired) if cfg.parallel.pipeline_schedule != "gpipe" \
                else stage.micro_batches
            if run.vpp > 1:
                in_flight *= 1 + (run.pp - 1) / (run.pp * run.vpp)
            # The last stage also runs the multi-token-prediction blocks' layers (indices num_layers on).
            layers = state["layers"] + list(range(m.num_layers, m.num_layers + m.mtp.layers)) * (p == run.pp - 1)
            # The warm-up's micro-batches in flight, and the last backward's one.
            act, tail = (activation_bytes(m, layers, stage.recompute, tokens, act_bytes=act_bytes, tp=run.tp,
                                          in_flight=flight, last=p == run.pp - 1, layer_of=self._layer_of(stage, run),
                                          saved_inputs=stage.saved_inputs) for flight in (in_flight, 1))
            moe_layers = [i for i in layers if m.is_moe_layer(i)]
            buffers = 0.0
            if run.ep > 1 and moe_layers:
                buffers += exchange_buffer_rows(cfg, run.ep, tokens / run.tp) * m.moe.latent_size * act_bytes
            if stage.cp > 1:  # one layer's exchange buffers at a time, the largest of the stage's mixers'
                buffers += max((context_parallel_cost(m, i).buffers(m, stage, tokens, run.tp, act_bytes)
                                for i in layers), default=0.0)
            # Routers see this tensor rank's sequence-parallel share of the positions.
            balancing = balancing_bytes(m.moe, len(moe_layers), tokens / run.tp, stage.micro_batches)
            vision = self.vision_bytes(stage, rows, in_flight, act_bytes, run.tp) if p == 0 else 0.0
            # Muon's step runs after the backward freed the activations: the direction and two exchange buffers
            # (its momentum's size each: parallel/muon.py) and one batch's Newton-Schulz work.
            muon_step = 3 * state["muon_momentum_bytes"] + MUON_STEP_BYTES if state["muon_momentum_bytes"] else 0
            copies = state["compute_copy_bytes"]
            # The gradients' reduce-scatters start in the last micro-batch's backward (one in flight), and their
            # shards live until the optimizer has stepped.
            shards = state["grad_shard_bytes"]
            last_backward = tail.peak + (
                self.vision_bytes(stage, rows, 1, act_bytes, run.tp) if p == 0 else 0.0)
            total = state["total_bytes"] + max(act.peak + buffers + balancing + vision + copies,
                                               last_backward + buffers + balancing + copies + shards,
                                               muon_step + shards)
            row = {"pp_rank": p, "param_bytes": state["param_bytes"], "grad_bytes": state["grad_bytes"],
                   "optimizer_bytes": state["optimizer_bytes"], "mixer_state_bytes": act.mixers,
                   "activation_bytes": act.other + act.transient + act.head, "buffer_bytes": buffers,
                   "balancing_bytes": balancing, "vision_bytes": vision, "compute_copy_bytes": copies,
                   "grad_shard_bytes": shards, "total_bytes": total,
                   "in_flight": in_flight, "host_bytes": act.host, "muon_flops": state["muon_flops"],
                   "muon_step_bytes": muon_step,
                   "communication": self.communication(cfg, run, stage, tokens, state, documents),
                   # The step's FLOPs: its micro-batches' forward and backward, and Muon's Newton-Schulz.
                   "flops": stage.micro_batches * tokens / run.tp * stage_flops_per_token(
                       m, layers, p == run.pp - 1, stage, rows, documents)
                   + state["muon_flops"]}
            most_host = max(most_host, act.host)
            ranks.append(row)
            if worst is None or total > worst["total_bytes"]:
                worst = row
            if p == 0:
                first = row
        busiest = max((r["communication"] for r in ranks), key=lambda sent: sum(sent.values()))
        return {"worst": worst, "first": first, "ranks": ranks, "host_bytes": most_host, "dp": dp,
                "rows_per_micro": rows, "communication": busiest}

    def _layer_of(self, stage: Stage, run: RunLayout):
        """activation_bytes' per-layer coefficients under this layout."""
        return lambda i, r: self._layer(i, r, stage.cp_mla, stage.cp, run.tp)

    def vision_bytes(self, stage: Stage, rows: int, in_flight: float,
                     act_bytes: int, tp: int) -> float:
        """The vision tower's saved activations (and one recomputed block's transient, in fp32) on a first-stage
        rank: `rows` rows per micro-batch, each filled with the largest image the run admits, dealt over the
        tp x cp block (largest first to the least loaded: no rank gets more than its share plus one image)."""
        m = self.cfg.model
        per_image, row_patches = largest_image_patches(m, stage.seq_len, run_max_pixels(self.cfg))
        total = row_patches * rows
        patches = min(total, total / (tp * stage.cp) + per_image) if tp * stage.cp > 1 else total
        saved, transient = vision_activations(m, stage.recompute)
        return patches * (saved * act_bytes * in_flight + transient * 4)

    def communication(self, cfg: Config, run: RunLayout, stage: Stage,
                      tokens: int, state: dict, documents: StageDocuments | None = None) -> dict:
        """Bytes one GPU of a pipeline rank (its state: rank_state.stage_state_bytes) sends per optimizer step,
        per column (collective_traffic.PLAN_COLUMNS; the node dispatch's two groups in place of ep:
        plan_columns folds them). documents: MLA's latent exchange priced by the stage's documents for one cp
        rank (None: one document per row, the busiest rank)."""
        m, M = cfg.model, stage.micro_batches
        b = compute_bytes(cfg.train.dtype)
        p = state["pp_rank"]
        first, last = p == 0, p == run.pp - 1
        # The last stage also runs the multi-token-prediction blocks' layers (indices num_layers on).
        layers = state["layers"] + list(range(m.num_layers, m.num_layers + m.mtp.layers)) * last
        passes = 3 if stage.recompute == "full" else 2  # forward, backward (+ the re-forward)
        expert_passes = passes if cfg.train.recompute_exchanges else 2  # recompute_exchanges=false: no re-forward
        # Muon's whole-matrix rules all-gather their tensor-parallel slices over the tp group (parallel/muon.py).
        tp = M * tensor_parallel_bytes(m, layers, tokens, run.tp, b, passes, first, last) + state["muon_join_bytes"]
        moe = sum(m.is_moe_layer(i) for i in layers)
        ep = {group: M * moe * size for group, size in
              expert_exchange_bytes(cfg, run.ep, tokens / run.tp, expert_passes, b).items()}
        chunks = pipeline_chunks(cfg)
        pp = M * pipeline_bytes(m, chunks, chunks_of_rank(len(chunks), run.pp, p), tokens / run.tp,
                                parameter_bytes(cfg.train.dtype), b)
        modules = recompute_modules(stage.recompute)
        cp = M * sum(context_parallel_cost(m, i).sent_bytes(m, stage, tokens, run.tp, b, passes, modules, documents)
                     for i in layers)
        # ZeRO-1: each reduce group's gradients reduce-scattered and its parameters all-gathered once a step; the
        # balancers' statistics all-reduced over tensor x data x context parallel.
        dp = sum(ring_share(size, scattered) + ring_share(size, gathered)
                 for size, scattered, gathered in state["reduce_groups"]) + state["muon_exchange_bytes"]
        dp += 2 * ring_share(run.gpus // run.pp, reduced_bytes(m.moe, moe))
        return {"tp": tp, **ep, "pp": pp, "cp": cp, "dp": dp}

    def fits(self, run: RunLayout, stage: Stage, gpu_bytes: float,
             headroom: float = 0.0) -> dict | None:
        """The stage's plan if the layout is valid and fits in (1 - headroom) of the GPU, else None."""
        if self.problems(run, stage):
            return None
        result = self.stage(run, stage)
        return result if within(result, gpu_bytes, headroom) else None

    def run_layouts(self, gpus: int) -> Iterator[RunLayout]:
        """The run layouts the searches try: tp, pp (at most a layer a stage) and the largest few ep."""
        m = self.cfg.model
        for tp in (1, 2, 4, 8):
            for pp in (1, 2, 4, 8, 16, 32, 64):
                if gpus % (tp * pp) or pp > m.num_layers:
                    continue
                for ep in _divisors_up_to(m.moe.num_experts, gpus // pp)[-EP_CANDIDATES:]:
                    yield RunLayout(gpus, tp, pp, ep)

    def propose(self, gpus: int, gpu_bytes: float) -> tuple[RunLayout, list[tuple[Stage, dict] | None]] | None:
        """The smallest layout that fits the most stages with HEADROOM: least tp x pp, then least cp per
        stage, then the cheapest recomputation (RECOMPUTE_ORDER), then the fewest bytes sent. A stage
        no layout of this run fits is None (None overall when no run layout is valid at all). Searched once per
        (gpus, gpu_bytes): launch.plan's proposal and its verdict ask alike."""
        if (gpus, gpu_bytes) not in self._proposals:
            self._proposals[gpus, gpu_bytes] = self._smallest(gpus, gpu_bytes)
        return self._proposals[gpus, gpu_bytes]

    def _smallest(self, gpus: int, gpu_bytes: float) -> tuple[RunLayout, list[tuple[Stage, dict] | None]] | None:
        best = None
        configured = resolve_stages(self.cfg)
        for run in self.run_layouts(gpus):
            stages = [next(self.stage_layouts_that_fit(run, stage, gpu_bytes), None) for stage in configured]
            chosen = [s for s in stages if s is not None]
            if not chosen:
                continue
            sent = sum(sum(result["communication"].values()) for _, result in chosen)
            key = (len(stages) - len(chosen), run.tp * run.pp, sum(stage.cp for stage, _ in chosen),
                   sum(RECOMPUTE_ORDER.index(stage.recompute) for stage, _ in chosen), sent)
            if best is None or key < best[0]:
                best = (key, run, stages)
        return None if best is None else (best[1], best[2])

    def stage_layouts_that_fit(self, run: RunLayout, stage: Stage, gpu_bytes: float, per_exchange: bool = False
                               ) -> Iterator[tuple[Stage, dict]]:
        """For each cp from the least, the stage with the layout of that cp that fits it with HEADROOM at the cheapest
        recomputation, then (under full recomputation) the layers' inputs on the device, on the host, in FP8,
        then Ulysses before the latent exchange (where the heads allow Ulysses), at the most micro-batches the
        rules allow (the fewest sequences in flight); with its plan. The first is the smallest. per_exchange: one
        for each of MLA's exchanges at each cp (either can be the faster)."""
        heads = self.cfg.model.mla.num_heads // run.tp
        for cp in [c for c in _powers_of_two(run.gpus // (run.tp * run.pp)) if stage.seq_len % (2 * c * run.tp) == 0]:
            exchanges = ["ulysses", "latent"] if mla_exchange("auto", cp, heads) == "ulysses" else ["latent"]
            model_parallel = run.tp * run.pp * cp
            if run.gpus % model_parallel or stage.rows % (run.gpus // model_parallel):
                continue
            counts = _multiples(stage.rows // (run.gpus // model_parallel), run.pp)
            if not counts:
                continue
            found: set[str] = set()
            for recompute in RECOMPUTE_ORDER:
                for saved_inputs in SAVED_INPUTS_ORDER if recompute == "full" else ["device"]:
                    for mla in exchanges:
                        if mla in found or (found and not per_exchange):
                            continue
                        candidate = dataclasses.replace(stage, cp=cp, recompute=recompute, micro_batches=max(counts),
                                                        cp_mla=mla, saved_inputs=saved_inputs)
                        result = self.fits(run, candidate, gpu_bytes, HEADROOM)
                        if result is not None:
                            found.add(mla)
                            yield candidate, result


RECOMPUTE_ORDER = ["none", "attn_res,norms,expert_act", "attn_res,norms,kda_pre,mla_up,expert_act",
                   "attn_res,norms,kda_pre,mla_up,core,expert_act",
                   "attn_res,norms,kda_pre,mla_up,core,experts,expert_act", "full"]
"""The recomputations the searches try, cheapest first: the elementwise modules (no GEMM again), then KDA's
pre-ops and MLA's up-projections (at most the queries' up-projection again), the attention cores, the routed
experts' GEMMs, whole layers. Each keeps fewer bytes than the one before (selective, core and experts alone, is
between the last two in FLOPs and keeps more than either)."""
SAVED_INPUTS_ORDER = ["device", "host", "fp8"]
"""Exact before lossy: host offload changes no number (it costs host memory and PCIe traffic), FP8 does."""
EP_CANDIDATES = 6
"""The search tries the largest few expert-parallel sizes (smaller ones only add expert memory per GPU)."""


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def _divisors_up_to(n: int, limit: int) -> list[int]:
    return [i for i in range(1, min(n, limit) + 1) if n % i == 0]


def _multiples(n: int, step: int) -> list[int]:
    """Divisors of n that are multiples of step (micro-batch counts a pp schedule accepts)."""
    return [i for i in range(step, n + 1, step) if n % i == 0]


def micro_batch_rows(run: RunLayout, stage: Stage) -> int:
    """The sequences one micro-batch of the stage holds on a tp x cp block of GPUs."""
    dp = ParallelLayout(run.gpus, run.tp, run.pp, run.ep, stage.cp, run.vpp).dp
    return stage.rows // (dp * stage.micro_batches)


def gigabytes(value: float, width: int = 7) -> str:
    """value bytes as GB right-aligned in width characters; a wider number widens its column, never loses digits."""
    return f"{value / 1e9:{width}.1f}"
