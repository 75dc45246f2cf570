"""Import of a release-format Kimi K3 checkpoint (MXFP4 experts) and export back, against a raw read of the same
files, with the projection for the full release; everything measured in one run.

Run: .venv/bin/python bench/kimi_k3_import.py [--experts 256 --hidden 256 --workers 1 2]

A release-format fixture (tests/distributed/test_kimi_k3_export.py's writer: the published config.json with a small
model's sizes, MXFP4 routed experts with random codes) is written once. Then, in one run: the named reference, a raw
read of every tensor of its files (safetensors, pages dropped from the page cache first); the import (decode into the
stacked expert weights, DCP files hashed as written, commit) with each --workers count; the export back to the
release's layout (MXFP4 encode, with each --workers count) and to its bf16 variant. Throughput is release bytes read
(import) or written (export) per second; the projection divides the release's 1.45 TB by it (one host; workers divide
it further where the host has the cores and the disks).
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoints_tool.__main__ import RELEASE_BYTES
from checkpoints_tool.hf_import import import_in_workers, release_run_config
from moe_pretrain.checkpoint.export import export
from moe_pretrain.config import config_to_dict
from tests.distributed.test_kimi_k3_export import write_release_fixture
from tests.models import tiny_config


def drop_cache(directory: Path) -> None:
    for file in directory.rglob("*"):
        if file.is_file():
            with file.open("rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def raw_read(directory: Path) -> int:
    total = 0
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                total += tensor.numel() * tensor.element_size()
    return total


def timed(work) -> tuple[float, object]:
    start = time.perf_counter()
    result = work()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    width = args.hidden
    cfg = tiny_config(f"model.hidden_size={width}", f"model.moe.num_experts={args.experts}",
                      f"model.moe.latent_size={width}", f"model.moe.expert_intermediate={2 * width}",
                      f"model.moe.shared_intermediate={2 * width}", "model.dense_intermediate=512")
    work = Path(tempfile.mkdtemp(prefix="kimi_k3_bench_"))
    try:
        release = work / "release"
        release.mkdir()
        write_release_fixture(release, cfg)
        config_file = work / "config.yaml"
        config_file.write_text(yaml.safe_dump(config_to_dict(cfg)))
        drop_cache(release)
        seconds, nbytes = timed(lambda: raw_read(release))
        reference = nbytes / seconds
        print(f"release fixture: {nbytes / 1e9:.3f} GB in {len(list(release.glob('*.safetensors')))} files")
        print(f"{'raw read (reference)':28s} {seconds:7.2f} s  {reference / 1e9:6.3f} GB/s  1.00x   "
              f"release: {RELEASE_BYTES / reference / 3600:6.2f} h")
        run_cfg, _, notes = release_run_config(release, config_file)
        imported = None
        for workers in args.workers:
            drop_cache(release)
            out = work / f"imported-{workers}"
            seconds, (imported, stats) = timed(lambda out=out, workers=workers: import_in_workers(
                release, out, run_cfg, "mxfp4", notes, workers))
            rate = stats.bytes_read / seconds
            print(f"{f'import, {workers} worker(s)':28s} {seconds:7.2f} s  {rate / 1e9:6.3f} GB/s  "
                  f"{rate / reference:.2f}x   release: {RELEASE_BYTES / rate / 3600:6.2f} h")
        for experts, workers in [("mxfp4", w) for w in args.workers] + [("bf16", 1)]:
            out = work / f"export-{experts}-{workers}"
            seconds, _ = timed(lambda out=out, experts=experts, workers=workers: export(
                imported, out, layout="kimi-k3-hf", experts=experts, workers=workers))
            written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
            rate = written / seconds
            print(f"{f'export, {experts}, {workers} worker(s)':28s} {seconds:7.2f} s  {rate / 1e9:6.3f} GB/s  "
                  f"{rate / reference:.2f}x   release: {RELEASE_BYTES / rate / 3600:6.2f} h  "
                  f"({written / 1e9:.3f} GB written)")
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
