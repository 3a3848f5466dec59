#!/usr/bin/env python3
"""The laptop case: QLoRA training and sampling on a quantized GGUF of a real-sized model.

Run from the repository root after ``cargo build --release -p temper``:

    python scripts/bench_laptop.py [--shape qwen3-0.6b|qwen2.5-1.5b] [--quant q4_k_m|q8_0]
                                   [--threads N] [--iters K] [--json-out FILE]

(any Python with torch, transformers and peft; ``scripts/requirements-fixtures.txt`` pins them).

1. Writes a randomly initialised model of the chosen shape with transformers from a config
   written here (no download; Qwen3-0.6B's shape by default: hidden 1024, 28 layers, 16 heads,
   8 KV heads, head_dim 128, intermediate 3072, vocab 151936, tied embeddings) as a Hugging
   Face directory in bf16 (as the real checkpoints ship), with the tiny Qwen3 fixture's
   byte-level BPE tokenizer (the embedding is padded past the tokenizer's vocabulary, as in
   the real Qwen checkpoints; a benchmark needs token ids, not words).
2. Converts it with temper's own export (``temper export DIR --format gguf --quant Q``).
   Both are cached under ``~/.cache/temper/laptop/`` (``--cache``): a rerun skips them.
3. Runs ``scripts/bench_torch.py`` on them: temper on the GGUF kept quantized
   (``temper --dtype gguf bench model --model FILE.gguf``: LoRA r=16 forward+backward on the
   frozen quantized base, i.e. QLoRA, and sampling through the adapter), then torch+PEFT with
   the directory loaded in bf16 (``--peer-dtype bf16``: the same LoRA forward+backward and
   ``generate`` through the adapter), in a fresh process so its memory is its own.
4. Prints one table: tokens/s of each with the ratio temper / torch, each side's peak resident
   memory per phase (Linux ``VmHWM``, model included) and the file sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import bench_torch  # noqa: E402  (the shared benchmark machinery: table, rows, ratios)

# The real models' config.json values (Qwen/Qwen3-0.6B, Qwen/Qwen2.5-1.5B), minus their weights.
SHAPES = {
    "qwen3-0.6b": {
        "model_type": "qwen3",
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "intermediate_size": 8960,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
    },
}
QUANTS = ("q4_k_m", "q8_0")
TOKENIZER_FIXTURE = ROOT / "fixtures" / "models" / "tiny-qwen3"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# Bump when what step 1 writes changes, so cached directories are rebuilt.
BUILD_VERSION = 1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--quant", choices=QUANTS, default="q4_k_m", help="GGUF tensor type (temper export --quant)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "temper" / "laptop")
    p.add_argument(
        "--temper", type=Path, default=ROOT / "target" / "release" / "temper", help="default: target/release/temper"
    )
    p.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for both sides (default: all)"
    )
    p.add_argument("--iters", type=int, default=3, help="timed training steps per side (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed torch training steps (temper runs one; default 1)")
    p.add_argument("--sample-runs", type=int, default=1, help="timed torch generate() calls after a warm-up (default 1)")
    p.add_argument("--batch", type=int, default=8, help="sequences per training step (default 8)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training sequence (default 128)")
    p.add_argument("--sample-seqs", type=int, default=8, help="sequences sampled at once (default 8)")
    p.add_argument("--new-tokens", type=int, default=128, help="new tokens per sampled sequence (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--json-out", type=Path, help="also write all numbers to this JSON file")
    return p.parse_args()


# ----------------------------------------------------------------------------- the model


def token_ids(tokenizer_json: Path) -> dict[str, int]:
    """Ids of the ChatML end-of-turn and end-of-text tokens in the fixture tokenizer."""
    added = json.loads(tokenizer_json.read_text())["added_tokens"]
    ids = {a["content"]: a["id"] for a in added}
    return {"eos": ids["<|im_end|>"], "pad": ids["<|endoftext|>"]}


def write_model(shape: str, seed: int, out: Path) -> None:
    """A random model of `shape` as a Hugging Face directory (bf16 safetensors + tokenizer)."""
    import torch
    import transformers

    spec = dict(SHAPES[shape])
    model_type = spec.pop("model_type")
    theta = spec.pop("rope_theta")
    ids = token_ids(TOKENIZER_FIXTURE / "tokenizer.json")
    cfg = transformers.AutoConfig.for_model(
        model_type,
        **spec,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        bos_token_id=None,
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        use_sliding_window=False,
    )
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = [ids["eos"], ids["pad"]]
    model.generation_config.pad_token_id = ids["pad"]
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_FIXTURE / name, out / name)
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {out}: {n / 1e6:.0f}M parameters in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def ensure_model(args: argparse.Namespace) -> Path:
    """The cached directory, written first if absent or stale."""
    out = args.cache / args.shape
    stamp = {"shape": SHAPES[args.shape], "seed": args.seed, "version": BUILD_VERSION}
    done = out / ".bench_laptop.json"
    if done.is_file() and json.loads(done.read_text()) == stamp:
        print(f"using cached {out}", file=sys.stderr)
        return out
    args.cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{args.shape}-", dir=args.cache))
    try:
        write_model(args.shape, args.seed, tmp)
        (tmp / done.name).write_text(json.dumps(stamp))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    # A stale GGUF came from the old directory.
    for g in args.cache.glob(f"{args.shape}.*.gguf"):
        g.unlink()
    return out


def ensure_gguf(args: argparse.Namespace, model_dir: Path) -> Path:
    """The cached GGUF, exported by temper first if absent."""
    out = args.cache / f"{args.shape}.{args.quant.upper()}.gguf"
    if out.is_file():
        print(f"using cached {out}", file=sys.stderr)
        return out
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    cmd = [str(args.temper), "export", str(model_dir), "--format", "gguf", "--quant", args.quant, "--out", str(tmp)]
    print("running:", " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        subprocess.run(cmd, check=True)
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"exported {out} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


# ----------------------------------------------------------------------------- the benchmark


def main() -> int:
    args = parse_args()
    if not args.temper.is_file():
        print(f"error: temper binary not found at {args.temper}; `cargo build --release -p temper`", file=sys.stderr)
        return 1
    model_dir = ensure_model(args)
    gguf = ensure_gguf(args, model_dir)

    # bench_torch in a child process: torch's peak memory is then that of a process that only
    # loaded the bf16 model (this one held the f32 model it wrote).
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        cmd = [
            sys.executable, str(ROOT / "scripts" / "bench_torch.py"),
            "--model", str(model_dir), "--temper-model", str(gguf), "--dtype", "gguf", "--peer-dtype", "bf16",
            "--temper", str(args.temper), "--threads", str(args.threads), "--iters", str(args.iters),
            "--warmup", str(args.warmup), "--sample-runs", str(args.sample_runs),
            "--batch", str(args.batch), "--seq-len", str(args.seq_len),
            "--sample-seqs", str(args.sample_seqs), "--new-tokens", str(args.new_tokens),
            "--seed", str(args.seed), "--json-out", str(report_path),
        ]
        # Its own table is printed below with the sizes added; its stderr (progress) passes through.
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        if not report_path.is_file():
            sys.stdout.write(proc.stdout)
            print(f"error: bench_torch.py exited with status {proc.returncode} and no report", file=sys.stderr)
            return 1
        report = json.loads(report_path.read_text())

    temper, peer, ratios = report["temper"], report["torch"], report["ratio_temper_over_torch"]
    gguf_mb = gguf.stat().st_size / 1e6
    hf_mb = dir_size(model_dir) / 1e6
    cfg = report["config"]
    print(
        f"laptop case: {args.shape} shape, random weights; temper `--dtype gguf` on {gguf.name} "
        f"({gguf_mb:.0f} MB) vs torch {peer['versions']['torch']} + PEFT {peer['versions']['peft']} "
        f"in bf16 on the same model ({hf_mb:.0f} MB of bf16 safetensors); LoRA r={cfg['lora_rank']} on "
        f"q,k,v,o,gate,up,down; train {cfg['batch']}x{cfg['seq_len']} (forward+backward), "
        f"sample {cfg['sample_seqs']}x({cfg['prompt_len']}+{cfg['new_tokens']}) at T=1 through the adapter; "
        f"threads={cfg['threads']}"
    )
    sizes = ("model file MB", f"{gguf_mb:.0f}", f"{hf_mb:.0f}", f"{hf_mb / gguf_mb:.2f}x")
    bench_torch.print_table(temper, peer, ratios, extra=[sizes])
    mb = lambda v: "n/a" if v is None else f"{v:.0f} MB"  # noqa: E731
    temper_loaded = ((temper or {}).get("rss_mb") or {}).get("after_load")
    print(
        f"RSS after loading: temper {mb(temper_loaded)}, torch {mb(peer.get('rss_after_load_mb'))} "
        f"(of which {mb(peer.get('rss_before_load_mb'))} before the model: torch's and transformers' libraries)"
    )
    if report.get("temper_error"):
        print(f"temper: not measured: {report['temper_error']}")
    if args.json_out:
        report["files"] = {"gguf": str(gguf), "gguf_mb": gguf_mb, "hf_dir": str(model_dir), "hf_mb": hf_mb}
        report["shape"], report["quant"] = args.shape, args.quant
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_out}", file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
