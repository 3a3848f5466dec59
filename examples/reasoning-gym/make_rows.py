"""Write an environment's train.jsonl and eval.jsonl from a reasoning-gym
task: one row per generated question, with the library's own entry in
`info` so that reward.py can hand it back to the library's scorer.

    .venv/bin/python make_rows.py ENV_DIR [--task basic_arithmetic]
        [--config '{"min_digits": 1, ...}'] [--train 2000] [--eval 60]

The default task is two one-digit terms with + and - (SmolLM2-135M gets
about one in eight right before training).
"""

import argparse
import json
import os

import reasoning_gym

DEFAULT_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"]}


def rows(task, config, size, seed):
    for entry in reasoning_gym.create_dataset(task, size=size, seed=seed, **config):
        yield {
            "question": entry["question"],
            "answer": entry["answer"],
            "info": {"entry": json.loads(json.dumps(entry, default=str))},
        }


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("env_dir")
    p.add_argument("--task", default="basic_arithmetic")
    p.add_argument("--config", default=json.dumps(DEFAULT_CONFIG), help="the task's arguments, as JSON")
    p.add_argument("--train", type=int, default=2000)
    p.add_argument("--eval", type=int, default=60)
    a = p.parse_args()
    config = json.loads(a.config)
    held_out = list(rows(a.task, config, a.eval, seed=1))
    asked = {r["question"] for r in held_out}
    # Small tasks repeat questions across seeds: keep train disjoint.
    train = [r for r in rows(a.task, config, a.train, seed=2) if r["question"] not in asked]
    for name, split in (("train.jsonl", train), ("eval.jsonl", held_out)):
        with open(os.path.join(a.env_dir, name), "w") as f:
            for r in split:
                f.write(json.dumps(r) + "\n")
        print(f"{a.env_dir}/{name}: {len(split)} rows")


if __name__ == "__main__":
    main()
