"""`harbor view` shows a temper job, in a real headless browser (Chromium).

Runs the job of test_harbor_job.py (`temper tasks run`, the oracle on four
tasks, 2 attempts each: rewards 1, 1 with a second key, 0.5, and none with
RewardFileNotFoundError), starts Harbor's own viewer (`harbor view JOBS
--jobs`: a FastAPI server and a React app) on it, and has Chromium render
the pages a user opens (`--dump-dom` after the app fetched its data):
the job list shows the job with every trial completed and its errors, the
job's Rollouts tab lists every trial with its reward (or its exception),
and a trial's page opens with its reward, its trajectory and its exception.
Saves screenshots into the artifacts directory.

Run: python tests/python/test_harbor_view.py --temper target/debug/temper --artifacts DIR
Needs `pip install -r tests/python/requirements-harbor.txt` (Python >= 3.12),
Chromium, and a host where temper's sandbox runs. About 30-60 s.
"""

import argparse
import html.parser
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

from test_harbor_job import ATTEMPTS, EXPECTED, JOB, run_job
from test_hub_browser import chromium, expect

# The app renders after fetching from the API; virtual time lets it finish.
WAIT = "--virtual-time-budget=20000"


class Rows(html.parser.HTMLParser):
    """The text of each table row's cells."""

    def __init__(self):
        super().__init__()
        self.rows, self.cell = [], None

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th") and self.rows:
            self.cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            self.rows[-1].append(" ".join("".join(self.cell).split()))
            self.cell = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


def rows_of(page):
    p = Rows()
    p.feed(page)
    return p.rows


def text_of(page):
    """What a user reads: the page's text without its scripts."""

    class Text(html.parser.HTMLParser):
        def __init__(self):
            super().__init__()
            self.out, self.skip = [], 0

        def handle_starttag(self, tag, attrs):
            self.skip += tag in ("script", "style")

        def handle_endtag(self, tag):
            self.skip -= tag in ("script", "style") and self.skip > 0

        def handle_data(self, data):
            if not self.skip:
                self.out.append(data)

    t = Text()
    t.feed(page)
    return " ".join(" ".join(t.out).split())


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_viewer(jobs, port):
    harbor = os.path.join(os.path.dirname(sys.executable), "harbor")
    proc = subprocess.Popen([harbor, "view", jobs, "--jobs", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"harbor view exited:\n{proc.stdout.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("harbor view did not answer /api/health within 120 s")


def shown_reward(rewards):
    """How the viewer prints a trial's reward: its `reward`, 2 decimals."""
    return f"{rewards['reward']:.2f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", required=True)
    ap.add_argument("--chromium", default="chromium")
    ap.add_argument("--artifacts", required=True)
    a = ap.parse_args()
    os.makedirs(a.artifacts, exist_ok=True)
    n_total = len(EXPECTED) * ATTEMPTS
    n_err = ATTEMPTS * sum(1 for v in EXPECTED.values() if v is None)
    with tempfile.TemporaryDirectory(prefix="harbor-view-") as root:
        jobs, job, _ = run_job(os.path.abspath(a.temper), root)
        trials = sorted(d for d in os.listdir(job) if os.path.isdir(os.path.join(job, d)))
        port = free_port()
        viewer = start_viewer(jobs, port)
        url = f"http://127.0.0.1:{port}"
        try:
            index = chromium(a.chromium, WAIT, "--dump-dom", url + "/")
            row = next((r for r in rows_of(index) if JOB in r), None)
            if row is None:
                raise SystemExit(f"the job list has no row for {JOB}:\n{text_of(index)[:3000]}")
            want = f"{n_total}/{n_total} ({n_err} errors)"
            if want not in row:
                raise SystemExit(f"job list row {row}: no {want!r}")
            print(f"ok    job list: {JOB} with {want}: {row}")

            page = chromium(a.chromium, WAIT, "--dump-dom", f"{url}/jobs/{JOB}?tab=results")
            expect(text_of(page), f"{n_total}/{n_total} trials completed | {n_err} errors", "job page")
            header = next((r for r in rows_of(page) if "Reward" in r), None)
            if header is None or "Trial" not in header:
                raise SystemExit(f"no trial table on the Rollouts tab:\n{text_of(page)[:3000]}")
            col = header.index("Reward")
            listed = {c: r for r in rows_of(page) for c in r if c in trials and len(r) == len(header)}
            if sorted(listed) != trials:
                raise SystemExit(f"Rollouts lists {sorted(listed)}, the job has {trials}")
            for name, r in sorted(listed.items()):
                rewards = EXPECTED[name.split("__")[0]]
                want = "RewardFileNotFoundError" if rewards is None else shown_reward(rewards)
                if not r[col].startswith(want):
                    raise SystemExit(f"{name}: the Reward cell says {r[col]!r}, not {want!r}")
            print(f"ok    Rollouts tab: all {n_total} trials, each with its reward or exception: "
                  + ", ".join(f"{n}={r[col]}" for n, r in sorted(listed.items())))

            for task, needles in [("merge-json", ["reward 1.00", "exact 1.00"]),
                                  ("half-credit", ["reward 0.50"]),
                                  ("no-reward", ["RewardFileNotFoundError",
                                                 "the verifier wrote neither"])]:
                name = next(t for t in trials if t.startswith(task + "__"))
                text = text_of(chromium(a.chromium, WAIT, "--dump-dom", f"{url}/jobs/{JOB}/trials/{name}"))
                for needle in [name, *needles, "Write ok to /app/ok.txt" if task != "merge-json" else "merged.json",
                               "oracle", "bash /solution/solve.sh"]:
                    expect(text, needle, f"trial page {name}")
                if "not found" in text.lower():
                    raise SystemExit(f"trial page {name} says not found:\n{text[:3000]}")
                print(f"ok    trial page {name}: {', '.join(needles)}, its trajectory")

            for shot_name, path in [("harbor-jobs.png", "/"), ("harbor-job.png", f"/jobs/{JOB}?tab=results"),
                                    ("harbor-trial.png", f"/jobs/{JOB}/trials/{trials[0]}")]:
                shot = os.path.abspath(os.path.join(a.artifacts, shot_name))
                chromium(a.chromium, WAIT, "--window-size=1400,900", "--screenshot=" + shot, url + path)
                if not os.path.getsize(shot) > 1000:
                    raise SystemExit(f"screenshot {shot} is empty")
            print(f"harbor view shows temper's job in Chromium; screenshots in {a.artifacts}")
        finally:
            viewer.terminate()
            viewer.wait(timeout=20)


if __name__ == "__main__":
    sys.exit(main())
