#!/usr/bin/env python3
"""Time-to-target-reward of RL: Hugging Face TRL's GRPOTrainer vs ``temper train rl``.

Both sides run the same task (temper's built-in ``arithmetic`` environment:
1-digit addition, user message ``What is 3 + 5?``, no system prompt, reward 1.0
when the number in the last ``<answer>...</answer>`` equals the sum, else 0),
from the same SFT-warmed tiny model directory, with the same batch shape and
optimiser settings, on the CPU with the same number of threads:

* LoRA r=16, alpha=32 on q,k,v,o,gate,up,down (base frozen, no dropout);
* 16 prompts x 8 completions (group size 8) = 128 completions per optimiser
  step; max 24 new tokens; temperature 1.0, no top-k / top-p;
* advantage = reward - group mean (no std scaling), token-level loss
  normalisation, no KL term / reference model (TRL: ``beta=0``,
  ``scale_rewards="none"``, ``loss_type="dapo"``);
* AdamW lr from the temper config (constant, no warm-up), betas (0.9, 0.95),
  eps 1e-12, weight decay 0, grad-norm clip 1.0 (temper's defaults);
* TRL: no gradient checkpointing (TRL's default turns it on; off is faster
  here), generation with transformers' ``generate`` (no vLLM on a CPU).

Differences that remain (by design of each tool, see the report): temper's
loop is asynchronous (the sampler generates the next batch while the trainer
trains, at most ``async.max_off_policy_steps`` = 1 behind, with importance-
sampling correction) and skips zero-advantage groups; TRL is synchronous and
fully on-policy. TRL's ``dapo`` loss normalises by all completion tokens of the
batch, temper by the tokens it trains on; with Adam this barely matters.

Time-to-target: the first optimiser step at which the rolling mean of the
per-step mean training reward over the last ``--window`` steps is >= ``--target``;
the time is the wall time from the start of the training loop to the end of
that step (model loading is reported separately, not included). Each side
stops as soon as it reaches the target (``--no-early-stop`` runs all steps).

The per-step mean reward of 16 prompts is noisy (about +-0.1 step to step)
and on this task both learning curves rise slowly (~0.45 -> ~0.6 over 40-50
steps), so the step at which a rolling mean first crosses the target moves by
many steps between seeds; the seconds-per-step ratio is the steadier number.
``--also-targets`` reports other thresholds from the same runs, ``--json-out``
saves every step, ``--from-json FILE`` re-prints a saved report.

Setup (a venv with TRL and its torch stack from PyPI; the versions the
published numbers were measured with are pinned in
``scripts/requirements-bench-rl.txt``)::

    python3 -m venv .venv-trl
    .venv-trl/bin/pip install -r scripts/requirements-bench-rl.txt

    # an SFT-warmed model + its RL config (~3 min on 2 cores)
    target/release/temper quickstart --dir /tmp/qsb --sft-steps 200 --rl-steps 2 --eval-examples 20

    .venv-trl/bin/python scripts/bench_rl_trl.py --temper target/release/temper \\
        --model /tmp/qsb/sft/model --rl-config /tmp/qsb/rl/config.toml \\
        --target 0.6 --max-steps 60 --threads 2

Held-out mode (``--heldout-target P``): the time for the *held-out* pass@1 of
an environment directory's recipe to reach P, e.g. the SmolLM2 recipe
(``examples/smollm2-rl``: SmolLM2-135M-Instruct, one-digit addition in
``<answer>`` tags with the env's system prompt and few-shot turn, reward
numeric_match 1.0 + format 0.5, 4 prompts x 4 completions, lr 5e-4, LoRA r=8)::

    target/release/temper export "$(scripts/fetch_smollm2.sh)" --format hf --out /tmp/smollm2-hf
    .venv-trl/bin/python scripts/bench_rl_trl.py --model /tmp/smollm2-hf \
        --rl-config examples/smollm2-rl/rl.toml --heldout-target 0.7 --max-steps 24 --threads 2

Both sides train every one of ``--max-steps`` steps (no early stop) and the
held-out pass@1 after each step is measured outside the training clock by
the same evaluator, on the config's ``[eval]`` rows (greedy, its
``num_examples``): temper's in-run evaluation (``--eval.interval 1``) for
temper, and ``temper eval`` against ``temper serve --lora`` of the adapter
TRL saved after each step (the clock paused while it saves) for TRL. The
same ``temper eval`` scores temper's final adapter too, which must give the
in-run evaluation's pass@1 (the two evaluators agree), and TRL's Python
copy of the rubric must give temper's reward, from temper's prompt, on
every rollout temper's evaluations scored. temper's clock comes
from a second run of the same config without the per-step evaluations
(``--eval.interval 0``; its rewards must equal the first run's step for
step): in-run evaluations would overlap the next step's sampling. A side's
time-to-target is its training clock at the first step whose held-out
pass@1 is >= P. ``--temper-checkpoints`` replaces temper's two runs by one
that saves its adapter after every step (its clock includes those writes),
each scored like TRL's: for runs that are not reproducible, such as
``--temper-set async.max_off_policy_steps=1``.

Measured with trl 1.16.0, torch 2.15.0, peft 0.21.2 and transformers 5.23.0
(training-reward mode) or 5.24.0 (held-out mode).
temper runs first, then TRL in this process (torch is imported only after
temper exits so the two never compete for cores). Run on an idle machine: with
2+ threads, PyTorch's OpenMP pool on a model this small (thousands of tiny ops
per step, each ending in a thread barrier) slows down 5-20x as soon as another
process wants the same cores, so a busy machine makes TRL look far slower than
it is. On a shared machine compare with ``--threads 1`` (no barriers); the
"CPU s/step" row (CPU seconds of all threads per step) is a second check.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
from temper_env import parse_tag  # noqa: E402  (temper's xml parser's last-element rule)

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.S)
NUMBER_RE = re.compile(r"[+-]?\d+(\.\d+)?")


# ---------------------------------------------------------------- shared rules


def parse_number(s: str) -> float | None:
    """Like temper's ``parse_number_literal`` for the integers of this task."""
    t = s.strip().replace(",", "")
    if not NUMBER_RE.fullmatch(t):
        return None
    return float(t)


