"""tinker-cookbook 0.6.1's recipes, unchanged, against `temper api serve` on SmolLM2.

Run: python tests/python/test_cookbook_recipes.py --temper target/release/temper --gguf SMOLLM2.gguf
Needs tests/python/requirements-cookbook.txt (see .ci/run). Prints one ok/FAIL
line per recipe and `tinker-cookbook: N passed, M failed`; exits non-zero on any
failure.

Each recipe runs as a user runs it, `python -m tinker_cookbook.recipes.X` with
command-line overrides (a few steps, small batches, short generations, and
`base_url` pointing at temper), and its own log (`metrics.jsonl`) is checked.

The only shims are the ones a machine without the Hugging Face Hub needs:

- Datasets: the recipes call `datasets.load_dataset("HuggingFaceH4/no_robots")`
  and the like. `load_dataset` takes a local directory of that name first, so the
  recipes run in a directory holding small datasets of the same names and columns
  (written below; their rows are made up, not the real data).
- Model name: the cookbook picks a renderer from `model_name` through its own
  registry, which knows no SmolLM2. SmolLM2-Instruct speaks ChatML, the format of
  the cookbook's `qwen3_instruct` renderer, so the recipes get
  `model_name=Qwen/Qwen3-4B-Instruct-2507`: a local directory of that name holds
  SmolLM2's tokenizer (`temper export --format hf`), which the cookbook's
  `get_tokenizer` loads for a directory, and temper serves SmolLM2's GGUF under
  that name (`--model NAME=FILE`).
- Packaging: the cookbook declares `tml-renderers>=0.4.1`, which the package index
  here lacks. It imports it only lazily, for the Inkling and Kimi K3.1 tokenizers
  and renderers, none of which these recipes use; so tinker-cookbook is installed
  with `--no-deps` and its other dependencies pinned in the requirements file.
  The first check below asserts tml-renderers is absent, so a recipe that
  imported it would fail here.
"""

import argparse
import json
import math
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request

