"""temper_reward: write a temper reward in Python (one file, stdlib only).

In env.toml, a rubric entry names a command instead of a built-in:

    [[rubric]]
    command = "python3 reward.py"   # started once, from the env directory
    function = "fields_right"       # which @reward function (default: the only one)
    weight = 1.0
    args = { strict = true }        # handed to the function as `args`

reward.py:

    from temper_reward import reward, serve

    @reward
    def fields_right(text, parsed, answer, info, args, **_):
        return 1.0 if parsed == answer else 0.0

    if __name__ == "__main__":
        serve()

A reward function is called once per rollout with keyword arguments:
  text        the last assistant message's text
  parsed      the environment parser's answer (str or None)
  answer      the row's reference answer (str or None)
  info        the row's info (dict)
  prompt      the prompt messages; completion: the completion messages
  state, stop_condition, error, is_truncated: the rollout's
  args        the rubric entry's args (dict)
and returns a number, or (number, {"metric": number}), or
{"reward": number, "metrics": {...}}. The metrics are reported as
`name/metric`. Accept **_ so that new arguments do not break it.

Protocol (temper's side is crates/temper-env/src/rubric.rs; the same JSON
lines as external environments): each request is {"id", "method",
"params"}, each answer {"id", "result"} or {"id", "error"}.
  info  -> {"functions": [names]}
  score, {function, args, row: {prompt, answer, info}, rollouts: [...]}
        -> [{"reward": x, "metrics": {...}}], one per rollout (one call per
           group of rollouts of a prompt: batch work there if it helps).
Stdout belongs to the protocol: print diagnostics to stderr.
"""

import json
import sys
import traceback

_REWARDS = {}


def reward(fn=None, *, name=None):
    """Register `fn` as a reward (usable as @reward or @reward(name=...))."""
    def register(f):
        _REWARDS[name or f.__name__] = f
        return f
    return register(fn) if fn is not None else register


def _as_score(value):
    if isinstance(value, dict):
        out = {"reward": float(value["reward"]), "metrics": {}}
        for k, v in (value.get("metrics") or {}).items():
            out["metrics"][k] = float(v)
        return out
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return {"reward": float(value[0]), "metrics": {k: float(v) for k, v in value[1].items()}}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"a reward returns a number, (number, metrics) or a dict, got {value!r}")
    return {"reward": float(value), "metrics": {}}


def _pick(name):
    if name is None:
        if len(_REWARDS) != 1:
            raise ValueError(f"name the function (rubric `function`): this file has {sorted(_REWARDS)}")
        return next(iter(_REWARDS.values()))
    if name not in _REWARDS:
        raise ValueError(f"no @reward function {name!r}; this file has {sorted(_REWARDS)}")
    return _REWARDS[name]


def _handle(req):
    method, params = req.get("method"), req.get("params") or {}
    if method == "info":
        return {"functions": sorted(_REWARDS)}
    if method == "score":
        fn = _pick(params.get("function"))
        row = params.get("row") or {}
        args = params.get("args") or {}
        out = []
        for r in params.get("rollouts") or []:
            out.append(_as_score(fn(
                text=r.get("text", ""), parsed=r.get("parsed"), answer=row.get("answer"),
                info=row.get("info") or {}, prompt=row.get("prompt") or [],
                completion=r.get("completion") or [], state=r.get("state"),
                stop_condition=r.get("stop_condition"), error=r.get("error"),
                is_truncated=r.get("is_truncated", False), args=args)))
        return out
    raise ValueError(f"unknown method {method!r}")


def serve(stdin=None, stdout=None):
    """Answer temper's requests until stdin closes."""
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    for line in stdin:
        line = line.strip()
        if not line:
            continue
        req = json.loads(line)
        try:
            reply = {"id": req.get("id"), "result": _handle(req)}
        except Exception as e:  # reported to temper, which records it as a metric
            traceback.print_exc(file=sys.stderr)
            reply = {"id": req.get("id"), "error": f"{type(e).__name__}: {e}"}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()
