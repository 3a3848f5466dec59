"""verifiers' train client against `temper serve`.

Run: python tests/python/test_verifiers_train_client.py [--temper target/debug/temper]
         [--gguf SmolLM2-135M-Instruct.Q4_1.gguf]
Needs `pip install -r tests/python/requirements-verifiers.txt` (see .ci/run).

verifiers' `TrainClient` (`verifiers.v1.clients.train`, the class prime-rl drives
for RL rollouts) renders the chat prompt to token ids itself and posts them to
vLLM's `POST /inference/v1/generate`, reading back the completion's token ids
and their logprobs (`choices[0].logprobs.content[i] = {"token": "token_id:<id>",
"logprob": ...}`; it rejects any other shape). This drives the installed class
itself against the real server — on the fixture model, and with `--gguf` also
on a real GGUF model (its tokenizer for the renderer exported by `temper export
--format hf`) — and checks what it recorded: the prompt ids are the ones temper
renders for the same chat, the completion ids decode to the message it parsed,
the logprobs equal temper's own `/v1/completions` logprobs for the same tokens
(the scoring forward, `echo`), and `min_tokens` sent through its sampling
config holds back an all-but-certain EOS. Prints `verifiers-train-client: N
passed, M failed`; exits non-zero on any failure.
"""

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import traceback
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_openai_server import MODEL, MODEL_DIR, ROOT, start_server  # noqa: E402

API_KEY = "sk-temper-verifiers"
KEY_VAR = "TEMPER_VERIFIERS_TEST_KEY"


def post_json(url, path, body):
    # A real model on the debug build of a busy CI machine can take minutes.
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def echo_logprobs(url, ids, temperature):
    """temper's logprobs of ids[1:] given the ids before each (the scoring forward)."""
    v = post_json(url, "/v1/completions", {
        "model": MODEL, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 0,
        "temperature": temperature})
    return v["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)]


def turns(eos):
    from verifiers.v1.types import SamplingConfig

    return [
        ({"model": MODEL, "messages": [{"role": "user", "content": "Say something."}]},
         SamplingConfig(temperature=1.0, max_tokens=12, seed=5)),
        ({"model": MODEL, "messages": [
            {"role": "user", "content": "Count to three."},
            {"role": "assistant", "content": "one two"},
            {"role": "user", "content": "Go on."}]},
         SamplingConfig(temperature=0.7, max_tokens=20, seed=9, min_tokens=4)),
        # EOS all but certain: min_tokens holds it back for 3 tokens, then it
        # ends the turn.
        ({"model": MODEL, "messages": [{"role": "user", "content": "Stop now."}]},
         SamplingConfig(temperature=1.0, max_tokens=16, min_tokens=3,
                        logit_bias={str(eos): 100})),
    ]


async def drive(url, tokenizer_dir, eos):
    from verifiers.v1.clients.train import TrainClient
    from verifiers.v1.configs.client import TrainClientConfig
    from verifiers.v1.dialects.chat import ChatDialect

    os.environ[KEY_VAR] = API_KEY
    # The renderer resolves from the tokenizer (renderers' default one here:
    # the model's own chat template).
    client = TrainClient(TrainClientConfig(
        base_url=url + "/v1", api_key_var=KEY_VAR, renderer_model_name=tokenizer_dir))
    results = []
    try:
        for body, sampling in turns(eos):
            resp = await client.get_response(ChatDialect(), body, sampling)
            results.append((body, sampling, resp))
    finally:
        await client.close()
    return results


def check(url, tok, eos, body, sampling, resp):
    t = resp.tokens
    assert t is not None, "no tokens recorded"
    # The prompt ids verifiers rendered are the ones temper renders.
    v = post_json(url, "/v1/chat/completions", {
        "model": MODEL, "messages": body["messages"], "max_tokens": 1,
        "return_token_ids": True})
    assert t.prompt_ids == v["prompt_token_ids"], (t.prompt_ids, v["prompt_token_ids"])
    ids, lps = t.completion_ids, t.completion_logprobs
    assert ids and len(lps) == len(ids), (ids, lps)
    assert len(ids) <= sampling.max_tokens
    assert all(math.isfinite(x) and x <= 0 for x in lps), lps
    min_tokens = getattr(sampling, "min_tokens", None) or 0
    assert len(ids) > min_tokens, (len(ids), min_tokens)
    assert resp.finish_reason in ("stop", "length"), resp.finish_reason
    if getattr(sampling, "logit_bias", None):
        assert ids[min_tokens:] == [eos], ids
        assert eos not in ids[:min_tokens], ids
        assert resp.finish_reason == "stop", resp.finish_reason
    # The recorded logprobs are temper's scoring-forward logprobs of the same
    # tokens at the sampling temperature.
    want = echo_logprobs(url, t.prompt_ids + ids, sampling.temperature)[-len(ids):]
    diff = max(abs(a - b) for a, b in zip(lps, want))
    assert diff <= 1e-6, (diff, lps, want)
    # The message verifiers parsed is the completion's text.
    text = tok.decode(ids, skip_special_tokens=True)
    content = resp.message.content or ""
    assert content in (text, text.strip()), (content, text)
    return (f"{len(ids)} tokens, finish {resp.finish_reason}, logprob diff {diff:.1e}, "
            f"ids {ids[:4]}..., logprobs {[round(x, 4) for x in lps[:4]]}..., "
            f"text {content[:40]!r}")


def suite(binary, label, model, tokenizer_dir):
    """Serve `model`, drive the train client through `turns`; (passed, failed)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert isinstance(eos, int), eos
    server, url = start_server(binary, "--api-key", API_KEY, model=model)
    passed, failed = 0, 0
    try:
        results = asyncio.run(drive(url, tokenizer_dir, eos))
        for i, (body, sampling, resp) in enumerate(results):
            name = f"{label} turn {i}: {json.dumps(body['messages'])[:50]}..."
            try:
                print(f"ok   {name} ({check(url, tok, eos, body, sampling, resp)})")
                passed += 1
            except Exception:
                print(f"FAIL {name}\n{traceback.format_exc()}")
                failed += 1
    except Exception:
        print(f"FAIL {label}: driving the train client\n{traceback.format_exc()}")
        failed += 1
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except Exception:
            server.kill()
    return passed, failed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", default=os.path.join(ROOT, "target", "debug", "temper"))
    ap.add_argument("--gguf", help="also a real GGUF model (e.g. SmolLM2-135M-Instruct)")
    args = ap.parse_args()
    import verifiers  # noqa: F401  (fail early if the requirements are missing)

    passed, failed = suite(args.temper, "tiny-qwen3", MODEL_DIR, MODEL_DIR)
    if args.gguf:
        with tempfile.TemporaryDirectory() as d:
            # The renderer loads a Hugging Face tokenizer: the GGUF's, exported.
            hf = os.path.join(d, "hf")
            subprocess.run([args.temper, "export", args.gguf, "--format", "hf", "--out", hf],
                           check=True, stdout=subprocess.DEVNULL)
            p, f = suite(args.temper, os.path.basename(args.gguf), args.gguf, hf)
            passed, failed = passed + p, failed + f
    print(f"verifiers-train-client: {passed} passed, {failed} failed")
    sys.exit(1 if failed or not passed else 0)


if __name__ == "__main__":
    main()
