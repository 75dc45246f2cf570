"""KDA on CPU: the chunked WY/UT form against the per-token recurrence, forward + backward.

Run: .venv/bin/python bench/kda.py [--T 1024 --H 4 --K 64 --repeats 3]
Prints the median time of each and the speed-up of the chunked form over the recurrence (the named
reference), both measured in this run, so the ratio is meaningful on a shared, noisy machine.
"""

import argparse
import statistics
import time

import torch

from moe_pretrain.ops import kda, kda_recurrent


def time_fwd_bwd(fn, inputs, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        leaves = [x.detach().requires_grad_() for x in inputs]
        start = time.perf_counter()
        o, _ = fn(*leaves)
        o.sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--T", type=int, default=1024)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--K", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    B, T, H, K = args.B, args.T, args.H, args.K
    q = torch.randn(B, T, H, K)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, K)
    g = -5 * torch.sigmoid(torch.randn(B, T, H, K))
    beta = torch.rand(B, T, H)
    inputs = (q, k, v, g, beta)
    chunked = time_fwd_bwd(kda, inputs, args.repeats)
    recurrent = time_fwd_bwd(kda_recurrent, inputs, args.repeats)
    tokens = B * T
    print(f"KDA fwd+bwd, B={B} T={T} H={H} K=V={K}, fp32, {torch.get_num_threads()} threads")
    print(f"  recurrent (reference) {recurrent * 1e3:9.1f} ms  {tokens / recurrent:10,.0f} tok/s")
    print(f"  chunked               {chunked * 1e3:9.1f} ms  {tokens / chunked:10,.0f} tok/s")
    print(f"  chunked / recurrent speed-up: {recurrent / chunked:.1f}x")


if __name__ == "__main__":
    main()
