#!/usr/bin/env python3
"""Check a finished `temper train rl` run: the training reward rose and the
held-out pass@1 improved by at least MIN_POINTS. Stdlib only.

    python3 scripts/check_rl_run.py RUN_DIR [MIN_POINTS]
"""
import json
import sys
from pathlib import Path


def main() -> int:
    run = Path(sys.argv[1])
    min_points = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    k = max(1, len(rewards) // 4)
    first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
    evals = sorted((run / "evals").iterdir())
    before = json.loads((evals[0] / "metadata.json").read_text())
    after = json.loads((evals[-1] / "metadata.json").read_text())
    acc = lambda m: m["pass_at_k"]["1"]
    gain = 100 * (acc(after) - acc(before))
    print(f"train reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}")
    print(f"held-out pass@1: {100 * acc(before):.1f}% -> {100 * acc(after):.1f}% "
          f"({gain:+.1f} points, {after['num_rollouts']} rollouts)")
    assert last > first, "the RL reward did not rise"
    assert gain >= min_points, f"held-out pass@1 gained {gain:.1f} < {min_points} points"
    print("rl run: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
