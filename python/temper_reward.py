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

Protocol (temper's side is crates/temper-env/src/rubric/program.rs; the same JSON
lines as external environments): each request is {"id", "method",
"params"}, each answer {"id", "result"} or {"id", "error"}.
  info  -> {"functions": [names]}
  score, {function, args, row: {prompt, answer, info}, rollouts: [...]}
        -> [{"reward": x, "metrics": {...}}], one per rollout (one call per
           group of rollouts of a prompt: batch work there if it helps).
While `serve()` runs, the protocol has the original stdin and stdout to
itself: file descriptors 0 and 1 (and `sys.stdin`, `sys.stdout`) read
/dev/null and write to stderr, so whatever a reward, or code it runs,
prints or reads cannot corrupt an answer.

To run code a model wrote, use `run` rather than forking by hand: a fresh
process in a temporary directory with a time and an output limit.

    r = run("print(solve(3))", files={"solution.py": code}, timeout=5)
    r.returncode, r.stdout, r.stderr, r.timed_out, r.ok
"""

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass

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


@dataclass
class RunResult:
    """What `run` saw: exit status (negative: killed by that signal, as
    after a timeout or too much output), the output (decoded, at most the
    limit each), and why it was stopped, if it was."""
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    output_truncated: bool

    @property
    def ok(self):
        """Exited with status 0 on its own."""
        return self.returncode == 0 and not self.timed_out and not self.output_truncated


def run(program, *, stdin="", files=None, timeout=10.0, max_output=1 << 20, env=None):
    """Run `program` in a fresh process and return a `RunResult`.

    `program` is Python source (run as `main.py` by this interpreter) or an
    argument list (`["python3", "-m", "pytest", "-q"]`). It runs in a new,
    empty temporary directory (removed afterwards) holding `files`, a dict
    of relative path -> str or bytes, in its own process group: after
    `timeout` seconds, or once stdout plus stderr pass `max_output` bytes,
    the whole group is killed. `stdin` (str) is its standard input.
    """
    work = tempfile.mkdtemp(prefix="temper-run-")
    try:
        for rel, content in (files or {}).items():
            path = os.path.normpath(os.path.join(work, rel))
            if os.path.isabs(rel) or not path.startswith(work + os.sep):
                raise ValueError(f"run: file {rel!r} is outside the work directory")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
        if isinstance(program, str):
            with open(os.path.join(work, "main.py"), "w") as f:
                f.write(program)
            argv = [sys.executable, "main.py"]
        else:
            argv = list(program)
        return _run_limited(argv, work, stdin, timeout, max_output, env)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_limited(argv, cwd, stdin, timeout, max_output, env):
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True)
    data = stdin.encode() if isinstance(stdin, str) else (stdin or b"")

    def feed():
        # A thread, so that a program that does not read its input cannot
        # block us on a full pipe.
        try:
            proc.stdin.write(data)
            proc.stdin.close()
        except OSError:
            pass
    threading.Thread(target=feed, daemon=True).start()
    out = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for pipe in out:
        sel.register(pipe, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    timed_out = truncated = False
    exited = False
    while sel.get_map() and not truncated:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        # Once the program has exited, read what is left without waiting
        # (a background child of it may hold the pipes open).
        events = sel.select(0 if exited else min(left, 0.05))
        if exited and not events:
            break
        for key, _ in events:
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            out[key.fileobj] += chunk
        truncated = sum(len(b) for b in out.values()) > max_output
        exited = exited or proc.poll() is not None
    sel.close()
    if not (timed_out or truncated):
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    # The program and whatever it started in its group.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()

    def text(b):
        return bytes(b[:max_output]).decode("utf-8", "replace")
    return RunResult(proc.returncode, text(out[proc.stdout]), text(out[proc.stderr]),
                     timed_out, truncated)


def _protocol_streams():
    """The process's stdin and stdout, kept for the protocol; fd 0 then
    reads /dev/null and fd 1 writes to stderr, for everything else."""
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


def serve(stdin=None, stdout=None):
    """Answer temper's requests until stdin closes."""
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
            reply = {"id": req.get("id"), "result": _handle(req)}
        except Exception as e:  # reported to temper, which records it as a metric
            traceback.print_exc(file=sys.stderr)
            reply = {"id": req.get("id"), "error": f"{type(e).__name__}: {e}"}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()
