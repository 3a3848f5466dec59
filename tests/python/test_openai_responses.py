"""OpenAI's Responses API against `temper serve`: the official `openai`
client's `responses.create` (plain, streamed, a tool-call round trip,
`responses.parse` with a Pydantic `text_format`) and `openai-agents` with its
default model (the Responses model, pointed at temper by `base_url`) running
a two-turn tool run to completion, non-streamed and streamed.

Run: python tests/python/test_openai_responses.py [--temper target/debug/temper]
     [--model DIR_OR_GGUF]   (default: the tiny fixture model)
Needs `pip install -r tests/python/requirements-responses.txt` (see .ci/run).
The fixture model is random: the agent's first turn is forced to call the
tool (`tool_choice="required"`, which the agent resets after a tool call),
and its answer is a bounded Pydantic `output_type`, so the second turn ends
with a valid document instead of running to the token limit. Prints
`openai-responses: N passed, M failed`; exits non-zero on any failure.
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from typing import Literal

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_openai_server import API_KEY, MODEL, MODEL_DIR, ROOT, checker, start_server  # noqa: E402

WEATHER_TOOL = {
    "type": "function", "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False},
    "strict": True,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--temper", default=os.path.join(ROOT, "target", "debug", "temper"))
    ap.add_argument("--model", default=MODEL_DIR)
    args = ap.parse_args()
    import openai
    import pydantic

    server, url = start_server(args.temper, "--api-key", API_KEY, max_model_len=2048,
                               model=args.model)
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    results = []

    check = checker(results)

    class Answer(pydantic.BaseModel):
        verdict: Literal["sunny", "rainy", "unknown"]
        confidence: int = pydantic.Field(ge=0, le=9)

    @check("responses.create: a string input with instructions")
    def _():
        r = client.responses.create(model=MODEL, instructions="Be brief.", input="Say hello.",
                                    max_output_tokens=16, temperature=0)
        assert r.object == "response" and r.model == MODEL, r
        assert r.status in ("completed", "incomplete"), r.status
        assert [o.type for o in r.output] == ["message"], r.output
        assert r.output[0].content[0].type == "output_text"
        assert isinstance(r.output_text, str)
        assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0, r.usage
        assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
        # The same engine as chat completions: the same greedy text.
        c = client.chat.completions.create(
            model=MODEL, max_tokens=16, temperature=0,
            messages=[{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "Say hello."}])
        assert r.output_text == c.choices[0].message.content, (r.output_text, c)
        assert r.usage.input_tokens == c.usage.prompt_tokens

    @check("responses.create(stream=True): typed events, then response.completed or .incomplete")
    def _():
        events = list(client.responses.create(model=MODEL, input="Tell me a story.",
                                              max_output_tokens=16, temperature=0, stream=True))
        types = [e.type for e in events]
        assert types[:4] == ["response.created", "response.in_progress",
                             "response.output_item.added", "response.content_part.added"], types
        assert types[-4:-1] == ["response.output_text.done", "response.content_part.done",
                                "response.output_item.done"], types
        assert types[-1] in ("response.completed", "response.incomplete"), types
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        final = events[-1].response
        assert final.output_text == text, (final.output_text, text)
        whole = client.responses.create(model=MODEL, input="Tell me a story.",
                                        max_output_tokens=16, temperature=0)
        assert whole.output_text == text
        assert final.status == whole.status

    @check("responses.stream: the SDK's stream helper rebuilds a structured answer")
    def _():
        # The helper wants `response.completed`: a bounded answer ends in time.
        with client.responses.stream(model=MODEL, input="Is it sunny?", text_format=Answer,
                                     max_output_tokens=64, temperature=0) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            got = stream.get_final_response()
        assert got.status == "completed", got
        assert isinstance(got.output_parsed, Answer), got
        assert got.output_text == "".join(deltas)

    @check("responses.create: a forced tool call, then its output as the next input")
    def _():
        question = [{"role": "user", "content": "What is the weather in Paris?"}]
        r = client.responses.create(model=MODEL, input=question, tools=[WEATHER_TOOL],
                                    tool_choice="required", max_output_tokens=64)
        assert r.status == "completed", r
        calls = [o for o in r.output if o.type == "function_call"]
        assert len(calls) == 1, r.output
        assert calls[0].name == "get_weather"
        assert json.loads(calls[0].arguments)["city"] in ("Paris", "Rome")
        follow = question + [o.model_dump(exclude_none=True) for o in r.output] + [
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"}]
        r2 = client.responses.create(model=MODEL, input=follow, tools=[WEATHER_TOOL],
                                     max_output_tokens=16)
        assert r2.status in ("completed", "incomplete"), r2
        assert r2.usage.input_tokens > r.usage.input_tokens
        # Streamed, the call arrives as a function_call item with its arguments.
        events = list(client.responses.create(
            model=MODEL, input=question, tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64,
            stream=True))
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1, [e.type for e in events]
        assert json.loads(done[0].arguments)["city"] in ("Paris", "Rome")
        assert events[-1].type == "response.completed"

    @check("responses.parse: text_format as a Pydantic model")
    def _():
        r = client.responses.parse(model=MODEL, input="Is it sunny?", text_format=Answer,
                                   max_output_tokens=64, temperature=1.0)
        assert r.status == "completed", r
        assert isinstance(r.output_parsed, Answer), r.output_parsed

    @check("errors: previous_response_id and unknown roles are 400s naming them")
    def _():
        try:
            client.responses.create(model=MODEL, input="hi", previous_response_id="resp_x")
            raise AssertionError("expected BadRequestError")
        except openai.BadRequestError as e:
            assert "previous_response_id" in str(e), e
        try:
            client.chat.completions.create(model=MODEL, max_tokens=2,
                                           messages=[{"role": "wizard", "content": "hi"}])
            raise AssertionError("expected BadRequestError")
        except openai.BadRequestError as e:
            assert "wizard" in str(e), e

    def route_counts():
        """Answered-200 requests per route, from /metrics."""
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        counts = {}
        for route in ("/v1/responses", "/v1/chat/completions"):
            line = f'temper_requests_total{{route="{route}",status="200"}} '
            counts[route] = sum(float(x[len(line):]) for x in text.splitlines()
                                if x.startswith(line))
        return counts

    def agent_run(streamed):
        from agents import (Agent, ModelSettings, Runner, function_tool,
                            set_default_openai_api, set_default_openai_client,
                            set_tracing_disabled)

        calls = []

        @function_tool
        def get_weather(city: Literal["Paris", "Rome"]) -> str:
            """The weather in a city."""
            calls.append(city)
            return "sunny"

        set_tracing_disabled(True)
        set_default_openai_api("responses")
        set_default_openai_client(openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY,
                                                     max_retries=0), use_for_tracing=False)
        agent = Agent(name="weather", instructions="Answer with the weather.", model=MODEL,
                      tools=[get_weather], output_type=Answer,
                      model_settings=ModelSettings(tool_choice="required", max_tokens=64))

        async def run():
            if streamed:
                r = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
                async for _ in r.stream_events():
                    pass
                return r
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

        before = route_counts()
        result = asyncio.run(run())
        after = route_counts()
        # The agent's default model speaks the Responses API: two calls there.
        assert after["/v1/responses"] - before["/v1/responses"] == 2, (before, after)
        assert after["/v1/chat/completions"] == before["/v1/chat/completions"], (before, after)
        assert len(result.raw_responses) == 2, result.raw_responses
        assert len(calls) == 1, calls
        assert isinstance(result.final_output, Answer), result.final_output
        kinds = [item.type for item in result.new_items]
        assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
        assert kinds[-1] == "message_output_item", kinds
        return result

    @check("openai-agents: a two-turn tool run completes (Runner.run)")
    def _():
        agent_run(streamed=False)

    @check("openai-agents: a two-turn tool run completes (Runner.run_streamed)")
    def _():
        agent_run(streamed=True)

    server.terminate()
    try:
        server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        server.kill()
    failed = [n for n, ok in results if not ok]
    print(f"openai-responses: {len(results) - len(failed)} passed, {len(failed)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