def arithmetic_reward(text: str, answer: int) -> float:
    """1.0 iff the number in the LAST <answer>...</answer> equals ``answer``."""
    found = ANSWER_RE.findall(text)
    if not found:
        return 0.0
    got = parse_number(found[-1])
    return 1.0 if got is not None and abs(got - answer) < 1e-9 else 0.0


def parse_number_literal(s: str) -> float | None:
    """temper's ``math::parse_number_literal`` (thousands commas allowed)."""
    t = s.strip()
    t = t[1:] if t.startswith("+") else t
    if "," in t:
        int_part = t.split(".", 1)[0].lstrip("-")
        groups = int_part.split(",")
        if not (groups[0] and len(groups[0]) <= 3 and all(len(g) == 3 for g in groups[1:])
                and all(g.isdigit() for g in groups)):
            return None
        t = t.replace(",", "")
    body = t[1:] if t.startswith("-") else t
    if (not body or not all(c.isdigit() or c == "." for c in body) or body.count(".") > 1
            or body.startswith(".") or body.endswith(".")):
        return None
    return float(t)


def build_task(rl_cfg: dict) -> dict:
    """The prompt prefix and reward of the config's first environment:
    temper's built-in ``arithmetic`` (1-digit +, no system prompt, reward 1
    for a correct last <answer>), or an environment directory whose env.toml
    uses the arithmetic generator (1-digit +), the xml parser and the
    numeric_match / format rubric (the SmolLM2 recipe's env)."""
    env = (rl_cfg.get("env") or [{}])[0]
    env_id, env_args = env.get("id", "arithmetic"), env.get("args", {})
    if env_id == "arithmetic":
        if env_args.get("digits", 1) != 1 or env_args.get("ops", ["+"]) != ["+"] or env_args.get(
            "system_prompt", ""
        ):
            raise SystemExit(
                "this benchmark builds only temper's arithmetic task with digits=1, ops=['+'], "
                f"no system prompt; the config has {env_args}"
            )
        return {"prefix": [], "reward": arithmetic_reward, "env_dir": None}
    env_dir = Path(env_id)
    spec_path = env_dir / "env.toml"
    if not spec_path.is_file():
        raise SystemExit(f"env {env_id!r}: neither 'arithmetic' nor a directory with env.toml")
    spec = tomllib.loads(spec_path.read_text())
    data = spec.get("dataset", {})
    dargs = {**data.get("args", {}), **env_args}
    parser = spec.get("parser", {})
    weights = {r["function"]: float(r.get("weight", 1.0)) for r in spec.get("rubric", [])}
    if (data.get("generator") != "arithmetic" or dargs.get("digits") != 1
            or dargs.get("ops") != ["+"] or parser.get("type") != "xml"
            or not set(weights) <= {"numeric_match", "format"}
            or spec.get("harness", {}).get("type", "single-turn") != "single-turn"):
        raise SystemExit(
            f"{spec_path}: this benchmark mirrors only single-turn 1-digit '+' arithmetic with "
            "the xml parser and the numeric_match / format rubric"
        )
    fields = parser.get("fields", [])
    if not all(isinstance(f, str) for f in fields):
        raise SystemExit(f"{spec_path}: xml fields with alternative names are not mirrored")
    answer_field = parser.get("answer_field", fields[-1] if fields else "answer")
    prefix = []
    if spec.get("system_prompt"):
        prefix.append({"role": "system", "content": spec["system_prompt"]})
    for shot in spec.get("few_shot", []):
        prefix.append({"role": "user", "content": shot["question"]})
        prefix.append({"role": "assistant", "content": shot["answer"]})

    def reward(text: str, answer: int) -> float:
        total = 0.0
        if "numeric_match" in weights:
            inner = parse_tag(text, answer_field)
            got = parse_number_literal(inner) if inner is not None else None
            ok = got is not None and abs(got - answer) < 1e-9
            total += weights["numeric_match"] * float(ok)
        if "format" in weights:
            if not fields:
                score = 1.0
            else:
                rest, present = text, 0
                for name in fields:
                    inner = parse_tag(text, name, strip=False)
                    if inner is not None:
                        present += 1
                        rest = rest.replace(f"<{name}>{inner}</{name}>", "")
                presence = present / len(fields)
                score = 0.8 * presence + 0.2 * float(not rest.strip()) * presence
            total += weights["format"] * score
        return total

    return {"prefix": prefix, "reward": reward, "env_dir": env_dir}


