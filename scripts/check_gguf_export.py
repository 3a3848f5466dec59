#!/usr/bin/env python3
"""Check that a GGUF written by `temper export --format gguf` loads in
transformers' GGUF loader and computes the logits of a reference model.

    python scripts/check_gguf_export.py --gguf OUT.gguf --ref MODEL [--adapter PEFT_DIR] [--tol 1e-4]

MODEL is a Hugging Face directory or a GGUF file (loaded by transformers too);
with --adapter the PEFT adapter is applied to it (what the export merged).
Compares logits (max abs diff / max abs logit <= --tol) and token ids of a few
prompts; exits non-zero on a mismatch. Needs torch, transformers, gguf, peft
(scripts/requirements-fixtures.txt plus `gguf`).
"""

import argparse
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROMPTS = [
    "The capital of France is",
    "Café naïve 日本語 🤗 and   spaces\n\nnewlines",
    "<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\n",
]


def load(path):
    kw = {}
    if os.path.isfile(path):
        kw["gguf_file"] = os.path.basename(path)
        path = os.path.dirname(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(path, **kw)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    return tok, model.eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--ref", required=True)
    ap.add_argument("--adapter")
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    tok_g, model_g = load(args.gguf)
    tok_r, model_r = load(args.ref)
    if args.adapter:
        from peft import PeftModel

        model_r = PeftModel.from_pretrained(model_r, args.adapter).eval()
    worst = 0.0
    for text in PROMPTS:
        ids_g = tok_g(text)["input_ids"]
        ids_r = tok_r(text)["input_ids"]
        if ids_g != ids_r:
            sys.exit(f"token ids differ for {text!r}: {ids_g} vs {ids_r}")
        with torch.no_grad():
            lg = model_g(torch.tensor([ids_g])).logits[0]
            lr = model_r(torch.tensor([ids_r])).logits[0]
        err = ((lg - lr).abs().max() / lr.abs().max()).item()
        worst = max(worst, err)
        print(f"{text[:30]!r}: {len(ids_g)} tokens, logits relative error {err:.2e}")
    print(f"transformers loads {os.path.basename(args.gguf)}: worst relative error {worst:.2e} (tol {args.tol:g})")
    if worst > args.tol:
        sys.exit(1)


if __name__ == "__main__":
    main()
