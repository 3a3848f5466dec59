#!/usr/bin/env python3
"""RL full fine-tuning ends with a Hugging Face model directory that
transformers loads and that computes what temper computes.

    python3 tests/python/check_rl_full_model.py target/release/temper

Runs `temper train rl` with `--lora.enabled false` for two steps on the tiny
Llama fixture and an environment with a graded reward (so both steps train),
then:

1. the run's output is `RUN/model` (config.json, model.safetensors, the
   tokenizer), as the RL guide promises;
2. transformers loads it, and its per-token logprobs on two sequences equal
   `temper bench parity`'s on the same directory within 1e-4;
3. the weights moved: the base model's logprobs differ.

Needs torch and transformers (CI's `.venv-torch`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM

from graded_env import write_graded_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = os.path.join(ROOT, "fixtures", "models", "tiny-llama")
TOL = 1e-4


def hf_logprobs(model_dir: str, seqs: list[list[int]]) -> list[list[float]]:
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            x = torch.tensor([s])
            lp = torch.log_softmax(m(x).logits[0, :-1].float(), -1)
            out.append(lp.gather(1, x[0, 1:, None])[:, 0].tolist())
    return out


def max_abs(a, b) -> float:
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def main() -> int:
    temper = os.path.abspath(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        env = write_graded_env(tmp, 40)
        run = os.path.join(tmp, "run")
        cfg = os.path.join(tmp, "rl.toml")
        with open(cfg, "w") as f:
            f.write(f"""seed = 5
[model]
path = "{BASE}"
[lora]
enabled = false
[[env]]
id = "{env}"
[sampling]
max_tokens = 8
group_size = 4
[trainer]
lr = 1e-3
batch_size = 2
max_steps = 2
[async]
max_off_policy_steps = 0
[eval]
num_examples = 0
[log]
dir = "{run}"
progress = false
""")
        subprocess.run([temper, "--threads", "2", "train", "rl", cfg], check=True,
                       stdout=subprocess.DEVNULL)
        model = os.path.join(run, "model")
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            assert os.path.exists(os.path.join(model, name)), f"{name} missing from {model}: " \
                f"{sorted(os.listdir(run))}"
        rows = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
        assert [r["trained_sequences"] > 0 for r in rows] == [True, True], rows

        seqs = [[1, 17, 33, 90, 5, 250, 7, 12], [3, 44, 2, 9, 100, 31]]
        work = os.path.join(tmp, "work.json")
        with open(work, "w") as f:
            json.dump({"sequences": seqs, "prompts": [], "new_tokens": 0, "samples": 0}, f)
        out = os.path.join(tmp, "parity.json")
        subprocess.run([temper, "bench", "parity", "--model", model, "--work", work, "--out", out],
                       check=True, stdout=subprocess.DEVNULL)
        ours = json.load(open(out))["logprobs"]
        theirs = hf_logprobs(model, seqs)
        diff = max_abs(ours, theirs)
        moved = max_abs(hf_logprobs(BASE, seqs), theirs)
        print(f"rl full fine-tuning: {model} loads in transformers; "
              f"logprobs max |temper - transformers| {diff:.2e} (tolerance {TOL:.0e}); "
              f"max change from the base {moved:.2e}")
        assert diff <= TOL, diff
        assert moved > 1e-5, "training did not change the weights"
    print("rl-full-model: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
