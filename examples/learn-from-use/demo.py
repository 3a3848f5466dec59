#!/usr/bin/env python3
"""Learn from use on SmolLM2: a scripted client sends one-digit additions
(the tasks of examples/smollm2-rl/env) through `temper serve --learn`, scores
each answer with that environment's rubric (correct number 1.0 + answer-tag
format 0.5) and posts it as the episode's reward. The server trains, gates
on the environment's held-out split and hot-swaps; this prints every
promotion and rejection with the live version's held-out pass@1, and the
serving latency (p50/p99) of the same load with and without learning.

Usage (from the repository root; Python 3 standard library only):

    python3 examples/learn-from-use/demo.py --temper target/release/temper \
        --model "$(scripts/fetch_smollm2.sh)" [--rounds 6] [--clients 4]
"""

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

SYSTEM = "Answer with only the number inside <answer></answer> tags."
FEW_SHOT = [("What is 2 + 3?", "<answer>5</answer>")]
HERE = os.path.dirname(os.path.abspath(__file__))


def call(base, method, path, body=None, token=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", "Bearer " + token)
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def reward(text, a, b):
    """examples/smollm2-rl/env's rubric: numeric_match 1.0 + format 0.5."""
    m = re.search(r"<answer>(.*?)</answer>", text, re.S)
    fmt = 0.5 if m else 0.0
    try:
        correct = 1.0 if m and float(m.group(1).strip()) == a + b else 0.0
    except ValueError:
        correct = 0.0
    return correct + fmt


def messages(a, b):
    msgs = [{"role": "system", "content": SYSTEM}]
    for q, ans in FEW_SHOT:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
    return msgs + [{"role": "user", "content": f"What is {a} + {b}?"}]


def start(temper, model, extra, log):
    p = subprocess.Popen(
        [temper, "serve", "--model", model, "--port", "0", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    while True:
        line = p.stderr.readline()
        if not line:
            raise SystemExit("the server exited")
        log.write(line)
        log.flush()
        if "learn: training on" in line:
            # The learner's own threads and their priority ([learn] threads, nice).
            print("  " + line.split("learn: ")[1].strip())
        if "listening on http://" in line:
            addr = line.split("listening on http://")[1].split()[0]
            break
    threading.Thread(target=lambda: [log.write(l) or log.flush() for l in p.stderr],
                     daemon=True).start()
    return p, addr


def episode_task(base, model, a, b, seed, lat, train):
    ep = call(base, "POST", "/v1/episodes", {"train": train})
    t = time.time()
    out = call(base, "POST", f"/episodes/{ep['id']}/v1/chat/completions",
               {"model": model, "messages": messages(a, b), "max_tokens": 32,
                "temperature": 1.0, "seed": seed}, ep["token"])
    lat.append(time.time() - t)
    r = reward(out["choices"][0]["message"]["content"], a, b)
    if train:
        call(base, "POST", f"/v1/episodes/{ep['id']}/reward", {"reward": r}, ep["token"])
    return r, out["version"]


def load(base, model, rounds, clients, group, seed, train, on_round=None):
    """`rounds` rounds of `clients` questions, each asked `group` times
    (a group of answers to one prompt), `clients` threads at once."""
    rng = random.Random(seed)
    lat, rewards = [], []
    for rnd in range(rounds):
        jobs = []
        for _ in range(clients):
            a, b = rng.randrange(10), rng.randrange(10)
            jobs += [(a, b, rng.randrange(1 << 30)) for _ in range(group)]
        results = [None] * len(jobs)

        def worker(i0):
            for i in range(i0, len(jobs), clients):
                a, b, s = jobs[i]
                results[i] = episode_task(base, model, a, b, s, lat, train)

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        rewards += [r for r, _ in results]
        if on_round:
            on_round(rnd, results)
    return lat, rewards


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", default="target/release/temper")
    ap.add_argument("--model", default=os.environ.get("TEMPER_SMOLLM2_GGUF"))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--state", default=None, help="state dir (default: a fresh temp dir)")
    args = ap.parse_args()
    if not args.model:
        raise SystemExit("--model (or $TEMPER_SMOLLM2_GGUF) is required")
    work = tempfile.mkdtemp(prefix="learn-from-use-")
    state = args.state or os.path.join(work, "state")
    cfg = open(os.path.join(HERE, "learn.toml")).read()
    cfg = re.sub(r'dir = ".*"', f'dir = "{state}"', cfg)
    batch = int(re.search(r"batch_size = (\d+)", cfg).group(1))
    cfg_path = os.path.join(work, "learn.toml")
    open(cfg_path, "w").write(cfg)
    log = open(os.path.join(work, "server.log"), "w")
    print(f"state: {state}; server log: {log.name}")

    # 1. The same server and load, learning off (trainer.max_steps = 0):
    # the latency baseline. Both phases serve the live LoRA adapter.
    off_cfg = os.path.join(work, "learn-off.toml")
    off = re.sub(r'dir = ".*"', f'dir = "{state}-off"', cfg)
    open(off_cfg, "w").write(off.replace("[trainer]\n", "[trainer]\nmax_steps = 0\n"))
    p, addr = start(args.temper, args.model, ["--learn", off_cfg], log)
    base = "http://" + addr
    t = time.time()
    lat0, rew0 = load(base, "live", args.rounds, args.clients, args.group, 11, True)
    print(f"learning off: {len(lat0)} calls in {time.time() - t:.0f}s, "
          f"p50 {pct(lat0, .5) * 1e3:.0f} ms, p99 {pct(lat0, .99) * 1e3:.0f} ms, "
          f"mean reward {sum(rew0) / len(rew0):.3f}")
    p.kill()
    p.wait()

    # 2. Learning: the client's traffic is the training data.
    t0 = time.time()
    p, addr = start(args.temper, args.model, ["--learn", cfg_path], log)
    base = "http://" + addr
    print(f"learning server up in {time.time() - t0:.0f}s (version 1 evaluated)")
    seen = [0]

    def report(*_):
        path = os.path.join(state, "learn.jsonl")
        lines = open(path).read().splitlines() if os.path.exists(path) else []
        for line in lines[seen[0]:]:
            e = json.loads(line)
            ev = e.get("eval", {})
            if e["event"] == "promoted" and "candidate" in e:
                print(f"  [{time.time() - t0:5.0f}s] candidate {e['candidate']} PROMOTED: held-out "
                      f"pass@1 {ev['pass@1']:.3f} (live v{e['parent']}: {e['live_eval']['pass@1']:.3f}); "
                      f"episodes {e['episodes']}, mismatch_max {e['mismatch_max']}, train {e['train_s']:.1f}s, "
                      f"eval {ev['time_s']:.1f}s")
            elif e["event"] == "promoted":
                print(f"  [{time.time() - t0:5.0f}s] version {e['version']} live: held-out pass@1 {ev['pass@1']:.3f}")
            elif e["event"] == "rejected":
                print(f"  [{time.time() - t0:5.0f}s] candidate {e['candidate']} REJECTED: {e['reason']}")
        seen[0] = len(lines)

    report()

    def on_round(rnd, results):
        versions = sorted({v for _, v in results})
        mean = sum(r for r, _ in results) / len(results)
        print(f"  round {rnd}: answered by version(s) {versions}, mean reward {mean:.3f}")
        report()

    lat1, rew1 = load(base, "live", args.rounds, args.clients, args.group, 11, True, on_round)
    # Let the last step finish.
    deadline = time.time() + 600
    while time.time() < deadline:
        st = json.load(open(os.path.join(state, "learner.json")))
        if st["cursor"] >= len(lat1) - len(lat1) % batch:
            break
        time.sleep(2)
    report()
    vs = call(base, "GET", "/v1/adapters/versions")
    print("versions: " + ", ".join(
        f"v{v['version']} pass@1 {v['meta']['eval']['pass_at_1']:.3f}" for v in vs["data"])
        + f"; live v{vs['live']}")
    print(f"learning: {len(lat1)} calls, p50 {pct(lat1, .5) * 1e3:.0f} ms, "
          f"p99 {pct(lat1, .99) * 1e3:.0f} ms; ratio to no learning: p50 "
          f"{pct(lat1, .5) / pct(lat0, .5):.2f}x, p99 {pct(lat1, .99) / pct(lat0, .99):.2f}x")
    p.kill()
    p.wait()
    if not args.state:
        shutil.rmtree(work, ignore_errors=True) if os.environ.get("DEMO_CLEAN") else None


if __name__ == "__main__":
    sys.exit(main())
