"""The official `openai` client against `temper serve --model FILE.gguf`, on a
real pretrained model: SmolLM2-135M-Instruct (scripts/fetch_smollm2.sh).

Run: python tests/python/test_openai_gguf.py --gguf PATH [--temper target/debug/temper]

Greedy chat answers must equal transformers' greedy continuations recorded in
fixtures/smollm2/refs.json (scripts/make_smollm2_refs.py), streamed and not;
structured outputs on a real model: a Pydantic schema at temperature 1 (both
samples finish and validate; the many-sample checks run on the fixture model
in test_openai_server.py, a debug build decodes SmolLM2 slowly) and greedy json_object; prints `openai-gguf: N passed, M failed` and exits non-zero on any failure.
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
from typing import Literal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REFS = os.path.join(ROOT, "fixtures", "smollm2", "refs.json")
MODEL = "smollm2"


def start_server(binary, gguf):
    proc = subprocess.Popen(
        [binary, "serve", "--model", gguf, "--served-model-name", MODEL,
         "--host", "127.0.0.1", "--port", "0", "--max-model-len", "2048"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines, box = [], {}

    def read():
        for line in proc.stderr:
            lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m and "url" not in box:
                box["url"] = m.group(1)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.time() + 120
    while time.time() < deadline and "url" not in box:
        if proc.poll() is not None:
            time.sleep(0.2)
            raise RuntimeError("server exited:\n" + "".join(lines))
        time.sleep(0.05)
    if "url" not in box:
        proc.kill()
        raise RuntimeError("server did not print its address:\n" + "".join(lines))
    return proc, box["url"]


def structured(client):
    """Structured outputs on SmolLM2; returns the number of checks passed."""
    import pydantic

    class Ticket(pydantic.BaseModel):
        category: Literal["billing", "bug", "account", "other"]
        urgent: bool
        summary: str = pydantic.Field(max_length=30)

    email = [{"role": "user", "content": "Classify this support email: 'I was charged twice "
              "for my subscription this month, please refund me today!'"}]
    r = client.chat.completions.parse(model=MODEL, messages=email, response_format=Ticket,
                                      temperature=1.0, n=2, seed=0, max_tokens=48)
    for c in r.choices:
        assert c.finish_reason == "stop", c
        Ticket.model_validate_json(c.message.content, strict=True)
    print(f"structured: {r.choices[0].message.content}")
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=48, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Reply with a JSON object whose only key is "
                   "\"city\", set to the capital of France."}])
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    assert isinstance(json.loads(c.message.content), dict), c.message.content
    print(f"json_object: {c.message.content}")
    return 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", default=os.path.join(ROOT, "target", "debug", "temper"))
    ap.add_argument("--gguf", default=os.environ.get("TEMPER_SMOLLM2_GGUF"))
    args = ap.parse_args()
    if not args.gguf:
        sys.exit("pass --gguf or set TEMPER_SMOLLM2_GGUF (scripts/fetch_smollm2.sh)")
    import openai

    with open(REFS, encoding="utf-8") as f:
        refs = json.load(f)
    server, url = start_server(args.temper, args.gguf)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    passed, failed = 0, 0
    try:
        models = [m.id for m in client.models.list().data]
        assert models == [MODEL], models
        passed += 1
        for chat in refs["chats"][:3]:
            want = chat["greedy_text"]
            r = client.chat.completions.create(
                model=MODEL, messages=chat["messages"], max_tokens=24, temperature=0.0)
            got = r.choices[0].message.content
            if got == want:
                passed += 1
            else:
                failed += 1
                print(f"FAIL chat {chat['messages'][-1]['content']!r}: {got!r} != {want!r}")
            stream = client.chat.completions.create(
                model=MODEL, messages=chat["messages"], max_tokens=24, temperature=0.0,
                stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            if text == want:
                passed += 1
            else:
                failed += 1
                print(f"FAIL streamed chat: {text!r} != {want!r}")
        print(f"answer: {refs['chats'][0]['messages'][-1]['content']!r} -> {refs['chats'][0]['greedy_text']!r}")
        passed += structured(client)
    except Exception:
        traceback.print_exc()
        failed += 1
    finally:
        server.kill()
        server.wait()
    print(f"openai-gguf: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
