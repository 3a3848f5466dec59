"""A temper job is a Harbor job: `temper tasks run` writes files that
Harbor's own pydantic models load.

Runs a real job (the oracle agent, 2 attempts each, on two example tasks and
two made-up ones: one scoring 0.5, one whose verifier writes no reward) and
validates every file Harbor defines with harbor's models: the job's
`config.json` (JobConfig) and `result.json` (JobResult), each trial's
`config.json` (TrialConfig), `result.json` (TrialResult) and
`agent/trajectory.json` (ATIF Trajectory). Checks that the trial results
hold the rewards and exceptions the verifier gave, that `task_checksum` is
Harbor's own `Task.checksum`, that the job's stats are the ones Harbor
computes from the trials (`JobStats.from_trial_results`, its `Mean`
metric), that the sandbox is named by `environment.import_path`, and that
temper still reads its job back (`temper view`, `temper tasks resume`,
which rebuilds a model-backed agent from Harbor's `AgentConfig`).

Run: python tests/python/test_harbor_job.py --temper target/debug/temper
Needs `pip install -r tests/python/requirements-harbor.txt` (Python >= 3.12)
and a host where temper's sandbox runs. A few seconds.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples", "tasks")
JOB = "harbor-check"
IMPORT_PATH = "temper.sandbox:TemperSandbox"

# Task name -> the rewards its verifier writes under the oracle (None: it
# writes none, so the trial ends with RewardFileNotFoundError).
EXPECTED = {
    "hello-file": {"reward": 1},
    "merge-json": {"reward": 1, "exact": 1},
    "half-credit": {"reward": 0.5},
    "no-reward": None,
}
ATTEMPTS = 2


def make_task(root, name, test_sh):
    d = os.path.join(root, name)
    for sub in ["environment", "tests", "solution"]:
        os.makedirs(os.path.join(d, sub))
    files = {
        "instruction.md": "Write ok to /app/ok.txt\n",
        "task.toml": 'version = "1.0"\n[environment]\nallow_internet = false\nmemory_mb = 256\n',
        "environment/Dockerfile": "FROM ubuntu:24.04\nWORKDIR /app\n",
        "solution/solve.sh": "echo ok > /app/ok.txt\n",
        "tests/test.sh": test_sh,
    }
    for rel, text in files.items():
        with open(os.path.join(d, rel), "w") as f:
            f.write(text)
    return d


def run_job(temper, root):
    """Runs the job into ROOT/jobs/JOB; returns (jobs dir, job dir, output)."""
    tasks = os.path.join(root, "tasks")
    made = [
        make_task(tasks, "half-credit", "echo 0.5 > /logs/verifier/reward.txt\n"),
        make_task(tasks, "no-reward", "echo 'no reward written'\n"),
    ]
    jobs = os.path.join(root, "jobs")
    cmd = [temper, "tasks", "run", os.path.join(EXAMPLES, "hello-file"),
           os.path.join(EXAMPLES, "merge-json"), *made, "-a", "oracle",
           "-n", str(ATTEMPTS), "-c", "4", "--jobs-dir", jobs, "--job-name", JOB]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"temper tasks run failed:\n{out.stdout}\n{out.stderr}")
    return jobs, os.path.join(jobs, JOB), out.stdout + out.stderr


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        raise SystemExit(1)


def read(path):
    with open(path) as f:
        return f.read()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", required=True)
    a = ap.parse_args()
    temper = os.path.abspath(a.temper)

    from harbor.metrics.mean import Mean
    from harbor.models.job.config import JobConfig
    from harbor.models.job.result import JobResult, JobStats
    from harbor.models.task.task import Task
    from harbor.models.trajectories import Trajectory
    from harbor.models.trial.config import TrialConfig
    from harbor.models.trial.result import TrialResult

    with tempfile.TemporaryDirectory(prefix="harbor-job-") as root:
        _, job, out = run_job(temper, root)
        n_total = len(EXPECTED) * ATTEMPTS

        config = JobConfig.model_validate_json(read(os.path.join(job, "config.json")))
        check(config.job_name == JOB and config.n_attempts == ATTEMPTS
              and config.n_concurrent_trials == 4, "config.json is a Harbor JobConfig")
        check([ag.name for ag in config.agents] == ["oracle"], "JobConfig.agents: the oracle")
        check(config.environment.type is None and config.environment.import_path == IMPORT_PATH
              and config.environment.kwargs == {"allow_internet": False},
              "JobConfig.environment: temper's sandbox by import_path, its settings in kwargs")
        check(sorted(os.path.basename(str(t.path)) for t in config.tasks) == sorted(EXPECTED),
              "JobConfig.tasks: each task once, by path")

        # In plan order (temper's own `trials` list, which Harbor ignores).
        trials = [t["trial_name"] for t in json.loads(read(os.path.join(job, "config.json")))["trials"]]
        dirs = sorted(d for d in os.listdir(job) if os.path.isdir(os.path.join(job, d)))
        check(len(trials) == n_total and sorted(trials) == dirs, f"{n_total} trial directories, as planned")
        results = []
        for name in trials:
            d = os.path.join(job, name)
            tc = TrialConfig.model_validate_json(read(os.path.join(d, "config.json")))
            tr = TrialResult.model_validate_json(read(os.path.join(d, "result.json")))
            Trajectory.model_validate_json(read(os.path.join(d, "agent", "trajectory.json")))
            task = tr.task_name
            if task not in EXPECTED:
                check(False, f"{name}: unexpected task {task}")
            if tc.task.name is not None or tc.task.path is None or tc != tr.config:
                check(False, f"{name}: config.json is the result's config, the task by path only")
            if tc.environment.type is not None or tc.environment.import_path != IMPORT_PATH:
                check(False, f"{name}: the trial's environment is temper's sandbox by import_path")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                checksum = Task(tr.task_id.get_local_path()).checksum
            if tr.task_checksum != checksum:
                check(False, f"{name}: task_checksum {tr.task_checksum} != Harbor's {checksum}")
            rewards = tr.verifier_result.rewards if tr.verifier_result else None
            if rewards != EXPECTED[task]:
                check(False, f"{name}: rewards {rewards} != {EXPECTED[task]}")
            if EXPECTED[task] is None:
                if tr.exception_info is None or tr.exception_info.exception_type != "RewardFileNotFoundError":
                    check(False, f"{name}: RewardFileNotFoundError, got {tr.exception_info}")
            elif tr.exception_info is not None:
                check(False, f"{name}: no exception, got {tr.exception_info}")
            if tr.trial_name != name or tr.finished_at is None or tr.started_at is None:
                check(False, f"{name}: trial_name and times")
            results.append(tr)
        check(True, f"{n_total} trials: TrialConfig, TrialResult and ATIF Trajectory validate; "
                     "rewards and exceptions as the verifier gave; task_checksum is Harbor's Task.checksum")
        check(len({r.id for r in results}) == n_total, "trial ids are distinct UUIDs")

        jr = JobResult.model_validate_json(read(os.path.join(job, "result.json")))
        s = jr.stats
        n_err = ATTEMPTS * sum(1 for v in EXPECTED.values() if v is None)
        check(jr.n_total_trials == n_total and s.n_completed_trials == n_total
              and s.n_errored_trials == n_err and s.n_pending_trials == 0 and s.n_running_trials == 0
              and jr.finished_at is not None,
              f"result.json is a Harbor JobResult: {n_total} completed, {n_err} errored, 0 pending")
        harbor = JobStats.from_trial_results(results, n_total_trials=n_total)
        ours = s.model_dump(mode="json", exclude={"evals"})
        want = harbor.model_dump(mode="json", exclude={"evals"})
        check(ours == want, f"JobStats counts are Harbor's own: {ours}")
        check(list(s.evals) == list(harbor.evals) == ["oracle__adhoc"], "one eval, oracle__adhoc")
        e, h = s.evals["oracle__adhoc"], harbor.evals["oracle__adhoc"]
        check((e.n_trials, e.n_errors, e.exception_stats, e.reward_stats)
              == (h.n_trials, h.n_errors, h.exception_stats, h.reward_stats),
              f"reward_stats and exception_stats are Harbor's own: {dict(e.reward_stats)}")
        mean = Mean().compute([r.verifier_result.rewards if r.verifier_result else None for r in results])
        check(e.metrics == [mean], f"metrics are Harbor's Mean: {e.metrics}")

        total = next(l for l in out.splitlines() if l.startswith("total"))
        check(f"{n_total}/{n_total}" in total, f"temper's summary counts every trial: {total!r}")
        view = subprocess.run([temper, "view", job], capture_output=True, text=True, timeout=60)
        check(view.returncode == 0 and "half-credit" in read(os.path.join(job, "report.html")),
              "temper view reads the job")
        resume = subprocess.run([temper, "tasks", "resume", job], capture_output=True, text=True, timeout=120)
        check(resume.returncode == 0 and f"0 of {n_total} trials left to run" in resume.stderr,
              "temper tasks resume reads the job and finds nothing left to run")
        JobResult.model_validate_json(read(os.path.join(job, "result.json")))
        check(True, "the resumed job's result.json validates")

        # A model-backed agent: its model and settings go in Harbor's
        # AgentConfig (model_name, kwargs), from which resume rebuilds it.
        program = f"{temper} tasks exec -- 'echo Hello, world! > /app/hello.txt'"
        jobs = os.path.join(root, "jobs")
        out = subprocess.run([temper, "tasks", "run", os.path.join(EXAMPLES, "hello-file"), "-a", "command",
                              "-m", "acme/tiny-model", "--agent-command", program, "--jobs-dir", jobs,
                              "--job-name", "command"], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            check(False, "temper tasks run -a command -m acme/tiny-model\n" + out.stderr[-2000:])
        job = os.path.join(jobs, "command")
        config = JobConfig.model_validate_json(read(os.path.join(job, "config.json")))
        agent = config.agents[0]
        check((agent.name, agent.model_name, agent.kwargs.get("command")) == ("command", "acme/tiny-model", program),
              "JobConfig.agents: the command agent, its model_name and its program in kwargs")
        (trial,) = [d for d in os.listdir(job) if os.path.isdir(os.path.join(job, d))]
        os.remove(os.path.join(job, trial, "result.json"))
        resume = subprocess.run([temper, "tasks", "resume", job], capture_output=True, text=True, timeout=120)
        if resume.returncode != 0 or "1 of 1 trials left to run" not in resume.stderr:
            check(False, "temper tasks resume of the command job\n" + resume.stderr[-2000:])
        tr = TrialResult.model_validate_json(read(os.path.join(job, trial, "result.json")))
        TrialConfig.model_validate_json(read(os.path.join(job, trial, "config.json")))
        jr = JobResult.model_validate_json(read(os.path.join(job, "result.json")))
        harbor = JobStats.from_trial_results([tr], n_total_trials=1)
        check(tr.agent_info.model_info is not None and tr.agent_info.model_info.name == "acme/tiny-model"
              and tr.verifier_result.rewards == {"reward": 1} and list(jr.stats.evals) == list(harbor.evals)
              == ["command__acme/tiny-model__adhoc"] and jr.stats.n_completed_trials == 1,
              "temper tasks resume rebuilt the agent from Harbor's AgentConfig: the rerun trial scores 1, "
              "its model in TrialResult.agent_info and the eval key")
    print("temper's job validates with harbor's models")


if __name__ == "__main__":
    sys.exit(main())
