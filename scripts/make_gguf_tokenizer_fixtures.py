#!/usr/bin/env python3
"""Small tokenizer-only GGUF files and transformers' encodings of them, for
temper-model's GGUF tokenizer tests (tests/it/gguf_tokenizers.rs).

    python scripts/make_gguf_tokenizer_fixtures.py

writes fixtures/gguf-tokenizers/{NAME}.gguf and refs.json:
- sp-llama: a SentencePiece BPE vocabulary (trained here with `sentencepiece`
  on a fixed text, byte fallback, a user-defined token), tokenizer.ggml.model
  = "llama", no merges (transformers derives them from the scores), BOS added;
- bpe-llama3 / bpe-qwen2 / bpe-smollm: the byte-level BPE vocabularies of the
  tiny fixture models under tokenizer.ggml.pre = llama-bpe / qwen2 / smollm.
Deterministic; needs transformers, gguf, sentencepiece.
"""

import io
import json
import os

import gguf
import sentencepiece as spm
from transformers import AutoTokenizer

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OUT = os.path.join(ROOT, "fixtures", "gguf-tokenizers")

CORPUS = [
    "Hello world",
    " Hello world",
    "  two  spaces and a\ttab\n\nnew lines\n",
    "Café naïve façade — “quotes” … ünïcödé",
    "日本語 中文 한국어 🤗🚀",
    "numbers 0 12 345 6789 3.14159",
    "I'm sure you're right, they'll see",
    "<s>special</s> and <|user|> inside text",
    "",
    " ",
    "trailing   ",
]

TRAIN_TEXT = """The quick brown fox jumps over the lazy dog. Hello world! This is a
small corpus used to train a tiny SentencePiece BPE vocabulary for tests.
Numbers like 12, 345 and 6789 appear, and so do words: model, token, train,
sample, reward, learn, evaluate, serve, export, import, format, quantise.
""" * 20


def sp_vocab():
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN_TEXT.splitlines()),
        model_writer=buf,
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        user_defined_symbols=["<|user|>"],
        character_coverage=1.0,
        num_threads=1,
        seed_sentencepiece_size=1000,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    tokens, scores, types = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        if sp.is_unknown(i):
            types.append(2)
        elif sp.is_control(i):
            types.append(3)
        elif sp.is_byte(i):
            types.append(6)
        elif sp.is_unused(i):
            types.append(5)
        elif tokens[-1] == "<|user|>":
            types.append(4)
        else:
            types.append(1)
    return tokens, scores, types


def write(name, arch, fields):
    path = os.path.join(OUT, f"{name}.gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    for key, (kind, value) in fields.items():
        if kind == "str":
            w.add_string(key, value)
        elif kind == "bool":
            w.add_bool(key, value)
        elif kind == "u32":
            w.add_uint32(key, value)
        elif kind == "arr":
            w.add_array(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def byte_level(model_dir, pre):
    tj = json.load(open(os.path.join(ROOT, "fixtures", "models", model_dir, "tokenizer.json")))
    size = len(tj["model"]["vocab"]) + len(tj["added_tokens"])
    tokens = [None] * size
    types = [1] * size
    for t, i in tj["model"]["vocab"].items():
        tokens[i] = t
    for a in tj["added_tokens"]:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = 3 if a["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return {
        "tokenizer.ggml.model": ("str", "gpt2"),
        "tokenizer.ggml.pre": ("str", pre),
        "tokenizer.ggml.tokens": ("arr", tokens),
        "tokenizer.ggml.token_type": ("arr", types),
        "tokenizer.ggml.merges": ("arr", merges),
        "tokenizer.ggml.bos_token_id": ("u32", next(a["id"] for a in tj["added_tokens"])),
        "tokenizer.ggml.eos_token_id": ("u32", tj["added_tokens"][-1]["id"]),
        "tokenizer.ggml.add_bos_token": ("bool", pre == "llama-bpe"),
    }


def main():
    os.makedirs(OUT, exist_ok=True)
    tokens, scores, types = sp_vocab()
    specs = {
        "sp-llama": (
            "llama",
            {
                "tokenizer.ggml.model": ("str", "llama"),
                "tokenizer.ggml.tokens": ("arr", tokens),
                "tokenizer.ggml.scores": ("arr", scores),
                "tokenizer.ggml.token_type": ("arr", types),
                "tokenizer.ggml.bos_token_id": ("u32", tokens.index("<s>")),
                "tokenizer.ggml.eos_token_id": ("u32", tokens.index("</s>")),
                "tokenizer.ggml.unknown_token_id": ("u32", tokens.index("<unk>")),
            },
        ),
        "bpe-llama3": ("llama", byte_level("tiny-llama", "llama-bpe")),
        "bpe-qwen2": ("qwen2", byte_level("tiny-qwen2", "qwen2")),
        "bpe-smollm": ("llama", byte_level("tiny-qwen3", "smollm")),
    }
    refs = {}
    for name, (arch, fields) in specs.items():
        path = write(name, arch, fields)
        tok = AutoTokenizer.from_pretrained(OUT, gguf_file=os.path.basename(path))
        cases = []
        for text in CORPUS:
            ids = tok(text)["input_ids"]
            cases.append(
                {
                    "text": text,
                    "ids": ids,
                    "decoded": tok.decode(ids, skip_special_tokens=False),
                    "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
                }
            )
        refs[name] = cases
        print(name, os.path.getsize(path), "bytes;", cases[0]["ids"], cases[7]["ids"])
    with open(os.path.join(OUT, "refs.json"), "w", encoding="utf-8") as f:
        json.dump(refs, f, ensure_ascii=False, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
