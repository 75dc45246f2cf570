"""Peak memory of one long-sequence training step of the smoke model without and with context parallelism.

Run: .venv/bin/python bench/long_context.py [--seq-len 32768 --cp 1 4 --recompute none]
     .venv/bin/python bench/long_context.py --seq-len 65536 --cp 1 8 --mla-heads 2 --recompute full
         (cp > MLA heads: the latent exchange; measured on 2 cores: cp 1 3.02 GB allocated, plan 3.08, 429 s
         a step; cp 8 worst rank 0.40 GB, x0.13, plan 0.38, 306 s. Without recomputation cp 1 needs ~16 GB)
For each cp, cp processes (gloo) train one step on one sequence of --seq-len tokens (smoke model, fp32;
--mla-heads MLA heads, 4 by default; MLA's exchange by parallel.cp_mla=auto: Ulysses where the heads divide
over cp, else the latent exchange). Each rank measures the
step's peak allocated bytes (live tensors, glibc mallinfo2) and resident peak (VmHWM) above its memory
before the step; printed: the worst rank's figures, the step time, the ratio of each cp's worst rank to
cp 1's (the named reference, measured in the same run), and the memory plan's activation peak for T / cp
positions (moe_pretrain/planning/step_activations.py). Activations split over cp ranks, so the ratio should
approach 1 / cp (parameters, gradients and Adam moments are small for this model).
"""

import argparse
import tempfile
import time

import torch.distributed as dist

from launch.local import run_distributed
from moe_pretrain.config import load_config
from moe_pretrain.config.stage import mla_exchange
from moe_pretrain.planning.measured import AllocatedPeak, peak_resident_bytes, reset_peak, resident_bytes
from moe_pretrain.planning.step_activations import activation_bytes, layer_activations
from moe_pretrain.training import Trainer
from parallel.collectives import gather_objects
from parallel.state import destroy_parallel, init_parallel


def measure(rank: int, world_size: int, overrides: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config("configs/smoke.yaml", [*overrides, f"parallel.cp={world_size}", f"train.run_dir={run_dir}",
                                                 "logging.progress=false", "train.steps=1"])
        ctx = init_parallel(cfg)
        try:
            trainer = Trainer(cfg, ctx)
            before = resident_bytes()
            reset_peak()
            start = time.perf_counter()
            with AllocatedPeak() as allocated:
                base = allocated.peak
                trainer.train_step()
            row = {"rank": rank, "allocated": allocated.peak - base, "resident": peak_resident_bytes() - before,
                   "seconds": time.perf_counter() - start}
            return gather_objects(row, dist.group.WORLD if ctx.distributed else None)
        finally:
            destroy_parallel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=32768)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--recompute", default="none", choices=["none", "selective", "full"])
    parser.add_argument("--mla-heads", type=int, default=4)
    args = parser.parse_args()
    overrides = [f"data.seq_len={args.seq_len}", "data.batch_size=1", f"model.mla.num_heads={args.mla_heads}",
                 f"train.recompute={args.recompute}"]
    print(f"smoke model, one step on 1 x {args.seq_len} tokens, fp32, recompute {args.recompute}; worst rank, GB")
    reference = None
    for cp in args.cp:
        rows = run_distributed(measure, cp, overrides, timeout=1800) if cp > 1 else measure(0, 1, overrides)
        worst = max(rows, key=lambda r: r["allocated"])
        reference = reference or worst
        allocated, resident = worst["allocated"], worst["resident"]
        m = load_config("configs/smoke.yaml", overrides).model
        exchange = mla_exchange("auto", cp, args.mla_heads) if cp > 1 else "ulysses"
        plan = activation_bytes(m, list(range(m.num_layers)), args.recompute, args.seq_len // cp, act_bytes=4,
                                layer_of=lambda i, r, m=m, e=exchange, c=cp: layer_activations(m, i, r, e, c)).peak
        label = f"{cp} (latent)" if exchange == "latent" else f"{cp}"
        print(f"  cp {label}: allocated peak {allocated / 1e9:6.2f} (x{allocated / reference['allocated']:.2f} of cp "
              f"{args.cp[0]}; plan {plan / 1e9:.2f}), resident peak {resident / 1e9:6.2f} "
              f"(x{resident / reference['resident']:.2f}), step {max(r['seconds'] for r in rows):.1f} s")


if __name__ == "__main__":
    main()
