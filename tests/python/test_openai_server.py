"""The official `openai` Python client against `temper serve` on a fixture model.

Run: python tests/python/test_openai_server.py [--temper target/debug/temper]
Needs `pip install -r tests/python/requirements-openai.txt` (see .ci/run).
Starts `temper serve --port 0` (waiting for the address it prints), drives it
through the client — chat, completions, streaming, n > 1, logprobs /
top_logprobs, seeds, tools, LoRA hot-swap, the token-in/token-out route,
structured outputs (response_format json_object / json_schema through
Pydantic models, tool_choice "required" / named, each validated over many
samples at temperature 1) and every error class — and prints `openai-client: N passed, M failed`; exits
non-zero on any failure.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request
from typing import List, Literal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_DIR = os.path.join(ROOT, "fixtures", "models", "tiny-qwen3")
ADAPTER_DIR = os.path.join(ROOT, "fixtures", "adapters", "tiny-qwen3-lora")
API_KEY = "sk-temper-test"
MODEL = "tiny"


def start_server(binary, *extra, max_model_len=512, model=MODEL_DIR):
    """Start `temper serve` on a free port; return (process, base URL)."""
    proc = subprocess.Popen(
        [binary, "serve", "--model", model, "--served-model-name", MODEL,
         "--host", "127.0.0.1", "--port", "0", "--max-model-len", str(max_model_len),
         "--lora-root", os.path.dirname(ADAPTER_DIR), *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines = []
    box = {}

    def read():
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m and "url" not in box:
                box["url"] = m.group(1)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.time() + 60
    while time.time() < deadline and "url" not in box:
        if proc.poll() is not None:
            time.sleep(0.2)
            raise RuntimeError("server exited:\n" + "".join(lines))
        time.sleep(0.05)
    if "url" not in box:
        proc.kill()
        raise RuntimeError("server did not print its address:\n" + "".join(lines))
    return proc, box["url"]


def post_json(url, path, body, key=API_KEY):
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def checker(results):
    """A decorator that runs a check at once, prints ok / FAIL with its time
    and records (name, passed) in `results`."""
    def check(name):
        def wrap(fn):
            t0 = time.time()
            try:
                fn()
                results.append((name, True))
                print(f"ok   {name} ({time.time() - t0:.2f}s)")
            except Exception:
                results.append((name, False))
                print(f"FAIL {name}")
                traceback.print_exc()
            return fn
        return wrap
    return check


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", default=os.path.join(ROOT, "target", "debug", "temper"))
    args = ap.parse_args()
    import openai
    import pydantic  # installed with openai

    server, url = start_server(args.temper, "--api-key", API_KEY,
                               "--lora", f"pol={ADAPTER_DIR}")
    busy, busy_url = start_server(args.temper, "--max-queue", "0")
    # The tiny vocabulary spells two tool schemas in ~590 prompt tokens.
    wide, wide_url = start_server(args.temper, max_model_len=2048)
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    results = []

    check = checker(results)

    user = [{"role": "user", "content": "Say something."}]

    @check("models: base and adapter listed")
    def _():
        ids = [m.id for m in client.models.list().data]
        assert ids[0] == MODEL and "pol" in ids, ids

    @check("chat: n=2, usage, version in system_fingerprint")
    def _():
        r = client.chat.completions.create(model=MODEL, messages=user, max_tokens=8,
                                           n=2, seed=1, temperature=0.8)
        assert r.object == "chat.completion"
        assert len(r.choices) == 2 and [c.index for c in r.choices] == [0, 1]
        for c in r.choices:
            assert c.message.role == "assistant"
            assert isinstance(c.message.content, str)
            assert c.finish_reason in ("stop", "length")
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.usage.completion_tokens <= 16
        assert r.system_fingerprint == f"{MODEL}@v0", r.system_fingerprint
        assert r.model_extra.get("version") == 0

    @check("chat: same seed reproduces, another seed differs")
    def _():
        def run(seed):
            r = client.chat.completions.create(
                model=MODEL, messages=user, max_completion_tokens=24, seed=seed, n=2,
                temperature=1.0, extra_body={"ignore_eos": True})
            return [c.message.content for c in r.choices]
        a, b, c = run(7), run(7), run(8)
        assert a == b, (a, b)
        assert a != c, (a, c)

    @check("chat: logprobs and top_logprobs")
    def _():
        r = client.chat.completions.create(model=MODEL, messages=user, max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=4)
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens
        for t in content:
            assert t.logprob <= 0.0
            assert len(t.top_logprobs) == 4
            # Greedy: the chosen token is the most likely one.
            assert t.top_logprobs[0].token == t.token
            assert t.top_logprobs[0].logprob == t.logprob
            assert sorted([x.logprob for x in t.top_logprobs], reverse=True) == \
                [x.logprob for x in t.top_logprobs]

    @check("chat: streaming equals the non-streamed answer, ends with usage")
    def _():
        kw = dict(model=MODEL, messages=user, max_tokens=20, seed=3, temperature=1.0, n=2)
        whole = client.chat.completions.create(**kw)
        stream = client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True})
        text, finish, usage, chunks = ["", ""], [None, None], None, 0
        for ch in stream:
            chunks += 1
            if ch.usage is not None:
                usage = ch.usage
            for c in ch.choices:
                text[c.index] += c.delta.content or ""
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
        assert chunks > 3, chunks
        assert text == [c.message.content for c in whole.choices], (text, whole)
        assert finish == [c.finish_reason for c in whole.choices]
        assert usage.completion_tokens == whole.usage.completion_tokens

    @check("completions: text, token ids, echo with logprobs")
    def _():
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                      temperature=0, logprobs=2, echo=True)
        c = r.choices[0]
        assert c.text.startswith("Once upon a time")
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
        assert lp.token_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:])
        assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
        ids = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, n=3,
                                        temperature=1.0, seed=2)
        assert len(ids.choices) == 3 and ids.usage.prompt_tokens == 3
        default = client.completions.create(model=MODEL, prompt="x", temperature=1.0,
                                            seed=1, extra_body={"ignore_eos": True})
        assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens

    @check("completions: streaming")
    def _():
        kw = dict(model=MODEL, prompt="The", max_tokens=12, seed=9, temperature=1.0)
        whole = client.completions.create(**kw)
        text = "".join(ch.choices[0].text for ch in
                       client.completions.create(**kw, stream=True) if ch.choices)
        assert text == whole.choices[0].text, (text, whole.choices[0].text)

    @check("tools: schemas reach the template; a tool-call round trip renders")
    def _():
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}}]
        plain = client.chat.completions.create(model=MODEL, messages=user, max_tokens=1)
        with_tools = client.chat.completions.create(model=MODEL, messages=user, max_tokens=1,
                                                    tools=tools, tool_choice="auto")
        assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
        ]
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                           max_tokens=4)
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")

    def expect(exc, fn, needle):
        try:
            fn()
        except exc as e:
            assert needle in str(e), (needle, str(e))
            return e
        raise AssertionError(f"expected {exc.__name__}")

    # Structured outputs: the fixture model is random, so only the mask makes
    # these outputs valid. Every field is bounded, so a valid answer is finite.
    class Ticket(pydantic.BaseModel):
        category: Literal["billing", "bug", "other"]
        urgent: bool
        summary: str = pydantic.Field(max_length=12)
        priority: int = pydantic.Field(ge=1, le=5)
        tags: List[Literal["a", "b"]] = pydantic.Field(max_length=2)

    class GetWeather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=10)
        unit: Literal["celsius", "fahrenheit"]

    class Add(pydantic.BaseModel):
        a: int = pydantic.Field(ge=-99, le=99)
        b: int = pydantic.Field(ge=-99, le=99)

    ticket = [{"role": "user", "content": "Support email: 'I was charged twice!' Classify it."}]

    @check("structured: json_schema via parse(Pydantic, strict): 32 samples at T=1 all validate")
    def _():
        for seed in range(4):
            r = client.chat.completions.parse(model=MODEL, messages=ticket, response_format=Ticket,
                                              n=8, temperature=1.0, seed=seed, max_tokens=160)
            assert len(r.choices) == 8
            for c in r.choices:
                # parse() raises on finish_reason "length"; "stop" = a complete document.
                assert c.finish_reason == "stop", c
                assert isinstance(c.message.parsed, Ticket), c.message
                Ticket.model_validate_json(c.message.content, strict=True)
        greedy = client.chat.completions.parse(model=MODEL, messages=ticket,
                                               response_format=Ticket, temperature=0,
                                               max_tokens=160)
        assert isinstance(greedy.choices[0].message.parsed, Ticket)

    @check("structured: json_object: of 16 samples at T=1, each that stops is a JSON object")
    def _():
        # Free-form keys and strings: a random model may not close them within
        # max_tokens (SmolLM2 must: test_openai_gguf.py).
        r = client.chat.completions.create(model=MODEL, messages=ticket, n=16, temperature=1.0,
                                           seed=5, max_tokens=256,
                                           response_format={"type": "json_object"})
        stopped = 0
        for c in r.choices:
            assert c.message.content.startswith("{"), c
            assert c.finish_reason in ("stop", "length"), c
            if c.finish_reason == "stop":
                stopped += 1
                assert isinstance(json.loads(c.message.content), dict), c.message.content
        assert stopped > 0, r

    @check("structured: streaming a schema gives the non-streamed documents; length cuts")
    def _():
        fmt = openai.lib._pydantic.to_strict_json_schema(Ticket)
        kw = dict(model=MODEL, messages=ticket, n=2, temperature=1.0, seed=9, max_tokens=160,
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "Ticket", "schema": fmt,
                                                   "strict": True}})
        whole = client.chat.completions.create(**kw)
        text, finish = ["", ""], [None, None]
        for ch in client.chat.completions.create(**kw, stream=True):
            for c in ch.choices:
                text[c.index] += c.delta.content or ""
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
        assert text == [c.message.content for c in whole.choices], (text, whole)
        assert finish == ["stop", "stop"], finish
        for t in text:
            Ticket.model_validate_json(t, strict=True)
        kw["max_tokens"] = 4
        cut = client.chat.completions.create(**kw)
        assert [c.finish_reason for c in cut.choices] == ["length", "length"]

    @check("structured: tool_choice required / named: 16 calls at T=1 all validate")
    def _():
        tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(Add)]
        classes = {"GetWeather": GetWeather, "Add": Add}
        wide_client = openai.OpenAI(base_url=wide_url + "/v1", api_key="any", max_retries=0)
        for choice, only in (("required", None),
                             ({"type": "function", "function": {"name": "Add"}}, "Add")):
            r = wide_client.chat.completions.create(model=MODEL, messages=ticket, tools=tools,
                                               tool_choice=choice, n=8, temperature=1.0,
                                               seed=2, max_tokens=160)
            for c in r.choices:
                assert c.finish_reason == "tool_calls", c
                (call,) = c.message.tool_calls
                name = call.function.name
                assert name in classes and (only is None or name == only), name
                classes[name].model_validate_json(call.function.arguments, strict=True)

    @check("structured: unenforceable keywords: strict 400 naming them, else named in the answer")
    def _():
        unique = {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2, "uniqueItems": True}
        expect(openai.BadRequestError, lambda: client.chat.completions.create(
            model=MODEL, messages=user, max_tokens=8, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                                       "schema": unique}}), "uniqueItems")
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=user, max_tokens=8, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": unique}})
        assert raw.headers["x-temper-unenforced-schema-keywords"] == "uniqueItems", raw.headers
        r = raw.parse()
        assert r.model_extra["unenforced_schema_keywords"] == ["uniqueItems"], r
        expect(openai.BadRequestError, lambda: client.chat.completions.create(
            model=MODEL, messages=user, max_tokens=8,
            tools=[openai.pydantic_function_tool(Add)],
            tool_choice={"type": "function", "function": {"name": "Nope"}}), "not in `tools`")

    @check("RL: /v1/generate token-in/token-out with logprobs and version")
    def _():
        r = post_json(url, "/v1/generate", {
            "model": "pol", "prompt_token_ids": [5, 17, 300], "n": 2, "max_tokens": 6,
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": 4,
            "stop_token_ids": [], "stop": []})
        assert r["version"] == 1 and r["model"] == "pol"
        for c in r["choices"]:
            assert len(c["token_ids"]) == len(c["logprobs"]) >= 1
            assert all(x <= 0 for x in c["logprobs"])

    @check("LoRA: hot-swap bumps the version the responses report")
    def _():
        before = client.chat.completions.create(model="pol", messages=user, max_tokens=2)
        assert before.system_fingerprint == "pol@v1", before.system_fingerprint
        r = post_json(url, "/v1/load_lora_adapter",
                      {"lora_name": "pol", "lora_path": ADAPTER_DIR})
        assert r["version"] == 2, r
        after = client.chat.completions.create(model="pol", messages=user, max_tokens=2)
        assert after.system_fingerprint == "pol@v2"
        post_json(url, "/v1/unload_lora_adapter", {"lora_name": "pol"})
        try:
            client.chat.completions.create(model="pol", messages=user, max_tokens=2)
            raise AssertionError("unloaded adapter still served")
        except openai.NotFoundError:
            pass

    @check("errors: 400 invalid parameter")
    def _():
        expect(openai.BadRequestError, lambda: client.chat.completions.create(
            model=MODEL, messages=user, temperature=5), "temperature")
        expect(openai.BadRequestError, lambda: client.chat.completions.create(
            model=MODEL, messages=user, n=0), "n must be")

    @check("sampling: logit_bias forces a token; stop_token_ids ends on it")
    def _():
        forced = [client.chat.completions.create(
            model=MODEL, messages=user, max_tokens=6, temperature=1.0, seed=seed,
            logit_bias={"42": 100}, extra_body={"ignore_eos": True}) for seed in (1, 2)]
        assert forced[0].choices[0].message.content == forced[1].choices[0].message.content
        assert forced[0].usage.completion_tokens == 6
        free = [client.chat.completions.create(
            model=MODEL, messages=user, max_tokens=6, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True}).choices[0].message.content for seed in (1, 2)]
        assert free[0] != free[1], free
        r = client.chat.completions.create(
            model=MODEL, messages=user, max_tokens=6, temperature=1.0, seed=1,
            logit_bias={"42": 100}, extra_body={"stop_token_ids": [42]})
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1, r

    @check("sampling: min_p, repetition/frequency/presence penalties are honoured")
    def _():
        def text(**kw):
            extra = kw.pop("extra_body", {})
            extra["ignore_eos"] = True
            return client.chat.completions.create(
                model=MODEL, messages=user, max_tokens=16, seed=3, extra_body=extra,
                **kw).choices[0].message.content
        greedy = text(temperature=0.0)
        assert text(temperature=1.0, extra_body={"min_p": 1.0}) == greedy
        assert text(temperature=0.0, extra_body={"repetition_penalty": 50.0}) != greedy
        sampled = text(temperature=1.0)
        assert text(temperature=1.0, frequency_penalty=2.0, presence_penalty=2.0) != sampled
        expect(openai.BadRequestError, lambda: text(temperature=1.0, frequency_penalty=3.0),
               "frequency_penalty")

    @check("errors: 400 names a field the server does not implement")
    def _():
        e = expect(openai.BadRequestError, lambda: client.chat.completions.create(
            model=MODEL, messages=user, max_tokens=2, extra_body={"guided_json": {}}),
            "unsupported field `guided_json`")
        assert e.param == "guided_json", e.param
        expect(openai.BadRequestError, lambda: client.completions.create(
            model=MODEL, prompt="x", max_tokens=2, extra_body={"bad_words": ["x"]}),
            "unsupported field `bad_words`")

    @check("errors: 400 context length exceeded, with the limit")
    def _():
        e = expect(openai.BadRequestError, lambda: client.chat.completions.create(
            model=MODEL, messages=user, max_tokens=10_000), "maximum context length is 512")
        assert e.code == "context_length_exceeded", e.code

    @check("errors: 404 unknown model")
    def _():
        expect(openai.NotFoundError, lambda: client.chat.completions.create(
            model="no-such-model", messages=user), "does not exist")

    @check("errors: 401 bad API key")
    def _():
        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
        expect(openai.AuthenticationError, lambda: bad.models.list(), "API key")

    @check("errors: 503 overloaded")
    def _():
        c = openai.OpenAI(base_url=busy_url + "/v1", api_key="any", max_retries=0)
        e = expect(openai.InternalServerError, lambda: c.chat.completions.create(
            model=MODEL, messages=user, max_tokens=2), "overloaded")
        assert e.status_code == 503

    @check("metrics: Prometheus text with request and token counters")
    def _():
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'temper_requests_total{route="/v1/chat/completions",status="200"}' in text
        assert "temper_generation_tokens_total" in text
        assert "temper_kv_cache_usage_ratio" in text

    for p in (server, busy, wide):
        p.terminate()
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
    failed = [n for n, ok in results if not ok]
    print(f"openai-client: {len(results) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
