"""The memory plan's activation formulas against measured memory of real CPU forward + backward passes.

Run: .venv/bin/python bench/activation_memory.py [--lengths 2048 8192] [--modes none selective full full-kept]
(a mode may be any train.recompute value, a module list such as attn_res,norms,kda_pre,mla_up,core,expert_act too)
Each (recompute, T) runs in a fresh process (a clean allocator): the tiny model (d = 64, KDA chunk 64,
1000-token documents) in fp32 does one forward, a cross-entropy loss and a backward. Printed, in MB: the
plan's saved activations and peak (moe_pretrain/planning/step_activations.py, the same arithmetic launch.plan
uses per stage); the live tensor bytes after the forward and at their peak (measured.LiveTensorBytes: exact,
what tests/unit/test_activation_memory.py bounds, in process); the allocated bytes at the backward's peak (glibc
mallinfo2: tensors plus what malloc rounds up, what a GPU allocator reports as allocated) and the resident
peak (which adds the allocator's retained freed memory), both of which depend on the machine. Ratios are
measured / plan.
"""

import argparse
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ["model.hidden_size=64", "model.kda.head_dim=16", "model.kda.chunk_size=64"]


class ProcessMemory:
    """The bench's figures of the process around a probe: the allocator's peak and the resident peak over their
    values at entry (meaningful in a fresh process only, so never in tests)."""

    def __enter__(self) -> "ProcessMemory":
        from moe_pretrain.planning.measured import AllocatedPeak, reset_peak, resident_bytes

        self.resident_start = resident_bytes()
        reset_peak()
        self.allocated = AllocatedPeak().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.allocated.__exit__(*exc)

    def figures(self) -> dict:
        from moe_pretrain.planning.measured import peak_resident_bytes

        return {"allocated_peak": self.allocated.peak - self.allocated.start,
                "resident_peak": peak_resident_bytes() - self.resident_start}


def probe(recompute: str, T: int, process: ProcessMemory | None = None) -> dict:
    """One forward + loss + backward at T tokens: the plan's figures and the measured live tensor bytes (and the
    process's figures, when a ProcessMemory is given). recompute "full-kept": full recomputation around the
    expert exchanges (train.recompute_exchanges=false; here the local dispatcher's, which saves what the
    expert-parallel ones save)."""
    from moe_pretrain.planning.measured import LiveTensorBytes
    from moe_pretrain.planning.step_activations import activation_bytes
    from parallel.parallelize import build_model
    from tests.models import tiny_config

    cfg = tiny_config(*CONFIG)
    model = build_model(cfg)
    mode, exchanges = ("full", False) if recompute == "full-kept" else (recompute, True)
    model.set_recompute(mode, exchanges=exchanges)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # gradients are the plan's state, not activations
    gen = torch.Generator().manual_seed(0)
    tokens, labels = (torch.randint(0, cfg.model.vocab_size, (1, T), generator=gen) for _ in range(2))
    doc_ids = (torch.arange(T) // 1000).unsqueeze(0)
    with process or contextlib.nullcontext(), LiveTensorBytes() as live:
        logits, balance = model(tokens, doc_ids)
        after_forward = live.live
        (F.cross_entropy(logits.flatten(0, 1), labels.flatten()) + balance).backward()
    m = cfg.model
    plan = activation_bytes(m, list(range(m.num_layers)), mode, T, act_bytes=4, exchanges=exchanges)
    result = {"recompute": recompute, "T": T, "plan_saved": plan.saved, "plan_peak": plan.peak,
              "live_after_forward": after_forward, "live_peak": live.peak}
    return {**result, **(process.figures() if process else {})}


def run_probe(recompute: str, T: int) -> dict:
    """probe() with the allocator's figures, in a fresh process (a clean allocator)."""
    done = subprocess.run([sys.executable, __file__, "--probe", recompute, str(T)], capture_output=True, text=True,
                          check=True, timeout=300, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--modes", nargs="+", default=["none", "selective", "full", "full-kept"])
    parser.add_argument("--probe", nargs=2, metavar=("RECOMPUTE", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(probe(args.probe[0], int(args.probe[1]), ProcessMemory())))
        return
    mb = 1e6
    print("tiny model d=64, fp32, one forward + loss + backward; MB; ratios measured / plan")
    print(f"{'recompute':>9} {'T':>6} {'plan saved':>10} {'live fwd':>8} {'ratio':>6} {'plan peak':>9} "
          f"{'live peak':>9} {'ratio':>6} {'alloc peak':>10} {'ratio':>6} {'resident':>8} {'ratio':>6}")
    for recompute in args.modes:
        for T in args.lengths:
            r = run_probe(recompute, T)
            peak = r["plan_peak"]
            print(f"{recompute:>9} {T:>6} {r['plan_saved'] / mb:10.1f} {r['live_after_forward'] / mb:8.1f} "
                  f"{r['live_after_forward'] / r['plan_saved']:6.2f} {peak / mb:9.1f} {r['live_peak'] / mb:9.1f} "
                  f"{r['live_peak'] / peak:6.2f} {r['allocated_peak'] / mb:10.1f} {r['allocated_peak'] / peak:6.2f} "
                  f"{r['resident_peak'] / mb:8.1f} {r['resident_peak'] / peak:6.2f}")


if __name__ == "__main__":
    main()
