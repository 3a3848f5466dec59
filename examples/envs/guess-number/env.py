"""Guess the number: a multi-turn temper environment written in Python.

The model guesses a number in [1, hi]; after each guess it hears "higher",
"lower" or "correct". Reward: 1 for finding it, minus 0.05 per extra guess;
the guess count is a metric. Argument: hi (difficulty, default 100).
"""

import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "python"))
from temper_env import Environment, last_assistant_text, parse_tag, serve  # noqa: E402


class GuessNumber(Environment):
    env_id = "guess-number"
    multi_turn = True
    max_turns = 10
    eval_defaults = {"num_examples": 10, "rollouts_per_example": 1, "max_tokens": 32, "temperature": 0.7}

    def rows(self, split, n, seed):
        hi = int(self.args.get("hi", 100))
        rng = random.Random(f"{split}/{seed}")
        out = []
        while len(out) < n:
            secret = rng.randint(1, hi)
            # Eval secrets are odd, train secrets even: disjoint splits.
            if (secret % 2 == 1) != (split == "eval"):
                continue
            out.append({
                "prompt": [
                    {"role": "system", "content": f"Guess my number between 1 and {hi}. Reply with <guess>N</guess>."},
                    {"role": "user", "content": "Your first guess?"},
                ],
                "answer": str(secret),
                "info": {"hi": hi},
            })
        return out

    def env_response(self, row, messages, state):
        guess = parse_tag(last_assistant_text(messages), "guess")
        state = dict(state)
        state["guesses"] = state.get("guesses", 0) + 1
        try:
            g = int(guess)
        except (TypeError, ValueError):
            return [{"role": "user", "content": "Reply with <guess>N</guess>."}], False, state
        secret = int(row["answer"])
        if g == secret:
            state["solved"] = True
            return [{"role": "user", "content": "correct"}], True, state
        return [{"role": "user", "content": "higher" if g < secret else "lower"}], False, state

    def score_one(self, row, rollout):
        state = rollout.get("state") or {}
        guesses = state.get("guesses", 0)
        solved = bool(state.get("solved"))
        reward = max(0.0, 1.0 - 0.05 * (guesses - 1)) if solved else 0.0
        return {"reward": reward, "metrics": {"solved": float(solved), "guesses": float(guesses)}}


if __name__ == "__main__":
    serve(GuessNumber())
