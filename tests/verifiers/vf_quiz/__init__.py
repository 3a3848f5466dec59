"""Multi-turn (verifiers 0.4 `verifiers.v1`): a quiz of arithmetic questions asked
one per turn. The environment is an `Env` whose `run()` holds the agent's rollout
open as an `interaction` and answers each reply with the next question; the reward
is the share of questions answered right (`@vf.reward`), the turn count a metric.
A fixture of temper's verifiers support, written as verifiers' docs describe an
env; nothing in it knows about temper."""

import re

import verifiers.v1 as vf

SYSTEM = "Answer each question with only the number inside <answer></answer> tags."
TAG = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")
QUIZZES = [
    [(2, 3), (4, 4), (7, 1)],
    [(5, 6), (9, 2), (3, 8)],
    [(1, 1), (6, 7), (8, 9)],
    [(12, 5), (3, 3), (10, 4)],
]


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


class QuizData(vf.TaskData):
    questions: list[str]
    answers: list[int]


class QuizTask(vf.Task[QuizData]):
    @vf.reward
    async def accuracy(self, trace: vf.Trace) -> float:
        replies = [m.content or "" for m in trace.assistant_messages]
        right = 0
        for answer, reply in zip(self.data.answers, replies):
            found = TAG.findall(reply)
            right += bool(found) and int(found[-1]) == answer
        return right / len(self.data.answers)

    @vf.metric
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class QuizTaskset(vf.Taskset[QuizTask, vf.TasksetConfig]):
    def load(self):
        for i, quiz in enumerate(QUIZZES):
            questions = [question(a, b) for a, b in quiz]
            yield QuizTask(
                QuizData(
                    id=f"quiz-{i}",
                    prompt=questions[0],
                    system_prompt=SYSTEM,
                    questions=questions,
                    answers=[a + b for a, b in quiz],
                ),
                self.config.task,
            )


class QuizEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"})


class QuizEnv(vf.Env[QuizEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            for next_question in task.data.questions[1:]:
                if segment.terminated:
                    break
                segment = await chat.turn(next_question)


__all__ = ["QuizEnv", "QuizTaskset"]
