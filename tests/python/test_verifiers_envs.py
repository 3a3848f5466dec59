"""verifiers environments run in temper unchanged: `temper eval verifiers:...` on the
fixtures under tests/verifiers (written against verifiers 0.4 in the shapes its docs
describe), against temper's mock OpenAI server.

Run with the Python that has verifiers (tests/python/requirements-verifiers.txt):

    .venv-verifiers/bin/python tests/python/test_verifiers_envs.py [--temper target/debug/temper]

- vf_add (single-turn, a dataset, a few-shot Messages prompt, two weighted @vf.reward
  functions): every reward is 1.0 x right number + 0.5 x tag format, recomputed here
  from the completion; the mock gets about a third of the sums wrong, so both occur.
- vf_quiz (multi-turn: an Env whose run() answers each reply with the next question):
  three assistant turns with the questions between them; the reward is the share
  answered right, recomputed here.
- vf_calc (tool use: a vf.Toolset MCP server with a `calculate` @vf.tool): the mock
  calls the tool, the env's server answers with the exact value (checked here), the
  model's final answer is scored 1.0 and the `used_tool` metric is 1.
- Clear errors: no such taskset, a Python without verifiers, no such Python.

The mock's answers are known (see crates/temper-eval/src/mock.rs), which is what lets
each reward be checked against the env's own rubric. The harness program runs through
verifiers' `uv` script runner, so `uv` must be on PATH (it is in the same venv).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "verifiers")
TAG = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
NULL_HARNESS = {"agent": {"harness": {"id": "null"}}}


def env_vars(python=None):
    env = dict(os.environ)
    # verifiers finds `uv` on PATH; the venv that has verifiers has it.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["TEMPER_VERIFIERS_PYTHON"] = python or sys.executable
    return env


def run_eval(temper, base, fixture, args, n, r, save):
    cmd = [temper, "eval", f"verifiers:{os.path.join(FIXTURES, fixture)}", "-a", json.dumps(args),
           "-m", "mock", "-b", base, "-n", str(n), "-r", str(r), "--quiet", "--save-dir", save]
    subprocess.run(cmd, check=True, env=env_vars(), cwd=ROOT, timeout=600)
    [env_runs] = [d for d in os.listdir(save) if d.startswith(fixture)]
    [run] = os.listdir(os.path.join(save, env_runs))
    run_dir = os.path.join(save, env_runs, run)
    lines = [json.loads(l) for l in open(os.path.join(run_dir, "results.jsonl"))]
    meta = json.load(open(os.path.join(run_dir, "metadata.json")))
    assert len(lines) == n * r, (fixture, len(lines))
    assert meta["env_id"] == fixture and meta["status"] == "completed", meta
    for l in lines:
        assert l["error"] is None, (fixture, l["error"])
    return lines


def answer(text):
    found = TAG.findall(text or "")
    return int(found[-1]) if found else None


def check_add(lines):
    rewards = set()
    for l in lines:
        assert [m["role"] for m in l["prompt"]] == ["system", "user", "assistant", "user"], l["prompt"]
        [reply] = l["completion"]
        numbers = re.findall(r"-?\d+", reply["content"])
        correct = float(bool(numbers) and int(numbers[-1]) == int(l["answer"]))
        tagged = float(answer(reply["content"]) is not None)
        assert l["metrics"]["correct"] == correct and l["metrics"]["tagged"] == tagged, l
        assert abs(l["reward"] - (1.0 * correct + 0.5 * tagged)) < 1e-9, l
        assert l["stop_condition"] == "agent_completed", l["stop_condition"]
        rewards.add(l["reward"])
    assert rewards == {0.5, 1.5}, f"the mock answers some sums wrong: {rewards}"


def check_quiz(lines):
    for l in lines:
        roles = [m["role"] for m in l["completion"]]
        assert roles == ["assistant", "user", "assistant", "user", "assistant"], roles
        questions = [l["prompt"][-1]["content"]] + [m["content"] for m in l["completion"] if m["role"] == "user"]
        replies = [m["content"] for m in l["completion"] if m["role"] == "assistant"]
        right = 0
        for q, reply in zip(questions, replies):
            a, b = map(int, re.findall(r"\d+", q))
            right += answer(reply) == a + b
        assert abs(l["reward"] - right / 3) < 1e-9, (l["reward"], right, questions, replies)
        assert l["metrics"]["accuracy"] == l["reward"] and l["metrics"]["turns"] == 3.0, l["metrics"]
    assert len({l["reward"] for l in lines}) > 1, "the mock answers some questions wrong"


def check_calc(lines):
    for l in lines:
        expression = l["prompt"][-1]["content"].removeprefix("What is ").removesuffix("?")
        value = eval(expression, {"__builtins__": {}})  # the fixture's own arithmetic
        shown = str(int(value)) if float(value).is_integer() else str(value)
        call, tool, final = l["completion"]
        assert call["tool_calls"][0]["function"]["name"] == "calculate", call
        assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == {"expression": expression}
        assert tool["role"] == "tool" and tool["content"] == shown, tool
        assert answer(final["content"]) == int(l["answer"]) == int(value), final
        assert l["reward"] == 1.0 and l["metrics"] == {"correct": 1.0, "used_tool": 1.0}, l


def check_errors(temper, base):
    def fails(spec, python=None):
        p = subprocess.run([temper, "eval", spec, "-m", "mock", "-b", base, "-n", "1", "--quiet"],
                           env=env_vars(python), cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert p.returncode != 0, spec
        return p.stderr

    add = f"verifiers:{os.path.join(FIXTURES, 'vf_add')}"
    assert "no taskset package or file at" in fails("verifiers:tests/verifiers/no_such_env")
    err = fails(add, python="/no/such/python")
    assert "cannot start `/no/such/python`" in err and "TEMPER_VERIFIERS_PYTHON" in err, err
    # A Python without verifiers: a fresh venv without packages.
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", d], check=True)
        err = fails(add, python=os.path.join(d, "bin", "python"))
    assert "verifiers is not installed" in err and "pip install verifiers" in err, err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", default=os.path.join(ROOT, "target", "debug", "temper"))
    a = ap.parse_args()
    temper = os.path.abspath(a.temper)
    mock = subprocess.Popen([temper, "mock-openai", "--addr", "127.0.0.1:0", "--tool-calls"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = mock.stdout.readline().strip()
        assert line.startswith("listening on "), line
        base = "http://" + line.split()[-1] + "/v1"
        with tempfile.TemporaryDirectory() as save:
            check_add(run_eval(temper, base, "vf_add", NULL_HARNESS, n=6, r=2, save=save))
            print("ok   vf_add: single-turn, rewards from its rubric")
            check_quiz(run_eval(temper, base, "vf_quiz", {}, n=4, r=1, save=save))
            print("ok   vf_quiz: multi-turn, rewards from its rubric")
            check_calc(run_eval(temper, base, "vf_calc", NULL_HARNESS, n=4, r=1, save=save))
            print("ok   vf_calc: tool use through its MCP tool server, rewards from its rubric")
        check_errors(temper, base)
        print("ok   clear errors: no taskset, no verifiers, no Python")
    finally:
        mock.kill()
        mock.wait()
    print("verifiers environments: ok")


if __name__ == "__main__":
    main()
