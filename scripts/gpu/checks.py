#!/usr/bin/env python3
"""Every device check of issue 37 in one run: temper against PyTorch on the
same device, same shapes, same weights.

    python3 scripts/gpu/checks.py --temper .gpu/temper --device cuda --out DIR
    python3 scripts/gpu/checks.py --temper target/release/temper --device cpu \\
        --shapes tiny --out /tmp/checks          # the same checks on the CPU

Needs torch, transformers and peft (the GPU machine has them; on the CPU any
venv with tests/python/requirements-cookbook.txt and
scripts/requirements-gguf-check.txt). No network: every model is built here by
transformers from a config with random weights (seeded), saved as safetensors,
and loaded by both sides. A PEFT LoRA adapter (rank 16 on every linear layer,
B non-zero) is made the same way.

Per shape:

1. correctness (``temper bench parity``): per-token logprobs of the base
   model and with the adapter, greedy continuations, and the LoRA gradients
   of a summed token NLL, against transformers + PEFT in f32 (TF32 off) and,
   on a GPU, in bf16;
2. sampler vs trainer: temper's sampled logprobs against its own training
   forward on the same tokens and weights (max |diff|, KL estimates);
3. speed (``temper bench model``), as ratios in this run: LoRA
   forward+backward tokens/s on 8 x 1024 tokens against torch + PEFT, and
   batched sampling tokens/s of 64 sequences against transformers'
   ``generate``; GPU memory of each.

Writes DIR/checks.json (every number) and DIR/checks.log (what was run);
exits non-zero if a correctness check failed. Each step's failure is recorded
and the run goes on, so one broken op does not hide the rest.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER_DIR = os.path.join(ROOT, "fixtures", "models", "tiny-qwen3")

# Shapes of the public models (config.json values), weights random.
SHAPES = {
    "tiny": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                 tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-5,
                 max_position_embeddings=4096),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                         rms_norm_eps=1e-5, max_position_embeddings=8192),
    "qwen3-0.6b": dict(model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192}),
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Tolerances. f32: both sides compute the same math in f32 with different
# reduction orders. bf16: temper's error against the f32 reference may be at
# most BF16_FACTOR x torch bf16's own error against it, plus BF16_SLACK.
F32_LOGPROB_TOL = 2e-3
F32_GRAD_REL_TOL = 2e-3
BF16_FACTOR = 2.0
BF16_SLACK = 0.05
GREEDY_TIE = 1e-3

LOG = []


def log(msg):
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    LOG.append(line)


def run(cmd, timeout=600):
    log("$ " + " ".join(cmd))
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"exit {p.returncode}: {p.stderr[-4000:]}{p.stdout[-2000:]}")
    return p.stdout


class GpuMemory:
    """Peak GPU memory in use (MiB, whole device, minus what was in use at
    start) while a child process runs, read with nvidia-smi."""

    def __init__(self, device):
        self.on = device == "cuda" and shutil.which("nvidia-smi") is not None
        self.peak = None

    def _used(self):
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout
        return float(out.split()[0])

    def __enter__(self):
        if self.on:
            self.base = self._used()
            self.peak = 0.0
            self.stop = False
            self.t = threading.Thread(target=self._poll, daemon=True)
            self.t.start()
        return self

    def _poll(self):
        while not self.stop:
            self.peak = max(self.peak, self._used() - self.base)
            time.sleep(0.1)

    def __exit__(self, *exc):
        if self.on:
            self.stop = True
            self.t.join()


def make_model(shape, out_dir, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM
    from peft import LoraConfig, get_peft_model

    cfg = dict(SHAPES[shape])
    model_type = cfg.pop("model_type")
    config = AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mdir = os.path.join(out_dir, shape)
    model.save_pretrained(mdir, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER_DIR, f), mdir)
    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS,
                                                  lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    adir = os.path.join(out_dir, shape + "-lora")
    peft_model.save_pretrained(adir)
    return mdir, adir


def make_work(vocab, seed=0, n_seq=4, seq_len=64, n_prompts=4, prompt_len=8):
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()
    return {"sequences": [ids(seq_len) for _ in range(n_seq)],
            "prompts": [ids(prompt_len) for _ in range(n_prompts)],
            "new_tokens": 16, "samples": 4}


def torch_reference(mdir, adir, work, device, dtype):
    """Logprobs (base and adapter), LoRA gradients and greedy tokens."""
    from transformers import AutoModelForCausalLM
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=dtype).to(device)
    model.eval()

    def logprobs(m):
        out = []
        for s in work["sequences"]:
            x = torch.tensor([s], device=device)
            with torch.no_grad():
                lp = torch.log_softmax(m(x).logits[0, :-1].float(), -1)
            out.append(lp.gather(1, x[0, 1:, None])[:, 0].tolist())
        return out

    ref = {"logprobs": logprobs(model)}
    greedy, gaps = [], []
    for p in work["prompts"]:
        x = torch.tensor([p], device=device)
        with torch.no_grad():
            o = model.generate(x, max_new_tokens=work["new_tokens"], min_new_tokens=work["new_tokens"],
                               do_sample=False, output_scores=True, return_dict_in_generate=True,
                               pad_token_id=0, eos_token_id=None)
        greedy.append(o.sequences[0, len(p):].tolist())
        # The top-2 logit gap at each step: a near-tie may flip either way.
        gaps.append([float(torch.topk(s[0].float(), 2).values.diff().abs()) for s in o.scores])
    ref["greedy"], ref["greedy_gaps"] = greedy, gaps

    pm = PeftModel.from_pretrained(model, adir, is_trainable=True).to(device)
    ref["logprobs_adapter"] = logprobs(pm)
    pm.zero_grad()
    loss = 0.0
    for s in work["sequences"]:
        x = torch.tensor([s], device=device)
        lp = torch.log_softmax(pm(x).logits[0, :-1].float(), -1)
        nll = -lp.gather(1, x[0, 1:, None]).sum()
        nll.backward()
        loss += float(nll)
    ref["loss_adapter"] = loss
    grads = {}
    for name, p in pm.named_parameters():
        if p.grad is not None:
            g = p.grad.float().flatten()
            grads[name.replace(".default", "")] = {"norm": float(g.norm()), "sum": float(g.sum()),
                                                   "head": g[:16].tolist()}
    ref["grads"] = grads
    del pm, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return ref


def max_abs(a, b):
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def greedy_agrees(ours, ref, gaps):
    """Equal, or first different where the reference's top two were a near-tie."""
    for o, r, g in zip(ours, ref, gaps):
        for i, (x, y) in enumerate(zip(o, r)):
            if x != y:
                if g[i] >= GREEDY_TIE:
                    return False, f"differs at token {i} (reference top-2 gap {g[i]:.2e})"
                break
    return True, "equal" if ours == ref else "equal up to a near-tie"


