"""The shape of one training step: host reads of tensor values per step, by kind and by site, as depth and
micro-batches grow (issue 25's before / after table).

Run: .venv/bin/python bench/step_shape.py [--layers 2 8] [--micro-batches 1 4]
One process, the smoke model (layer pattern cut to the depth, 3 KDA : 1 MLA), fp32, one warm-up step, then
one counted step (moe_pretrain/planning/host_reads.HostReads: exact counts of calls, the same on every
machine). The reference is the shallowest, single-micro-batch run measured in the same invocation: a step
whose host reads do not grow with depth or micro-batches prints x1.00 in every row.
"""

import argparse
import tempfile

from moe_pretrain.config import load_config
from moe_pretrain.planning.host_reads import HostReads
from moe_pretrain.training import Trainer

PATTERN = "KKKM"


def counted_step(layers: int, micro_batches: int, run_dir: str) -> HostReads:
    pattern = (PATTERN * layers)[:layers]
    cfg = load_config("configs/smoke.yaml", [
        f"model.num_layers={layers}", f"model.layer_pattern={pattern}", f"data.micro_batches={micro_batches}",
        "train.steps=2", "eval.tokens=0", "eval.every=0", "logging.progress=false", f"train.run_dir={run_dir}"])
    trainer = Trainer(cfg)
    trainer.train_step()
    with HostReads() as reads:
        trainer.train_step()
    return reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--sites", type=int, default=12, help="the sites with the most reads to list")
    args = parser.parse_args()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            for micro in args.micro_batches:
                runs[layers, micro] = counted_step(layers, micro, f"{tmp}/{layers}-{micro}")
    reference = runs[min(runs)]
    kinds = sorted({kind for reads in runs.values() for kind in reads.by_kind})
    print("host reads in one training step (smoke model, one process); ratio against "
          f"{min(runs)[0]} layers x {min(runs)[1]} micro-batch")
    print(f"{'layers':>6s} {'micro':>5s} {'total':>6s} {'ratio':>6s}  " + "  ".join(kinds))
    for (layers, micro), reads in runs.items():
        print(f"{layers:6d} {micro:5d} {reads.total:6d} {reads.total / reference.total:6.2f}  "
              + "  ".join(f"{reads.by_kind[k]:{len(k)}d}" for k in kinds))
    deepest = runs[max(runs)]
    print(f"\nsites, {max(runs)[0]} layers x {max(runs)[1]} micro-batches (reads per step):")
    for (kind, site), n in deepest.by_site.most_common(args.sites):
        print(f"{n:6d}  {kind:20s} {site}")


if __name__ == "__main__":
    main()
