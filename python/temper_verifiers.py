"""temper_verifiers: a verifiers environment (verifiers 0.4, `verifiers.v1`) in temper, unchanged.

temper runs this file with the environment's Python when an environment is named
`verifiers:TARGET` (`temper eval verifiers:my_taskset`, `[[env]] id = "verifiers:..."`):

    python -u -c <this file> TARGET

TARGET is what `vf-eval` takes as the taskset id (an importable module or package
exporting its Taskset, and optionally its Env, via `__all__`), or a path to such a
package directory or `.py` file. The environment's arguments are its verifiers env
config (`taskset`, `agent` with `harness`/`runtime`/`max_turns`, an env `id`, ...), as
`vf-eval`'s `[env]` table; a role's runtime defaults to `subprocess` (local) here,
since verifiers' default runtime is a Prime cloud sandbox.

It speaks temper's external-environment protocol (JSON lines on stdin/stdout, see
crates/temper-env/src/external.rs) and says `"rollout": true`: temper hands each
rollout the base URL of a loopback OpenAI endpoint served from the rollout's model
(the evaluated endpoint, or the policy being trained). The bridge runs one verifiers
episode per rollout with that endpoint as the episode's model client, so the
environment's harness, interception server and runtime run as they do under
`vf-eval`, every model call goes through temper's gate (where temper keeps the exact
token ids and logprobs), and the task's `@vf.reward` functions give the reward.

Stdout belongs to the protocol; verifiers' warnings go to stderr.
"""

import asyncio
import contextlib
import importlib
import json
import logging
import os
import sys
import threading
import traceback

# The gate needs no key; verifiers' client reads one from this variable.
KEY_VAR = "TEMPER_GATE_KEY"


class BridgeError(Exception):
    """A failure the message explains (no traceback)."""


def _import_verifiers():
    try:
        import verifiers  # noqa: F401
        import verifiers.v1 as vf
    except ImportError as e:
        raise BridgeError(
            f"verifiers is not installed for {sys.executable} ({e}); install it "
            "(pip install verifiers==0.4.0) or point the environment's `python` "
            "argument (or TEMPER_VERIFIERS_PYTHON) at a Python that has it"
        ) from None
    version = getattr(verifiers, "__version__", "?")
    if not version.startswith("0.4."):
        logging.getLogger("temper_verifiers").warning(
            "verifiers %s: this bridge is written against verifiers 0.4", version
        )
    return vf


def importable(directory):
    """Make modules in `directory` importable here and in the processes verifiers
    starts (a toolset's MCP server imports the taskset's module)."""
    sys.path.insert(0, directory)
    parts = [directory] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)


def resolve_target(target):
    """The taskset id for `target`, making a path importable first."""
    path = os.path.abspath(target)
    if os.path.isdir(path):
        importable(os.path.dirname(path))
        return os.path.basename(path)
    if os.path.isfile(path) and path.endswith(".py"):
        importable(os.path.dirname(path))
        return os.path.basename(path)[:-3]
    if os.sep in target or target.endswith(".py"):
        raise BridgeError(f"no taskset package or file at {target}")
    importable(os.getcwd())
    return target


def env_config(vf, taskset_id, args):
    """The verifiers env config: `args`, with the taskset id set and each role's
    runtime defaulting to the local `subprocess` runtime."""
    from verifiers.v1.utils.loaders import env_config_type, resolve_env_config

    data = json.loads(json.dumps(args or {}))
    taskset = data.setdefault("taskset", {})
    if not isinstance(taskset, dict):
        raise ValueError("`taskset` must be a table of the taskset's config")
    if taskset.get("id") not in (None, taskset_id):
        raise ValueError(f"`taskset.id` is {taskset['id']!r}, but the environment names {taskset_id!r}")
    taskset["id"] = taskset_id
    cls = env_config_type(taskset_id, data.get("id") or "")
    for name, field in cls.model_fields.items():
        if isinstance(field.default, vf.AgentConfig):
            role = data.setdefault(name, {})
            if isinstance(role, dict):
                role.setdefault("runtime", {"type": "subprocess"})
    return resolve_env_config(data)


def wire_messages(messages):
    from verifiers.v1.dialects.chat import message_to_wire

    return [message_to_wire(m) for m in messages]


def prompt_messages(data):
    """The task's opening messages, for temper's row (reports, the eval's prompt)."""
    out = []
    if data.system_prompt:
        out.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        out.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        out.extend(wire_messages(data.prompt))
    return out


def rollout_result(episode):
    """An episode as temper's rollout answer. Reward: the mean over the episode's
    trainable traces (one for a single-agent env) of the trace's weighted reward
    sum; metrics: each reward and metric by name."""
    traces = [t for t in episode.traces if t.agent.trainable] or list(episode.traces)
    many = len(traces) > 1
    metrics = {}
    for t in traces:
        prefix = f"{t.agent.name}/" if many else ""
        for name, r in t.rewards.items():
            if r is not None:
                metrics[prefix + name] = float(r.score)
        for name, v in t.metrics.items():
            if v is not None:
                metrics[prefix + name] = float(v)
    errors = list(episode.errors) + [e for t in traces for e in t.errors]
    error = f"{errors[0].type}: {errors[0].message}" if errors else None
    reward = sum(t.reward for t in traces) / len(traces) if traces else 0.0
    main = traces[-1] if traces else None
    completion = []
    if main is not None:
        msgs = wire_messages(main.messages)
        # What followed the task's prompt (few-shot turns in it are not the model's).
        prompt = prompt_messages(main.task.data)
        n = len(prompt)
        if [m.get("role") for m in msgs[:n]] != [m["role"] for m in prompt]:
            n = next((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), len(msgs))
        completion = msgs[n:]
    return {
        "completion": completion,
        "error": error,
        "stop_condition": main.stop_condition if main is not None else None,
        "is_truncated": bool(main is not None and main.is_truncated),
        "state": {
            "score": {"reward": float(reward), "metrics": metrics},
            "episode": episode.id,
            "traces": len(episode.traces),
            "tools": [t.name for t in main.tools] if main is not None else [],
        },
    }