def grad_rel_err(ours, ref):
    worst, missing = 0.0, [k for k in ref if k not in ours]
    if missing:
        return math.inf, f"missing {missing[:3]}"
    for k, r in ref.items():
        o = ours[k]
        worst = max(worst, abs(o["norm"] - r["norm"]) / max(r["norm"], 1e-12))
        scale = max(max(abs(v) for v in r["head"]), 1e-12)
        worst = max(worst, max(abs(x - y) for x, y in zip(o["head"], r["head"])) / scale)
    return worst, ""


def correctness(args, shape, mdir, adir, work, results):
    wfile = os.path.join(os.path.dirname(mdir), f"{shape}-work.json")
    with open(wfile, "w") as f:
        json.dump(work, f)
    dtypes = ["f32", "bf16"] if args.device == "cuda" else ["f32"]
    ref32 = torch_reference(mdir, adir, work, args.device, torch.float32)
    ok = True
    for dt in dtypes:
        key = f"{shape}/{dt}"
        r = results.setdefault(key, {})
        try:
            pfile = os.path.join(os.path.dirname(mdir), f"{shape}-{dt}-parity.json")
            t = time.time()
            run([args.temper, "bench", "parity", "--model", mdir, "--adapter", adir, "--work", wfile,
                 "--device", args.device, "--device-dtype", dt, "--out", pfile])
            r["temper_parity_s"] = round(time.time() - t, 2)
            ours = json.load(open(pfile))
            r["logprob_max_abs"] = max_abs(ours["logprobs"], ref32["logprobs"])
            r["logprob_adapter_max_abs"] = max_abs(ours["logprobs_adapter"], ref32["logprobs_adapter"])
            r["grad_rel_err"], note = grad_rel_err(ours["grads"], ref32["grads"])
            r["loss_adapter"] = [ours["loss_adapter"], ref32["loss_adapter"]]
            r["mismatch"] = ours.get("mismatch")
            if dt == "f32":
                r["greedy_ok"], r["greedy"] = greedy_agrees(ours["greedy"], ref32["greedy"],
                                                            ref32["greedy_gaps"])
                r["pass"] = (r["logprob_max_abs"] <= F32_LOGPROB_TOL
                             and r["logprob_adapter_max_abs"] <= F32_LOGPROB_TOL
                             and r["grad_rel_err"] <= F32_GRAD_REL_TOL and r["greedy_ok"])
                r["tolerance"] = {"logprob_abs": F32_LOGPROB_TOL, "grad_rel": F32_GRAD_REL_TOL}
            else:
                ref16 = torch_reference(mdir, adir, work, args.device, torch.bfloat16)
                r["torch_bf16_logprob_max_abs"] = max_abs(ref16["logprobs"], ref32["logprobs"])
                r["torch_bf16_logprob_adapter_max_abs"] = max_abs(ref16["logprobs_adapter"],
                                                                  ref32["logprobs_adapter"])
                r["torch_bf16_grad_rel_err"], _ = grad_rel_err(ref16["grads"], ref32["grads"])
                lim = lambda torch_err: BF16_FACTOR * torch_err + BF16_SLACK
                r["pass"] = (r["logprob_max_abs"] <= lim(r["torch_bf16_logprob_max_abs"])
                             and r["logprob_adapter_max_abs"]
                             <= lim(r["torch_bf16_logprob_adapter_max_abs"])
                             and r["grad_rel_err"] <= lim(r["torch_bf16_grad_rel_err"]))
                r["tolerance"] = f"temper's error vs torch f32 <= {BF16_FACTOR} x torch bf16's + {BF16_SLACK}"
            if note:
                r["grad_note"] = note
            log(f"{key}: {json.dumps(r)}")
            ok &= bool(r["pass"])
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            r["pass"] = False
            r["error"] = f"{type(e).__name__}: {e}"[-3000:]
            log(f"{key}: FAILED {r['error']}")
            ok = False
    return ok


