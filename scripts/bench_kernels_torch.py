#!/usr/bin/env python3
"""Compare ``temper bench kernels`` with PyTorch's matmul on the same shapes.

Run from the repository root after ``cargo build --release -p temper``:

    python scripts/bench_kernels_torch.py [--threads N] [--rows 1,32,128,1024]

(any Python with torch). For each linear-layer shape of a decoder (SmolLM2-135M
by default: hidden 576, intermediate 1536) and each row count, it times the
forward ``x @ W.T`` and the input gradient ``g @ W`` in f32 with ``N`` threads,
after running temper's half first (so neither steals the other's cores), and
prints GFLOP/s and the ratio temper / torch (higher = temper faster).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(budget: float, f, clock) -> float:
    f()
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget and len(times) < 1000):
        t = clock()
        f()
        times.append(clock() - t)
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,32,128,1024")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--seconds", type=float, default=0.5)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the calling thread's CPU time (needs --threads 1; robust on a busy machine)")
    p.add_argument("--temper", type=Path, default=ROOT / "target/release/temper")
    args = p.parse_args()

    out = subprocess.run(
        [str(args.temper), "--threads", str(args.threads), "bench", "kernels", "--json",
         "--rows", args.rows, "--hidden", str(args.hidden),
         "--intermediate", str(args.intermediate), "--seconds", str(args.seconds),
         "--clock", args.clock],
        check=True, capture_output=True, text=True,
    ).stdout
    temper = json.loads(out)

    import torch

    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    print(f"temper bench kernels vs torch {torch.__version__}: GFLOP/s, f32, "
          f"{args.threads} threads, {args.clock} time, temper's g·W kernel on {temper['isa']}")
    print(f"{'layer':<8} {'out':>6} {'in':>6} {'rows':>5} | {'fwd temper':>10} {'torch':>8} {'ratio':>6}"
          f" | {'bwd temper':>10} {'torch':>8} {'ratio':>6}")
    ratios = []
    for r in temper["results"]:
        n, k, m = r["out"], r["in"], r["rows"]
        w = torch.randn(n, k) * 0.05
        x = torch.randn(m, k)
        g = torch.randn(m, n)
        flop = 2.0 * m * n * k
        with torch.no_grad():
            fwd = flop / timed(args.seconds, lambda: x @ w.T, clock) / 1e9
            bwd = flop / timed(args.seconds, lambda: g @ w, clock) / 1e9
        rf, rb = r["fwd_nt_gflops"] / fwd, r["bwd_nn_gflops"] / bwd
        ratios.append((rf, rb))
        print(f"{r['layer']:<8} {n:>6} {k:>6} {m:>5} | {r['fwd_nt_gflops']:>10.1f} {fwd:>8.1f} {rf:>5.2f}x"
              f" | {r['bwd_nn_gflops']:>10.1f} {bwd:>8.1f} {rb:>5.2f}x")
    gm = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs))
    print(f"geometric mean temper / torch: forward {gm([a for a, _ in ratios]):.2f}x, "
          f"input gradient {gm([b for _, b in ratios]):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
