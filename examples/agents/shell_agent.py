"""A minimal external agent for `temper tasks run -a command`.

    temper tasks run examples/tasks -a command \
        --agent-command 'python3 /path/to/examples/agents/shell_agent.py' \
        -m MODEL -b http://127.0.0.1:8000/v1

It reads the instruction on stdin, asks the model at $OPENAI_BASE_URL for
one ```bash block per turn, runs it in the trial's sandbox through
$TEMPER_EXEC_URL, and feeds the output back, until the model answers
TASK_COMPLETE or MAX_TURNS. Standard library only (urllib), so it runs
anywhere; with the `openai` package the chat call is
`OpenAI().chat.completions.create(model=..., messages=...)`, which reads the
same OPENAI_BASE_URL / OPENAI_API_KEY variables.
"""

import json
import os
import re
import sys
import urllib.request

MAX_TURNS = int(os.environ.get("MAX_TURNS", "20"))


def post(url, body, token):
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.load(resp)


def chat(messages):
    base = os.environ["OPENAI_BASE_URL"].rstrip("/")
    body = {"model": os.environ.get("OPENAI_MODEL", ""), "messages": messages, "max_tokens": 1024}
    answer = post(base + "/chat/completions", body, os.environ.get("OPENAI_API_KEY", "EMPTY"))
    return answer["choices"][0]["message"].get("content") or ""


def run(command):
    r = post(os.environ["TEMPER_EXEC_URL"], {"command": command, "timeout_sec": 60},
             os.environ["TEMPER_EXEC_TOKEN"])
    return (r.get("stdout", "") + r.get("stderr", ""))[-8000:] + "\n[exit code %s]" % r.get("exit_code")


def main():
    instruction = sys.stdin.read()
    messages = [
        {"role": "system", "content": "You work in a Linux shell in %s. Answer each turn with one "
         "```bash block; you will see its output. Answer TASK_COMPLETE when done."
         % os.environ.get("TEMPER_WORKDIR", "/app")},
        {"role": "user", "content": instruction},
    ]
    for turn in range(MAX_TURNS):
        text = chat(messages)
        messages.append({"role": "assistant", "content": text})
        blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S)
        if not blocks:
            if "TASK_COMPLETE" in text:
                break
            messages.append({"role": "user", "content": "Answer with one ```bash block or TASK_COMPLETE."})
            continue
        output = run(blocks[-1])
        print("turn %d: %s" % (turn + 1, blocks[-1].strip().splitlines()[0][:80]))
        messages.append({"role": "user", "content": "Output:\n" + output})


if __name__ == "__main__":
    main()