def torch_speed(mdir, device, batch, seq, sample_seqs, new_tokens, iters):
    from transformers import AutoModelForCausalLM
    from peft import LoraConfig, get_peft_model

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=dtype).to(device)
    vocab = model.config.vocab_size
    out = {}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    pm = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS,
                                          lora_dropout=0.0))
    x = torch.randint(0, vocab, (batch, seq + 1), device=device)
    times = []
    for i in range(iters + 1):
        sync()
        t = time.time()
        lp = torch.log_softmax(pm(x[:, :-1]).logits.float(), -1)
        (-lp.gather(2, x[:, 1:, None]).sum()).backward()
        pm.zero_grad(set_to_none=True)
        sync()
        if i:
            times.append(time.time() - t)
    del lp
    out["train_tokens_per_s"] = batch * seq / sorted(times)[len(times) // 2]
    if device == "cuda":
        out["train_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    base = pm.unload() if hasattr(pm, "unload") else model
    prompts = torch.randint(0, vocab, (sample_seqs, 16), device=device)
    times = []
    for i in range(2):
        sync()
        t = time.time()
        with torch.no_grad():
            base.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                          temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)
        sync()
        if i:
            times.append(time.time() - t)
    out["sample_tokens_per_s"] = sample_seqs * new_tokens / times[0]
    if device == "cuda":
        out["sample_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    del base, pm, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def speed(args, shape, mdir, results):
    key = f"{shape}/speed"
    r = results.setdefault(key, {})
    b, s, n, new, iters = args.batch, args.seq_len, args.sample_seqs, args.new_tokens, args.iters
    r["work"] = f"LoRA r16 fwd+bwd {b}x{s} tokens; sampling {n} sequences x {new} new tokens"
    try:
        with GpuMemory(args.device) as mem:
            t = time.time()
            rep = json.loads(run([args.temper, "bench", "model", "--json", "--model", mdir,
                                  "--device", args.device, "--device-dtype", "bf16",
                                  "--batch", str(b), "--seq-len", str(s), "--sample-seqs", str(n),
                                  "--new-tokens", str(new), "--iters", str(iters)]).strip().splitlines()[-1])
        r["temper"] = {"train_tokens_per_s": rep["train_tokens_per_s"],
                       "sample_tokens_per_s": rep["sample_tokens_per_s"],
                       "gpu_peak_mib": mem.peak, "wall_s": round(time.time() - t, 1)}
    except Exception as e:  # noqa: BLE001
        r["temper_error"] = f"{type(e).__name__}: {e}"[-3000:]
    try:
        r["torch"] = torch_speed(mdir, args.device, b, s, n, new, iters)
    except Exception as e:  # noqa: BLE001
        r["torch_error"] = f"{type(e).__name__}: {e}"[-3000:]
    if "temper" in r and "torch" in r:
        r["ratio_train"] = r["temper"]["train_tokens_per_s"] / r["torch"]["train_tokens_per_s"]
        r["ratio_sample"] = r["temper"]["sample_tokens_per_s"] / r["torch"]["sample_tokens_per_s"]
    log(f"{key}: {json.dumps(r)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--temper", required=True)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--shapes", default="smollm2-135m,qwen3-0.6b,llama-3.2-1b")
    ap.add_argument("--speed-shapes", default="qwen3-0.6b,llama-3.2-1b",
                    help="shapes to time (subset of --shapes; empty for none)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--sample-seqs", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    results = {"device": args.device, "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None}
    import transformers
    import peft
    results["transformers"], results["peft"] = transformers.__version__, peft.__version__
    log(f"checks on {args.device}: {results}")
    models = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"temper-checks-{os.getpid()}")

    def save():
        # After every shape, so a run cut off by its time limit keeps what it measured.
        with open(os.path.join(args.out, "checks.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(args.out, "checks.log"), "w") as f:
            f.write("\n".join(LOG) + "\n")

    ok = True
    t0 = time.time()
    for shape in [s for s in args.shapes.split(",") if s]:
        try:
            mdir, adir = make_model(shape, models)
        except Exception as e:  # noqa: BLE001
            results[f"{shape}/make"] = f"{type(e).__name__}: {e}"
            log(f"{shape}: could not make the model: {traceback.format_exc()}")
            ok = False
            continue
        ok &= correctness(args, shape, mdir, adir, make_work(SHAPES[shape]["vocab_size"]), results)
        if shape in args.speed_shapes.split(","):
            speed(args, shape, mdir, results)
        shutil.rmtree(mdir, ignore_errors=True)
        shutil.rmtree(adir, ignore_errors=True)
        save()
    results["wall_s"] = round(time.time() - t0, 1)
    results["pass"] = ok
    save()
    log(f"{'PASS' if ok else 'FAIL'}: every number in {os.path.join(args.out, 'checks.json')}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
