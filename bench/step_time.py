"""The dry run's predicted step time against a measured one, on one GPU: the probe config
(configs/probe_step_time.yaml: the full model's layer widths at a size one GPU holds) trains a few steps on this
machine's device (launch.train, the kernels the device resolves), and launch.dryrun predicts the same config's step
on the named GPU. Prints each, the ratio measured / predicted, and the measured MFU.

Run: python bench/step_time.py [--config configs/probe_step_time.yaml] [--gpu h200] [--steps 8] [--warmup 3]
     [--predict-only | --measure-only]
The measured figure is the median of the steps after the first --warmup ones (the first compiles and autotunes
kernels). Without a CUDA GPU only the prediction is printed: a CPU's step says nothing of a GPU's.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def measure(configs: list[str], steps: int, warmup: int) -> dict:
    """Train the probe for `steps` steps in this process (the trainer's own step, no run directory or
    checkpoint); the median step time after the warm-up."""
    from gpu_kernels.fast_paths import describe
    from moe_pretrain.config import load_config
    from moe_pretrain.log import setup_logging
    from moe_pretrain.training import Trainer
    from parallel.state import init_parallel

    setup_logging(0)
    cfg = load_config(configs, [f"train.steps={steps}"])
    trainer = Trainer(cfg, init_parallel(cfg))
    results = []
    for step in range(steps):
        results.append(trainer.train_step())
        print(f"step {step + 1}: {results[-1].seconds:.4g} s, loss {results[-1].loss:.4f}", flush=True)
    timed = results[warmup:]
    if not timed:
        raise SystemExit(f"--steps {steps} leaves no step after --warmup {warmup}")
    return {"step_s": statistics.median(r.seconds for r in timed),
            "mfu": statistics.median(trainer.mfu(r.tokens, r.seconds, r.seq_len, r.attended_keys) for r in timed),
            "first_s": results[0].seconds, "kernels": describe(trainer.model),
            "loss": (results[0].loss, results[-1].loss)}


def predict(configs: list[str], gpu: str) -> dict:
    """launch.dryrun's one-GPU trace of the same config on `gpu`'s kernels and roofline."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "trace.json"
        subprocess.run([sys.executable, "-m", "launch.dryrun", *(f"--config={c}" for c in configs), "--gpus", "1",
                        "--gpu", gpu, "--json", str(out)], check=True, stdout=subprocess.DEVNULL)
        (trace,) = json.loads(out.read_text())
    return trace


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", default=[])
    parser.add_argument("--gpu", default="h200", help="the GPU the prediction is for (launch.dryrun --gpu)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--predict-only", action="store_true", help="print the dry run's prediction alone")
    parser.add_argument("--measure-only", action="store_true", help="print the measured step alone (the prediction "
                        "is the same on any machine: `--predict-only` elsewhere saves the GPU's time)")
    args = parser.parse_args()
    configs = args.config or ["configs/probe_step_time.yaml"]
    import torch

    measured = None
    if not args.predict_only and torch.cuda.is_available():
        measured = measure(configs, args.steps, args.warmup)
        print(f"measured on {torch.cuda.get_device_name()}: {measured['step_s']:.4g} s a step (median of steps "
              f"{args.warmup + 1}-{args.steps}; the first took {measured['first_s']:.4g} s), "
              f"MFU {measured['mfu']:.1%}, loss {measured['loss'][0]:.3f} -> {measured['loss'][1]:.3f}")
        print(f"  {measured['kernels']}")
    elif args.measure_only:
        print("no CUDA GPU here: nothing to measure (a CPU's step says nothing of a GPU's)")
        return 1
    elif not args.predict_only:
        print("no CUDA GPU here: the prediction alone")
    if args.measure_only:
        return 0
    trace = predict(configs, args.gpu)
    print(f"predicted for {args.gpu}: {trace['step_s']:.4g} s a step (compute {trace['compute_s']:.4g} s at the "
          f"roofline, {trace['flops'] / 1e12:.4g} TFLOP, {trace['bytes_moved'] / 1e9:.4g} GB moved), "
          f"MFU {trace['mfu']:.1%}")
    if measured:
        print(f"measured / predicted step time: {measured['step_s'] / trace['step_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
