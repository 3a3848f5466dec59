"""The reward is reasoning-gym's own scorer for the task that generated the
row (make_rows.py put the library's entry in the row's `info`): 1.0 for
the exact answer, partial credit for an answer that contains it. The
metric `exact` counts exact answers only.
"""

import reasoning_gym
from temper_reward import reward, serve

_scorers = {}


@reward
def correct(parsed, info, **_):
    entry = info["entry"]
    task = entry["metadata"]["source_dataset"]
    if task not in _scorers:
        _scorers[task] = reasoning_gym.get_score_answer_fn(task)
    answer = parsed.strip() if parsed is not None else None
    score = _scorers[task](answer, entry)
    return score, {"exact": 1.0 if score == 1.0 else 0.0}


if __name__ == "__main__":
    serve()
