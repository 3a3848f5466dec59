"""A file environment with a graded reward, shared by the Python checks.

Each question `echo i` has the answer `aaaa{i}` and the `lcs` rubric scores
partial overlap, so a group's rewards differ and every RL step trains.
"""

from __future__ import annotations

import json
import os


def write_graded_env(parent: str, rows: int) -> str:
    """Writes the environment under `parent/env` with `rows` training rows;
    returns its directory."""
    env = os.path.join(parent, "env")
    os.makedirs(env)
    with open(os.path.join(env, "train.jsonl"), "w") as f:
        for i in range(rows):
            f.write(json.dumps({"question": f"echo {i}", "answer": f"aaaa{i}"}) + "\n")
    with open(os.path.join(env, "env.toml"), "w") as f:
        f.write('name = "graded"\n[dataset]\ntrain = "train.jsonl"\n[parser]\ntype = "plain"\n'
                '[[rubric]]\nfunction = "lcs"\nweight = 1.0\n')
    return env
