"""`python -m checkpoints_tool <command>`: look after checkpoints without building a model.

  inspect DIR                      step, tokens, layout, parameter count, bytes per component, files
  verify DIR                       completeness and every SHA-256; exit 0 only if all hold
  prune DIR --keep-last N [--keep-every K] [--force]
                                   keeps the newest N checkpoints that verify (each checked, newest first;
                                   one that does not is kept and named, uncounted) and multiples of K; never
                                   touches the checkpoint `latest` names; N < 2 only with --force
  export DIR OUT [--format native|kimi-k3-hf] [--experts mxfp4|bf16] [--max-shard-mb M] [--workers N]
                                   model weights as sharded safetensors + index + config.json, under our
                                   names (files of at most M MiB) or as the released Kimi K3 checkpoint
                                   (its names, dtypes, files and config.json; routed experts MXFP4 unless
                                   --experts bf16); N processes write the files
  import HF_DIR OUT [--config FILE] [--set key=value ...] [--workers N]
                                   a Kimi K3 checkpoint directory (the release, or our kimi-k3-hf export) as
                                   a model-only checkpoint OUT/step_00000000 that training resumes from
                                   (fresh optimizer and data position); the model comes from its config.json,
                                   FILE and --set give the run's other settings; N processes share the
                                   work (or run it under torchrun: every rank takes a share)
  reshard DIR OUT --tp A --pp B --ep C [--dp D] [--set key=value ...]
                                   rewrite as that layout would save it (all 1 = consolidate), locally

DIR is a checkpoint (step_<N>) or a checkpoint root, in which case `latest` is used, or without `latest` the
newest committed checkpoint, as training resumes (verify checks every committed checkpoint of a root).
"""

import argparse
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

from safetensors import safe_open
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from checkpoints_tool import ImportWorkerError
from moe_pretrain.checkpoint import committed_checkpoints, prune, read_trainer_state, verify
from moe_pretrain.checkpoint.directory import LATEST
from moe_pretrain.checkpoint.export import EXTRAS, LAYOUTS, export
from moe_pretrain.checkpoint.kimi_k3 import EXPERT_FORMATS
from moe_pretrain.checkpoint.manifest import MANIFEST, read_manifest
from moe_pretrain.checkpoint.store import CheckpointError
from moe_pretrain.config import ConfigError

RELEASE_BYTES = 1_453_660_000_000
"""The released Kimi K3's tensors in bytes (1,453.66 GB in 96 files: its published index), for the projection."""


class ToolError(Exception):
    """What is wrong with the command's input, in one line naming the path (exit 2, no traceback)."""


def is_root(path: Path) -> bool:
    """A checkpoint root: `latest` in it, or step_<N> directories and no manifest of its own (training resumes
    from a root whose `latest` is gone: the newest checkpoint that verifies)."""
    return (path / LATEST).is_file() or (not (path / MANIFEST).is_file() and bool(committed_checkpoints(path)))


def resolve(path: Path) -> Path:
    """The checkpoint a path means: itself, or the one a checkpoint root's `latest` names (without `latest`, the
    newest that committed, said on stderr); it must have committed (a manifest), else ToolError."""
    root = path if is_root(path) else None
    committed = [p for _, p in committed_checkpoints(root) if (p / MANIFEST).is_file()] if root else []
    if root is not None and not (root / LATEST).is_file():
        if not committed:
            raise ToolError(f"{root} holds no committed checkpoint: no step_<N> directory in it has a {MANIFEST}")
        print(f"{root} has no `{LATEST}`: taking the newest committed checkpoint, {committed[0]} (training resumes "
              f"from the newest that verifies)", file=sys.stderr)
        return committed[0]
    if root is not None:
        path = root / (root / LATEST).read_text().strip()
    if not (path / MANIFEST).is_file():
        older = (f"; the newest checkpoint with a manifest is {committed[0]} (inspect it, and run verify on "
                 f"{root})" if committed else "")
        raise ToolError(f"{path} is not a checkpoint: no {MANIFEST} (not a step_<N> directory or a root with "
                        f"`{LATEST}`, or a save that never committed){older}")
    return path


def component(key: str) -> str:
    """model.layers.3.mlp.experts.w_up -> model.layers.*.mlp.experts (bytes are summed per component)."""
    key = re.sub(r"\.layers\.\d+\.", ".layers.*.", key)
    return key.rsplit(".", 1)[0]


