#!/usr/bin/env python3
"""Reference outputs of transformers' GGUF loader on SmolLM2-135M-Instruct (Q4_1),
for temper-model's real-model golden tests (tests/it/smollm2.rs).

    python scripts/make_smollm2_refs.py PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf

writes fixtures/smollm2/refs.json (small: token ids, rendered chat templates,
greedy continuations, logit slices). Needs torch, transformers >= 5 and gguf
(scripts/requirements-fixtures.txt plus `gguf`). The GGUF itself comes from
scripts/fetch_smollm2.sh and is never committed.
"""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

# Special tokens, non-ASCII text, whitespace runs, digits, code, newlines.
CORPUS = [
    "Hello world",
    " Hello world",
    "The capital of France is Paris.",
    "<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>Once upon a time<|endoftext|>",
    "Numbers: 0 1 12 123 1234 12345 3.14159 2024-11-24 1,000,000",
    "Café, naïve, façade — “quotes” ‘single’ … ünïcödé",
    "日本語のテキストと中文文本，以及한국어.",
    "Emoji: 🤗🚀👍🏽 and symbols ∑∫√∞ ≠ ≤ ≥ €£¥",
    "   leading spaces, trailing spaces   ",
    "tabs\there\t\tand\n\nnewlines\n\n\n  indented\r\nwindows",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(3))",
    "multiple     spaces      between       words",
    "I'm sure you're right, they'll see it's done; we've, I'd",
    "MiXeD CaSe and ALLCAPS and snake_case and camelCase",
    "<|im_start|><|im_end|><repo_name>a<file_sep>b<filename>",
    "",
    " ",
    "\n",
    "a" * 40,
]

CHATS = [
    [{"role": "user", "content": "What is 7 + 5?"}],
    [{"role": "user", "content": "Name the capital of France."}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three primary colors."},
    ],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Translate 'thank you' into French."},
    ],
    [{"role": "user", "content": "What is the square root of 144?"}],
]

MAX_NEW_TOKENS = 24
LOGIT_SLICE = 32


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    gguf = os.path.abspath(sys.argv[1])
    folder, name = os.path.dirname(gguf), os.path.basename(gguf)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()

    corpus = []
    for text in CORPUS:
        ids = tok(text)["input_ids"]
        corpus.append(
            {
                "text": text,
                "ids": ids,
                "decoded": tok.decode(ids, skip_special_tokens=False),
                "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
            }
        )

    chats = []
    for messages in CHATS:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
            completion = out[0, len(prompt) :].tolist()
            logits = model(torch.tensor([prompt])).logits[0]
        last = logits[-1]
        top = torch.topk(last, 5)
        chats.append(
            {
                "messages": messages,
                "rendered": text,
                "prompt_ids": prompt,
                "greedy_ids": completion,
                "greedy_text": tok.decode(completion, skip_special_tokens=True),
                # First LOGIT_SLICE logits at the first and last prompt positions.
                "logits_first": logits[0, :LOGIT_SLICE].tolist(),
                "logits_last": last[:LOGIT_SLICE].tolist(),
                "top5_ids": top.indices.tolist(),
                "top5_logits": top.values.tolist(),
                "max_abs_logit_last": last.abs().max().item(),
            }
        )

    refs = {
        "source": "transformers GGUF loader on " + name,
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "eos_token_id": tok.eos_token_id,
        "vocab_size": len(tok),
        "chat_template": tok.chat_template,
        "config": {
            k: getattr(model.config, k)
            for k in [
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "vocab_size",
                "rms_norm_eps",
                "max_position_embeddings",
                "tie_word_embeddings",
            ]
        },
        "rope_theta": model.config.rope_parameters["rope_theta"],
        "corpus": corpus,
        "chats": chats,
    }
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "smollm2")
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "refs.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(refs, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {path}")
    for c in chats:
        print(repr(c["greedy_text"]))


if __name__ == "__main__":
    main()
