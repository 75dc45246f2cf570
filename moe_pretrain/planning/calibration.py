"""What a GPU and its fabric really reach, one table per GPU kind (configs/calibration/<gpu>.yaml), every figure
with its source: the dry run's estimate prices each launch and collective by it, beside the roofline bound.

The bound (planning/step_time.py) runs every GEMM at the dense peak, every memory-bound kernel at the full HBM
bandwidth, every link at its line rate with no latency, every launch at no cost. Measured kernels and links do
not reach that; the table says how far they get, from public measurements (a figure's `source` names them) or,
once a GPU is lent, from `bench/gpu_check.sh` on that card (`--calibration FILE` takes such a table). What the
figures price is in planning/kernel_estimate.py (one launch) and planning/collective_estimate.py (one
collective); planning/timeline.py lays them out with the host's issue time and the links' queues.

A table is YAML whose every leaf is `{value: ..., source: "..."}`: a figure without a source is refused, in one
line naming the file and key.
"""

from dataclasses import dataclass
from pathlib import Path

import yaml

from moe_pretrain.config import ConfigError

CALIBRATIONS = Path(__file__).resolve().parents[2] / "configs" / "calibration"
"""The tables shipped with the project, one per GPU kind (the name moe_pretrain/gpus.py gives it)."""


@dataclass(frozen=True)
class LinkCalibration:
    """A link kind (NVLink inside a node, the NIC between nodes) as NCCL drives it."""

    base_latency_s: float
    """A collective's fixed start-up time (NCCL's baseLat for the ring, Simple protocol)."""
    step_latency_s: float
    """Each step of a ring over this link (NCCL's hwLat): a ring all-gather of n ranks takes n - 1 steps."""
    fraction: dict[str, float]
    """Of the line rate (cluster.*_gb_s), what a collective's bytes move at, by kind: ring (all-gather,
    reduce-scatter, all-reduce), alltoall, p2p (a pipeline's send)."""


@dataclass(frozen=True)
class Calibration:
    gpu: str
    path: str
    peak_flops: dict[str, float]
    """Dense FLOP/s by the operands' dtype: bf16 (also fp16), fp8, fp32 (CUDA cores: torch's float32 matmul)."""
    gemm_ceiling: dict[str, float]
    """Of peak_flops, what the best GEMM shape reaches, by dtype (a measured maximum achievable FLOP/s)."""
    sms: int
    tiles: tuple[tuple[int, int], ...]
    """The output tiles (rows, columns) a GEMM library picks from; each tile runs on one SM for its wave."""
    split_k_min: int
    """The shortest slice of K a split-K GEMM gives a tile (libraries split K to fill the SMs)."""
    gemm_fixed_s: float
    """A GEMM's time beyond its tiles' waves and its bytes: the pipeline's fill and the last wave's epilogue."""
    memory_bytes_s: float
    memory_fraction: float
    """Of the HBM bandwidth, what a streaming kernel reaches."""
    attention_fraction: dict[str, float]
    """Of the BF16 peak, what fused attention reaches: forward, backward."""
    kernel_fraction: float
    """Of the BF16 peak, what the tensor-core products inside Triton kernels (fla's KDA, ours) reach."""
    launch_gpu_s: float
    """The least time a kernel takes on the GPU, however small."""
    launch_host_s: float
    """The host's time to issue one kernel or collective (the framework's dispatch and the driver's launch)."""
    links: dict[str, LinkCalibration]
    """'nvlink' and 'nic'."""
    alltoall_peer_s: float
    """An all-to-all's time per peer beyond its bytes (one send and one receive posted per peer)."""
    collective_sm_share: float
    """Of the SMs, what a collective's kernels hold while in flight: compute beside them runs this much slower."""
    sources: dict[str, str]
    """Every figure's source, by its key in the file."""


