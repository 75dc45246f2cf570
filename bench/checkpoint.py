"""Checkpoint save and load throughput against this disk's raw sequential bandwidth, measured in one run.

Run: .venv/bin/python bench/checkpoint.py [--hidden 256 --layers 8 --experts 32]

Builds a smoke-shaped model (larger by default), takes one training step so Adam state exists,
then times: a raw sequential write and read of the same number of bytes (fsync'd; the named
reference), our synchronous save (DCP files + SHA-256 manifest + atomic commit), a load (DCP read
into the model and the sharded optimizer's moments, in place), and the training stall of an
asynchronous save (staging to host memory) as a fraction of the synchronous save's time. The read
figures include the page cache, for both sides alike.
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

from moe_pretrain.checkpoint import AsyncSaver, find
from moe_pretrain.config import load_config
from moe_pretrain.training import Trainer


def raw_write_read(path: Path, size: int) -> tuple[float, float]:
    block = os.urandom(1 << 20)
    start = time.perf_counter()
    with path.open("wb") as f:
        for _ in range(size >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write = time.perf_counter() - start
    start = time.perf_counter()
    with path.open("rb") as f:
        while f.read(1 << 20):
            pass
    return write, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        overrides = [f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}",
                     f"model.layer_pattern={'KKKM' * (args.layers // 4)}", f"model.moe.num_experts={args.experts}",
                     f"model.moe.latent_size={args.hidden // 2}", "train.steps=1", "logging.progress=false",
                     f"train.run_dir={tmp}/run", "checkpoint.every=0"]
        cfg = load_config("configs/smoke.yaml", overrides)
        trainer = Trainer(cfg)
        trainer.run()  # one step, then the end-of-run save (untimed warm-up of the code path)
        start = time.perf_counter()
        trainer.step += 1  # a new step number: checkpoints are never overwritten
        path = trainer.save_checkpoint()
        save_s = time.perf_counter() - start
        size = sum(p.stat().st_size for p in path.iterdir())
        start = time.perf_counter()
        found, _ = find(trainer.checkpoint_root, "auto")  # includes SHA-256 verification
        trainer.state.load(found)  # in place, into the model and the optimizer's moments
        load_s = time.perf_counter() - start
        trainer.async_saver = AsyncSaver(None)
        trainer.step += 1
        start = time.perf_counter()
        trainer.save_checkpoint()  # returns once the tensors are staged
        stall_s = time.perf_counter() - start
        trainer.async_saver.wait()
        raw_w, raw_r = raw_write_read(Path(tmp) / "raw.bin", max(size, 1 << 20))
    raw_size = max(size, 1 << 20) >> 20 << 20
    mib = 2**20
    raw_write, raw_read = raw_size / raw_w, raw_size / raw_r
    saving, loading = size / save_s, size / load_s
    print(f"checkpoint of {size / mib:.1f} MiB ({sum(p.numel() for p in trainer.model.parameters()):,} parameters "
          "+ Adam moments), 1 process")
    print(f"  raw sequential write  {raw_write / mib:8.1f} MiB/s   (reference)")
    print(f"  save (sync)           {saving / mib:8.1f} MiB/s   {saving / raw_write:.2f}x raw write")
    print(f"  raw sequential read   {raw_read / mib:8.1f} MiB/s   (reference)")
    print(f"  verify + load         {loading / mib:8.1f} MiB/s   {loading / raw_read:.2f}x raw read")
    print(f"  async save stall      {stall_s * 1e3:8.1f} ms      {stall_s / save_s:.2f}x the synchronous save "
          f"({save_s * 1e3:.1f} ms)")

if __name__ == "__main__":
    main()
