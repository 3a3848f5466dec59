"""{{name}}'s reward: called once per rollout by temper (through
temper_reward.py, which sits beside this file; both run from this
directory). Change `correct` to score your task; import any library the
interpreter in env.toml's `command` has installed.
"""

from temper_reward import reward, serve


@reward
def correct(parsed, answer, info, **_):
    """1 when the answer in <answer></answer> equals the row's (any case).

    Arguments (all keywords; accept **_ for the rest): text (the whole
    reply), parsed (the <answer> text, or None), answer and info (the row's),
    prompt, completion, args (env.toml's `args = {...}`). Return a number,
    or (number, {"metric": number}): metrics show as `correct/metric`.
    """
    answered = parsed is not None
    right = answered and answer is not None and parsed.strip().lower() == answer.strip().lower()
    return (1.0 if right else 0.0), {"answered": 1.0 if answered else 0.0}


if __name__ == "__main__":
    serve()
