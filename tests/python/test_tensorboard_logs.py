"""CI: `[log] tensorboard = true` writes event files TensorBoard reads.

Trains a 3-step RL run on the tiny preset model with TensorBoard logging,
then reads the run directory with the `tensorboard` package's own event
reader (EventAccumulator, as `tensorboard --logdir` does): every metric of
every `metrics.jsonl` line is a scalar with that value at that step, and
each step's samples are a text summary. Run with the venv of
requirements-tensorboard.txt.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

sys.path.insert(0, os.path.dirname(__file__))
from test_view_browser import config, write_env  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", required=True)
    a = ap.parse_args()
    t0 = time.time()
    work = tempfile.mkdtemp(prefix="tensorboard-")
    runs = os.path.join(work, "runs")
    cfg = config(work, runs, "tb", 3, 1, write_env(work))
    subprocess.run([os.path.abspath(a.temper), "train", "rl", cfg, "--log.tensorboard", "true"], check=True,
                   capture_output=True, text=True)
    run = os.path.join(runs, "tb")
    files = [f for f in os.listdir(run) if f.startswith("events.out.tfevents.")]
    if len(files) != 1:
        raise SystemExit(f"expected one event file in {run}: {sorted(os.listdir(run))}")
    acc = EventAccumulator(run, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    with open(os.path.join(run, "metrics.jsonl")) as f:
        records = [json.loads(l) for l in f]
    tags = set(acc.Tags()["scalars"])
    checked = 0
    for r in records:
        for k, v in r.items():
            if k == "step" or not isinstance(v, (int, float)):
                continue
            if k not in tags:
                raise SystemExit(f"metric {k} is not a TensorBoard scalar (scalars: {sorted(tags)})")
            got = {e.step: e.value for e in acc.Scalars(k)}
            if r["step"] not in got or abs(got[r["step"]] - v) > 1e-6 * max(1.0, abs(v)):
                raise SystemExit(f"{k} at step {r['step']}: TensorBoard has {got.get(r['step'])}, metrics.jsonl {v}")
            checked += 1
    texts = acc.Tags()["tensors"]
    if "samples" not in texts:
        raise SystemExit(f"no samples text summary (tensors: {texts})")
    text = acc.Tensors("samples")[0].tensor_proto.string_val[0].decode()
    if "echo " not in text or "reward" not in text:
        raise SystemExit(f"the samples text lacks a prompt or reward: {text[:500]}")
    print(f"TensorBoard read {checked} scalars over {len(records)} steps and {len(acc.Tensors('samples'))} "
          f"samples texts from {files[0]} ({time.time() - t0:.1f}s)")


if __name__ == "__main__":
    sys.exit(main())
