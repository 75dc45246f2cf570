"""The GPUs the project knows, in one table: dense BF16 peak, memory bandwidth and memory (vendor data sheets).

MFU's denominator (training/peak_flops.py: the peak of the device a run finds), the dry run's roofline
(planning/op_census.py: peak and bandwidth) and the memory plan's capacity (launch.plan --gpu) read it; a
GPU missing here is named by logging.peak_tflops in a run and cannot be planned for.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    name: str
    """A lower-case part of the name torch.cuda.get_device_name gives, spaces as dashes (h100-pcie)."""
    peak_flops: float
    """Dense BF16 FLOP/s, without sparsity: MFU's convention, also for FP8 and float32 runs."""
    memory_bytes_s: float
    """HBM bandwidth, bytes/s."""
    memory_bytes: float
    """HBM per GPU, bytes (1e9 a GB)."""


GPUS = {spec.name: spec for spec in (
    GpuSpec("a100", 312e12, 2.0e12, 80e9),
    GpuSpec("h100", 989e12, 3.35e12, 80e9),
    GpuSpec("h100-pcie", 756e12, 2.0e12, 80e9),
    GpuSpec("h100-nvl", 835e12, 3.9e12, 94e9),
    GpuSpec("h800", 989e12, 3.35e12, 80e9),
    GpuSpec("h200", 989e12, 4.8e12, 141e9),
    GpuSpec("gh200", 989e12, 4.0e12, 96e9),
    GpuSpec("b200", 2250e12, 8.0e12, 180e9),
    GpuSpec("gb200", 2500e12, 8.0e12, 186e9),
)}


def gpu_of_device(device_name: str) -> GpuSpec | None:
    """The table's entry for a device name ("NVIDIA H200", "NVIDIA H100 PCIe"), None if unknown: the longest
    name found in it wins (an H100 PCIe is h100-pcie, not h100; a GH200 is gh200, not h200)."""
    name = device_name.lower().replace(" ", "-")
    found = [key for key in GPUS if key in name]
    return GPUS[max(found, key=len)] if found else None