class Bridge:
    def __init__(self, target):
        self.target = target
        self.env = None
        self.tasks = {}
        self.loop = asyncio.new_event_loop()
        self.serving = None
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    # --- the protocol's methods -------------------------------------------------

    def info(self, args):
        vf = _import_verifiers()
        from verifiers.v1.utils.loaders import load_environment

        taskset_id = resolve_target(self.target)
        config = env_config(vf, taskset_id, args)
        self.env = load_environment(config)
        # The env's serving resources (interception, shared tool servers) come up
        # once, before any rollout, and stay up for the process's life, as under
        # vf-eval.
        self.serving = contextlib.AsyncExitStack()
        asyncio.run_coroutine_threadsafe(
            self.serving.enter_async_context(self.env.serving()), self.loop
        ).result()
        return {"env_id": config.env_id, "rollout": True}

    def rows(self, split, n, seed):
        taskset = self.env.taskset
        if split == "train" and taskset.bounded:
            taskset = taskset.shuffle(seed)
        rows = []
        for task in taskset.take(n):
            data = task.data
            self.tasks[data.idx] = task
            answer = getattr(data, "answer", None)
            rows.append({
                "prompt": prompt_messages(data),
                "answer": None if answer is None else str(answer),
                "info": {"verifiers_task": data.idx, "id": data.id, "name": data.name},
            })
        return rows

    async def rollout(self, row, base_url, model, sampling):
        from verifiers.v1.clients import EvalClientConfig, ModelContext
        from verifiers.v1.types import SamplingConfig

        idx = (row.get("info") or {}).get("verifiers_task")
        task = self.tasks.get(idx)
        if task is None:
            raise ValueError(f"no verifiers task {idx!r}: rows must come from this environment")
        os.environ.setdefault(KEY_VAR, "temper")
        ctx = ModelContext(
            client=EvalClientConfig(base_url=base_url, api_key_var=KEY_VAR),
            model=model,
            sampling=SamplingConfig(
                temperature=sampling.get("temperature"),
                top_p=sampling.get("top_p"),
                max_tokens=sampling.get("max_tokens"),
            ),
        )
        [slot] = self.env.slots(task, 1)
        episode = await self.env.run_slot(slot, ctx)
        return rollout_result(episode)

    def score(self, row, rollouts):
        # The episode already ran the task's rewards: hand them back.
        out = []
        for r in rollouts:
            s = (r.get("state") or {}).get("score")
            out.append(s if s is not None else {"reward": 0.0, "metrics": {"verifiers/error": 1.0}})
        return out

    def close(self):
        """Tear down the serving resources (temper closed the pipe)."""
        if self.serving is not None:
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self.serving.aclose(), self.loop).result(timeout=30)

    # --- dispatch -----------------------------------------------------------------

    def handle(self, req, write):
        method, params = req.get("method"), req.get("params") or {}
        try:
            if method == "info":
                result = self.info(params.get("args"))
            elif method == "rows":
                result = self.rows(params.get("split", "eval"), int(params.get("n", 0)), int(params.get("seed", 0)))
            elif method == "score":
                result = self.score(params.get("row") or {}, params.get("rollouts") or [])
            elif method == "rollout":
                future = asyncio.run_coroutine_threadsafe(
                    self.rollout(params.get("row") or {}, params["base_url"], params.get("model", "policy"),
                                 params.get("sampling") or {}),
                    self.loop)
                future.add_done_callback(lambda f: write(req.get("id"), f))
                return
            else:
                raise ValueError(f"unknown method {method!r}")
            write(req.get("id"), result=result)
        except BridgeError as e:
            write(req.get("id"), error=str(e))
        except Exception as e:  # noqa: BLE001 - every failure is an answer
            traceback.print_exc(file=sys.stderr)
            write(req.get("id"), error=f"{type(e).__name__}: {e}")


def serve(bridge, stdin=None, stdout=None):
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    lock = threading.Lock()

    def write(id_, future=None, result=None, error=None):
        if future is not None:
            try:
                result = future.result()
            except Exception as e:  # noqa: BLE001
                traceback.print_exception(e, file=sys.stderr)
                error = f"{type(e).__name__}: {e}"
        msg = {"id": id_, "error": error} if error is not None else {"id": id_, "result": result}
        with lock:
            stdout.write(json.dumps(msg) + "\n")
            stdout.flush()

    for line in stdin:
        if line.strip():
            bridge.handle(json.loads(line), write)
    bridge.close()


def main(argv):
    if len(argv) < 2:
        sys.exit("usage: temper_verifiers.py TASKSET_ID_OR_PATH")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="verifiers: %(levelname)s %(name)s: %(message)s")
    serve(Bridge(argv[1]))


if __name__ == "__main__":
    main(sys.argv)