API_KEY = "tml-cookbook-test-key"
# The cookbook's registry maps this name to the `qwen3_instruct` renderer (ChatML).
MODEL = "Qwen/Qwen3-4B-Instruct-2507"
TEACHER = "teacher"
WORDS = ["after", "before", "between", "during", "however", "into", "many", "only", "over",
         "such", "their", "through", "time", "under", "when", "while"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_dataset(root, name, configs):
    """A local dataset directory `root/name`, loadable by `load_dataset(name[, config])`.

    configs: {config_name or None: {split: [row, ...]}}; its README's YAML
    names each config's files, as a Hub dataset card does.
    """
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    card = ["---", "configs:"]
    for cfg, splits in configs.items():
        cname = cfg or "default"
        card.append(f"- config_name: {cname}")
        card.append("  data_files:")
        for split, rows in splits.items():
            rel = f"{cname}/{split}.jsonl"
            os.makedirs(os.path.join(d, cname), exist_ok=True)
            with open(os.path.join(d, rel), "w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
            card.append(f"  - split: {split}")
            card.append(f"    path: {rel}")
    card.append("---")
    with open(os.path.join(d, "README.md"), "w") as f:
        f.write("\n".join(card) + "\n")


def write_datasets(root):
    rng = random.Random(0)

    def arith(n):
        rows = []
        for _ in range(n):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            # The answer is in the question so that SmolLM2 gets some right and some
            # wrong: a group with mixed rewards is what makes rl_loop train a step.
            rows.append({"question": f"What is {a} plus {b}? Answer: \\boxed{{{a + b}}}",
                         "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"})
        return rows

    def chats(n):
        rows = []
        for i in range(n):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            msgs = [{"role": "user", "content": f"Please add {a} and {b}."},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
            rows.append({"prompt": msgs[0]["content"], "prompt_id": str(i),
                         "messages": msgs, "category": "Math"})
        return rows

    def prefs(n):
        rows = []
        for _ in range(n):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            q = f"\n\nHuman: What is {a} plus {b}?\n\nAssistant:"
            rows.append({"chosen": f"{q} {a} plus {b} is {a + b}.",
                         "rejected": f"{q} I do not know."})
        return rows

    write_dataset(root, "HuggingFaceH4/no_robots", {None: {"train": chats(64), "test": chats(4)}})
    write_dataset(root, "openai/gsm8k", {"main": {"train": arith(64), "test": arith(4)}})
    write_dataset(root, "Anthropic/hh-rlhf", {None: {"train": prefs(64), "test": prefs(4)}})
    write_dataset(root, "allenai/tulu-3-sft-mixture",
                  {None: {"train": [{"id": str(i), "messages": r["messages"], "source": "made-up"}
                                    for i, r in enumerate(chats(64))]}})
    # Wikipedia-like prose with the counting task's words in it.
    lines = []
    for _ in range(400):
        lines.append(" ".join(rng.choice(WORDS + ["the", "city", "river", "was", "built",
                                                  "king", "war", "song", "of", "a"])
                              for _ in range(24)) + " .")
    write_dataset(root, "Salesforce/wikitext",
                  {"wikitext-103-raw-v1": {"train": [{"text": f" {line}\n"} for line in lines]}})


def start_server(binary, gguf, port, ckpt_dir, log_path):
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [binary, "api", "serve", "--model", f"{MODEL}={gguf}", "--host", "127.0.0.1",
         "--port", str(port), "--api-key", API_KEY, "--checkpoints", ckpt_dir],
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + open(log_path).read())
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/api/v1/healthz",
                                         headers={"X-API-Key": API_KEY})
            urllib.request.urlopen(req, timeout=1).read()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not come up")


def write_tokenizer(binary, gguf, work):
    """SmolLM2's tokenizer as a Hugging Face directory named like the model."""
    out = os.path.join(work, "hf-export")
    subprocess.run([binary, "export", gguf, "--format", "hf", "--out", out], check=True,
                   stdout=subprocess.DEVNULL)
    tok = os.path.join(work, MODEL)
    os.makedirs(tok)
    for name in os.listdir(out):
        if name.startswith("tokenizer") or name in ("chat_template.jinja", "config.json",
                                                     "generation_config.json"):
            shutil.copy(os.path.join(out, name), tok)
    shutil.rmtree(out)  # the merged weights: temper serves the GGUF itself


class Recipe:
    """One `python -m tinker_cookbook.recipes.MODULE ARGS...` run, started in the background."""

    def __init__(self, name, module, args, python, work, env, runs):
        self.name, self.log_path = name, os.path.join(runs, name)
        self.out_path = os.path.join(runs, f"{name}.out")
        cmd = [python, "-m", f"tinker_cookbook.recipes.{module}", *args,
               f"log_path={self.log_path}"]
        self.t0 = time.time()
        self.out = open(self.out_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=self.out,
                                     stderr=subprocess.STDOUT)

    def wait(self, timeout):
        if self.proc.returncode is not None and self.out.closed:
            return self.rc
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.out.close()
        self.secs = time.time() - self.t0
        self.rc = rc
        return rc

    def output(self):
        with open(self.out_path) as f:
            return f.read()

    def metrics(self):
        """The recipe's own log: one dict per logged step (the final summary row dropped)."""
        rows = []
        with open(os.path.join(self.log_path, "metrics.jsonl")) as f:
            for line in f:
                row = json.loads(line)
                if len(row) > 1:
                    rows.append(row)
        return rows


def finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


def column(rows, key):
    vals = [r[key] for r in rows if key in r]
    assert vals and all(finite(v) for v in vals), f"{key}: {vals}"
    return vals


def check_kl_zero(rows):
    """The cookbook's own sampler-vs-trainer check: exactly 0 on temper."""
    v1, v2 = column(rows, "optim/kl_sample_train_v1"), column(rows, "optim/kl_sample_train_v2")
    assert all(v == 0.0 for v in v1 + v2), f"kl_sample_train_v1 {v1}, v2 {v2}"
    return f"kl_sample_train_v1 {v1}, kl_sample_train_v2 {v2}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", required=True)
    ap.add_argument("--gguf", required=True, help="SmolLM2-135M-Instruct's GGUF")
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter with tinker-cookbook installed")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per recipe")
    args = ap.parse_args()
    binary = os.path.abspath(args.temper)
    gguf = os.path.abspath(args.gguf)
    work = tempfile.mkdtemp(prefix="temper-cookbook-")
    runs = os.path.join(work, "runs")
    os.makedirs(runs)
    t_start = time.time()
    write_datasets(work)
    write_tokenizer(binary, gguf, work)
    port = free_port()
    server = start_server(binary, gguf, port, os.path.join(work, "checkpoints"),
                          os.path.join(work, "server.log"))
    base_url = f"http://127.0.0.1:{port}"
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": os.path.join(work, "hf-home"),
        "TINKER_API_KEY": API_KEY, "TINKER_TELEMETRY": "0",
        "TINKER_COOKBOOK_RUNS_DIR": runs,
        "PYTHONUNBUFFERED": "1",
    })
    common = [f"base_url={base_url}", f"model_name={MODEL}"]
    # rl_basic and sl_basic fix their dataset builder's batch sizes in the recipe;
    # chz takes new ones only with the builder named again.
    math_builder = ["dataset_builder=tinker_cookbook.recipes.math_rl.math_env:Gsm8kDatasetBuilder",
                    "dataset_builder.batch_size=1", "dataset_builder.group_size=4",
                    f"dataset_builder.model_name_for_tokenizer={MODEL}",
                    "dataset_builder.renderer_name=qwen3_instruct"]
    chat_builder = ["dataset_builder=tinker_cookbook.recipes.chat_sl.chat_datasets:NoRobotsBuilder",
                    "dataset_builder.common_config.batch_size=8",
                    "dataset_builder.common_config.max_length=256",
                    f"dataset_builder.common_config.model_name_for_tokenizer={MODEL}",
                    "dataset_builder.common_config.renderer_name=qwen3_instruct"]
    specs = {
        "sl_loop": ("sl_loop", common + ["batch_size=8", "max_steps=3", "lora_rank=8",
                                         "save_every=0"]),
        "sl_basic": ("sl_basic", common + chat_builder + ["max_steps=3", "lora_rank=8",
                                                          "eval_every=0", "save_every=0"]),
        "rl_loop (default: stable_reinforce)": (
            "rl_loop", common + ["batch_size=2", "group_size=4", "max_tokens=16", "max_steps=1",
                                 "lora_rank=8", "save_every=0"]),
        "rl_loop loss_fn=gspo": (
            "rl_loop", common + ["loss_fn=gspo", "batch_size=2", "group_size=12",
                                 "max_tokens=24", "max_steps=3", "lora_rank=8",
                                 "save_every=0"]),
        "rl_basic": ("rl_basic", common + math_builder + ["max_tokens=24", "max_steps=2",
                                                          "lora_rank=8", "save_every=0"]),
        "preference.dpo.train (hhh)": (
            "preference.dpo.train", common + ["dataset=hhh", "batch_size=4", "max_length=256",
                                              "max_steps=2",
                                              "behavior_if_log_dir_exists=delete"]),
        "rl_numerics_check.train": (
            "rl_numerics_check.train",
            common + ["lora_rank=8", "group_size=2", "groups_per_batch=1", "max_tokens=24",
                      "max_trajectory_tokens=4096", "task.num_pages_min=1",
                      "task.num_pages_max=2", "task.page_chars=400", "max_steps=2",
                      "save_every=0", "behavior_if_log_dir_exists=delete"]),
    }
    results = []

    def report(name, ok, detail):
        results.append(ok)
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)

    running = {}
    try:
        probe = subprocess.run(
            [args.python, "-c", "import importlib.util as u; import tinker_cookbook; "
             "print(u.find_spec('tml_renderers') is None, tinker_cookbook.__version__)"],
            capture_output=True, text=True)
        absent = probe.stdout.split()[:1] == ["True"]
        report("tml-renderers is not installed (nothing below imports it)", absent,
               f"tinker-cookbook {probe.stdout.split()[-1:]}, find_spec('tml_renderers') is None: "
               f"{absent}{probe.stderr[-500:]}")
        for i, (name, (module, rargs)) in enumerate(specs.items()):
            running[name] = Recipe(f"r{i}", module, rargs, args.python, work, env, runs)
        # The distillation's teacher is sl_loop's fine-tuned SmolLM2, so it waits for it.
        order = list(running)
        sl_loop = running["sl_loop"]
        sl_loop.wait(args.timeout)
        distill_name = "distillation.on_policy_distillation (tulu3)"
        teacher = None
        if sl_loop.rc == 0:
            with open(os.path.join(sl_loop.log_path, "checkpoints.jsonl")) as f:
                teacher = json.loads(f.readlines()[-1])["sampler_path"]
            running[distill_name] = Recipe(
                "r_distill", "distillation.on_policy_distillation",
                common + [f"teacher_model={MODEL}", f"teacher_checkpoint={teacher}",
                          "dataset=tulu3", "group_size=2", "groups_per_batch=1",
                          "max_tokens=16", "lora_rank=8", "max_steps=2", "eval_every=0",
                          "save_every=0", "behavior_if_log_dir_exists=delete"],
                args.python, work, env, runs)
            order.append(distill_name)
        else:
            report(distill_name, False, "not run: sl_loop (its teacher) failed")
        for name in order:
            r = running[name]
            r.wait(args.timeout)
            try:
                detail = CHECKS[name](r)
                report(name, True, f"{detail} (done by {r.secs:.0f}s)")
            except Exception as e:
                report(name, False, f"{e!r} (exit {r.rc}, done by {r.secs:.0f}s)")
                traceback.print_exc()
                print("     last output:\n" + "\n".join(
                    "     | " + line for line in r.output().splitlines()[-25:]))
    finally:
        for r in running.values():
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
        server.terminate()
        server.wait()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print("work directory:", work)
    passed = sum(results)
    print(f"total {time.time() - t_start:.0f}s")
    print(f"tinker-cookbook: {passed} passed, {len(results) - passed} failed")
    sys.exit(0 if passed == len(results) else 1)


