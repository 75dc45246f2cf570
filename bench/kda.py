"""KDA on CPU: the chunked WY/UT form against the per-token recurrence, forward and forward + backward.

Run: .venv/bin/python bench/kda.py [--T 4096 --H 4 --K 64 --repeats 3 --documents 1]
Prints the median time of each and the speed-up of the chunked form over the recurrence (the named
reference), both measured in this run, so the ratio is meaningful on a shared, noisy machine.
Goals: forward >= 10x the recurrence's forward, forward + backward >= 30x.
With --documents N the sequence is packed with N equal documents (cu_seqlens).
"""

import argparse
import statistics
import time

import torch

from moe_pretrain.ops import kda, kda_recurrent


def time_forward(fn, inputs, repeats: int) -> float:
    times = []
    with torch.no_grad():
        fn(*inputs)  # warm-up: first-call allocations
        for _ in range(repeats):
            start = time.perf_counter()
            fn(*inputs)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_fwd_bwd(fn, inputs, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        leaves = [x.detach().requires_grad_() for x in inputs]
        start = time.perf_counter()
        o, _ = fn(*leaves)
        o.sum().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--T", type=int, default=4096)
    parser.add_argument("--H", type=int, default=4)
    parser.add_argument("--K", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--documents", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    B, T, H, K = args.B, args.T, args.H, args.K
    q = torch.randn(B, T, H, K)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, K)
    g = -5 * torch.sigmoid(torch.randn(B, T, H, K))
    beta = torch.rand(B, T, H)
    inputs = (q, k, v, g, beta)
    cu_seqlens = None
    if args.documents > 1:
        cu_seqlens = torch.linspace(0, B * T, args.documents + 1).round().long()
        inputs = tuple(x.reshape(1, B * T, *x.shape[2:]) for x in inputs)

    def chunked_fn(*xs):
        return kda(*xs, cu_seqlens=cu_seqlens)

    def recurrent_fn(*xs):
        return kda_recurrent(*xs, cu_seqlens=cu_seqlens)

    tokens = B * T
    print(f"KDA, B={B} T={T} H={H} K=V={K} documents={args.documents}, fp32, {torch.get_num_threads()} threads")
    for label, timer, goal in (("forward", time_forward, 10), ("forward + backward", time_fwd_bwd, 30)):
        chunked = timer(chunked_fn, inputs, args.repeats)
        recurrent = timer(recurrent_fn, inputs, args.repeats)
        print(f"  {label}")
        print(f"    recurrent (reference) {recurrent * 1e3:9.1f} ms  {tokens / recurrent:10,.0f} tok/s")
        print(f"    chunked               {chunked * 1e3:9.1f} ms  {tokens / chunked:10,.0f} tok/s")
        print(f"    chunked / recurrent speed-up: {recurrent / chunked:.1f}x (goal >= {goal}x)")


if __name__ == "__main__":
    main()
