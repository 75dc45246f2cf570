"""Each data-parallel rank reads only its rows; together they are the single-process batch, row for row."""

import torch

from moe_pretrain.config.stage import resolve_stages
from moe_pretrain.data import Batch, PretrainingData
from moe_pretrain.data.prefetch import BatchPrefetcher, BatchRequest
from tests.models import tiny_config

FIELDS = ("tokens", "labels", "doc_ids", "image_mask", "patches")
MICRO_BATCHES = 2
CONFIG = tiny_config(
    "data.image_fraction=0.3", "data.text_doc_bytes=256", "train.steps=6",
    f"stages=[{{name: a, tokens: 6144, seq_len: 128, batch_tokens: 2048, micro_batches: {MICRO_BATCHES}}}, "
    f"{{name: b, tokens: 6144, seq_len: 256, batch_tokens: 2048, micro_batches: {MICRO_BATCHES}}}]")
STAGES = resolve_stages(CONFIG)
# Stage 0 packs 128-token rows (8 a micro-batch), stage 1 256-token rows (4 a micro-batch).
STEPS = [STAGES[0]] * 3 + [STAGES[1]] * 3


def staged_data() -> PretrainingData:
    return PretrainingData(CONFIG)


def take(prefetchers: list[BatchPrefetcher], step: int) -> list[list[Batch]]:
    """Every rank's micro-batches of `step`, each rank then preparing the next step in the background."""
    taken = []
    for shard, prefetcher in enumerate(prefetchers):
        taken.append(prefetcher.take(BatchRequest(STEPS[step], shard, len(prefetchers), True)))
        if step + 1 < len(STEPS):
            prefetcher.prepare_ahead(BatchRequest(STEPS[step + 1], shard, len(prefetchers), True))
    return taken


def test_union_of_rank_shards_is_the_single_process_batch_across_stages_and_a_resume_on_another_layout():
    single = BatchPrefetcher(staged_data(), background=False)
    reference = [take([single], step)[0] for step in range(len(STEPS))]

    four = [BatchPrefetcher(staged_data()) for _ in range(4)]
    got = [take(four, step) for step in range(2)]
    positions = [p.position for p in four]
    assert all(position == positions[0] for position in positions)  # every rank agrees where the stream is
    for p in four:
        p.close()
    two = [BatchPrefetcher(staged_data()) for _ in range(2)]
    for p in two:
        p.load_state(positions[0])  # resumed at dp=2, across the stage boundary at step 3
    got += [take(two, step) for step in range(2, len(STEPS))]

    assert [r[0].tokens.shape[1] for r in reference] == [128, 128, 128, 256, 256, 256]
    images = 0
    for step, per_rank in enumerate(got):
        for micro in range(MICRO_BATCHES):
            union = Batch.concatenate([rank[micro] for rank in per_rank])
            for name in FIELDS:
                assert torch.equal(getattr(union, name), getattr(reference[step][micro], name)), (step, micro, name)
            images += int(union.image_mask.sum())
    assert images > 0


def test_a_position_saved_while_the_next_step_is_prepared_is_the_taken_one():
    """A checkpoint taken while the next batches are being prepared resumes at the step after the taken one."""
    running = BatchPrefetcher(staged_data())
    take([running], 0)  # and step 1 is being prepared in the background
    resumed = BatchPrefetcher(staged_data(), background=False)
    resumed.load_state(running.position)
    a, b = take([running], 1)[0], take([resumed], 1)[0]
    assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, b))
    # A take of another request than the one prepared ahead rewinds first: no document is skipped.
    direct = BatchPrefetcher(staged_data(), background=False)
    take([direct], 0)
    take([direct], 1)  # where `running` is, with step 2 (stage 0) prepared ahead
    other = BatchRequest(STAGES[1], 0, 1, True)
    a, b = running.take(other), direct.take(other)
    assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, b))
    assert running.position == direct.position
