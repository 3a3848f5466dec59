#!/usr/bin/env python3
"""Regenerate fixtures/golden/dpo.json: TRL's DPOTrainer on the tiny Qwen2
fixture (fixtures/models/tiny-qwen2 with the PEFT adapter
fixtures/adapters/tiny-qwen2-lora), for crates/temper-rl/tests/dpo_golden.rs.

Per case (a preference set in one of TRL's formats, a loss type, beta) it
records the tokens TRL trains on, the first step's loss, metrics and the
gradient of every LoRA tensor, and the second step's loss and metrics after
one AdamW step (torch's AdamW: betas 0.9/0.999, eps 1e-8, constant lr,
gradient-norm clip 1). The whole set is one batch, so TRL's shuffling does
not change the mean.

Run from the repository root:

    python -m venv .venv-trl && .venv-trl/bin/pip install -r scripts/requirements-dpo.txt
    .venv-trl/bin/python scripts/make_dpo_goldens.py

(scripts/requirements-dpo.txt pins torch, transformers, trl and peft; the
Rust test needs none of them.)
"""

import json
import tempfile
from pathlib import Path

import peft
import torch
import transformers
import trl
from datasets import Dataset
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "fixtures" / "models" / "tiny-qwen2"
ADAPTER = ROOT / "fixtures" / "adapters" / "tiny-qwen2-lora"
OUT = ROOT / "fixtures" / "golden" / "dpo.json"
LR = 1e-3

TEXT = [
    {"prompt": "The sky is", "chosen": " blue today.", "rejected": " made of cheese."},
    {"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5, roughly"},
    {"prompt": "Write a greeting:", "chosen": " Hello there!", "rejected": " Go away."},
    {"prompt": "Cats are", "chosen": " small mammals.", "rejected": " birds"},
]
CONVERSATIONAL = [
    {
        "prompt": [{"role": "user", "content": "What colour is the sky?"}],
        "chosen": [{"role": "assistant", "content": "Blue."}],
        "rejected": [{"role": "assistant", "content": "Green, with purple spots."}],
    },
    {
        "prompt": [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "7 * 6?"},
        ],
        "chosen": [{"role": "assistant", "content": "42"}],
        "rejected": [{"role": "assistant", "content": "I don't know"}],
    },
    {
        "prompt": [{"role": "user", "content": "Say hi"}],
        "chosen": [{"role": "assistant", "content": "Hi!"}],
        "rejected": [{"role": "assistant", "content": "No."}],
    },
]
# (name, rows, loss, beta, keep gradients): gradients of two cases keep the
# file small; the others are compared on their losses and metrics.
CASES = [
    ("sigmoid_text", TEXT, "sigmoid", 0.1, True),
    ("sigmoid_conversational", CONVERSATIONAL, "sigmoid", 0.5, False),
    ("ipo_conversational", CONVERSATIONAL, "ipo", 0.5, True),
    ("ipo_text", TEXT, "ipo", 0.1, False),
]
METRICS = [
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
]


def peft_name(name: str) -> str:
    """PEFT's saved key of a parameter (the adapter name dropped)."""
    return name.replace(".default.", ".")


def run_case(name, rows, loss_type, beta, keep_grads):
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, ADAPTER, is_trainable=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = DPOConfig(
            output_dir=tmp,
            beta=beta,
            loss_type=[loss_type],
            per_device_train_batch_size=len(rows),
            max_steps=2,
            learning_rate=LR,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.0,
            max_grad_norm=1.0,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_epsilon=1e-8,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            bf16=False,
            seed=0,
            dataloader_drop_last=False,
        )
        trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok)
        tokens = [
            {"prompt": r["prompt_ids"], "chosen": r["chosen_ids"], "rejected": r["rejected_ids"]}
            for r in trainer.train_dataset
        ]
        # Step 1 by hand (the same batch the trainer's first step sees, in
        # some order): loss, metrics, gradients.
        batch = next(iter(trainer.get_train_dataloader()))
        model.train()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        grads = {
            peft_name(n): [float(f"{x:.7g}") for x in p.grad.detach().flatten().tolist()]
            for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None
        }
        step1 = {"loss": loss.item()}
        step1.update({k: trainer._metrics["train"][k][-1] for k in METRICS})
        model.zero_grad()
        trainer._metrics["train"].clear()
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert len(logs) == 2, logs
        assert abs(logs[0]["loss"] - step1["loss"]) < 1e-5, (logs[0], step1)
        step2 = {"loss": logs[1]["loss"]}
        step2.update({k: logs[1][k] for k in METRICS})
    return {
        "name": name,
        "rows": rows,
        "loss_type": loss_type,
        "beta": beta,
        "tokens": tokens,
        "step1": step1,
        "grads": grads if keep_grads else {},
        "step2": step2,
    }


def main():
    out = {
        "generator": "scripts/make_dpo_goldens.py",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
            "peft": peft.__version__,
        },
        "model": "fixtures/models/tiny-qwen2",
        "adapter": "fixtures/adapters/tiny-qwen2-lora",
        "optimizer": {"lr": LR, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "grad_clip": 1.0, "weight_decay": 0.0},
        "cases": [run_case(*c) for c in CASES],
    }
    OUT.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