def time_to_target(steps: list[tuple[int, float, float]], target: float, window: int):
    """steps: (step, reward, elapsed_s) in order. Returns (step, elapsed, rolling) or None."""
    rewards: list[float] = []
    for step, reward, elapsed in steps:
        rewards.append(reward)
        if len(rewards) >= window:
            rolling = sum(rewards[-window:]) / window
            if rolling >= target:
                return step, elapsed, rolling
    return None


def summarise(name: str, steps, load_s: float, args) -> dict:
    hit = time_to_target(steps, args.target, args.window)
    n = len(steps)
    total = steps[-1][2] if steps else float("nan")
    # Seconds per step: over all steps but the first (warm-up), when there are several.
    if n >= 3:
        sps = (steps[-1][2] - steps[0][2]) / (n - 1)
    elif n:
        sps = total / n
    else:
        sps = float("nan")
    return {
        "name": name,
        "steps_run": n,
        "loop_s": total,
        "first_step_s": steps[0][2] if steps else float("nan"),
        "s_per_step": sps,
        "s_per_step_incl_first": total / n if n else float("nan"),
        "load_s": load_s,
        "reached": hit is not None,
        "steps_to_target": hit[0] if hit else None,
        "time_to_target_s": hit[1] if hit else None,
        "rolling_at_target": hit[2] if hit else None,
        "first_reward": steps[0][1] if steps else None,
        "last_rolling": (
            sum(r for _, r, _ in steps[-args.window:]) / min(n, args.window) if n else None
        ),
        "per_step": [{"step": s, "reward": r, "elapsed_s": e} for s, r, e in steps],
    }


# ---------------------------------------------------------------------- temper


def run_temper(args, workdir: Path, name: str = "temper-run",
               eval_args: tuple[str, ...] = ("--eval.num_examples", "0")) -> dict:
    """One `temper train rl` run in WORKDIR/NAME; EVAL_ARGS set its held-out
    evaluations (none by default) and checkpoints (none unless they say)."""
    log_dir = workdir / name
    early_stop = not args.no_early_stop and args.heldout_target is None
    cmd = [
        str(args.temper), "--threads", str(args.threads), "train", "rl", str(args.rl_config),
        "--model.path", str(args.model),
        "--log.dir", str(log_dir),
        "--trainer.max_steps", str(args.max_steps),
        *eval_args,
        *(() if "--ckpt.interval" in eval_args else ("--ckpt.interval", "0")),
        "--log.progress", "false",
        "--seed", str(args.seed),
    ]
    for kv in args.temper_set:
        key, sep, value = kv.partition("=")
        if not sep or not key:
            raise SystemExit(f"--temper-set {kv!r}: expected KEY=VALUE (e.g. async.max_off_policy_steps=1)")
        cmd += [f"--{key}", value]
    print("temper:", " ".join(cmd), flush=True)
    metrics = log_dir / "metrics.jsonl"
    log_path = workdir / f"{name}.log"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        steps: list[tuple[int, float, float]] = []
        stopped_early = False
        while True:
            rc = proc.poll()
            steps = read_temper_metrics(metrics)
            if (
                rc is None
                and early_stop
                and time_to_target(steps, args.target, args.window) is not None
            ):
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                stopped_early = True
                break
            if rc is not None:
                break
            time.sleep(0.2)
    wall = time.perf_counter() - t0
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = ru.ru_utime + ru.ru_stime
    steps = read_temper_metrics(metrics)
    if proc.returncode != 0 and not stopped_early:
        print(open(log_path).read()[-4000:], file=sys.stderr)
        raise SystemExit(f"temper exited with status {proc.returncode} (log: {log_path})")
    if not steps:
        raise SystemExit(f"temper wrote no metrics (log: {log_path})")
    # time/elapsed counts from the start of the RL loop; the rest of the process
    # wall time up to the last step is start-up (model load, engine init).
    load_s = max(0.0, wall - steps[-1][2]) if not stopped_early else float("nan")
    out = summarise("temper", steps, load_s, args)
    out["process_wall_s"] = wall
    # CPU seconds of the whole process (start-up included) per step run.
    out["cpu_s_per_step"] = cpu_s / len(steps)
    out["stopped_early"] = stopped_early
    out["log_dir"] = str(log_dir)
    out["version"] = subprocess.run(
        [str(args.temper), "--version"], capture_output=True, text=True
    ).stdout.strip()
    return out


