"""Writes train.jsonl and eval.jsonl: small Python functions to write tests
for. Each row: `question` (the prompt with the code), `info.code` (the code
under test) and `info.samples` (calls whose results tell a mutant from the
original; mutants that agree on all of them are dropped as equivalent).
Held-out rows use other constants than training rows. Deterministic:

    python3 examples/test-writing/gen.py
"""

import json
import os
import random

# (name, code template, sample-call templates); {k} is the row's constant.
FAMILIES = [
    ("add_k", "def add_k(x):\n    return x + {k}\n", ["add_k(0)", "add_k(5)", "add_k(-3)"]),
    ("scale", "def scale(x):\n    return x * {k}\n", ["scale(0)", "scale(1)", "scale(-4)", "scale(7)"]),
    ("is_multiple", "def is_multiple(n):\n    return n % {k} == 0\n",
     ["is_multiple(0)", "is_multiple({k})", "is_multiple({k} + 1)", "is_multiple(2 * {k})", "is_multiple(1)"]),
    ("count_above", "def count_above(xs):\n    return sum(1 for x in xs if x > {k})\n",
     ["count_above([])", "count_above([{k}])", "count_above([{k} + 1, {k} - 1, {k} + 5])", "count_above([0, 100])"]),
    ("last_n", "def last_n(s):\n    return s[-{k}:]\n",
     ["last_n('abcdefghij')", "last_n('')", "last_n('xy')", "last_n([1, 2, 3, 4, 5, 6, 7])"]),
    ("first_n", "def first_n(s):\n    return s[:{k}]\n",
     ["first_n('abcdefghij')", "first_n('')", "first_n('x')", "first_n([9, 8, 7, 6, 5, 4])"]),
    ("in_range", "def in_range(x):\n    return {k} <= x < {k} + 10\n",
     ["in_range({k})", "in_range({k} - 1)", "in_range({k} + 9)", "in_range({k} + 10)", "in_range({k} + 4)"]),
    ("repeat", "def repeat(s):\n    return s * {k}\n", ["repeat('ab')", "repeat('')", "repeat('x')"]),
    ("above", "def above(x):\n    if x > {k}:\n        return True\n    return False\n",
     ["above({k})", "above({k} + 1)", "above({k} - 1)", "above(-100)"]),
    ("poly", "def poly(x):\n    return {k} * x + 1\n", ["poly(0)", "poly(1)", "poly(-2)", "poly(10)"]),
    ("bonus", "def bonus(score):\n    if score >= {k}:\n        return score + 5\n    return score\n",
     ["bonus({k})", "bonus({k} - 1)", "bonus({k} + 3)", "bonus(0)"]),
    ("safe_div", "def safe_div(a, b):\n    if b == 0:\n        return {k}\n    return a // b\n",
     ["safe_div(7, 0)", "safe_div(7, 2)", "safe_div(-9, 3)", "safe_div(0, 5)", "safe_div(100, 7)"]),
    ("sum_to", "def sum_to(n):\n    total = 0\n    for i in range(1, n + {k}):\n        total += i\n    return total\n",
     ["sum_to(0)", "sum_to(1)", "sum_to(4)", "sum_to(10)"]),
    ("drop", "def drop(s):\n    return s[{k}:-1]\n",
     ["drop('abcdefghij')", "drop('')", "drop('abc')", "drop([1, 2, 3, 4, 5, 6, 7, 8])"]),
    ("tax", "def tax(price):\n    return price + price * {k} // 100\n",
     ["tax(0)", "tax(100)", "tax(250)", "tax(7)"]),
    ("both_above", "def both_above(a, b):\n    return a > {k} and b > {k}\n",
     ["both_above({k} + 1, {k} + 1)", "both_above({k}, {k} + 1)", "both_above({k} + 1, {k})", "both_above(0, 0)"]),
]

EXAMPLE_CODE = "def triple(x):\n    return 3 * x\n"
PROMPT = (
    "Write tests for this Python function: assert statements that pass on it "
    "and would fail if it had a bug. Reply with one ```python block.\n\n```python\n{code}```"
)


def rows(constants, rng):
    out = []
    for name, code, samples in FAMILIES:
        for k in constants:
            src = code.format(k=k)
            out.append({
                "question": PROMPT.format(code=src),
                "info": {"code": src, "samples": [s.format(k=k) for s in samples]},
            })
    rng.shuffle(out)
    return out


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    rng = random.Random(0)
    train = rows([2, 3, 4, 6, 8], rng)
    held_out = rows([5, 7, 9], rng)
    for name, data in (("train.jsonl", train), ("eval.jsonl", held_out)):
        with open(os.path.join(here, name), "w") as f:
            for r in data:
                f.write(json.dumps(r) + "\n")
    print("train %d rows, eval %d rows" % (len(train), len(held_out)))


if __name__ == "__main__":
    main()
