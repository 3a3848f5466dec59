"""Token capture end to end: a Python agent built on the official `openai`
client, run by `temper tasks run -a command --capture` against
`temper serve` on the tiny fixture model.

Run: python tests/python/test_capture_agent.py [--temper target/debug/temper]
Needs `pip install -r tests/python/requirements-openai.txt` (see .ci/run) and
a host where temper's sandbox runs (namespaces). Checks that each of the
agent's calls is in the trial's agent/tokens.jsonl with the chat-templated
prompt's token ids, the sampled token ids, and logprobs equal bit for bit to
the server's scoring of prompt + completion (the trainer's `Model::score`,
through `/v1/completions` with `echo`); that the episode is dropped on the
server afterwards; that the agent's key was the episode's token, not the
server's; and that `temper traces export` turns the trial into one
chat-jsonl row with the captured conversation. A few seconds.
"""

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

from test_openai_server import API_KEY, MODEL, ROOT, post_json, start_server

TASK = os.path.join(ROOT, "examples", "tasks", "hello-file")

# The agent: two chat turns with the official client (which reads
# OPENAI_BASE_URL and OPENAI_API_KEY, set by the command agent), then it
# solves the task through the exec endpoint. It logs the answers it got.
AGENT = r'''
import json, os, sys, urllib.request
import openai

client = openai.OpenAI(max_retries=0)
model = os.environ["OPENAI_MODEL"]
messages = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": sys.stdin.read()}]
answers = []
for turn in range(2):
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=6,
                                       temperature=0.8, seed=turn)
    text = r.choices[0].message.content or ""
    answers.append({"content": text, "id": r.id,
                    "completion_tokens": r.usage.completion_tokens})
    messages.append({"role": "assistant", "content": text})
    messages.append({"role": "user", "content": "Go on."})
json.dump(answers, open("answers.json", "w"))
# The key it was given: the episode's token, not the server's key.
open("key.txt", "w").write(os.environ["OPENAI_API_KEY"])
req = urllib.request.Request(
    os.environ["TEMPER_EXEC_URL"],
    data=json.dumps({"command": "echo 'Hello, world!' > /app/hello.txt"}).encode(),
    headers={"Authorization": "Bearer " + os.environ["TEMPER_EXEC_TOKEN"],
             "Content-Type": "application/json"})
urllib.request.urlopen(req, timeout=60).read()
'''


def f32_bits(xs):
    """The f32 bit patterns of `xs` (records hold f32s; the completions
    answer prints the same f32s widened to f64)."""
    return [struct.unpack("<I", struct.pack("<f", x))[0] for x in xs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", default=os.path.join(ROOT, "target", "debug", "temper"))
    args = ap.parse_args()
    server, url = start_server(args.temper, "--api-key", API_KEY)
    failures = []

    def check(cond, what):
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)

    try:
        with tempfile.TemporaryDirectory() as tmp:
            agent = os.path.join(tmp, "agent.py")
            with open(agent, "w") as f:
                f.write(AGENT)
            env = dict(os.environ, TEMPER_TEST_KEY=API_KEY)
            run = subprocess.run(
                [args.temper, "tasks", "run", TASK, "-a", "command", "--capture",
                 "-b", url + "/v1", "-m", MODEL, "-k", "TEMPER_TEST_KEY",
                 "--agent-command", f"{sys.executable} {agent}",
                 "--jobs-dir", tmp, "--job-name", "cap"],
                capture_output=True, text=True, env=env, timeout=300)
            out = run.stdout + run.stderr
            if "SKIPPED" in out or "namespaces" in out and run.returncode != 0:
                print("SKIPPED: temper's sandbox does not run here\n" + out)
                return
            check(run.returncode == 0, "temper tasks run -a command --capture succeeds\n" + out)
            job = os.path.join(tmp, "cap")
            trial = next(os.path.join(job, d) for d in os.listdir(job)
                         if os.path.isdir(os.path.join(job, d)))
            result = json.load(open(os.path.join(trial, "result.json")))
            check(result["verifier_result"]["rewards"]["reward"] == 1.0, "the task is solved")
            meta = result["agent_result"]["metadata"]
            check(meta.get("captured_calls") == 2, f"2 calls captured: {meta}")
            episode = meta.get("episode", "")
            answers = json.load(open(os.path.join(trial, "agent", "answers.json")))
            records = [json.loads(l) for l in open(os.path.join(trial, "agent", "tokens.jsonl"))]
            check(len(records) == 2, f"tokens.jsonl has 2 records ({len(records)})")
            for i, (rec, ans) in enumerate(zip(records, answers)):
                check(rec["episode"] == episode and rec["seq"] == i, f"call {i}: episode and order")
                check(rec["request_id"] == ans["id"], f"call {i}: the response's id")
                check(rec["response"]["content"] == ans["content"], f"call {i}: the answer")
                check(len(rec["completion_token_ids"]) == ans["completion_tokens"],
                      f"call {i}: completion token ids = usage.completion_tokens")
                check(len(rec["messages"]) == 2 + 2 * i, f"call {i}: the messages sent")
                check(rec["model"] == MODEL and rec["version"] == 0, f"call {i}: policy version")
                check(rec["sampling"]["temperature"] == 0.8, f"call {i}: sampling settings")
                # The prompt ids are the chat template's rendering: decoding
                # them gives the templated text, which holds every message.
                prompt, completion = rec["prompt_token_ids"], rec["completion_token_ids"]
                scored = post_json(url, "/v1/completions", {
                    "model": MODEL, "prompt": prompt + completion, "max_tokens": 1,
                    "echo": True, "logprobs": 0, "temperature": 0.8})
                lp = scored["choices"][0]["logprobs"]["token_logprobs"]
                want = lp[len(prompt):len(prompt) + len(completion)]
                check(f32_bits(rec["logprobs"]) == f32_bits(want) and len(want) == len(completion),
                      f"call {i}: logprobs equal the trainer's score "
                      f"({rec['logprobs']} vs {want})")
                text = scored["choices"][0]["text"]
                check(all(m["content"] in text for m in rec["messages"]),
                      f"call {i}: prompt ids render every message")
            # The agent held the episode's token, never the server's key.
            token = open(os.path.join(trial, "agent", "key.txt")).read()
            check(token and token != API_KEY, "the agent's key is the episode's token")
            # Collected, then dropped on the server (asked with the key and
            # the token, which opened it: without it every episode is a 404).
            req = urllib.request.Request(f"{url}/v1/episodes/{episode}",
                                         headers={"Authorization": f"Bearer {API_KEY}",
                                                  "X-Temper-Episode-Token": token})
            try:
                urllib.request.urlopen(req, timeout=10)
                check(False, "the episode is dropped on the server after the trial")
            except urllib.error.HTTPError as e:
                check(e.code == 404, "the episode is dropped on the server after the trial")
            # Traces to SFT data.
            sft = os.path.join(tmp, "sft.jsonl")
            ex = subprocess.run([args.temper, "traces", "export", job, "--min-reward", "1",
                                 "--format", "chat-jsonl", "--out", sft],
                                capture_output=True, text=True, timeout=60)
            check(ex.returncode == 0, "temper traces export succeeds\n" + ex.stderr)
            rows = [json.loads(l) for l in open(sft)]
            check(len(rows) == 1, f"one row ({len(rows)})")
            last = records[-1]
            check(rows and rows[0]["messages"] == last["messages"] + [
                {"role": "assistant", "content": last["response"]["content"]}],
                "the row is the last call's messages plus its answer")
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
    print(f"capture-agent: {'FAILED: ' + '; '.join(failures) if failures else 'all passed'}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
