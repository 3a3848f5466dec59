"""CI: the Python external environment (examples/envs/guess-number) through
`temper eval`, against temper's mock OpenAI server; then `temper view`.

The mock answers every prompt with <answer>42</answer>, so the model never
guesses well: what this proves is that temper runs the Python process over
the JSON-lines protocol (rows, env_response, score) end to end and writes a
complete run. The Rust test `python_external_environment_plays_multi_turn`
checks the rewards with a model that plays well.

Also unit-tests python/temper_env.py's request handling directly.
"""

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))

import temper_env  # noqa: E402


def test_helper_protocol():
    class Echo(temper_env.Environment):
        env_id = "echo"

        def rows(self, split, n, seed):
            return [{"question": f"say {i}", "answer": str(i)} for i in range(n)]

        def score_one(self, row, rollout):
            return {"reward": float(row["answer"] in temper_env.last_assistant_text(rollout["completion"])), "metrics": {}}

    reqs = [
        {"id": 1, "method": "info", "params": {"args": {"x": 1}}},
        {"id": 2, "method": "rows", "params": {"split": "eval", "n": 2, "seed": 0}},
        {"id": 3, "method": "score", "params": {"row": {"answer": "1"}, "rollouts": [
            {"completion": [{"role": "assistant", "content": "1"}]},
            {"completion": [{"role": "assistant", "content": "2"}]}]}},
        {"id": 4, "method": "env_response", "params": {"row": {}, "messages": [], "state": {}}},
        {"id": 5, "method": "nope", "params": {}},
    ]
    out = io.StringIO()
    with contextlib.redirect_stderr(io.StringIO()):  # the helper prints tracebacks of failing requests
        temper_env.serve(Echo(), stdin=io.StringIO("\n".join(json.dumps(r) for r in reqs) + "\n"), stdout=out)
    answers = {a["id"]: a for a in map(json.loads, out.getvalue().splitlines())}
    assert answers[1]["result"]["env_id"] == "echo"
    assert len(answers[2]["result"]) == 2
    assert [s["reward"] for s in answers[3]["result"]] == [1.0, 0.0]
    assert "NotImplementedError" in answers[4]["error"]
    assert "unknown method" in answers[5]["error"]
    assert temper_env.parse_tag("a <guess>7</guess> b", "guess") == "7"
    assert temper_env.parse_tag("no tags", "guess") is None


NOISY_ENV = """
import os, sys
sys.path.insert(0, {python!r})
import temper_env

class Noisy(temper_env.Environment):
    env_id = "noisy"
    def rows(self, split, n, seed):
        print("a print from rows()")
        os.system("echo a child process writing to fd 1")
        sys.stdout.write(sys.stdin.read() or "stdin reads nothing\\n")
        return [{{"question": "q", "answer": "a"}}]

temper_env.serve(Noisy())
"""


def test_prints_cannot_corrupt_the_protocol():
    """What an environment (or a program it starts) prints goes to stderr;
    stdout carries the protocol's answers only."""
    script = NOISY_ENV.format(python=os.path.join(ROOT, "python"))
    reqs = [{"id": 1, "method": "info", "params": {}},
            {"id": 2, "method": "rows", "params": {"split": "eval", "n": 1, "seed": 0}}]
    p = subprocess.run([sys.executable, "-c", script], input="".join(json.dumps(r) + "\n" for r in reqs),
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    answers = [json.loads(l) for l in p.stdout.splitlines()]
    assert [a["id"] for a in answers] == [1, 2], p.stdout
    assert answers[1]["result"] == [{"question": "q", "answer": "a"}], answers[1]
    for noise in ("a print from rows()", "a child process writing to fd 1", "stdin reads nothing"):
        assert noise in p.stderr, (noise, p.stderr)


def test_eval_through_temper(temper):
    mock = subprocess.Popen([temper, "mock-openai", "--addr", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    try:
        line = mock.stdout.readline().strip()
        assert line.startswith("listening on "), line
        base = "http://" + line.split()[-1] + "/v1"
        with tempfile.TemporaryDirectory() as save:
            env_dir = os.path.join(ROOT, "examples", "envs", "guess-number")
            subprocess.run([temper, "eval", env_dir, "-a", '{"hi": 20}', "-m", "mock", "-b", base,
                            "-n", "4", "-r", "2", "--quiet", "--save-dir", save], check=True)
            [env_runs] = os.listdir(save)
            [run] = os.listdir(os.path.join(save, env_runs))
            run_dir = os.path.join(save, env_runs, run)
            lines = [json.loads(l) for l in open(os.path.join(run_dir, "results.jsonl"))]
            assert len(lines) == 8, len(lines)
            assert sorted(l["example_id"] for l in lines) == [0, 0, 1, 1, 2, 2, 3, 3]
            for l in lines:
                # 10 wrong guesses (the mock never sends <guess>), then the turn limit.
                assert l["stop_condition"] == "max_turns_reached", l["stop_condition"]
                assert l["error"] is None
                assert l["reward"] == 0.0 and l["metrics"]["solved"] == 0.0
            meta = json.load(open(os.path.join(run_dir, "metadata.json")))
            assert meta["env_id"] == "guess-number" and meta["status"] == "completed"
            subprocess.run([temper, "view", run_dir], check=True, stdout=subprocess.DEVNULL)
            assert os.path.getsize(os.path.join(run_dir, "report.html")) > 1000
    finally:
        mock.kill()
        mock.wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--temper", default=os.path.join(ROOT, "target", "debug", "temper"))
    a = p.parse_args()
    test_helper_protocol()
    test_prints_cannot_corrupt_the_protocol()
    test_eval_through_temper(os.path.abspath(a.temper))
    print("external environment: ok")
