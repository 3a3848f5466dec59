"""{{name}}: a multi-turn temper environment.

The model answers a question; while the answer is wrong and turns remain,
the environment replies with feedback and the model tries again. Reward: 1
for a right answer, less 0.25 per extra attempt (never below 0); the number
of attempts is a metric. Replace the rows, the feedback and the reward.

temper runs `python3 env.py` (env.toml's command) and calls the methods
below over JSON lines; print diagnostics to stderr, never to stdout.
Try it: temper eval . -m MODEL -b http://127.0.0.1:8000/v1
"""

from temper_env import Environment, last_assistant_text, parse_tag, serve

TRAIN = [
    ("TODO: replace these rows with your task. What is the capital of Italy?", "Rome"),
    ("What is the capital of Spain?", "Madrid"),
    ("What is the capital of Japan?", "Tokyo"),
]
EVAL = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of Egypt?", "Cairo"),
]
SYSTEM = "Answer in <answer></answer> tags. If told you are wrong, try again."


class Env(Environment):
    env_id = "{{name}}"
    multi_turn = True
    max_turns = 3
    # `temper eval` defaults: one greedy rollout per example (several
    # rollouts only make sense with temperature > 0).
    eval_defaults = {"num_examples": 8, "rollouts_per_example": 1, "max_tokens": 256, "temperature": 0.0}

    def rows(self, split, n, seed):
        data = EVAL if split == "eval" else TRAIN
        # Eval: the held-out rows in order. Train: n rows cycling from a
        # seeded offset.
        start = seed % len(data) if split == "train" else 0
        count = n if split == "train" else min(n, len(data))
        return [
            {
                "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                "answer": a,
            }
            for q, a in (data[(start + i) % len(data)] for i in range(count))
        ]

    def correct(self, row, text):
        got = parse_tag(text, "answer")
        return got is not None and got.strip().lower() == row["answer"].strip().lower()

    def env_response(self, row, messages, state):
        state["attempts"] = state.get("attempts", 0) + 1
        if self.correct(row, last_assistant_text(messages)):
            return [{"role": "user", "content": "Correct."}], True, state
        return [{"role": "user", "content": "That is not right. Try again."}], False, state

    def score_one(self, row, rollout):
        attempts = (rollout.get("state") or {}).get("attempts", 1)
        solved = self.correct(row, last_assistant_text(rollout["completion"]))
        reward = max(0.0, 1.0 - 0.25 * (attempts - 1)) if solved else 0.0
        return {"reward": reward, "metrics": {"solved": float(solved), "attempts": float(attempts)}}


if __name__ == "__main__":
    serve(Env())
