"""Document-causal attention (ops.document_causal_attention) against the dense [T, T] mask it replaced.

Run: .venv/bin/python bench/attention.py [--lengths 4096 8192 16384] [--heads 2 --dim 48]

One document of T tokens, fp32, forward + backward, each measurement in a fresh process (peak resident
memory above its start, Linux VmHWM). Printed per length: time and peak memory of both paths and their
ratios (document / dense, same run). The dense path's memory grows as T^2 (its boolean mask, saved for the
backward); the document path's as T (q, k, v, outputs, their gradients and the flash kernel's tiles).
"""

import argparse
import json
import subprocess
import sys

PROBE = """
import json, sys, time, torch, torch.nn.functional as F
from moe_pretrain.planning.measured import peak_resident_bytes, reset_peak, resident_bytes
from moe_pretrain.ops.document_attention import document_causal_attention
path, T, H, D = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
q, k, v = (torch.randn(T, H, D, requires_grad=True) for _ in range(3))
start = resident_bytes(); reset_peak(); t0 = time.perf_counter()
if path == "document":
    out = document_causal_attention(q, k, v, [0, T], D ** -0.5)
else:
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), attn_mask=mask,
                                         scale=D ** -0.5)
out.sum().backward()
print(json.dumps({"seconds": time.perf_counter() - t0, "peak": peak_resident_bytes() - start}))
"""


def measure(path: str, length: int, heads: int, dim: int) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, path, str(length), str(heads), str(dim)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[4096, 8192, 16384])
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=48)
    args = parser.parse_args()
    print(f"one document, {args.heads} heads x {args.dim}, fp32, forward + backward")
    for length in args.lengths:
        document, dense = (measure(p, length, args.heads, args.dim) for p in ("document", "dense"))
        print(f"  T {length:>6}: document {document['seconds']:6.2f} s {document['peak'] / 1e9:6.3f} GB | dense "
              f"{dense['seconds']:6.2f} s {dense['peak'] / 1e9:6.3f} GB | document/dense time "
              f"{document['seconds'] / dense['seconds']:.2f}, memory {document['peak'] / dense['peak']:.3f}")


if __name__ == "__main__":
    main()