def completed(r):
    assert r.rc == 0, f"exit {r.rc}"
    return r.metrics()


def check_sl(r):
    rows = completed(r)
    nll = column(rows, "train_mean_nll")
    assert len(nll) == 3 and nll[-1] < nll[0], f"train_mean_nll {nll}"
    return "train_mean_nll " + " -> ".join(f"{x:.4f}" for x in nll)


def check_rl_loop_default(r):
    out = r.output()
    assert r.rc != 0, "stable_reinforce ran, but temper does not implement it"
    want = ("Error code: 400", "record_stability_info is not supported",
            "does not implement stable_reinforce (Tinker has not published its objective)")
    for w in want:
        assert w in out, f"no {w!r} in its output"
    line = next(x for x in out.splitlines() if "Error code: 400" in x)
    return "refused: " + line.split("BadRequestError: ", 1)[-1]


def check_rl_loop_gspo(r):
    rows = completed(r)
    reward = column(rows, "reward/total")
    assert len(reward) == 3, reward
    trained = [row["step"] for row in rows if "grad_norm:mean" in row]
    # A step whose groups all got one reward has nothing to learn and is skipped
    # by the recipe. SmolLM2 copies the question's \boxed{} answer about 1 time in 12
    # (seen: 4 of 48), so a group of 12 is all wrong about 1 time in 3, and all six
    # groups about 1 run in 700.
    assert trained, f"no step trained (rewards {reward}: every group constant)"
    return f"reward/total {reward}, gspo steps trained {trained}"


