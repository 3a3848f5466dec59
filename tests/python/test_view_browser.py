"""CI: `temper view`'s runs page in a real headless browser (Chromium).

Trains two short RL runs on the tiny preset model (seconds): A runs to
the end; B is started in the background with more steps. While B trains,
Chromium loads the runs list (B is running), B's page twice (its reward
chart gains points), follows a chart point's link (that step's samples,
then filtered by reward) and the overlay of A on B (two series); A's page
shows its checkpoints with their commands. Paths that leave the runs
directory get a 4xx. Then B is killed and the list shows it failed.
Screenshots go into the artifacts directory. Stdlib only.
"""

import argparse
import html
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
from test_hub_browser import chromium, expect  # noqa: E402

CONFIG = """
seed = {seed}
[model]
preset = "tiny"
[model.tiny]
hidden_size = 32
num_layers = 1
num_heads = 2
num_kv_heads = 1
intermediate_size = 64
max_position_embeddings = 256
[lora]
rank = 4
alpha = 8.0
[[env]]
id = "{env}"
[sampling]
max_tokens = 8
group_size = 4
[trainer]
lr = 1e-2
batch_size = 2
max_steps = {steps}
[eval]
num_examples = 0
[ckpt]
interval = 3
keep = 2
[log]
dir = "{dir}"
progress = false
samples = 4
"""


def write_env(work):
    env = os.path.join(work, "graded-env")
    os.makedirs(env)
    with open(os.path.join(env, "train.jsonl"), "w") as f:
        for i in range(40):
            f.write('{"question": "echo %d", "answer": "aaaa%d"}\n' % (i, i))
    with open(os.path.join(env, "env.toml"), "w") as f:
        # LCS against the answer: graded, so a random model still learns.
        f.write('name = "graded"\n[dataset]\ntrain = "train.jsonl"\n[parser]\ntype = "plain"\n'
                '[[rubric]]\nfunction = "lcs"\nweight = 1.0\n')
    return env


def config(work, runs, name, steps, seed, env):
    path = os.path.join(work, name + ".toml")
    with open(path, "w") as f:
        f.write(CONFIG.format(seed=seed, env=env, steps=steps, dir=os.path.join(runs, name)))
    return path


def dom(binary, url):
    return chromium(binary, "--dump-dom", url)


def points(page, metric):
    """The circles of one chart (`data-metric`) in a dumped page."""
    m = re.search(r'<div class="c" data-metric="%s">(.*?)</div>' % re.escape(metric), page, re.S)
    if not m:
        raise SystemExit(f"no {metric} chart in the page:\n{page[:3000]}")
    return m.group(1)


def series_len(page):
    """How many points the reward chart's first line has."""
    m = re.search(r'<polyline class="series"[^>]* points="([^"]*)"', points(page, "reward/mean"))
    return len(m.group(1).split()) if m else 0


