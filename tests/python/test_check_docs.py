#!/usr/bin/env python3
"""scripts/check_docs.py on pages made for it: what passes, what fails and
where, a bad run marker, a background process left behind, a timeout.

    python3 tests/python/test_check_docs.py      # stdlib only; ~5 s, no temper needed
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "check_docs.py"
failures = []


def check(name, cond, detail=""):
    print(f"{'ok  ' if cond else 'FAIL'} {name}" + (f": {detail}" if detail and not cond else ""))
    if not cond:
        failures.append(name)


def run(tmp, *pages, timeout="20"):
    # /bin/true stands in for temper: these pages never call it.
    return subprocess.run([sys.executable, str(CHECK), "--temper", "/bin/true", "--timeout", timeout,
                           "--scratch", str(tmp / "scratch"), *map(str, pages)],
                          capture_output=True, text=True, timeout=120)


def page(tmp, name, text):
    p = tmp / name
    p.write_text(text)
    return p


with tempfile.TemporaryDirectory(dir=os.environ.get("HOME")) as d:
    tmp = Path(d)
    pid_file = tmp / "bg.pid"
    good = page(tmp, "good.md", f"""# A page
```sh run
X=41
ls examples fixtures python scripts tests >/dev/null   # the repository's directories are linked
[ "$(command -v temper)" != "" ]                       # --temper is on PATH as temper
```
Prose, then a plain block that must not run:
```sh
exit 1
```
```toml
not = "run"
```
```sh run
X=$((X + 1)); [ "$X" = 42 ]                            # the same session as the block above
sleep 300 & echo $! > {pid_file}                        # left running: the check must kill it
test "$HOME" != "{os.environ.get('HOME')}"             # a fresh HOME
```
""")
    bad = page(tmp, "bad.md", """# Fails in its second block
```sh run
true
```

```sh run
echo before
false \\
    --an-argument
echo never
```
""")
    marker = page(tmp, "marker.md", "```bash run\ntrue\n```\n")
    markers = page(tmp, "markers.md", "```sh title=run.sh\nexit 1\n```\n```sh run-slow\ntrue\n```\n")
    slow = page(tmp, "slow.md", "```sh run\necho started\nuntil false; do sleep 0.2; done\n```\n")

    r = run(tmp, good)
    check("a good page passes", r.returncode == 0 and "ok " in r.stdout and "(2 blocks," in r.stdout,
          r.stdout + r.stderr)
    check("the summary counts runnable and plain blocks",
          any(line.split()[1:3] == ["2", "1"] for line in r.stdout.splitlines() if "good.md" in line
              and not line.startswith("ok")), r.stdout)
    pid = int(pid_file.read_text())
    time.sleep(0.2)
    alive = Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]
    check("a background process of the page is killed at its end", not alive)

    r = run(tmp, bad)
    check("a failing page fails", r.returncode == 1, r.stdout)
    check("the failure names the block, the line and the command",
          "FAIL " in r.stdout and "bad.md block 2 (line 8): false --an-argument" in r.stdout, r.stdout)
    check("the failure shows the output", "    before" in r.stdout and "never" not in r.stdout, r.stdout)

    r = run(tmp, marker)
    check("an unknown run marker fails its page",
          r.returncode == 1 and "unknown run marker `bash run`" in r.stdout, r.stdout)

    r = run(tmp, markers)
    check("any marker-like variant fails (`sh run-slow`), a word that merely contains run does not",
          r.returncode == 1 and "markers.md line 4: unknown run marker `sh run-slow`" in r.stdout
          and "line 1" not in r.stdout, r.stdout)

    t0 = time.monotonic()
    r = run(tmp, slow, timeout="2")
    check("a page past its timeout fails, naming the command it was in",
          r.returncode == 1 and "slow.md block 1 (line 3): until false" in r.stdout
          and "timed out" in r.stdout and time.monotonic() - t0 < 30, r.stdout)

    r = run(tmp, good, bad)
    check("one failing page fails the run, the others still run",
          r.returncode == 1 and "ok " in r.stdout and "1 of 2 pages passed" in r.stdout, r.stdout)

print(f"check-docs: {'all passed' if not failures else f'{len(failures)} failed'}")
sys.exit(1 if failures else 0)