def check_rl(r):
    rows = completed(r)
    reward = column(rows, "env/all/reward/total")
    assert len(reward) == 2, reward
    return f"{check_kl_zero(rows)}, env/all/reward/total {reward}"


def check_dpo(r):
    rows = completed(r)
    loss = column(rows, "dpo_loss")
    # Step 0: the policy is the reference, so the loss is exactly -log sigmoid(0).
    assert len(loss) == 2 and abs(loss[0] - math.log(2)) < 1e-4 and loss[1] < loss[0], loss
    acc = column(rows, "accuracy")
    return "dpo_loss " + " -> ".join(f"{x:.4f}" for x in loss) + f", accuracy {acc}"


def check_distill(r):
    rows = completed(r)
    kl = column(rows, "teacher_kl")
    # The teacher is sl_loop's fine-tuned model: the student starts away from it.
    assert len(kl) == 2 and kl[0] != 0.0, f"teacher_kl {kl}"
    return f"{check_kl_zero(rows)}, teacher_kl {kl}"


CHECKS = {
    "sl_loop": check_sl,
    "sl_basic": check_sl,
    "rl_loop (default: stable_reinforce)": check_rl_loop_default,
    "rl_loop loss_fn=gspo": check_rl_loop_gspo,
    "rl_basic": check_rl,
    "preference.dpo.train (hhh)": check_dpo,
    "rl_numerics_check.train": check_rl,
    "distillation.on_policy_distillation (tulu3)": check_distill,
}


if __name__ == "__main__":
    main()
