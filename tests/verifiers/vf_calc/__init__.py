"""Tool use (verifiers 0.4 `verifiers.v1`): arithmetic with a `calculate` tool, served
to the harness as an MCP tool server (a `vf.Toolset` with a `@vf.tool`, in tools.py).
Reward: the right number in <answer></answer> tags; metric: whether the model called the tool.
Run with a harness that supports MCP, e.g. `agent = {harness = {id = "null"}}`.
A fixture of temper's verifiers support, written as verifiers' docs describe a
taskset with tools; nothing in it knows about temper."""

import re

import verifiers.v1 as vf

from vf_calc.tools import CalcToolset, evaluate

SYSTEM = "Use the calculate tool, then answer with only the number inside <answer></answer> tags."
TAG = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
PROBLEMS = ["12 * 7 + 3", "(45 - 17) * 3", "1000 - 7 * 13", "81 / 9 + 40"]


class CalcData(vf.TaskData):
    answer: int


class CalcTask(vf.Task[CalcData]):
    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        found = TAG.findall(trace.last_reply)
        return float(bool(found) and int(found[-1]) == self.data.answer)

    @vf.metric
    async def used_tool(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages) > 0)


class CalcConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    @classmethod
    def toolsets(cls, config: CalcConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]

    def load(self):
        for i, problem in enumerate(PROBLEMS):
            yield CalcTask(
                CalcData(id=f"calc-{i}", prompt=f"What is {problem}?", system_prompt=SYSTEM,
                         answer=int(evaluate(problem))),
                self.config.task,
            )


__all__ = ["CalcTaskset"]
