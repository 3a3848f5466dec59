"""Orchestration overhead of `temper eval` vs the verifiers evaluator.

Both evaluate the same single-turn arithmetic environment (`What is A + B?`,
an <answer></answer> parser, an exact-number reward) against one
zero-latency mock OpenAI server (`temper mock-openai`, Rust/axum), at
concurrency 256, so what is measured is each evaluator's own cost per
rollout: building requests, HTTP, parsing, scoring, bookkeeping. Prints
rollouts/s for each and the ratio.

    python3 -m venv /tmp/vf && /tmp/vf/bin/pip install "verifiers==0.1.14"
    cargo build --release -p temper
    /tmp/vf/bin/python scripts/bench_eval.py --temper target/release/temper

verifiers 0.1.x is the evaluator with the SingleTurnEnv / Rubric /
`env.evaluate(max_concurrent=...)` API that temper mirrors; its 0.4 line
moved to a different (v1 Taskset/Harness) stack.
"""

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import tempfile
import time


def start_mock(temper):
    p = subprocess.Popen([temper, "mock-openai", "--addr", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    assert line.startswith("listening on "), line
    return p, "http://" + line.split()[-1] + "/v1"


def bench_temper(temper, base, n, concurrency):
    with tempfile.TemporaryDirectory() as save:
        out = subprocess.run(
            [temper, "eval", "arithmetic", "-a", '{"digits": 3, "ops": ["+"]}', "-m", "mock", "-b", base,
             "-n", str(n), "-r", "1", "-c", str(concurrency), "-t", "32", "--quiet", "--save-dir", save],
            check=True, capture_output=True, text=True,
        ).stdout
        [env_dir] = os.listdir(save)
        [run] = os.listdir(os.path.join(save, env_dir))
        meta = json.load(open(os.path.join(save, env_dir, run, "metadata.json")))
        assert meta["num_rollouts"] == n and meta["num_errors"] == 0, meta
        rate = float(re.search(r"rollouts/s\s+([\d.]+)", out).group(1))
        return rate, meta["avg_reward"]


def bench_verifiers(base, n, concurrency):
    import logging

    import verifiers as vf
    from datasets import Dataset

    logging.getLogger("verifiers").setLevel(logging.WARNING)
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def correct(completion, answer, **kwargs):
        got = parser.parse_answer(completion) or ""
        return 1.0 if got.strip() == answer else 0.0

    rubric = vf.Rubric(funcs=[correct, parser.get_format_reward_func()], weights=[1.0, 0.0], parser=parser)
    env = vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list(rows),
        system_prompt="Answer with the number in <answer></answer> tags.",
        parser=parser,
        rubric=rubric,
    )
    os.environ["MOCK_KEY"] = "none"
    client = vf.ClientConfig(api_base_url=base, api_key_var="MOCK_KEY", max_retries=0)

    async def go():
        t = time.perf_counter()
        out = await env.evaluate(
            client, "mock", sampling_args={"max_tokens": 32}, num_examples=n,
            rollouts_per_example=1, max_concurrent=concurrency, on_progress=lambda *a, **k: None,
        )
        return time.perf_counter() - t, out

    elapsed, out = asyncio.run(go())
    rewards = getattr(out, "reward", None)
    if rewards is None and isinstance(out, dict):
        rewards = out.get("reward")
    if rewards is None:
        rewards = [o["reward"] for o in out["outputs"]]
    assert len(rewards) == n, len(rewards)
    return n / elapsed, sum(rewards) / n


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--temper", default="target/release/temper")
    p.add_argument("-n", type=int, default=5000, help="rollouts per evaluator")
    p.add_argument("-c", type=int, default=256, help="concurrency")
    a = p.parse_args()
    mock, base = start_mock(os.path.abspath(a.temper))
    try:
        bench_temper(a.temper, base, 256, a.c)  # warm-up
        t_rate, t_reward = bench_temper(a.temper, base, a.n, a.c)
        print(f"temper eval : {t_rate:10.1f} rollouts/s  (n={a.n}, c={a.c}, avg reward {t_reward:.3f})", flush=True)
        v_rate, v_reward = bench_verifiers(base, a.n, a.c)
        print(f"verifiers   : {v_rate:10.1f} rollouts/s  (n={a.n}, c={a.c}, avg reward {v_reward:.3f})")
        print(f"ratio       : {t_rate / v_rate:.1f}x")
    finally:
        mock.kill()
        mock.wait()


if __name__ == "__main__":
    main()
