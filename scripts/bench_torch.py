#!/usr/bin/env python3
"""Compare ``temper bench model`` with PyTorch / transformers on the same shapes.

Run from the repository root after ``cargo build --release -p temper``:

    /opt/pyref/bin/python scripts/bench_torch.py [--threads N] [--iters K] [--json-out FILE]

(any Python with torch, transformers and peft works; see
``scripts/requirements-fixtures.txt``). The fixed tiny config is a randomly
initialised f32 Llama (hidden 256, intermediate 768, 4 layers, 4 heads, 2 KV
heads, vocab 512, untied embeddings) on the CPU:

* train: one forward + backward of a PEFT LoRA model (rank 16, alpha 32 on
  q,k,v,o,gate,up,down; base frozen) with a summed token cross-entropy over a
  batch of 8 x 128 tokens, no optimizer step. Median of K steps after warm-up;
  tokens/s = 8 * 128 / step time.
* sample: ``model.generate`` on the plain model (no LoRA), 8 prompts of 16
  tokens, exactly 128 new tokens each, temperature 1.0 with no top-k / top-p
  truncation, KV cache. Median of a few runs after a warm-up; tokens/s =
  8 * 128 / wall time.

With ``--model DIR`` both sides run the same work on a Hugging Face model
directory instead (e.g. SmolLM2-135M); the torch side then also reports LoRA
training in bf16 (weights and activations cast with ``.to(torch.bfloat16)``,
what ``torch_dtype=bfloat16`` gives). Each phase reports its peak resident set
size (Linux ``VmHWM``, reset per phase via ``/proc/self/clear_refs``).

``--temper-model FILE`` gives temper another file of the same model (e.g. a
GGUF export of DIR, with ``--dtype gguf``). ``--peer-dtype bf16`` runs the
torch side in bf16 only, the way a bf16 user runs it: DIR loaded with
``dtype=bfloat16`` (no f32 copy), LoRA attached to it in place, and
``generate`` through the adapter as temper samples (``--peer-dtype f32``, the
default, keeps the f32 rows above). ``--batch``, ``--seq-len``,
``--sample-seqs`` and ``--new-tokens`` set the shapes of both sides
(``scripts/bench_laptop.py`` uses all of these).

Attention uses transformers' default "sdpa" implementation (what a user gets).
The temper binary is run first as ``temper bench model --json --threads N
--iters K``, then the PyTorch half in this process (so torch's worker threads
cannot steal cores from temper). Prints a table with the ratio temper / peer
(higher = temper faster). ``--skip-temper`` runs only the PyTorch half.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Must match `temper bench model` (its JSON echoes its config; we check it).
CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 2,
    "vocab_size": 512,
    "lora_rank": 16,
    "batch": 8,
    "seq_len": 128,
    "prompt_len": 16,
    "sample_seqs": 8,
    "new_tokens": 128,
}
LORA_ALPHA = 32
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTN_IMPLEMENTATION = "sdpa"

# Table rows: (label, key in temper's JSON, key in the torch results). temper's headline sampling
# number also returns per-token logprobs; when it reports a run without them, that row is shown
# too (transformers' generate computes no logprobs by default, so it is the closer match).
# Rows whose peer key is missing (bf16 and memory rows without --model / on non-Linux) are skipped.
# Memory rows are "lower is better": their ratio is peer / temper, so > 1 still means temper wins.
ROWS = [
    ("train tokens/s", "train_tokens_per_s", "train_tokens_per_s"),
    ("train tokens/s vs torch bf16", "train_tokens_per_s", "bf16_train_tokens_per_s"),
    ("train tokens per CPU-second", "train_tokens_per_cpu_s", "train_tokens_per_cpu_s"),
    ("sample tokens/s", "sample_tokens_per_s", "sample_tokens_per_s"),
    ("sample tokens/s (no logprobs)", "sample_without_logprobs_tokens_per_s", "sample_tokens_per_s"),
    ("train peak RSS MB", "train_peak_rss_mb", "train_peak_rss_mb"),
    ("train peak RSS MB vs torch bf16", "train_peak_rss_mb", "bf16_train_peak_rss_mb"),
    ("sample peak RSS MB", "sample_peak_rss_mb", "sample_peak_rss_mb"),
    ("peak RSS MB (train, sample)", "peak_rss_mb", "peak_rss_mb"),
]
LOWER_IS_BETTER = {"train_peak_rss_mb", "sample_peak_rss_mb", "peak_rss_mb"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads for both sides (default: all)")
    p.add_argument("--iters", type=int, default=10, help="timed training steps (also passed to temper; default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed training steps before timing (default 3)")
    p.add_argument("--sample-runs", type=int, default=3, help="timed generate() calls after one warm-up (default 3)")
    p.add_argument(
        "--temper", type=Path, default=ROOT / "target" / "release" / "temper", help="default: target/release/temper"
    )
    p.add_argument("--temper-timeout", type=float, default=1800.0, help="seconds before the temper run is abandoned")
    p.add_argument("--skip-temper", action="store_true", help="only run the PyTorch half")
    p.add_argument("--json-out", type=Path, help="also write all numbers to this JSON file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", type=Path, help="a Hugging Face model directory instead of the tiny random Llama")
    p.add_argument("--no-bf16", action="store_true", help="with --model: skip the bf16 training run")
    p.add_argument(
        "--dtype", choices=["f32", "bf16", "auto", "gguf"], default="f32",
        help="temper's weight precision (`temper --dtype`); compare bf16 against the torch bf16 row",
    )
    p.add_argument("--temper-model", type=Path, help="with --model: the file temper runs (default: --model)")
    p.add_argument(
        "--peer-dtype", choices=["f32", "bf16"], default="f32",
        help="bf16: torch loads --model in bf16 and trains and samples (through the adapter) in bf16 only",
    )
    p.add_argument("--batch", type=int, default=CONFIG["batch"], help="sequences per training step")
    p.add_argument("--seq-len", type=int, default=CONFIG["seq_len"], help="tokens per training sequence")
    p.add_argument("--sample-seqs", type=int, default=CONFIG["batch"], help="sequences sampled at once")
    p.add_argument("--new-tokens", type=int, default=CONFIG["new_tokens"], help="new tokens per sampled sequence")
    p.add_argument(
        "--train-only", action="store_true",
        help="skip sampling on both sides (with --threads 1, the CPU-second row is robust on a busy machine)",
    )
    args = p.parse_args()
    for name in ("threads", "iters", "sample_runs", "batch", "seq_len", "sample_seqs", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if (args.temper_model or args.peer_dtype != "f32") and not args.model:
        p.error("--temper-model and --peer-dtype need --model")
    CONFIG.update(
        batch=args.batch, seq_len=args.seq_len, sample_seqs=args.sample_seqs, new_tokens=args.new_tokens
    )
    return args


# ----------------------------------------------------------------------------- temper


def run_temper(args: argparse.Namespace) -> tuple[dict | None, str | None]:
    """Run ``temper bench model --json``; return (parsed JSON, None) or (None, error message)."""
    exe = args.temper
    if not exe.is_file():
        return None, (
            f"temper binary not found at {exe}; build it first with `cargo build --release -p temper` "
            "(or pass --temper PATH)"
        )
    cmd = [
        str(exe), "--dtype", args.dtype, "bench", "model", "--json",
        "--threads", str(args.threads), "--iters", str(args.iters),
        "--batch", str(args.batch), "--seq-len", str(args.seq_len),
        "--sample-seqs", str(args.sample_seqs), "--new-tokens", str(args.new_tokens),
    ]
    if args.model:
        cmd += ["--model", str(args.temper_model or args.model)]
    if args.train_only:
        cmd += ["--train-only"]
    print("running:", " ".join(cmd), file=sys.stderr, flush=True)
    try:
        # stdout carries the JSON; temper's stderr (progress, errors) goes straight to ours.
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.temper_timeout)
    except subprocess.TimeoutExpired:
        return None, f"temper did not finish within {args.temper_timeout:.0f} s"
    except OSError as e:
        return None, f"could not run {exe}: {e}"
    if proc.returncode != 0:
        return None, f"temper exited with status {proc.returncode} (its stderr is above)"
    out = proc.stdout.strip()
    try:
        result = json.loads(out)
    except json.JSONDecodeError:
        # Tolerate stray lines around the object: take the last line that parses.
        result = None
        for line in reversed(out.splitlines()):
            try:
                result = json.loads(line)
                break
            except json.JSONDecodeError:
                continue
    if not isinstance(result, dict):
        return None, f"could not parse temper's output as a JSON object:\n{out[:2000]}"
    rss = result.get("rss_mb") or {}
    if rss.get("train_peak") is not None:
        result["train_peak_rss_mb"] = rss["train_peak"]
    if rss.get("sample_peak") is not None:
        result["sample_peak_rss_mb"] = rss["sample_peak"]
    result["peak_rss_mb"] = max_peak(result)
    missing = [k for k in ("train_tokens_per_s", "sample_tokens_per_s") if k not in result]
    if args.train_only:
        missing = [k for k in missing if k != "sample_tokens_per_s"]
    if missing:
        return None, f"temper's JSON lacks {missing}: {out[:2000]}"
    # Warn (do not fail) if temper benchmarked different shapes.
    theirs = result.get("config", {})
    diff = {k: (v, theirs.get(k)) for k, v in CONFIG.items() if k in theirs and theirs[k] != v}
    if theirs.get("threads") not in (None, args.threads):
        diff["threads"] = (args.threads, theirs["threads"])
    if diff:
        print(f"warning: temper's config differs (ours, temper's): {diff}", file=sys.stderr)
    return result, None


# ----------------------------------------------------------------------------- memory


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float | None:
    return _status_mb("VmHWM")


def rss_mb() -> float | None:
    return _status_mb("VmRSS")


def max_peak(result: dict) -> float | None:
    """The larger of the training and sampling peaks (each includes the loaded model)."""
    peaks = [result.get(k) for k in ("train_peak_rss_mb", "sample_peak_rss_mb")]
    peaks = [v for v in peaks if v is not None]
    return max(peaks) if peaks else None


# ----------------------------------------------------------------------------- torch


def build_model(torch, transformers):
    cfg = transformers.LlamaConfig(
        vocab_size=CONFIG["vocab_size"],
        hidden_size=CONFIG["hidden_size"],
        intermediate_size=CONFIG["intermediate_size"],
        num_hidden_layers=CONFIG["num_layers"],
        num_attention_heads=CONFIG["num_heads"],
        num_key_value_heads=CONFIG["num_kv_heads"],
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation=ATTN_IMPLEMENTATION,
    )
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION, model.config._attn_implementation
    return model


def load_model(torch, transformers, path: Path, dtype=None):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype or torch.float32, attn_implementation=ATTN_IMPLEMENTATION
    )
    cfg = model.config
    CONFIG.update(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        vocab_size=cfg.vocab_size,
    )
    return model


def bench_train(torch, peft, base, args, dtype=None, in_place=False) -> tuple[dict, object | None]:
    """Median time of one LoRA forward+backward over batch x seq_len tokens.

    Trains a copy of `base` cast to `dtype` and returns (results, None); with `in_place`, attaches
    the adapter to `base` itself (no second copy of the weights) and returns (results, PEFT model).
    """
    lora_cfg = peft.LoraConfig(
        r=CONFIG["lora_rank"],
        lora_alpha=LORA_ALPHA,
        target_modules=LORA_TARGETS,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    dtype = dtype or torch.float32
    model = peft.get_peft_model(base if in_place else copy.deepcopy(base).to(dtype), lora_cfg)
    model.train()
    # PEFT zero-initialises lora_B; give it small values so the adapter path is "live" (cost is the same).
    with torch.no_grad():
        for name, prm in model.named_parameters():
            if "lora_B" in name:
                prm.normal_(0.0, 0.02)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    b, t = CONFIG["batch"], CONFIG["seq_len"]
    ids = torch.randint(0, CONFIG["vocab_size"], (b, t))

    def step() -> float:
        logits = model(input_ids=ids).logits  # [b, t, vocab]
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        loss = -logp.gather(-1, ids[:, 1:].unsqueeze(-1)).sum()
        loss.backward()
        return loss.item()

    reset = reset_peak_rss()
    for _ in range(args.warmup):
        model.zero_grad(set_to_none=True)
        step()
    times, cpu = [], []
    for _ in range(args.iters):
        model.zero_grad(set_to_none=True)
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    med = statistics.median(times)
    peak = peak_rss_mb()
    model.zero_grad(set_to_none=True)
    if not in_place:
        del model
        model = None
    return {
        "train_peak_rss_mb": peak,
        "peak_is_per_phase": reset,
        "train_tokens_per_s": b * t / med,
        "train_tokens_per_cpu_s": b * t / statistics.median(cpu),
        "train_step_ms": med * 1e3,
        "train_step_ms_all": [x * 1e3 for x in times],
        "lora_trainable_params": n_trainable,
    }, model


def bench_sample(torch, transformers, model, args) -> dict:
    """Median wall time of generate() for batch prompts x new_tokens sampled tokens."""
    model.eval()
    b, p, n = CONFIG["sample_seqs"], CONFIG["prompt_len"], CONFIG["new_tokens"]
    prompts = torch.randint(0, CONFIG["vocab_size"], (b, p))
    gen_cfg = transformers.GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,  # transformers defaults to top_k=50; temper's plain sampling has no truncation
        top_p=1.0,
        max_new_tokens=n,
        min_new_tokens=n,
        eos_token_id=None,  # random model: never stop early
        pad_token_id=0,
        use_cache=True,
    )

    def run() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            mask = torch.ones_like(prompts)
            out = model.generate(input_ids=prompts, attention_mask=mask, generation_config=gen_cfg)
            dt = time.perf_counter() - t0
        assert out.shape == (b, p + n), f"generate returned shape {tuple(out.shape)}, expected {(b, p + n)}"
        return dt

    reset_peak_rss()
    run()  # warm-up
    times = [run() for _ in range(args.sample_runs)]
    med = statistics.median(times)
    return {
        "sample_peak_rss_mb": peak_rss_mb(),
        "sample_tokens_per_s": b * n / med,
        "sample_ms": med * 1e3,
        "sample_ms_all": [x * 1e3 for x in times],
    }


def run_torch(args: argparse.Namespace) -> dict:
    import peft
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    transformers.logging.set_verbosity_error()
    # peft 0.21 calls a transformers method that is deprecated in 5.x; harmless noise.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    bf16_only = args.peer_dtype == "bf16"
    imported = rss_mb()  # torch's and transformers' own libraries, before any model
    if args.model:
        base = load_model(torch, transformers, args.model, torch.bfloat16 if bf16_only else None)
    else:
        base = build_model(torch, transformers)
    loaded = rss_mb()
    print(
        f"torch: train in {args.peer_dtype} ({args.warmup} warm-up + {args.iters} timed steps) ...",
        file=sys.stderr, flush=True,
    )
    # bf16 only: the adapter goes on the loaded model and sampling runs through it, as temper's does.
    train, lora_model = bench_train(torch, peft, base, args, dtype=base.dtype, in_place=bf16_only)
    if args.model and not args.no_bf16 and not bf16_only:
        print("torch: train in bf16 ...", file=sys.stderr, flush=True)
        bf, _ = bench_train(torch, peft, base, args, dtype=torch.bfloat16)
        train["bf16_train_tokens_per_s"] = bf["train_tokens_per_s"]
        train["bf16_train_step_ms"] = bf["train_step_ms"]
        train["bf16_train_peak_rss_mb"] = bf["train_peak_rss_mb"]
    sample = {}
    if not args.train_only:
        print(f"torch: sample (1 warm-up + {args.sample_runs} timed generate calls) ...", file=sys.stderr, flush=True)
        sample = bench_sample(torch, transformers, lora_model or base, args)
    result = {"rss_before_load_mb": imported, "rss_after_load_mb": loaded, **train, **sample}
    result["peak_rss_mb"] = max_peak(result)
    return {
        **result,
        "dtype": args.peer_dtype,
        "threads": torch.get_num_threads(),
        "attn_implementation": ATTN_IMPLEMENTATION,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
        },
    }


# ----------------------------------------------------------------------------- report


def print_table(temper: dict | None, peer: dict, ratios: dict, extra=()) -> None:
    """The ROWS both sides report, then `extra` rows given as four strings each."""
    header = ("metric", "temper", f"torch/transformers {peer.get('dtype', 'f32')}", "ratio temper/peer")
    lines = [header]
    for label, tkey, pkey in ROWS:
        if peer.get(pkey) is None or (tkey != pkey and not (temper and tkey in temper)):
            continue  # optional extra row, only when both sides report it
        t = f"{temper[tkey]:.1f}" if temper and tkey in temper else "-"
        r = f"{ratios[label]:.2f}x" if ratios.get(label) is not None else "-"
        lines.append((label, t, f"{peer[pkey]:.1f}", r))
    lines.extend(extra)
    widths = [max(len(row[i]) for row in lines) for i in range(4)]

    def fmt(row: tuple[str, ...]) -> str:
        return " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))

    print(fmt(lines[0]))
    print("-+-".join("-" * w for w in widths))
    for row in lines[1:]:
        print(fmt(row))
    print("(ratio > 1 means temper is faster / uses less memory)")


def main() -> int:
    args = parse_args()
    if args.model:
        # Shapes for the config check and the table come from the model's config.json.
        cfg = json.loads((args.model / "config.json").read_text())
        CONFIG.update(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            vocab_size=cfg["vocab_size"],
        )
    temper, temper_err = (None, None) if args.skip_temper else run_temper(args)
    if temper_err:
        print(f"error: {temper_err}", file=sys.stderr)
        print("continuing with the PyTorch half only", file=sys.stderr)

    peer = run_torch(args)
    def ratio(tkey: str, pkey: str) -> float | None:
        t, p = (temper or {}).get(tkey), peer.get(pkey)
        if t is None or p is None or t <= 0 or p <= 0:
            return None
        return p / t if tkey in LOWER_IS_BETTER else t / p

    ratios = {label: ratio(tkey, pkey) for label, tkey, pkey in ROWS}

    b, t, n = CONFIG["batch"], CONFIG["seq_len"], CONFIG["new_tokens"]
    print(
        f"config: {args.temper_model or args.model or 'random Llama'} d={CONFIG['hidden_size']} ff={CONFIG['intermediate_size']} layers={CONFIG['num_layers']} "
        f"heads={CONFIG['num_heads']}/{CONFIG['num_kv_heads']}kv vocab={CONFIG['vocab_size']}, "
        f"temper weights {(temper or {}).get('config', {}).get('dtype', args.dtype)}, "
        f"torch {args.peer_dtype}, LoRA r={CONFIG['lora_rank']}; train {b}x{t}, "
        f"sample {CONFIG['sample_seqs']}x({CONFIG['prompt_len']}+{n}); "
        f"threads={args.threads}; torch {peer['versions']['torch']}, transformers {peer['versions']['transformers']} "
        f"(attn={ATTN_IMPLEMENTATION})"
    )
    print_table(temper, peer, ratios)
    if temper_err:
        print(f"temper: not measured: {temper_err}")

    if args.json_out:
        report = {
            "config": {**CONFIG, "threads": args.threads},
            "temper": temper,
            "temper_error": temper_err,
            "torch": peer,
            "ratio_temper_over_torch": ratios,
        }
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 1 if temper_err else 0


if __name__ == "__main__":
    sys.exit(main())