def read_temper_metrics(path: Path) -> list[tuple[int, float, float]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            break  # a line being written
        rows.append((int(m["step"]), float(m["reward/mean"]), float(m["time/elapsed"])))
    return rows


def read_metric_rows(path: Path) -> list[dict]:
    """Every complete line of a run's metrics.jsonl."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def check_reward_mirror(task: dict, run_dir: Path) -> int:
    """TRL is rewarded by a Python copy of the environment's rubric: it must
    give temper's reward on every rollout temper's evaluations scored."""
    checked = 0
    for results in sorted((run_dir / "evals").glob("step-*/results.jsonl")):
        for line in results.read_text().splitlines():
            r = json.loads(line)
            prompt = r["prompt"]
            if prompt[:-1] != task["prefix"]:
                raise SystemExit(f"{results}: temper's prompt {prompt[:-1]} is not the mirror's "
                                 f"{task['prefix']}")
            got = task["reward"](r["completion"][-1]["content"], int(r["answer"]))
            if abs(got - r["reward"]) > 1e-9:
                raise SystemExit(f"{results}: the Python reward {got} != temper's {r['reward']} "
                                 f"for {r['completion'][-1]['content']!r}")
            checked += 1
    print(f"reward mirror: equal to temper's on all {checked} evaluated rollouts", flush=True)
    return checked


def on_training_clock(b: dict, rows: list[dict], heldout: list, args) -> None:
    """Put `b`, run_temper's summary of the timed run, on the training clock
    (its last step's `time/elapsed` includes the final evaluation; no other
    step's does) with the held-out curve (`heldout`: pass@1 after each step,
    None where `heldout` scores it later)."""
    curve = [
        {"step": r["step"], "heldout": h, "train_s": r["time/elapsed"] - r.get("time/eval", 0.0),
         "reward": r["reward/mean"]}
        for r, h in zip(rows, heldout)
    ]
    steps = [(c["step"], c["reward"], c["train_s"]) for c in curve]
    b.update(summarise("temper", steps, b["load_s"], args))
    b["heldout_curve"] = curve
    b["final_inrun_pass1"] = rows[-1].get("eval/pass@1")
    b["final_adapter"] = str(Path(b["log_dir"]) / "adapter")


def run_temper_heldout(args, task: dict, workdir: Path) -> dict:
    """temper's side of the held-out mode: run A evaluates after every step
    (the held-out curve), run B does not (the training clock). With
    --temper-checkpoints, one run saves its adapter after every step
    instead, scored later by the evaluator TRL's adapters get."""
    if args.temper_checkpoints:
        return run_temper_checkpoints(args, task, workdir)
    a = run_temper(args, workdir, "temper-eval-every-step", ("--eval.interval", "1"))
    b = run_temper(args, workdir, "temper-run", ("--eval.interval", "0"))
    rows_a = read_metric_rows(Path(a["log_dir"]) / "metrics.jsonl")
    rows_b = read_metric_rows(Path(b["log_dir"]) / "metrics.jsonl")
    rewards_a = [r["reward/mean"] for r in rows_a]
    rewards_b = [r["reward/mean"] for r in rows_b]
    if rewards_a != rewards_b:
        raise SystemExit(
            "temper's two runs diverged (the held-out curve would not be the timed run's): "
            f"rewards {rewards_a} vs {rewards_b}"
        )
    on_training_clock(b, rows_b, [r["eval/pass@1"] for r in rows_a], args)
    b["reward_mirror_checked"] = check_reward_mirror(task, Path(a["log_dir"]))
    b["heldout_steps_checked_equal"] = len(rewards_a)
    return b


def run_temper_checkpoints(args, task: dict, workdir: Path) -> dict:
    """One temper run checkpointing every step (the clock includes those
    writes); its per-step adapters, as PEFT directories, for `heldout`."""
    keep = ("--ckpt.interval", "1", "--ckpt.keep", str(args.max_steps + 1))
    b = run_temper(args, workdir, "temper-run", ("--eval.interval", "0", *keep))
    run_dir = Path(b["log_dir"])
    rows = read_metric_rows(run_dir / "metrics.jsonl")
    config = run_dir / "adapter" / "adapter_config.json"
    adapters = {}
    for weights in sorted(run_dir.glob("checkpoints/*/step-*/weights.safetensors")):
        step = int(weights.parent.name.removeprefix("step-"))
        out = workdir / "temper-adapters" / f"step-{step:04d}"
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(config, out / "adapter_config.json")
        shutil.copyfile(weights, out / "adapter_model.safetensors")
        adapters[step] = str(out)
    if sorted(adapters) != [r["step"] for r in rows]:
        raise SystemExit(f"checkpoints of steps {sorted(adapters)}, metrics of "
                         f"{[r['step'] for r in rows]} (ckpt.interval 1 expected)")
    b["checkpoint_adapters"] = {str(k): v for k, v in adapters.items()}
    on_training_clock(b, rows, [None] * len(rows), args)
    b["reward_mirror_checked"] = check_reward_mirror(task, run_dir)
    return b


# ------------------------------------------------------------------------- TRL


def run_trl(args, rl_cfg: dict, task: dict, workdir: Path) -> dict:
    # Thread settings before torch is imported.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

    t_load = time.perf_counter()
    import torch
    import transformers
    import peft
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    transformers.logging.set_verbosity_error()

    sampling = rl_cfg.get("sampling", {})
    trainer_cfg = rl_cfg.get("trainer", {})
    lora_cfg = rl_cfg.get("lora", {})
    group = int(sampling.get("group_size", 8))
    prompts_per_step = int(trainer_cfg.get("batch_size", 16))
    max_tokens = int(sampling.get("max_tokens", 24))
    temperature = float(sampling.get("temperature", 1.0))
    top_p = float(sampling.get("top_p", 1.0))
    lr = float(trainer_cfg.get("lr", 2e-3))
    grad_clip = float(trainer_cfg.get("grad_clip", 1.0))
    weight_decay = float(trainer_cfg.get("weight_decay", 0.0))
    rank = int(lora_cfg.get("rank", 16))
    alpha = float(lora_cfg.get("alpha", 32.0))
    targets = lora_cfg.get("targets") or LORA_TARGETS
    if trainer_cfg.get("warmup_steps", 0):
        raise SystemExit("trainer.warmup_steps > 0 is not mirrored on the TRL side")

    # Prompts: like temper's arithmetic generator, a and b uniform in 0..=9.
    rng = random.Random(args.seed)
    rows = []
    for _ in range(prompts_per_step * args.max_steps):
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        question = [{"role": "user", "content": f"What is {a} + {b}?"}]
        rows.append({"prompt": task["prefix"] + question, "answer": a + b})
    dataset = Dataset.from_list(rows)

    def correct(prompts, completions, answer, **kwargs):
        out = []
        for c, ans in zip(completions, answer):
            text = c[-1]["content"] if isinstance(c, list) else c
            out.append(task["reward"](text, int(ans)))
        return out

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    config = GRPOConfig(
        output_dir=str(workdir / "trl-run"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=args.seed,
        max_steps=args.max_steps,
        num_generations=group,
        per_device_train_batch_size=group * prompts_per_step,  # completions per step
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_completion_length=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=0,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-12,
        weight_decay=weight_decay,
        max_grad_norm=grad_clip,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="none",
        mask_truncated_completions=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=False,
        log_completions=False,
        # TRL defaults to gradient checkpointing; it only costs time on a model this small.
        gradient_checkpointing=False,
    )
    lora = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=list(targets),
        task_type="CAUSAL_LM",
        use_rslora=bool(lora_cfg.get("rslora", False)),
    )

    steps: list[tuple[int, float, float]] = []
    state = {"t0": None}
    target, window = args.target, args.window
    early = not args.no_early_stop and args.heldout_target is None
    # Held-out mode: the adapter after every step, saved with the clock paused.
    save_dir = workdir / "trl-adapters" if args.heldout_target is not None else None
    state["paused"] = 0.0
    adapters: dict[int, Path] = {}

    class Timer(TrainerCallback):
        def on_train_begin(self, a, s, control, **kw):
            state["t0"] = time.perf_counter()
            state["cpu0"] = time.process_time()

        def on_step_end(self, a, s, control, model=None, **kw):
            if save_dir is None or model is None:
                return
            t = time.perf_counter()
            out = save_dir / f"step-{s.global_step:04d}"
            model.save_pretrained(str(out))
            adapters[s.global_step] = out
            state["paused"] += time.perf_counter() - t

        def on_log(self, a, s, control, logs=None, **kw):
            if logs is None or "reward" not in logs or state["t0"] is None:
                return
            elapsed = time.perf_counter() - state["t0"] - state["paused"]
            steps.append((s.global_step, float(logs["reward"]), elapsed))
            if args.verbose:
                print(
                    f"  trl step {s.global_step:3d}  reward {logs['reward']:.3f}  "
                    f"t {elapsed:7.1f}s",
                    flush=True,
                )
            if early and time_to_target(steps, target, window) is not None:
                control.should_training_stop = True

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[correct],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[Timer()],
    )
    trainer.remove_callback(PrinterCallback)  # the per-step log dicts
    load_s = time.perf_counter() - t_load
    print(f"TRL: model + trainer ready in {load_s:.1f}s; training...", flush=True)
    trainer.train()
    cpu_s = time.process_time() - state["cpu0"]
    out = summarise("TRL GRPOTrainer", steps, load_s, args)
    # CPU seconds of the training loop (all threads of this process) per step.
    out["cpu_s_per_step"] = cpu_s / max(1, len(steps))
    out["versions"] = {
        "trl": trl.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
    }
    out["torch_threads"] = torch.get_num_threads()
    out["adapters"] = {str(k): str(v) for k, v in sorted(adapters.items())}
    return out


