"""Chunks of a MoE layer's tokens run as a pipeline, so that one chunk's exchange hides behind another's
compute (parallel.dispatch_chunks; Megatron-core's and DeepSeek-V3's overlap of the expert all-to-all).

Each chunk is a generator that starts an exchange (collectives.start_rows) and yields, and on being resumed
finishes it and computes up to its next start. run_interleaved resumes the chunks in turn: with two, chunk
2's dispatch is in flight while chunk 1's experts compute, chunk 1's combine while chunk 2's do. The
backward runs the same way without being told: each finish's backward starts the gradients' exchange and
its start's backward waits for it, and the autograd engine runs the later-made of the ready nodes first,
so the other chunk's backward runs in between. With one chunk every exchange is waited for at once.
"""

from collections.abc import Generator, Iterable


def run_interleaved(chunks: Iterable[Generator[None, None, None]]) -> None:
    """Resume each chunk in turn until all are done."""
    running = list(chunks)
    while running:
        for chunk in list(running):
            try:
                next(chunk)
            except StopIteration:
                running.remove(chunk)
