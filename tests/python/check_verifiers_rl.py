"""Check a finished `temper train rl` run on a verifiers environment
(tests/verifiers/rl-smollm2.toml): every step trained on the policy's own sampled
tokens, so the sampler/trainer logprob mismatch is exactly 0 on a nonzero number of
tokens, and the reward came from the env's rubric (its reward names are logged).
Stdlib only.

    python3 tests/python/check_verifiers_rl.py RUN_DIR
"""
import json
import sys
from pathlib import Path


def main() -> int:
    run = Path(sys.argv[1])
    rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
    steps = [r for r in rows if "mismatch/max" in r]
    assert steps, "no training steps logged"
    for r in steps:
        print(f"step {r['step']}: reward/mean {r['reward/mean']:.3f}  mismatch/max {r['mismatch/max']}  "
              f"mismatch/tokens {r['mismatch/tokens']}")
        assert r["mismatch/max"] == 0.0, r
        assert r["mismatch/tokens"] > 0, r
    # The env's @vf.reward functions, logged as rubric metrics.
    names = sorted({k for r in steps for k in r if k.startswith("metric/")})
    print("rubric metrics:", ", ".join(names))
    assert {"metric/correct", "metric/tagged"} <= set(names), names
    for r in steps:
        expected = 1.0 * r["metric/correct"] + 0.5 * r["metric/tagged"]
        assert abs(r["reward/mean"] - expected) < 1e-6, (r["reward/mean"], expected)
    print("verifiers rl run: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
