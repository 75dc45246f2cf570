"""The shape of one training step: host reads of tensor values, and collectives by purpose (calls and bytes),
per step as depth and micro-batches grow, and an MLA layer's ops as documents per row grow.

Run: .venv/bin/python bench/step_shape.py [--layers 2 8] [--micro-batches 1 4] [--world 2]
The smoke model (layer pattern cut to the depth, 3 KDA : 1 MLA), fp32, one warm-up step, then one counted
step. Host reads: one process (moe_pretrain/planning/host_reads.HostReads). Collectives: --world processes
(gloo, data parallel with experts split over them: parallel.ep = world), counted on rank 0 by wrapping
torch.distributed's collectives; each call is filed under the innermost module of moe_pretrain or parallel
on its stack, its purpose (model/balancing is quantile balancing; "bwd": called from a backward). Counts
are of calls and bytes, exact and the same on every machine. The reference is the shallowest,
single-micro-batch run of the same invocation: counts that do not grow with depth or micro-batches print
x1.00 in every row.
"""

import argparse
import collections
import contextlib
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from gpu_kernels.choice import Kernels
from launch.local import run_distributed
from moe_pretrain.config import load_config
from moe_pretrain.model.init import initialize
from moe_pretrain.model.layout import DocumentLayout
from moe_pretrain.model.mla import GatedMLA
from moe_pretrain.planning.host_reads import HostReads
from moe_pretrain.planning.torch_calls import TorchCalls
from moe_pretrain.training import Trainer
from parallel.state import destroy_parallel, init_parallel

PATTERN = "KKKM"
COUNTED = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
           "all_gather_object", "batch_isend_irecv", "isend", "irecv")
_ROOT = str(Path(__file__).resolve().parents[1]) + "/"
_PACKAGES = (_ROOT + "moe_pretrain/", _ROOT + "parallel/")
_PLUMBING = ("parallel/collectives.py", "parallel/torch_compat.py", "parallel/statistics.py")


def config(layers: int, micro_batches: int, run_dir: str, *overrides: str):
    pattern = (PATTERN * layers)[:layers]
    return load_config("configs/smoke.yaml", [
        f"model.num_layers={layers}", f"model.layer_pattern={pattern}", f"data.micro_batches={micro_batches}",
        "train.steps=2", "train.dtype=float32", "eval.tokens=0", "eval.every=0", "logging.progress=false",
        # Gradient buckets of 100 KiB: the smoke model's parameters fill one 25 MiB bucket per group, leaving
        # its reduce-scatter nothing to overlap; at full size a stage has thousands of 25 MiB buckets.
        "parallel.bucket_mb=0.1", f"train.run_dir={run_dir}", *overrides])


def _purpose() -> str:
    """The innermost frame in moe_pretrain/ or parallel/ other than the collectives' own modules, marked
    'bwd' when the call is made while a backward runs (a backward function's, or a gradient hook's)."""
    frame, purpose, backward = sys._getframe(2), "?", False
    while frame is not None:
        path, name = frame.f_code.co_filename, frame.f_code.co_name
        backward |= name in ("backward", "bwd")
        if purpose == "?" and path.startswith(_PACKAGES) and not path.endswith(_PLUMBING):
            purpose = path[len(_ROOT):].removeprefix("moe_pretrain/").removesuffix(".py")
        frame = frame.f_back
    return purpose + (" bwd" if backward else "")


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


