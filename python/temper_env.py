"""temper_env: write a temper environment in Python (one file, stdlib only).

temper starts your script once and talks JSON lines over stdin/stdout:
each request is {"id", "method", "params"}; each answer {"id", "result"} or
{"id", "error"}. Subclass Environment, then call serve(MyEnv()).

    from temper_env import Environment, serve

    class Echo(Environment):
        env_id = "echo"
        def rows(self, split, n, seed):
            return [{"question": f"Say {i}", "answer": str(i)} for i in range(n)]
        def score_one(self, row, rollout):
            text = last_assistant_text(rollout["completion"])
            return {"reward": float(row["answer"] in text), "metrics": {}}

    if __name__ == "__main__":
        serve(Echo())

Methods (override what you need):
  rows(split, n, seed) -> list of {"prompt": [messages]} or {"question": str},
      with optional "answer" and "info". split is "train" or "eval"; keep
      the two disjoint and deterministic in seed.
  env_response(row, messages, state) -> (messages, done, state)
      multi-turn only (set multi_turn = True): answer the last assistant turn.
  score(row, rollouts) -> [{"reward": float, "metrics": {name: float}}]
      default: score_one per rollout. A rollout has completion, state,
      stop_condition, error, is_truncated.
While `serve()` runs, the protocol has the original stdin and stdout to
itself: file descriptors 0 and 1 (and `sys.stdin`, `sys.stdout`) read
/dev/null and write to stderr, so whatever the environment, or a program it
starts, prints or reads cannot corrupt an answer.
"""

import json
import os
import sys
import traceback


class Environment:
    env_id = "python-env"
    multi_turn = False
    max_turns = 10
    eval_defaults = {}

    def __init__(self):
        self.args = {}

    def configure(self, args):
        """Called once with the environment arguments (-a JSON)."""
        self.args = args or {}

    def rows(self, split, n, seed):
        raise NotImplementedError

    def env_response(self, row, messages, state):
        raise NotImplementedError("multi-turn environments implement env_response")

    def score_one(self, row, rollout):
        raise NotImplementedError

    def score(self, row, rollouts):
        return [self.score_one(row, r) for r in rollouts]


def last_assistant_text(messages):
    for m in reversed(messages):
        if m.get("role") == "assistant":
            c = m.get("content")
            if isinstance(c, list):
                return "".join(p.get("text", "") for p in c if isinstance(p, dict))
            return c or ""
    return ""


def parse_tag(text, tag, strip=True):
    """The content of the last <tag>...</tag> in text (whitespace stripped
    unless strip=False), or None."""
    close = text.rfind(f"</{tag}>")
    if close < 0:
        return None
    start = text.rfind(f"<{tag}>", 0, close)
    if start < 0:
        return None
    inner = text[start + len(tag) + 2 : close]
    return inner.strip() if strip else inner


def _handle(env, req):
    method, params = req.get("method"), req.get("params") or {}
    if method == "info":
        env.configure(params.get("args"))
        return {
            "env_id": env.env_id,
            "multi_turn": env.multi_turn,
            "max_turns": env.max_turns,
            "eval_defaults": env.eval_defaults,
        }
    if method == "rows":
        return env.rows(params["split"], int(params["n"]), int(params["seed"]))
    if method == "env_response":
        messages, done, state = env.env_response(params["row"], params["messages"], params.get("state") or {})
        return {"messages": messages, "done": bool(done), "state": state}
    if method == "score":
        return env.score(params["row"], params["rollouts"])
    raise ValueError(f"unknown method {method!r}")


def _protocol_streams():
    """The process's stdin and stdout, kept for the protocol; fd 0 then
    reads /dev/null and fd 1 writes to stderr, for everything else.
    (temper_reward.py has the same function: each helper is one
    self-contained file a user can copy.)"""
    sys.stdout.flush()
    proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8")
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    sys.stdin = open(os.devnull)
    sys.stdout = sys.stderr
    return proto_in, proto_out


def serve(env, stdin=None, stdout=None):
    """Answer requests until stdin closes."""
    if stdin is None and stdout is None:
        stdin, stdout = _protocol_streams()
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    for line in stdin:
        line = line.strip()
        if not line:
            continue
        req = json.loads(line)
        try:
            reply = {"id": req.get("id"), "result": _handle(env, req)}
        except Exception as e:  # reported to temper, which records it on the rollout
            traceback.print_exc(file=sys.stderr)
            reply = {"id": req.get("id"), "error": f"{type(e).__name__}: {e}"}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()