def _figures(node: object, path: str, where: str, out: dict[str, tuple[object, str]]) -> None:
    """Flatten the YAML tree into {dotted key: (value, source)}, refusing a leaf without a source."""
    if isinstance(node, dict) and "value" in node:
        source = node.get("source")
        if not isinstance(source, str) or not source.strip():
            raise ConfigError(f"{where}: {path} has no source (each figure is {{value: ..., source: \"...\"}})")
        out[path] = (node["value"], source)
        return
    if not isinstance(node, dict):
        raise ConfigError(f"{where}: {path} is not a {{value: ..., source: \"...\"}} figure")
    for key, child in node.items():
        _figures(child, f"{path}.{key}" if path else str(key), where, out)


def load_calibration(path: str | Path) -> Calibration:
    """The table in `path`; a missing key, a figure without a source or a value of the wrong kind is one line
    naming the file and the key."""
    where = str(path)
    try:
        tree = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise ConfigError(f"--calibration {where}: {err.strerror}") from err
    if not isinstance(tree, dict) or not isinstance(tree.get("gpu"), str):
        raise ConfigError(f"{where}: a calibration names its gpu (gpu: h100) and holds figures")
    figures: dict[str, tuple[object, str]] = {}
    _figures({k: v for k, v in tree.items() if k not in ("gpu", "description")}, "", where, figures)

    def number(key: str) -> float:
        if key not in figures:
            raise ConfigError(f"{where}: {key} is missing")
        value = figures[key][0]
        if isinstance(value, str):  # YAML 1.1 reads 3.35e12 (no sign in the exponent) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ConfigError(f"{where}: {key} must be a number >= 0, not {value!r}")
        return float(value)

    def link(name: str) -> LinkCalibration:
        prefix = f"links.{name}"
        return LinkCalibration(number(f"{prefix}.base_latency_s"), number(f"{prefix}.step_latency_s"),
                               {kind: number(f"{prefix}.fraction.{kind}") for kind in ("ring", "alltoall", "p2p")})

    if "gemm.tiles" not in figures:
        raise ConfigError(f"{where}: gemm.tiles is missing")
    tiles = figures["gemm.tiles"][0]
    if not isinstance(tiles, list) or not all(isinstance(t, list) and len(t) == 2 for t in tiles):
        raise ConfigError(f"{where}: gemm.tiles must be a list of [rows, columns], not {tiles!r}")
    return Calibration(
        gpu=tree["gpu"], path=where,
        peak_flops={dtype: number(f"peak_flops.{dtype}") for dtype in ("bf16", "fp8", "fp32")},
        gemm_ceiling={dtype: number(f"gemm.ceiling.{dtype}") for dtype in ("bf16", "fp8", "fp32")},
        sms=int(number("gemm.sms")), tiles=tuple((int(m), int(n)) for m, n in tiles),
        split_k_min=int(number("gemm.split_k_min")), gemm_fixed_s=number("gemm.fixed_s"),
        memory_bytes_s=number("memory.bytes_s"), memory_fraction=number("memory.fraction"),
        attention_fraction={kind: number(f"attention.{kind}") for kind in ("forward", "backward")},
        kernel_fraction=number("kernels.tensor_core_fraction"),
        launch_gpu_s=number("launch.gpu_s"), launch_host_s=number("launch.host_s"),
        links={name: link(name) for name in ("nvlink", "nic")},
        alltoall_peer_s=number("links.alltoall_peer_s"),
        collective_sm_share=number("contention.collective_sm_share"),
        sources={key: source for key, (_, source) in figures.items()})


def calibration_for(gpu: str, path: str | Path | None = None) -> Calibration | None:
    """The table at `path`, else the project's for `gpu` (None where it ships none). A table for another GPU than
    the one the step is priced for is refused."""
    if path is None:
        path = CALIBRATIONS / f"{gpu}.yaml"
        if not path.exists():
            return None
    calibration = load_calibration(path)
    if calibration.gpu != gpu:
        raise ConfigError(f"--calibration {path}: it calibrates {calibration.gpu}, not --gpu {gpu}")
    return calibration