@contextlib.contextmanager
def counting_collectives():
    """{purpose: [calls, bytes]} of the collectives called inside (the first tensor argument's bytes)."""
    counts: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    originals = {name: getattr(dist, name) for name in COUNTED}
    import parallel.collectives as ours  # holds all_gather / reduce_scatter under their compat names
    compat = {name: getattr(ours, name) for name in ("all_gather_single", "reduce_scatter_single")}

    def counted(fn):
        def call(*args, **kwargs):
            entry = counts[_purpose()]
            entry[0] += 1
            entry[1] += _bytes(args[0] if args else None)
            return fn(*args, **kwargs)
        return call

    for name, fn in originals.items():
        setattr(dist, name, counted(fn))
    for name, fn in compat.items():
        setattr(ours, name, counted(fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
        for name, fn in compat.items():
            setattr(ours, name, fn)


def host_reads(layers: int, micro_batches: int, run_dir: str) -> HostReads:
    trainer = Trainer(config(layers, micro_batches, run_dir))
    trainer.train_step()
    with HostReads() as reads:
        trainer.train_step()
    return reads


def collectives_worker(rank: int, world_size: int, layers: int, micro_batches: int, run_dir: str) -> dict:
    cfg = config(layers, micro_batches, run_dir, f"parallel.ep={world_size}")
    ctx = init_parallel(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        trainer.train_step()
        with counting_collectives() as counts:
            trainer.train_step()
        return dict(counts)
    finally:
        destroy_parallel()


@torch.no_grad()
def mla_calls(documents_per_row: int, attention: str, rows: int = 2, seq_len: int = 256) -> int:
    """Torch calls of one MLA layer's forward (the smoke model's) over rows of `documents_per_row` documents,
    with the layout (bounds, block mask) built beforehand, once per forward in the model."""
    cfg = config(2, 1, "unused")
    layer = GatedMLA(cfg.model.hidden_size, cfg.model.mla, init_std=0.02, out_std=0.02,
                     kernels=Kernels(attention=attention))
    initialize(layer, 0).eval()
    doc_ids = torch.arange(seq_len).div(seq_len // documents_per_row, rounding_mode="floor").expand(rows, seq_len)
    layout = DocumentLayout.from_doc_ids(doc_ids)
    layout.document_bounds  # noqa: B018
    if attention == "flex":
        layout.attention_mask  # noqa: B018
    x = torch.randn(rows, seq_len, cfg.model.hidden_size)
    with TorchCalls() as calls:
        layer(x, layout)
    return calls.calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--world", type=int, default=2, help="processes for the collectives (0: skip them)")
    parser.add_argument("--sites", type=int, default=12, help="the sites with the most reads to list")
    args = parser.parse_args()
    runs, collectives = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            for micro in args.micro_batches:
                runs[layers, micro] = host_reads(layers, micro, f"{tmp}/{layers}-{micro}")
                if args.world > 1:
                    collectives[layers, micro] = run_distributed(collectives_worker, args.world, layers, micro,
                                                                 f"{tmp}/{layers}-{micro}-dist", timeout=600)
    smallest = min(runs)
    reference = runs[smallest]
    kinds = sorted({kind for reads in runs.values() for kind in reads.by_kind})
    print(f"host reads in one training step (smoke model, one process); ratio against {smallest[0]} layers x "
          f"{smallest[1]} micro-batch")
    print(f"{'layers':>6s} {'micro':>5s} {'total':>6s} {'ratio':>6s}  " + "  ".join(kinds))
    for (layers, micro), reads in runs.items():
        print(f"{layers:6d} {micro:5d} {reads.total:6d} {reads.total / reference.total:6.2f}  "
              + "  ".join(f"{reads.by_kind[k]:{len(k)}d}" for k in kinds))
    deepest = runs[max(runs)]
    print(f"\nsites, {max(runs)[0]} layers x {max(runs)[1]} micro-batches (reads per step):")
    for (kind, site), n in deepest.by_site.most_common(args.sites):
        print(f"{n:6d}  {kind:20s} {site}")
    if collectives:
        purposes = sorted({p for counts in collectives.values() for p in counts})
        print(f"\ncollectives in one training step, rank 0 of {args.world} (ep={args.world}): calls (MB) by purpose")
        print(f"{'layers':>6s} {'micro':>5s} {'total':>6s} {'ratio':>6s}  " + "  ".join(purposes))
        base = sum(c for c, _ in collectives[smallest].values())
        for (layers, micro), counts in collectives.items():
            total = sum(c for c, _ in counts.values())
            cells = [f"{counts.get(p, [0, 0])[0]:d} ({counts.get(p, [0, 0])[1] / 1e6:.2f})".rjust(len(p))
                     for p in purposes]
            print(f"{layers:6d} {micro:5d} {total:6d} {total / base:6.2f}  " + "  ".join(cells))
    print("\ntorch calls of one MLA layer's forward (smoke model, 2 rows x 256 positions), ratio against 1 document "
          "per row\n  attention             1 doc/row  32 docs/row  ratio")
    for attention, what in (("sdpa", "SDPA per document"), ("flex", "FlexAttention")):
        one, many = mla_calls(1, attention), mla_calls(32, attention)
        print(f"  {what:20s} {one:10d} {many:12d} {many / one:6.2f}")


if __name__ == "__main__":
    main()