# ------------------------------------------------------------- held-out eval


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def eval_adapters(args, env_dir: Path, adapters: dict[str, str], rl_cfg: dict,
                  pass_threshold: float, workdir: Path) -> dict[str, float]:
    """Held-out pass@1 of each adapter (NAME -> PEFT dir) on the base model:
    one `temper serve --lora` for all of them, one `temper eval` each, with
    the RL config's [eval] rows and settings (greedy unless it says)."""
    import urllib.request

    ev = rl_cfg.get("eval", {})
    num = int(ev.get("num_examples", 100))
    temperature = float(ev.get("temperature", 0.0))
    max_tokens = int(rl_cfg.get("sampling", {}).get("max_tokens", 24))
    port = free_port()
    cmd = [str(args.temper), "serve", "--model", str(args.model), "--port", str(port)]
    for name, d in adapters.items():
        cmd += ["--lora", f"{name}={d}"]
    log = open(workdir / "eval-serve.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if server.poll() is not None:
                raise SystemExit(f"temper serve exited (log: {workdir / 'eval-serve.log'})")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            raise SystemExit("temper serve did not come up in 5 minutes")
        out = {}
        for name in adapters:
            save = workdir / "evals" / name
            subprocess.run(
                [str(args.temper), "eval", str(env_dir), "-b", base + "/v1", "-m", name,
                 "-n", str(num), "-T", str(temperature), "-t", str(max_tokens),
                 "--pass-threshold", str(pass_threshold), "--seed", "0",
                 "--save-dir", str(save), "--quiet"],
                check=True, stdout=subprocess.DEVNULL,
            )
            meta = sorted(save.rglob("metadata.json"))
            if len(meta) != 1:
                raise SystemExit(f"expected one metadata.json under {save}, found {len(meta)}")
            out[name] = float(json.loads(meta[0].read_text())["pass_at_k"]["1"])
            print(f"  held-out pass@1 of {name}: {out[name]:.3f}", flush=True)
        return out
    finally:
        server.terminate()
        server.wait()
        log.close()


def heldout(t: dict, r: dict | None, rl_cfg: dict, task: dict, args, workdir: Path) -> None:
    """Score the saved adapters on the held-out rows: TRL's (r["heldout_curve"])
    and, with --temper-checkpoints, temper's; and check the evaluator against
    temper's in-run evaluation of its final adapter."""
    inrun = sorted((Path(t["log_dir"]) / "evals").glob("step-*/metadata.json"))[-1]
    inrun_meta = json.loads(inrun.read_text())
    threshold = float(inrun_meta["pass_threshold"])
    env_dir = task["env_dir"]
    adapters = {"temper-final": t["final_adapter"]}
    for k, v in t.get("checkpoint_adapters", {}).items():
        adapters[f"temper-step-{int(k):04d}"] = v
    for k, v in (r["adapters"] if r else {}).items():
        adapters[f"trl-step-{int(k):04d}"] = v
    print(f"evaluating {len(adapters)} adapters on the held-out rows...", flush=True)
    scores = eval_adapters(args, env_dir, adapters, rl_cfg, threshold, workdir)
    t["final_served_pass1"] = scores["temper-final"]
    if abs(scores["temper-final"] - t["final_inrun_pass1"]) > 1e-9:
        raise SystemExit(
            f"the evaluators disagree: temper's final adapter served scores "
            f"{scores['temper-final']:.3f}, its in-run evaluation {t['final_inrun_pass1']:.3f}"
        )
    for c in t["heldout_curve"]:
        if c["heldout"] is None:
            c["heldout"] = scores[f"temper-step-{c['step']:04d}"]
    if r is None:
        return
    logged = {d["step"]: d for d in r["per_step"]}
    r["heldout_curve"] = [
        {"step": k, "heldout": scores[f"trl-step-{k:04d}"], "train_s": logged[k]["elapsed_s"],
         "reward": logged[k]["reward"]}
        for k in sorted(map(int, r["adapters"])) if k in logged
    ]


def heldout_hit(curve: list[dict], target: float):
    return next((c for c in curve if c["heldout"] >= target - 1e-12), None)


def report_heldout(t: dict, r: dict | None, args) -> None:
    print()
    print(f"RL time-to-target on held-out pass@1 (target {args.heldout_target}), "
          f"{args.threads} threads, {args.max_steps} steps each")
    print(f"temper's final adapter: in-run pass@1 {t['final_inrun_pass1']:.3f}, "
          f"served {fmt(t.get('final_served_pass1'), '.3f')} (the same evaluator)")
    print(f"{'step':>4} | {'temper s':>9} {'reward':>6} {'held-out':>8} | "
          f"{'TRL s':>9} {'reward':>6} {'held-out':>8}")
    tc = {c["step"]: c for c in t["heldout_curve"]}
    rc = {c["step"]: c for c in (r["heldout_curve"] if r else [])}
    for step in sorted(set(tc) | set(rc)):
        a, b = tc.get(step), rc.get(step)
        left = f"{a['train_s']:9.1f} {a['reward']:6.3f} {a['heldout']:8.3f}" if a else " " * 25
        right = f"{b['train_s']:9.1f} {b['reward']:6.3f} {b['heldout']:8.3f}" if b else ""
        print(f"{step:4d} | {left} | {right}")
    print(f"s/step: temper {t['s_per_step']:.2f}, TRL {fmt(r['s_per_step'] if r else None, '.2f')}"
          + (f"  (per-step speedup {r['s_per_step'] / t['s_per_step']:.1f}x)" if r else ""))
    targets = [args.heldout_target] + sorted(
        {float(x) for x in args.heldout_also.split(",") if x.strip()} - {args.heldout_target})
    for tgt in targets:
        a = heldout_hit(t["heldout_curve"], tgt)
        b = heldout_hit(r["heldout_curve"], tgt) if r else None
        cell = lambda h, side: (f"{h['train_s']:.1f}s (step {h['step']})" if h else
                                f"not reached in {len(side['heldout_curve'])} steps")
        line = f"held-out pass@1 >= {tgt}: temper {cell(a, t)}"
        if r:
            line += f", TRL {cell(b, r)}"
            if a and b:
                line += f"  -> time-to-target speedup {b['train_s'] / a['train_s']:.1f}x"
            elif a:
                line += (f"  -> speedup > {r['heldout_curve'][-1]['train_s'] / a['train_s']:.1f}x"
                         " (TRL's whole run)")
        print(line)


# ----------------------------------------------------------------------- report


def fmt(x, spec=".1f", none="-"):
    if x is None or (isinstance(x, float) and x != x):
        return none
    return format(x, spec)


def report(t: dict | None, r: dict | None, args) -> None:
    print()
    print(
        f"RL time-to-target: arithmetic (1-digit +), target rolling mean reward "
        f">= {args.target} over {args.window} steps, max {args.max_steps} steps, "
        f"{args.threads} threads"
    )
    cols = [c for c in (t, r) if c]
    w = 18
    print(f"{'':28}" + "".join(f"{c['name']:>{w}}" for c in cols))

    def row(label, key, spec=".2f"):
        print(f"{label:28}" + "".join(f"{fmt(c.get(key), spec):>{w}}" for c in cols))

    row("steps run", "steps_run", "d")
    row("first step (s)", "first_step_s")
    row("s/step (after the first)", "s_per_step")
    row("s/step (all)", "s_per_step_incl_first")
    row("CPU s/step (all threads)", "cpu_s_per_step")
    row("reward at step 1", "first_reward", ".3f")
    row("steps to target", "steps_to_target", "d")
    row("time to target (s)", "time_to_target_s", ".1f")
    row("last rolling reward", "last_rolling", ".3f")
    row("load/start-up (s, excl.)", "load_s", ".1f")
    extra = sorted({float(x) for x in args.also_targets.split(",") if x.strip()} - {args.target})
    if extra:
        print()
        print(f"time to other rolling-reward targets (window {args.window}), s (step):")
        for tgt in extra:
            cells = []
            for c in cols:
                steps = [(d["step"], d["reward"], d["elapsed_s"]) for d in c["per_step"]]
                hit = time_to_target(steps, tgt, args.window)
                cells.append(f"{hit[1]:.1f} ({hit[0]})" if hit else "not reached")
            ratio = ""
            if len(cols) == 2 and all(x != "not reached" for x in cells):
                a = time_to_target([(d["step"], d["reward"], d["elapsed_s"])
                                    for d in cols[0]["per_step"]], tgt, args.window)
                b = time_to_target([(d["step"], d["reward"], d["elapsed_s"])
                                    for d in cols[1]["per_step"]], tgt, args.window)
                ratio = f"   ratio {b[1] / a[1]:.1f}x"
            print(f"  >= {tgt:<23}" + "".join(f"{x:>{w}}" for x in cells) + ratio)
    if t and r:
        print()
        ratio_step = r["s_per_step"] / t["s_per_step"]
        print(f"per-step speedup (TRL s/step / temper s/step):   {ratio_step:.1f}x  (>1: temper faster)")
        ratio_all = r["s_per_step_incl_first"] / t["s_per_step_incl_first"]
        print(f"per-step speedup incl. first step:               {ratio_all:.1f}x")
        if t["reached"] and r["reached"]:
            ratio = r["time_to_target_s"] / t["time_to_target_s"]
            print(f"time-to-target speedup (TRL / temper):          {ratio:.1f}x  (>1: temper faster)")
        elif t["reached"]:
            lower = r["loop_s"] / t["time_to_target_s"]
            print(
                f"time-to-target speedup: TRL did not reach the target in "
                f"{r['steps_run']} steps ({r['loop_s']:.1f}s); speedup > {lower:.1f}x"
            )
        elif r["reached"]:
            print("time-to-target: temper did not reach the target, TRL did")
        else:
            print("time-to-target: neither side reached the target")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--temper", type=Path, default=Path("target/release/temper"))
    p.add_argument("--model", type=Path, help="SFT model dir (HF format)")
    p.add_argument("--rl-config", type=Path, help="temper RL config.toml")
    p.add_argument("--target", type=float, default=0.6)
    p.add_argument("--window", type=int, default=5, help="rolling window in steps")
    p.add_argument("--also-targets", default="0.5,0.55",
                   help="comma-separated extra targets reported from the same runs (no early stop on them)")
    p.add_argument("--from-json", type=Path, default=None,
                   help="re-print the report of an earlier --json-out file without running anything")
    p.add_argument("--heldout-target", type=float, default=None,
                   help="held-out mode: time for the config's held-out pass@1 to reach this")
    p.add_argument("--heldout-also", default="0.5,0.6",
                   help="held-out mode: other pass@1 targets reported from the same runs")
    p.add_argument("--temper-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for temper's runs (repeatable), e.g. "
                        "async.max_off_policy_steps=1")
    p.add_argument("--temper-checkpoints", action="store_true",
                   help="held-out mode: one temper run saving its adapter every step, scored "
                        "by the evaluator TRL's adapters get (for runs that are not "
                        "reproducible, e.g. asynchronous ones)")
    p.add_argument("--max-steps", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-early-stop", action="store_true", help="run max-steps on both sides")
    p.add_argument("--skip-temper", action="store_true")
    p.add_argument("--skip-trl", action="store_true")
    p.add_argument("--workdir", type=Path, default=None, help="default: a temp dir")
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("-v", "--verbose", action="store_true", help="print TRL steps as they go")
    args = p.parse_args()

    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        if saved["temper"] and "heldout_curve" in saved["temper"]:
            report_heldout(saved["temper"], saved["trl"], args)
        else:
            report(saved["temper"], saved["trl"], args)
        return 0
    if args.model is None or args.rl_config is None:
        p.error("--model and --rl-config are required")
    rl_cfg = tomllib.loads(args.rl_config.read_text())
    # Before anything runs: an environment TRL's side cannot mirror fails here.
    task = None if args.skip_trl and args.heldout_target is None else build_task(rl_cfg)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench_rl_trl_"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"workdir: {workdir}")
    print(f"load average before: {os.getloadavg()}", flush=True)

    if args.heldout_target is not None and args.skip_temper:
        p.error("the held-out mode needs temper's runs (its evaluator is checked on them)")
    if args.heldout_target is not None:
        t = run_temper_heldout(args, task, workdir)
    else:
        t = None if args.skip_temper else run_temper(args, workdir)
    if t:
        print(
            f"temper: {t['steps_run']} steps in {t['loop_s']:.1f}s "
            f"(process {t['process_wall_s']:.1f}s)",
            flush=True,
        )
    r = None if args.skip_trl else run_trl(args, rl_cfg, task, workdir)
    if args.heldout_target is not None:
        heldout(t, r, rl_cfg, task, args, workdir)
        report_heldout(t, r, args)
    else:
        report(t, r, args)
    print(f"\nload average after: {os.getloadavg()}")
    if r:
        print("versions:", ", ".join(f"{k} {v}" for k, v in r["versions"].items()),
              f"| temper: {t['version'] if t else '-'} | python {platform.python_version()}")
    if args.json_out:
        args.json_out.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                        "temper": t, "trl": r, "loadavg_after": os.getloadavg()}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
