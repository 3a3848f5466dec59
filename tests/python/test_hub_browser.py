"""CI: the hub's web page in a real headless browser (Chromium).

Starts `temper hub serve` on a free port, publishes an environment with
`temper env push`, then has Chromium load the list, a search and the
environment's page (`--dump-dom`: the DOM after the browser parsed and laid
it out) and asserts what a user sees there; saves screenshots into the
artifacts directory. Stdlib only.
"""

import argparse
import os
import subprocess
import sys
import tempfile


def chromium(binary, *args, console=False):
    """Run headless Chromium; its stdout, or with `console` also the page's
    console messages (CSP violations are reported there)."""
    logging = ["--enable-logging=stderr", "--v=0"] if console else []
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--user-data-dir=" + tempfile.mkdtemp(prefix="chromium-"), *logging, *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"chromium failed ({out.returncode}): {out.stderr[-2000:]}")
    if console:
        return out.stdout, [l for l in out.stderr.splitlines() if "CONSOLE" in l or "Content Security Policy" in l]
    return out.stdout


def expect(text, needle, what):
    if needle not in text:
        raise SystemExit(f"{what}: {needle!r} not in the page:\n{text[:3000]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", required=True)
    ap.add_argument("--chromium", default="chromium")
    ap.add_argument("--artifacts", required=True)
    a = ap.parse_args()
    temper = os.path.abspath(a.temper)
    os.makedirs(a.artifacts, exist_ok=True)
    work = tempfile.mkdtemp(prefix="hub-browser-")
    env = dict(os.environ, TEMPER_CONFIG_DIR=os.path.join(work, "config"),
               TEMPER_HUB_CACHE=os.path.join(work, "cache"))
    hub_dir = os.path.join(work, "hub")
    server = subprocess.Popen([temper, "hub", "serve", "--addr", "127.0.0.1:0", "--dir", hub_dir],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = server.stdout.readline().strip()
        if not line.startswith("listening on "):
            raise SystemExit(f"hub did not start: {line!r}")
        url = "http://" + line[len("listening on "):]
        token = subprocess.run([temper, "hub", "token", "create", "--namespace", "acme", "--dir", hub_dir],
                               check=True, capture_output=True, text=True, env=env).stdout.strip()
        envdir = os.path.join(work, "capitals")
        os.makedirs(envdir)
        with open(os.path.join(envdir, "env.toml"), "w") as f:
            f.write('name = "capitals"\nnamespace = "acme"\nversion = "1.0.0"\n'
                    'description = "Name the capital of a European country."\ntags = ["geo", "easy"]\n'
                    'license = "MIT"\n[dataset]\neval = "eval.jsonl"\n[[rubric]]\nfunction = "exact_match"\n')
        with open(os.path.join(envdir, "eval.jsonl"), "w") as f:
            f.write('{"question": "France?", "answer": "Paris"}\n')
        with open(os.path.join(envdir, "README.md"), "w") as f:
            # Issue 31: links a README must not turn into script.
            f.write("# Capitals\n\nAsk for **capitals**.\n\n| country | capital |\n|---|---|\n| France | Paris |\n\n"
                    "[click me](javascript:alert(document.domain)) [also](JaVa&#x53;cript:alert(1)) "
                    "![pic](data:image/svg+xml;base64,PHN2Zz4=) [docs](https://example.com/docs) [up](#capitals)\n")
        push = subprocess.run([temper, "env", "push", envdir, "--hub", url], capture_output=True, text=True,
                              env=dict(env, TEMPER_HUB_TOKEN=token))
        if push.returncode != 0:
            raise SystemExit(f"push failed: {push.stderr}")
        digest = push.stdout.split()[2]

        index = chromium(a.chromium, "--dump-dom", url + "/")
        expect(index, 'href="/envs/acme/capitals"', "list")
        expect(index, "Name the capital of a European country.", "list")
        expect(index, "1 environment", "list")
        search = chromium(a.chromium, "--dump-dom", url + "/?q=nothing+like+this")
        expect(search, "0 environments", "search")
        tagged = chromium(a.chromium, "--dump-dom", url + "/?tag=geo")
        expect(tagged, "acme/capitals", "tag search")
        page, console = chromium(a.chromium, "--dump-dom", url + "/envs/acme/capitals", console=True)
        # The Content-Security-Policy allows the page's own inline style (by
        # hash) and nothing has to be blocked: no violation is reported.
        if console:
            raise SystemExit("the page reported console messages (CSP violations?):\n" + "\n".join(console))
        for dead in ["javascript:", "JaVaScript:", "data:image"]:
            if dead in page:
                raise SystemExit(f"README link {dead!r} is live in the page:\n{page[:3000]}")
        expect(page, 'href="https://example.com/docs"', "README https link")
        expect(page, 'href="#capitals"', "README anchor link")
        expect(page, "<strong>capitals</strong>", "rendered README")
        expect(page, "<td>Paris</td>", "README table")
        expect(page, digest, "digest")
        expect(page, "temper eval acme/capitals@1.0.0", "eval command")
        for name, path in [("hub-index.png", "/"), ("hub-env.png", "/envs/acme/capitals")]:
            shot = os.path.abspath(os.path.join(a.artifacts, name))
            chromium(a.chromium, "--window-size=1200,900", "--screenshot=" + shot, url + path)
            if not os.path.getsize(shot) > 1000:
                raise SystemExit(f"screenshot {shot} is empty")
        print(f"hub pages OK in Chromium; screenshots in {a.artifacts}")
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