def status_of(url, path):
    try:
        with urllib.request.urlopen(url + path) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", required=True)
    ap.add_argument("--chromium", default="chromium")
    ap.add_argument("--artifacts", required=True)
    a = ap.parse_args()
    t0 = time.time()
    temper = os.path.abspath(a.temper)
    os.makedirs(a.artifacts, exist_ok=True)
    shots = os.path.abspath(a.artifacts)
    work = tempfile.mkdtemp(prefix="view-browser-")
    runs = os.path.join(work, "runs")
    env = write_env(work)
    # A: a finished run (its checkpoints and adapter).
    subprocess.run([temper, "train", "rl", config(work, runs, "rl-a", 6, 1, env)], check=True,
                   capture_output=True, text=True)
    print(f"run A trained ({time.time() - t0:.1f}s)")
    server = subprocess.Popen([temper, "view", runs, "--port", "0"], stdout=subprocess.PIPE, text=True)
    b = subprocess.Popen([temper, "train", "rl", config(work, runs, "rl-b", 100000, 2, env)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline().strip()
        if not line.startswith("listening on "):
            raise SystemExit(f"temper view did not start: {line!r}")
        url = "http://" + line[len("listening on "):]
        metrics = os.path.join(runs, "rl-b", "metrics.jsonl")

        def steps_of_b():
            try:
                with open(metrics) as f:
                    return sum(1 for l in f if l.endswith("\n"))
            except FileNotFoundError:
                return 0

        deadline = time.time() + 120
        while steps_of_b() < 2:
            if b.poll() is not None:
                raise SystemExit(f"run B ended early: {b.stderr.read()[-2000:]}")
            if time.time() > deadline:
                raise SystemExit("run B wrote no steps in 120 s")
            time.sleep(0.2)

        index = dom(a.chromium, url + "/")
        expect(index, '<tr data-run="rl-b" data-status="running">', "B listed as running")
        expect(index, '<tr data-run="rl-a" data-status="finished">', "A listed as finished")
        expect(index, "2 runs", "runs list")
        chromium(a.chromium, "--window-size=1400,500", "--screenshot=" + os.path.join(shots, "view-index.png"),
                 url + "/")

        page1 = dom(a.chromium, url + "/run?id=rl-b")
        n1 = series_len(page1)
        expect(page1, 'data-live="1"', "B's page refreshes while running")
        expect(page1, "temper train rl", "B's command line")
        expect(page1, "max_steps = 100000", "B's resolved config")
        later = steps_of_b() + 2
        while steps_of_b() < later and time.time() < deadline:
            time.sleep(0.2)
        page2 = dom(a.chromium, url + "/run?id=rl-b")
        n2 = series_len(page2)
        if not n2 > n1 >= 2:
            raise SystemExit(f"the reward chart did not gain points while B trained: {n1} then {n2}")
        print(f"B's reward chart: {n1} points, then {n2}")
        # Left open, the page refreshes itself (its script fetches the page
        # again every 2 s): after 8 s of the browser's virtual time it shows
        # later steps than B had written when it was opened.
        s0 = steps_of_b()
        live = chromium(a.chromium, "--virtual-time-budget=8000", "--dump-dom", url + "/run?id=rl-b")
        refreshed = re.search(r'data-refreshed="(\d+)"', live)
        shown = int(re.search(r'id="step">(\d+)<', live).group(1))
        if not refreshed or shown <= s0:
            raise SystemExit(f"the open page did not refresh itself: step {shown} shown, {s0} written before; "
                             f"{refreshed and refreshed.group(0)}")
        print(f"the open page refreshed itself {refreshed.group(1)} time(s): step {s0} when opened, {shown} shown")
        chromium(a.chromium, "--window-size=1400,1000", "--screenshot=" + os.path.join(shots, "view-run.png"),
                 url + "/run?id=rl-b")

        # A click on a chart point follows its link: that step's samples.
        href = re.search(r'<a class="step" href="([^"]+)"', points(page2, "reward/mean"))
        if not href:
            raise SystemExit("the reward chart's points have no step links")
        step_url = url + html.unescape(href.group(1))
        step = re.search(r"step=(\d+)", step_url).group(1)
        samples = dom(a.chromium, step_url)
        expect(samples, f"4 samples of step {step}", "samples of the clicked step")
        expect(samples, 'class="sample"', "sample rows")
        expect(samples, "echo ", "a sample's prompt")
        expect(samples, "<th>advantage</th>", "advantage column")
        chromium(a.chromium, "--window-size=1400,1000", "--screenshot=" + os.path.join(shots, "view-samples.png"),
                 step_url.split("#")[0])
        filtered = dom(a.chromium, step_url.split("#")[0] + "&min_reward=2")
        expect(filtered, f"0 samples of step {step}", "filtered by reward (LCS rewards are ≤ 1)")

        # Overlay A on B: two series in the reward chart.
        overlay = dom(a.chromium, url + "/run?id=rl-b&vs=rl-a")
        series = re.findall(r'<polyline class="series" data-run="([^"]+)"', points(overlay, "reward/mean"))
        if series != ["rl-b", "rl-a"]:
            raise SystemExit(f"overlay drew {series}, not B and A")
        chromium(a.chromium, "--window-size=1400,900", "--screenshot=" + os.path.join(shots, "view-overlay.png"),
                 url + "/run?id=rl-b&vs=rl-a")

        # A finished run: its checkpoints and the commands that use them.
        page_a = dom(a.chromium, url + "/run?id=rl-a")
        expect(page_a, 'data-live="0"', "A's page does not refresh")
        expect(page_a, "trainer state after step 6", "A's checkpoint")
        expect(page_a, "temper serve --model", "serve command")
        expect(page_a, "temper export", "export command")
        expect(page_a, "the trained LoRA adapter", "A's adapter")
        # Tall: the checkpoints are below the charts (a fragment URL screenshots blank).
        chromium(a.chromium, "--window-size=1400,3600", "--screenshot=" + os.path.join(shots, "view-finished.png"),
                 url + "/run?id=rl-a")

        # Paths from a request stay inside the runs directory.
        os.symlink(work, os.path.join(runs, "escape"))
        for path, want in [("/run?id=../runs/rl-a", 400), ("/run?id=%2Fetc", 400), ("/api/metrics?id=escape", 403),
                           ("/report?id=rl-a/../../x", 400), ("/run?id=nope", 404), ("/api/samples?id=rl-a&step=x", 400)]:
            got = status_of(url, path)
            if got != want:
                raise SystemExit(f"GET {path}: {got}, expected {want}")

        # Killed: its process is gone while run.json says running.
        b.send_signal(signal.SIGKILL)
        b.wait(timeout=10)
        index = dom(a.chromium, url + "/")
        expect(index, '<tr data-run="rl-b" data-status="failed">', "B, killed, listed as failed")
        print(f"view pages OK in Chromium ({time.time() - t0:.1f}s); screenshots in {a.artifacts}")
    finally:
        if b.poll() is None:
            b.kill()
            b.wait(timeout=10)
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    sys.exit(main())
