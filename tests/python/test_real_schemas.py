"""Real-world JSON schemas as `response_format` on `temper serve` (SmolLM2).

The schemas are SchemaStore's (and a few vendors') configuration-file schemas
as vendored by `check-jsonschema` (pinned in
tests/python/requirements-schemas.txt; pip fetches and caches it, nothing is
committed). Each is posted to `/v1/chat/completions` as
`response_format: json_schema` twice:

- `strict: true`: every keyword enforced or a 400 (how every schema was
  compiled before lenient mode: the "before" number);
- `strict` absent: llguidance's lenient mode; what it cannot enforce is named
  by the `x-temper-unenforced-schema-keywords` header and the
  `unenforced_schema_keywords` field.

Each lenient answer that finished (`finish_reason` `stop`) is validated with
`jsonschema` against the FULL schema (its own draft; `format` as an
annotation, the library's default). Prints a line per schema and

    real-schemas: N schemas; strict accepts S; lenient accepts A (refused R);
    finished F: valid V, invalid I; truncated T

then `real-schemas: P passed, Q failed` for three checks: lenient mode
accepts at least 80% of the schemas, the header and the field agree, and at
least 80% of finished answers validate. Exits non-zero on a failed check.

Run: python tests/python/test_real_schemas.py --temper target/release/temper \\
         --gguf "$(scripts/fetch_smollm2.sh)"   (~1.5 min on 2 cores)
"""

import argparse
import concurrent.futures
import importlib.metadata
import importlib.resources
import json
import os
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_openai_server import API_KEY, MODEL, ROOT, start_server  # noqa: E402

HEADER = "x-temper-unenforced-schema-keywords"


def vendored_schemas():
    """(name, schema) of every schema check-jsonschema vendors, by name."""
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    out = []
    for f in sorted(vendor.iterdir(), key=lambda f: f.name):
        if f.name.endswith(".json"):
            out.append((f.name[:-5], json.loads(f.read_text(encoding="utf-8"))))
    return out


def post(url, body):
    """(status, headers, parsed body) of a POST; errors are answers too."""
    data = json.dumps(body, separators=(",", ":")).encode()
    req = urllib.request.Request(
        url + "/v1/chat/completions", data=data, method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, e.headers, json.loads(raw)
        except ValueError:
            return e.code, e.headers, {"error": {"message": raw.decode(errors="replace")}}


def request(name, schema, strict, max_tokens):
    fmt = {"name": name.replace(".", "_")[:64], "schema": schema}
    if strict:
        fmt["strict"] = True
    title = schema.get("title") or name
    return {
        "model": MODEL, "max_tokens": max_tokens, "temperature": 0.7, "seed": 7,
        "messages": [{"role": "user", "content":
                      f"Write a small, typical {name} configuration file ({title}) as JSON."}],
        "response_format": {"type": "json_schema", "json_schema": fmt},
    }


def validate(schema, doc):
    """The first error of `doc` under the full `schema`, or None."""
    import jsonschema
    cls = jsonschema.validators.validator_for(schema)
    err = next(iter(cls(schema).iter_errors(doc)), None)
    if err is None:
        return None
    where = "/".join(str(p) for p in err.absolute_path)
    return f"at /{where}: {err.message[:160]}"


def run_one(url, name, schema, max_tokens):
    r = {"name": name}
    # Before: strict mode, compile only (one token is enough to know).
    st, _, v = post(url, request(name, schema, True, 1))
    r["strict"] = st == 200
    r["strict_error"] = None if st == 200 else v.get("error", {}).get("message", "")
    t0 = time.time()
    st, headers, v = post(url, request(name, schema, False, max_tokens))
    r["secs"] = time.time() - t0
    if st != 200:
        r["status"] = st
        r["error"] = v.get("error", {}).get("message", "")
        return r
    r["status"] = 200
    r["header"] = headers.get(HEADER)
    r["field"] = v.get("unenforced_schema_keywords")
    choice = v["choices"][0]
    r["finish"] = choice["finish_reason"]
    text = choice["message"]["content"]
    r["tokens"] = v["usage"]["completion_tokens"]
    r["text"] = text
    if r["finish"] == "stop":
        try:
            doc = json.loads(text)
        except ValueError as e:
            r["invalid"] = f"not JSON: {e}"
            return r
        r["invalid"] = validate(schema, doc)
        r["doc"] = text
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", default=os.path.join(ROOT, "target", "release", "temper"))
    ap.add_argument("--gguf", required=True, help="SmolLM2's GGUF (scripts/fetch_smollm2.sh)")
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--parallel", type=int, default=8)
    args = ap.parse_args()

    schemas = vendored_schemas()
    version = importlib.metadata.version("check-jsonschema")
    print(f"{len(schemas)} schemas from check-jsonschema {version}")
    server, url = start_server(args.temper, "--api-key", API_KEY, max_model_len=1024,
                               model=args.gguf)
    results = []
    try:
        with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
            futures = [pool.submit(run_one, url, n, s, args.max_tokens) for n, s in schemas]
            for f in futures:
                results.append(f.result())
    finally:
        server.terminate()
        server.wait(timeout=30)

    disagree = []
    for r in results:
        before = "strict ok " if r["strict"] else "strict 400"
        if r["status"] != 200:
            print(f"  {r['name']:24} {before} | lenient {r['status']}: {r['error'][:220]}")
            continue
        said = ", ".join(r["field"]) if r["field"] else None
        if r["header"] != said:
            disagree.append((r["name"], r["header"], r["field"]))
        if r["finish"] != "stop":
            outcome = f"truncated ({r['finish']}, {r['tokens']} tokens): {r['text'][-60:]!r}"
        elif r["invalid"]:
            outcome = f"INVALID {r['invalid']}"
        else:
            outcome = f"valid ({r['tokens']} tokens)"
        print(f"  {r['name']:24} {before} | lenient ok {r['secs']:5.1f}s, "
              f"unenforced [{said or ''}]: {outcome}")

    n = len(results)
    strict = sum(r["strict"] for r in results)
    accepted = [r for r in results if r["status"] == 200]
    finished = [r for r in accepted if r["finish"] == "stop"]
    valid = [r for r in finished if not r["invalid"]]
    invalid = len(finished) - len(valid)
    truncated = len(accepted) - len(finished)
    print(f"real-schemas: {n} schemas; strict accepts {strict}; lenient accepts "
          f"{len(accepted)} (refused {n - len(accepted)}); finished {len(finished)}: "
          f"valid {len(valid)}, invalid {invalid}; truncated {truncated}")
    for r in results:
        if r["status"] == 200 and r.get("invalid"):
            print(f"  invalid {r['name']}: {r['doc'][:300]}")
    if disagree:
        print(f"  header and field disagree: {disagree}")
    checks = [
        ("lenient mode accepts at least 80% of the schemas", len(accepted) >= 0.8 * n),
        ("the header and the field name the same unenforced keywords", not disagree),
        ("at least 80% of finished answers validate against the full schema",
         len(finished) > 0 and len(valid) >= 0.8 * len(finished)),
    ]
    for what, ok in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    failed = sum(not ok for _, ok in checks)
    print(f"real-schemas: {len(checks) - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