def inspect(path: Path) -> int:
    path = resolve(path)
    manifest = read_manifest(path)
    metadata = FileSystemReader(path).read_metadata()
    params, per_component = 0, defaultdict(int)
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            continue
        numel = 1
        for size in meta.size:
            numel *= size
        if key.startswith("model.") and meta.properties.dtype.is_floating_point and "expert_bias" not in key:
            params += numel
        per_component[component(key)] += numel * meta.properties.dtype.itemsize
    state = read_trainer_state(path)
    print(f"checkpoint  {path}")
    data = state["data"]
    position = (f"data rows {data['rows']:,}   documents drawn {sum(data['drawn'].values()):,} (mixture "
                f"{data['mixture']})" if data else "model only (no optimizer or data state)")
    print(f"step        {manifest['step']}   tokens {manifest['tokens']:,}   {position}")
    print(f"layout      {manifest['layout_text']}")
    print(f"parameters  {params:,}")
    print("bytes per component:")
    for name, size in sorted(per_component.items(), key=lambda kv: -kv[1]):
        print(f"  {size:>14,}  {name}")
    print("files:")
    for name, entry in manifest["files"].items():
        print(f"  {entry['bytes']:>14,}  {name}")
    return 0


def verify_command(path: Path) -> int:
    root = is_root(path)
    targets = [p for _, p in committed_checkpoints(path)] if root else [path]
    if root and not (path / LATEST).is_file():
        print(f"{path} has no `{LATEST}`: verifying every checkpoint in it (training resumes from the newest that "
              "verifies)")
    bad = 0
    for target in targets:
        problems = verify(target)
        print(f"{'OK ' if not problems else 'BAD'} {target}")
        for problem in problems:
            print(f"    {problem}")
        bad += bool(problems)
    return 1 if bad or not targets else 0


def import_command(args: argparse.Namespace) -> int:
    """import: the model from HF_DIR's config.json, the pieces over --workers processes or torchrun's ranks."""
    import torch.distributed as dist

    from checkpoints_tool.hf_import import import_hf, import_in_workers, release_run_config

    cfg, quantized, notes = release_run_config(args.dir, args.config, args.set)
    experts = "mxfp4" if quantized else "bf16"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: every rank converts its share
        dist.init_process_group("gloo")
        try:
            path, stats = import_hf(args.dir, args.out, cfg, experts, notes, group=dist.group.WORLD)
        finally:
            dist.destroy_process_group()
        if int(os.environ["RANK"]):
            return 0
    else:
        path, stats = import_in_workers(args.dir, args.out, cfg, experts, notes, args.workers)
    for note in stats.notes:
        print(f"note: {note}")
    if stats.mxfp4_groups_reencoded_differently:
        print(f"note: {stats.mxfp4_groups_reencoded_differently:,} of {stats.mxfp4_groups:,} MXFP4 groups have "
              "no code of magnitude 4 or 6: an export writes their values exactly, with other codes")
    rate = stats.bytes_read / max(stats.seconds, 1e-9)
    print(f"read {stats.bytes_read / 1e9:.3f} GB in {stats.seconds:.1f} s ({rate / 1e9:.3f} GB/s): the "
          f"{RELEASE_BYTES / 1e12:.2f} TB release would take {RELEASE_BYTES / rate / 3600:.1f} h at this rate")
    print(f"wrote {path} (model only: resume from it with train.resume={path})")
    return 0


