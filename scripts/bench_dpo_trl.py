#!/usr/bin/env python3
"""DPO steps/s: ``temper train dpo`` vs Hugging Face TRL's DPOTrainer, in one run.

Both sides train the same model directory (SmolLM2-135M-Instruct exported to
Hugging Face format from its GGUF, so both load the same f32 weights), on the
same pairs (examples/smollm2-dpo/prefs.jsonl, TRL's conversational format:
both tokenize them identically, see crates/temper-rl/tests/dpo_golden.rs),
with the same batch and optimiser, on the CPU with the same number of threads:

* LoRA r=8, alpha=16 on q,k,v,o,gate,up,down (no dropout); sigmoid loss,
  beta 0.1; 8 pairs per optimiser step; AdamW, constant lr 5e-4, grad-norm
  clip 1.0;
* the reference logprobs computed once before training on both sides
  (temper always does this for a file; TRL: ``precompute_ref_log_probs``),
  so a step is the policy's forward and backward on 8 pairs (16 sequences);
* TRL without gradient checkpointing (faster here), no padding-free.

Seconds per step are timed inside each loop (temper: ``time/step`` of
``metrics.jsonl``; TRL: a callback around each optimiser step); the first
``--warmup`` steps of each side are left out. temper runs first (a
subprocess), then TRL in this process.

Setup::

    python -m venv .venv-trl && .venv-trl/bin/pip install -r scripts/requirements-dpo.txt
    cargo build --release -p temper
    GGUF=$(scripts/fetch_smollm2.sh)
    target/release/temper export "$GGUF" --format hf --out /tmp/smollm2-hf
    .venv-trl/bin/python scripts/bench_dpo_trl.py --temper target/release/temper \\
        --model /tmp/smollm2-hf --threads 2 --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "smollm2-dpo" / "prefs.jsonl"
CONFIG = ROOT / "examples" / "smollm2-dpo" / "dpo.toml"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BATCH, LR, BETA, RANK, ALPHA = 8, 5e-4, 0.1, 8, 16


def run_temper(args, work: Path) -> list[float]:
    run_dir = work / "temper-run"
    cmd = [
        str(args.temper), "--threads", str(args.threads), "train", "dpo", str(CONFIG),
        "--model.path", str(args.model), "--data.path", str(DATA), "--data.eval_fraction", "0",
        "--trainer.batch_size", str(BATCH), "--trainer.lr", str(LR), "--dpo.beta", str(BETA),
        "--trainer.max_steps", str(args.steps), "--eval.num_examples", "0",
        "--log.dir", str(run_dir), "--log.progress", "false",
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r["time/step"] for r in rows if "time/step" in r]


def run_trl(args, work: Path) -> list[float]:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(args.threads)
    rows = [json.loads(l) for l in DATA.read_text().splitlines() if l.strip()]
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, a, s, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, s, control, **kw):
            times.append(time.perf_counter() - self.t0)

    cfg = DPOConfig(
        output_dir=str(work / "trl-run"),
        beta=BETA,
        loss_type=["sigmoid"],
        per_device_train_batch_size=BATCH,
        max_steps=args.steps,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_length=512,
        precompute_ref_log_probs=True,
        gradient_checkpointing=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    peft = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    trainer = DPOTrainer(
        model=model, args=cfg, train_dataset=Dataset.from_list(rows), processing_class=tok,
        peft_config=peft, callbacks=[Timer()],
    )
    trainer.train()
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--temper", type=Path, default=ROOT / "target" / "release" / "temper")
    p.add_argument("--model", type=Path, required=True, help="Hugging Face model directory (SmolLM2 exported)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1, help="first steps of each side left out")
    args = p.parse_args()
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        t = run_temper(args, work)[args.warmup:]
        r = run_trl(args, work)[args.warmup:]
    ts, rs = sum(t) / len(t), sum(r) / len(r)
    print(f"DPO on {args.model.name}, {BATCH} pairs/step, LoRA r{RANK}, {args.threads} threads, "
          f"{len(t)} timed steps each (after {args.warmup} warm-up)")
    print(f"  temper: {ts:.2f} s/step = {1 / ts:.3f} steps/s")
    print(f"  TRL:    {rs:.2f} s/step = {1 / rs:.3f} steps/s")
    print(f"  ratio (temper steps/s over TRL's): {rs / ts:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
