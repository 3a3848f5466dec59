#!/usr/bin/env python3
"""The transformers half of ``temper bench serve``: HF ``generate`` on the
same model directory and the same work, so the two tokens/s compare.

``temper bench serve`` writes a random-weight f32 Llama directory, measures
its own server, then runs this script (``/opt/pyref/bin/python`` by default;
any Python with torch + transformers works):

    python scripts/bench_serve.py --model DIR --concurrency 1,8,32 \
        --prompt-len 16 --max-tokens 128 --rounds 2 --threads N

For each concurrency C it runs ``rounds`` batches of C prompts (random ids,
all ``prompt-len`` long, so there is no padding: the best case for static
batching) through ``model.generate`` with a KV cache, temperature 1.0, no
top-k / top-p, exactly ``max-tokens`` new tokens each (EOS suppressed). That
is the same number of generated tokens as the server's C concurrent clients
x ``rounds`` requests. With ``--repeats R`` the best of R runs per level is
kept. Prints one JSON object: {"C": tokens_per_second, ...}.
"""

import argparse
import json
import time
import warnings


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def run(c):
        ids = torch.randint(0, vocab - 8, (c, args.prompt_len), generator=gen)
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                top_k=0, top_p=1.0, max_new_tokens=args.max_tokens,
                min_new_tokens=args.max_tokens, pad_token_id=0)
        assert out.shape == (c, args.prompt_len + args.max_tokens), out.shape
        return c * args.max_tokens

    run(1)  # warm-up
    result = {}
    for c in [int(x) for x in args.concurrency.split(",")]:
        best = 0.0
        for _ in range(max(1, args.repeats)):
            t0 = time.perf_counter()
            tokens = sum(run(c) for _ in range(args.rounds))
            best = max(best, tokens / (time.perf_counter() - t0))
        result[str(c)] = best
    print(json.dumps(result))


if __name__ == "__main__":
    main()