def positive(text: str) -> int:
    """argparse type: an integer >= 1 (a bad value is a usage error naming the option)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be >= 1")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="checkpoints_tool", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("inspect").add_argument("dir", type=Path)
    commands.add_parser("verify").add_argument("dir", type=Path)
    pruning = commands.add_parser("prune")
    pruning.add_argument("dir", type=Path)
    pruning.add_argument("--keep-last", type=int, required=True)
    pruning.add_argument("--keep-every", type=int, default=0)
    pruning.add_argument("--force", action="store_true", help="allow --keep-last 1")
    exporting = commands.add_parser("export")
    exporting.add_argument("dir", type=Path)
    exporting.add_argument("out", type=Path)
    exporting.add_argument("--max-shard-mb", type=float, default=1024.0)
    exporting.add_argument("--format", choices=LAYOUTS, default="native")
    exporting.add_argument("--experts", choices=EXPERT_FORMATS, default="mxfp4",
                           help="kimi-k3-hf: routed experts as the release stores them (mxfp4) or in bf16")
    exporting.add_argument("--workers", type=positive, default=1, help="local processes writing the files")
    importing = commands.add_parser("import")
    importing.add_argument("dir", type=Path)
    importing.add_argument("out", type=Path)
    importing.add_argument("--config", type=Path, default=None,
                           help="a training config for the run's other sections (its model section is replaced)")
    importing.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    importing.add_argument("--workers", type=positive, default=1,
                           help="local processes converting shares of the files")
    resharding = commands.add_parser("reshard")
    resharding.add_argument("dir", type=Path)
    resharding.add_argument("out", type=Path)
    for dim in ("tp", "pp", "ep", "dp", "vpp"):
        resharding.add_argument(f"--{dim}", type=int, default=1)
    resharding.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                            help="other config overrides the target layout needs (e.g. data.micro_batches=2)")
    args = parser.parse_args(argv)
    try:
        if not args.dir.exists():
            raise ToolError(f"{args.dir} does not exist")
        return run(args)
    except (ToolError, ConfigError, CheckpointError, FileNotFoundError, FileExistsError,
            ImportWorkerError) as err:
        print(f"checkpoints_tool {args.command}: {err}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    if args.command == "inspect":
        return inspect(args.dir)
    if args.command == "verify":
        return verify_command(args.dir)
    if args.command == "import":
        return import_command(args)
    if args.command in ("reshard", "export"):
        source = resolve(args.dir)
        problems = verify(source)
        if problems:
            raise ToolError(f"refusing to {args.command} {source}, which does not verify: {'; '.join(problems)}")
    if args.command == "reshard":
        from checkpoints_tool.reshard import reshard

        world = args.tp * args.pp * args.dp
        overrides = [f"parallel.{d}={getattr(args, d)}" for d in ("tp", "pp", "ep", "vpp")] + args.set
        result = reshard(source, args.out, world, overrides)
        print(f"wrote {result.path} ({world} processes; rank 0 peaked at {result.peak_bytes / 1e9:.2f} GB above "
              f"its start for {result.state_bytes / 1e9:.2f} GB of state)")
        return 0
    if args.command == "export":
        if args.out.exists():
            raise ToolError(f"{args.out} exists; export never overwrites")
        for file in export(source, args.out, int(args.max_shard_mb * 2**20), args.format, args.experts, args.workers):
            print(f"wrote {file}")
        if (extras := args.out / EXTRAS).exists():
            print(kept_aside(extras, args.format))
        return 0
    return prune_command(args)


def prune_command(args: argparse.Namespace) -> int:
    """prune: only checkpoints that verify count toward --keep-last, and the newest of them is never deleted."""
    if args.keep_last < 1:
        raise ToolError("--keep-last must be >= 1")
    if args.keep_last < 2 and not args.force:
        raise ToolError(f"--keep-last {args.keep_last} leaves no checkpoint to fall back on if the newest is damaged "
                        "(training refuses checkpoint.keep_last < 2); pass --force to prune to one anyway")
    if not committed_checkpoints(args.dir):
        raise ToolError(f"{args.dir} is not a checkpoint root: no step_<N> directories in it")
    pruned = prune(args.dir, args.keep_last, args.keep_every, background=False, check=verify)
    for path, problems in pruned.damaged:
        print(f"kept {path}: it does not verify, so it does not count toward --keep-last ({problems[0]}"
              f"{f'; {len(problems) - 1} more problems' if len(problems) > 1 else ''})")
    for path in pruned.dropped:
        print(f"deleted {path}")
    if not pruned.good:
        print(f"no checkpoint in {args.dir} verifies: nothing deleted", file=sys.stderr)
        return 1
    return 0


def kept_aside(extras: Path, layout: str) -> str:
    """What an export put beside the layout's files, said: the multi-token-prediction blocks by name."""
    with safe_open(str(extras), framework="pt") as f:
        names = list(f.keys())
    blocks = sorted({name.split(".")[1] for name in names if name.startswith("mtp.")})
    line = f"kept {len(names)} tensors the {layout} layout has no place for in {extras}"
    if blocks:
        line += (f", among them the {len(blocks)} multi-token-prediction block(s) (mtp.*): the release has "
                 f"num_nextn_predict_layers 0, so serving engines load the backbone without them")
    return line


if __name__ == "__main__":
    sys.exit(main())
