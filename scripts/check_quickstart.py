#!/usr/bin/env python3
"""Check a finished `temper quickstart` run: the RL reward rose and the
held-out pass@1 after RL beats the SFT baseline. Stdlib only.

    python3 scripts/check_quickstart.py runs/quickstart
"""
import json
import sys
from pathlib import Path


def main() -> int:
    run = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/quickstart")
    rows = [json.loads(l) for l in (run / "rl" / "metrics.jsonl").read_text().splitlines() if l.strip()]
    steps = [r["step"] for r in rows]
    assert steps == list(range(1, len(rows) + 1)), f"steps not 1..N exactly once: {steps}"
    rewards = [r["reward/mean"] for r in rows]
    k = max(1, len(rewards) // 4)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    evals = sorted((run / "rl" / "evals").iterdir())
    before = json.loads((evals[0] / "metadata.json").read_text())
    after = json.loads((evals[-1] / "metadata.json").read_text())
    acc = lambda m: m["pass_at_k"]["1"]
    print(f"train reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
    print(f"held-out pass@1: {100 * acc(before):.1f}% -> {100 * acc(after):.1f}% "
          f"({100 * (acc(after) - acc(before)):+.1f} points, {after['num_rollouts']} rollouts)")
    # Measured on every step (on-policy tokens, or the probe of a lagged
    # sequence), and exactly 0 wherever it was.
    measured = [[r[k] for k in ("mismatch/max", "mismatch/probe_max") if r.get(k) is not None] for r in rows]
    assert all(measured), f"a step measured no mismatch: {[r['step'] for r, m in zip(rows, measured) if not m]}"
    assert all(v == 0.0 for m in measured for v in m), "sampler/trainer logprob mismatch"
    assert last > first, "the RL reward did not rise"
    assert acc(after) > acc(before), "RL did not improve held-out pass@1"
    print("quickstart: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
