"""The MFU denominator: a process's peak FLOP/s, from logging.peak_tflops, the GPU table, or a CPU matmul.

On a GPU the peak is the vendor's dense BF16 figure for the device (MFU's convention, also for FP8 and
float32 runs), never a measurement: a small matmul timed at start-up measures launch latency and clocks, not
the tensor cores, and would overstate MFU several times. A GPU the table does not know must state
logging.peak_tflops. CPU runs (tests, smoke) time a float32 matmul once (a CPU without bf16
units emulates bf16 GEMMs: timing one would take seconds and measure the emulation).
"""

import time

import torch

from moe_pretrain.config import ConfigError
from moe_pretrain.gpus import GPUS, gpu_of_device


def measured_cpu_peak_flops(dtype: torch.dtype, n: int = 1024, repeats: int = 8) -> float:
    """FLOP/s of a square matmul on the CPU in dtype (CPU matmuls return when done: no synchronisation)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def peak_flops(peak_tflops: float, device: torch.device, dtype: torch.dtype) -> float:
    """Peak FLOP/s of one process training in dtype on device: logging.peak_tflops when set; on CUDA the
    table's BF16 figure whatever the dtype (a ConfigError naming logging.peak_tflops when the device is not
    in it); on CPU a timed matmul."""
    if peak_tflops > 0:
        return peak_tflops * 1e12
    if device.type == "cpu":
        return measured_cpu_peak_flops(torch.float64 if dtype == torch.float64 else torch.float32)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    gpu = gpu_of_device(name) if device.type == "cuda" else None
    if gpu is None:
        raise ConfigError(f"logging.peak_tflops is needed for MFU on {name}: the table (moe_pretrain/gpus.py) "
                          f"knows {', '.join(sorted(GPUS))} only")
    return gpu.peak_flops
