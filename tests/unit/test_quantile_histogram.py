"""Quantile balancing from margin histograms (ops/margin_histogram.py) against the exact rule, on the smoke
model's router scores over real text; one collective for all of a stage's layers; no host read."""

from pathlib import Path

import torch

from moe_pretrain.config import load_config
from moe_pretrain.model import MoETransformer
from moe_pretrain.model.balancing import HistogramQuantileBalancer, QuantileBalancer, reduce_pending
from moe_pretrain.model.init import initialize
from moe_pretrain.ops.margin_histogram import MarginBins
from moe_pretrain.ops.statistics import LocalStatistics
from moe_pretrain.planning.host_reads import HostReads

CORPUS = Path(__file__).parents[1] / "assets" / "golden_corpus.jsonl"


def smoke_router_scores(micro_batches: int = 3) -> tuple[dict[int, list[torch.Tensor]], int, int]:
    """{MoE layer: its router's scores [tokens, E] per micro-batch} of the smoke model (fp32) over the
    golden corpus's bytes (the byte tokenizer's ids), and (experts, top-k)."""
    cfg = load_config("configs/smoke.yaml", [])
    torch.manual_seed(0)
    model = initialize(MoETransformer(cfg.model), 0).train()
    text = torch.tensor(list(CORPUS.read_bytes()[: micro_batches * 4 * 256]), dtype=torch.long)
    seen: dict[int, list[torch.Tensor]] = {}
    for layer, router in model.routers().items():
        def spy(scores, topk_idx, bias, layer=layer):
            seen.setdefault(layer, []).append(scores)
        router.balancer.observe = spy
    for tokens in text.view(micro_batches, 4, 256):
        model(tokens)
    return seen, cfg.model.moe.num_experts, cfg.model.moe.top_k


def test_histogram_bias_is_within_one_bin_of_the_exact_one():
    """The bound is one bin width, (2 + bias range) / qb_bins (2e-3 at the default 1000 bins, bias 0): the exact
    quantile lies in the bin the counts point at and the interpolation stays inside it. Checked for every
    expert of every MoE layer, over three bias updates (the bias moves, so do the bins); the mean error is
    well under the bound (a tenth of a bin here)."""
    scores, experts, k = smoke_router_scores()
    cfg = load_config("configs/smoke.yaml", []).model.moe
    exact_cfg = load_config("configs/smoke.yaml", ["model.moe.qb_quantile=exact"]).model.moe
    errors = []
    for layer_scores in scores.values():
        bias = torch.zeros(experts)
        for _ in range(3):
            histogram, exact = HistogramQuantileBalancer(cfg), QuantileBalancer(exact_cfg)
            for micro_batch in layer_scores:
                choices = (micro_batch + bias).topk(k).indices
                histogram.observe(micro_batch, choices, bias)
                exact.observe(micro_batch, choices, bias)
            width = float(MarginBins.for_bias(bias, cfg.qb_bins, torch.float32).width)
            got, want = histogram.next_bias(bias), exact.next_bias(bias)
            error = (got - want).abs()
            assert float(error.max()) < width, (float(error.max()), width)
            errors.append(float(error.mean()) / width)
            bias = want
    assert sum(errors) / len(errors) < 0.25


def test_the_counts_of_a_step_are_those_of_its_micro_batches_and_nothing_is_kept_or_read():
    scores, experts, _ = smoke_router_scores(micro_batches=2)
    cfg = load_config("configs/smoke.yaml", []).model.moe
    streamed, whole = HistogramQuantileBalancer(cfg), HistogramQuantileBalancer(cfg)
    layer_scores = next(iter(scores.values()))
    bias = torch.linspace(-0.05, 0.05, experts)
    with HostReads() as reads:
        for micro_batch in layer_scores:
            streamed.observe(micro_batch, None, bias)
        new_bias = streamed.next_bias(bias)
    assert reads.total == 0
    whole.observe(torch.cat(layer_scores), None, bias)
    assert streamed.counts is None and not hasattr(streamed, "_scores")  # no score is kept, nothing is left behind
    assert torch.equal(new_bias, whole.next_bias(bias))


class CountingStatistics(LocalStatistics):
    def __init__(self):
        self.calls = 0

    def total(self, x):
        self.calls += 1
        return x


def test_a_stage_reduces_all_its_layers_histograms_in_one_collective():
    scores, experts, _ = smoke_router_scores(micro_batches=1)
    cfg = load_config("configs/smoke.yaml", []).model.moe
    stats = CountingStatistics()
    batched, alone = [], []
    bias = torch.zeros(experts)
    for layer_scores in scores.values():
        for balancers in (batched, alone):
            balancer = HistogramQuantileBalancer(cfg)
            balancer.stats = stats
            balancer.observe(layer_scores[0], None, bias)
            balancers.append(balancer)
    reduce_pending(batched)
    assert stats.calls == 1 and len(batched) > 1
    biases = [b.next_bias(bias) for b in batched]
    assert stats.calls == 1  # next_bias found the counts reduced
    assert all(torch.equal(got, b.next_bias(bias)) for got, b in zip(biases, alone, strict=True))
    assert stats.calls == 1 + len(alone)  # one each when not batched


def test_the_memory_plan_counts_the_bytes_the_balancers_hold():
    """planning/balancing_state.held_bytes against the bytes of the tensors the balancers of every MoE layer
    hold after a step's micro-batches, in both modes; at full size (896 experts, 1000 bins) a histogram is
    7.2 MB per layer, while the exact mode keeps 3.7 KB per routed token per layer."""
    from moe_pretrain.planning.balancing_state import held_bytes

    scores, experts, k = smoke_router_scores(micro_batches=2)
    tokens = next(iter(scores.values()))[0].shape[0]
    for mode in ("histogram", "exact"):
        cfg = load_config("configs/smoke.yaml", [f"model.moe.qb_quantile={mode}"]).model.moe
        held = 0
        for layer_scores in scores.values():
            balancer = HistogramQuantileBalancer(cfg) if mode == "histogram" else QuantileBalancer(cfg)
            for micro_batch in layer_scores:
                balancer.observe(micro_batch, micro_batch.topk(k).indices, torch.zeros(experts))
            kept = [balancer.counts] if mode == "histogram" else [*balancer._scores, *balancer._choices]
            held += sum(t.numel() * t.element_size() for t in kept)
        assert held == held_bytes(cfg, len(scores), tokens, 2), mode
    full = load_config("configs/full.yaml", []).model.moe
    assert held_bytes(full, 1, 1, 1) == 896 * 1000 * 8
