"""Single-turn with a dataset and a rubric (verifiers 0.4 `verifiers.v1`): one-digit
additions read from data.jsonl, asked after one worked example (a Messages prompt),
to be answered in <answer></answer> tags. Rewards: the right number as the reply's
last number (weight 1.0) and the tag format (weight 0.5), as `@vf.reward` methods.
Run with the tool-less chat harness: `agent = {harness = {id = "null"}}`.
A fixture of temper's verifiers support, written as verifiers' docs describe a
taskset; nothing in it knows about temper."""

import json
import re
from pathlib import Path

import verifiers.v1 as vf

SYSTEM = "Answer with only the number inside <answer></answer> tags."
TAG = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
NUMBER = re.compile(r"-?\d+")
EXAMPLE = [
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "<answer>5</answer>"},
]


class AddData(vf.TaskData):
    answer: int


class AddTask(vf.Task[AddData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        found = NUMBER.findall(trace.last_reply)
        return float(bool(found) and int(found[-1]) == self.data.answer)

    @vf.reward(weight=0.5)
    async def tagged(self, trace: vf.Trace) -> float:
        return float(TAG.search(trace.last_reply) is not None)


class AddConfig(vf.TasksetConfig):
    num_tasks: int | None = None


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        lines = (Path(__file__).parent / "data.jsonl").read_text().splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
        for row in rows[: self.config.num_tasks]:
            yield AddTask(
                AddData(
                    id=row["id"],
                    prompt=[*EXAMPLE, {"role": "user", "content": row["question"]}],
                    system_prompt=SYSTEM,
                    answer=row["answer"],
                ),
                self.config.task,
            )


__all__ = ["AddTaskset"]
