#!/usr/bin/env python3
"""Regenerate the golden test fixtures under ``fixtures/``.

Run from the repository root:

    /opt/pyref/bin/python scripts/make_fixtures.py

(any Python with the packages in ``scripts/requirements-fixtures.txt`` works).
Everything is built from fixed seeds on the CPU in float32: two byte-level BPE
tokenizers trained on a generated corpus, three tiny randomly initialised
decoders (Llama, Qwen2, Qwen3) saved with ``save_pretrained``, one PEFT LoRA
adapter per model, and reference outputs from Hugging Face transformers that
the Rust tests in ``crates/temper-model`` compare against. Nothing is
downloaded.
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import sys
from pathlib import Path

import peft
import safetensors
import tokenizers
import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"
TOKENIZER_VOCAB_SIZE = 1000  # including special tokens
MIN_MARGIN = 1e-2  # every greedy step of a chosen prompt has a top1-top2 logit gap above this
GREEDY_NEW_TOKENS = 16
INPUT_LENGTHS = (5, 11, 17)
MAX_FIXTURE_BYTES = 8 * 1024 * 1024

# Pre-tokenizer split patterns of the real models (Qwen2 splits digits one by one, Llama 3 in groups of <= 3).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# --------------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------------

WORDS = (
    "the a an of to and in is it that was for on are as with his they at be this have from or one had by word "
    "but not what all were we when your can said there use each which she do how their if will up other about "
    "out many then them these so some her would make like him into time has look two more write go see number "
    "no way could people my than first water been call who oil its now find long down day did get come made may "
    "part model token weather city answer question assistant user system tool function call result value small "
    "tiny test golden file data list string number true false hello world please thanks help think reason step "
    "because therefore first second finally temperature celsius paris tokyo london berlin café naïve résumé"
).split()
NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Mallory", "Trent", "Zoë", "José", "Ana"]
CITIES = ["Paris", "Tokyo", "London", "Berlin", "Lisbon", "Oslo", "東京", "São Paulo", "Zürich"]
CODE_SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "for i in range({n}):\n    print(i * {m})\n",
    "import json\n\ndata = json.loads(text)\nprint(data['name'])\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "if x > {n} and y < {m}:\n    x, y = y, x\nelse:\n    x += 1\n",
    "result = [n ** 2 for n in range({n}) if n % 2 == 0]\n",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "with open('out.txt', 'w') as f:\n    f.write(\"hello\\n\")\n",
]


def make_corpus(seed: int = 0, n_lines: int = 4000) -> list[str]:
    """English-ish sentences, numbers, arithmetic, Python code, JSON and chat markup."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        kind = i % 6
        if kind == 0:
            words = [rng.choice(WORDS) for _ in range(rng.randint(5, 14))]
            words[0] = words[0].capitalize()
            lines.append(" ".join(words) + rng.choice([".", ".", "!", "?", ","]))
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice(["+", "-", "*"])
            value = {"+": a + b, "-": a - b, "*": a * b}[op]
            lines.append(f"{a} {op} {b} = {value}")
        elif kind == 2:
            code = rng.choice(CODE_SNIPPETS)
            lines.append(code.format(n=rng.randint(1, 99), m=rng.randint(1, 99)))
        elif kind == 3:
            obj = {
                "name": rng.choice(NAMES),
                "city": rng.choice(CITIES),
                "age": rng.randint(1, 99),
                "score": round(rng.random() * 100, 2),
                "tags": rng.sample(WORDS, 3),
                "active": rng.random() < 0.5,
            }
            indent = rng.choice([None, 2, 4])
            lines.append(json.dumps(obj, ensure_ascii=False, indent=indent))
        elif kind == 4:
            name, city = rng.choice(NAMES), rng.choice(CITIES)
            lines.append(
                f"{name} lives in {city} and was born in {rng.randint(1900, 2024)}; "
                f"it is {rng.randint(-20, 40)} degrees celsius there today."
            )
        else:
            role = rng.choice(["system", "user", "assistant", "tool"])
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
            lines.append(f"{role}\n{words.capitalize()}.\n")
    return lines


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------

CHATML_SPECIALS = [
    # (content, special) -- as in the real Qwen2.5 / Qwen3 tokenizer.json, the think / tool_call markers are
    # added tokens (never split) but not "special" (they survive decode(skip_special_tokens=True)).
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<tool_call>", False),
    ("</tool_call>", False),
]
LLAMA3_SPECIALS = [
    ("<|begin_of_text|>", True),
    ("<|end_of_text|>", True),
    ("<|start_header_id|>", True),
    ("<|end_header_id|>", True),
    ("<|eot_id|>", True),
    ("<|python_tag|>", True),
]


def train_bpe(corpus: list[str], split_pattern: str, specials, nfc: bool) -> Tokenizer:
    """Byte-level BPE in the layout of Qwen2 / Llama 3: regex Split + ByteLevel(use_regex=False).

    The added tokens are appended after the learned vocabulary, so (as in the real models) their ids
    are at the end of the vocabulary.
    """
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE - len(specials),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens(
        [AddedToken(content, special=special, normalized=False, single_word=False, lstrip=False, rstrip=False)
         for content, special in specials]
    )
    assert tok.get_vocab_size(with_added_tokens=True) == TOKENIZER_VOCAB_SIZE, tok.get_vocab_size()
    return tok


def train_chatml(corpus: list[str]) -> Tokenizer:
    return train_bpe(corpus, QWEN2_SPLIT, CHATML_SPECIALS, nfc=True)


def train_llama3(corpus: list[str]) -> Tokenizer:
    tok = train_bpe(corpus, LLAMA3_SPLIT, LLAMA3_SPECIALS, nfc=False)
    bos = "<|begin_of_text|>"
    # Same post-processor as Llama 3: ByteLevel (offsets only) then prepend BOS.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, tok.token_to_id(bos))],
            ),
        ]
    )
    return tok


def wrap_chatml(tok: Tokenizer, chat_template: str) -> PreTrainedTokenizerFast:
    hf = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tok.to_str()),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
        additional_special_tokens=["<|im_start|>"],
    )
    hf.chat_template = chat_template
    return hf


def wrap_llama3(tok: Tokenizer, chat_template: str) -> PreTrainedTokenizerFast:
    hf = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tok.to_str()),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        unk_token=None,
        pad_token=None,
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = chat_template
    return hf


# --------------------------------------------------------------------------------------------------
# Chat templates (modelled on the real Qwen2.5-Instruct, Qwen3 and Llama-3.1-Instruct templates)
# --------------------------------------------------------------------------------------------------

TOOLS_PREAMBLE = (
    "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n"
)

QWEN2_TEMPLATE = (
    """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Tiny Qwen, a small test model. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n"""
    + TOOLS_PREAMBLE
    + """" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- \""""
    + TOOLS_POSTAMBLE
    + """" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Tiny Qwen, a small test model. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
)

QWEN3_TEMPLATE = (
    """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- \""""
    + TOOLS_PREAMBLE
    + """" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- \""""
    + TOOLS_POSTAMBLE
    + """" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
)

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\\n\\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if message.role == 'system' %}
        {{- raise_exception("The system message must be the first message of the conversation.") }}
    {%- endif %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
            {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# --------------------------------------------------------------------------------------------------
# Chat, encode and decode cases
# --------------------------------------------------------------------------------------------------

TRICKY = "Ça coûte 5 € au café — 東京 <b>&amp;</b> 'quoted' \"double\" \\ tab\there"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city. Returns <temp> & 'conditions' — e.g. café weather in 東京.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. \"Paris\" or 'São Paulo'"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Unit < & >"},
            },
            "required": ["city"],
        },
    },
}
CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression such as 12 + 7.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}, "precision": {"type": "integer", "minimum": 0}},
            "required": ["expression"],
        },
    },
}


def tool_call(name: str, arguments: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def common_chat_cases() -> list[dict]:
    return [
        {
            "messages": [{"role": "user", "content": "What is 12 + 7?"}],
            "tools": None,
            "add_generation_prompt": True,
            "extra": {},
        },
        {
            "messages": [
                {"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "Hello!"},
                {"role": "assistant", "content": "Hi. What do you need?"},
                {"role": "user", "content": "Add 3 and 4."},
                {"role": "assistant", "content": "3 + 4 = 7"},
            ],
            "tools": None,
            "add_generation_prompt": False,
            "extra": {},
        },
        {
            "messages": [
                {"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "Hello!"},
                {"role": "assistant", "content": "Hi. What do you need?"},
                {"role": "user", "content": "Write a Python function that adds two numbers."},
            ],
            "tools": None,
            "add_generation_prompt": True,
            "extra": {},
        },
        {
            "messages": [{"role": "user", "content": TRICKY + "\n\n  Second line with trailing spaces.  "}],
            "tools": None,
            "add_generation_prompt": True,
            "extra": {},
        },
    ]


def qwen_tool_case() -> dict:
    return {
        "messages": [
            {"role": "system", "content": "You can look up the weather & do <math>."},
            {"role": "user", "content": "Weather in 東京 and Paris? Also 12 * 7."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    tool_call("get_weather", {"city": "東京", "unit": "celsius"}),
                    tool_call("get_weather", {"city": "Paris", "unit": "celsius"}),
                    tool_call("calculate", {"expression": "12 * 7", "precision": 0}),
                ],
            },
            {"role": "tool", "content": '{"temp": 21, "conditions": "sunny & warm"}'},
            {"role": "tool", "content": '{"temp": 14, "conditions": "café <cloudy>"}'},
            {"role": "tool", "content": "84"},
            {"role": "assistant", "content": "東京: 21 °C, sunny. Paris: 14 °C, cloudy. 12 * 7 = 84."},
        ],
        "tools": [WEATHER_TOOL, CALC_TOOL],
        "add_generation_prompt": False,
        "extra": {},
    }


def qwen2_chat_cases() -> list[dict]:
    return common_chat_cases() + [
        qwen_tool_case(),
        {
            "messages": [{"role": "user", "content": "Weather in Zürich?"}],
            "tools": [WEATHER_TOOL],
            "add_generation_prompt": True,
            "extra": {},
        },
    ]


def qwen3_chat_cases() -> list[dict]:
    return common_chat_cases() + [
        qwen_tool_case(),
        {
            # reasoning_content after the last user query is rendered inside <think>...</think>;
            # earlier turns keep only the final answer (inline <think> is stripped).
            "messages": [
                {"role": "user", "content": "What is 2 + 2?"},
                {"role": "assistant", "content": "<think>\nSimple addition.\n</think>\n\n2 + 2 = 4"},
                {"role": "user", "content": "And 12 + 7?"},
                {"role": "assistant", "content": "12 + 7 = 19", "reasoning_content": "\n12 plus 7 is 19.\n"},
            ],
            "tools": None,
            "add_generation_prompt": False,
            "extra": {},
        },
        {
            "messages": [{"role": "user", "content": "Say hi without thinking."}],
            "tools": None,
            "add_generation_prompt": True,
            "extra": {"enable_thinking": False},
        },
        {
            "messages": [{"role": "user", "content": "Think about 3 * 3."}],
            "tools": None,
            "add_generation_prompt": True,
            "extra": {"enable_thinking": True},
        },
    ]


def llama_chat_cases() -> list[dict]:
    tool_messages = [
        {"role": "system", "content": "You can look up the weather & do <math>."},
        {"role": "user", "content": "  Weather in 東京?  "},
        {"role": "assistant", "tool_calls": [tool_call("get_weather", {"city": "東京", "unit": "celsius"})]},
        {"role": "tool", "content": '{"temp": 21, "conditions": "sunny & warm"}'},
        {"role": "assistant", "content": "It is 21 °C and sunny in 東京."},
    ]
    return common_chat_cases() + [
        {"messages": tool_messages, "tools": [WEATHER_TOOL, CALC_TOOL], "add_generation_prompt": False, "extra": {}},
        {
            "messages": tool_messages[:4],
            "tools": [WEATHER_TOOL],
            "add_generation_prompt": True,
            "extra": {"tools_in_user_message": False, "date_string": "01 Jan 2025"},
        },
    ]


def encode_cases(special_sample: str, add_bos: bool) -> list[dict]:
    """(text, add_special_tokens) pairs; add_bos says whether the tokenizer adds BOS by default."""
    texts = [
        "Hello world! 12 + 7 = 19",
        TRICKY,
        "def add(a, b):\n    return a + b\n\n\n",
        '{"name": "Zoë", "tags": ["a", "b"], "n": 12345678}',
        special_sample,
        "   leading spaces and trailing   \n\n",
        "",
    ]
    cases = [(t, add_bos) for t in texts]
    cases += [(texts[0], not add_bos), (special_sample, not add_bos)]
    return cases


# --------------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------------

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic, deliberately large-ish init so outputs are far from trivial."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights are listed once
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.1 * noise)


def init_lora(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float32))


def build_model(spec: dict) -> torch.nn.Module:
    torch.manual_seed(spec["seed"])
    config = spec["config_cls"](**spec["config"])
    config.dtype = torch.float32
    model = spec["model_cls"](config).to(torch.float32).eval()
    init_weights(model, spec["seed"])
    model.generation_config = GenerationConfig(**spec["generation"])
    return model


@torch.no_grad()
def forward_logits(model, ids: list[int]) -> torch.Tensor:
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0].to(torch.float32).contiguous()


@torch.no_grad()
def greedy_case(model, prompt_ids: list[int]) -> dict:
    """16 greedy tokens from model.generate (EOS ignored), cross-checked against a cache-free loop."""
    out = model.generate(
        input_ids=torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        do_sample=False,
        max_new_tokens=GREEDY_NEW_TOKENS,
        eos_token_id=None,  # never stop early
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    new_ids = out.sequences[0, len(prompt_ids):].tolist()
    assert len(new_ids) == GREEDY_NEW_TOKENS, new_ids

    ids, margins = list(prompt_ids), []
    for step in range(GREEDY_NEW_TOKENS):
        last = forward_logits(model, ids)[-1]
        top2 = torch.topk(last, 2).values
        margins.append(float(top2[0] - top2[1]))
        ids.append(int(last.argmax()))
        torch.testing.assert_close(out.logits[step][0], last, rtol=1e-4, atol=1e-4)
    assert ids[len(prompt_ids):] == new_ids, (ids, new_ids)
    return {"prompt_ids": list(prompt_ids), "new_ids": new_ids, "min_margin": min(margins)}


# --------------------------------------------------------------------------------------------------
# Per-model driver
# --------------------------------------------------------------------------------------------------

INPUT_TEXTS = [
    "The weather in Paris is sunny today, and the café is open until late.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    '12 + 7 = 19 and 345 * 2 = 690; {"name": "Zoë", "city": "東京", "age": 42, "tags": ["x", "y"]}',
]
GREEDY_PROMPTS = [
    "The weather in",
    "12 + 7 =",
    "def add(a, b):",
    "Alice lives in",
    '{"name": "',
    "Hello world",
    "for i in range(",
    "The first number is",
    "Bob was born in",
    "print(",
    "Thanks for the help",
    "345 * 2 =",
]


def normalize_adapter_dir(adapter_dir: Path) -> None:
    """Make the PEFT output byte-stable: target_modules is saved from a set (hash-seed dependent order),
    and the auto-generated model card is boilerplate."""
    (adapter_dir / "README.md").unlink(missing_ok=True)
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True))


def chat_template_location(model_dir: Path) -> str:
    if (model_dir / "chat_template.jinja").exists():
        return "chat_template.jinja"
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    if "chat_template" in config:
        return "tokenizer_config.json"
    raise RuntimeError(f"no chat template saved in {model_dir}")


def rope_config_note(model_dir: Path) -> str:
    config = json.loads((model_dir / "config.json").read_text())
    keys = [k for k in ("rope_scaling", "rope_parameters", "rope_theta") if k in config]
    return f"config.json rope keys: {keys}; " + "; ".join(f"{k} = {json.dumps(config[k])}" for k in keys)


def make_model_fixtures(spec: dict) -> None:
    name, tokenizer = spec["name"], spec["tokenizer"]
    model_dir = FIXTURES / "models" / name
    adapter_dir = FIXTURES / "adapters" / f"{name}-lora"
    golden_dir = FIXTURES / "golden"
    print(f"[{name}] building model")

    model = build_model(spec)
    model.save_pretrained(model_dir, max_shard_size=spec.get("max_shard_size", "50MB"))
    tokenizer.save_pretrained(model_dir)
    # Work from what was saved, exactly as the Rust side will.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    add_special = spec["add_special_tokens"]

    # Forward-pass goldens.
    tensors: dict[str, torch.Tensor] = {}
    inputs = []
    for i, (text, length) in enumerate(zip(INPUT_TEXTS, INPUT_LENGTHS)):
        ids = tokenizer(text, add_special_tokens=add_special)["input_ids"]
        assert len(ids) >= length, (name, text, len(ids))
        ids = ids[:length]
        inputs.append(ids)
        tensors[f"logits.{i}"] = forward_logits(model, ids)

    # Keep the two candidate prompts whose greedy continuations are furthest from a tie.
    candidates = [
        {"prompt_text": prompt, **greedy_case(model, tokenizer(prompt, add_special_tokens=add_special)["input_ids"])}
        for prompt in GREEDY_PROMPTS
    ]
    greedy = sorted(candidates, key=lambda case: -case["min_margin"])[:2]
    assert all(case["min_margin"] > MIN_MARGIN for case in greedy), f"{name}: greedy prompts too close to a tie"

    # LoRA adapter (applied, not merged) on a pristine copy of the base model.
    lora_config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=LORA_TARGETS,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(copy.deepcopy(model), lora_config).eval()
    init_lora(peft_model, spec["seed"] + 1000)
    peft_model.peft_config["default"].base_model_name_or_path = f"fixtures/models/{name}"
    peft_model.save_pretrained(adapter_dir)
    normalize_adapter_dir(adapter_dir)
    for i, ids in enumerate(inputs):
        lora_logits = forward_logits(peft_model, ids)
        assert (lora_logits - tensors[f"logits.{i}"]).abs().max() > 1e-2, "adapter has no effect"
        tensors[f"lora_logits.{i}"] = lora_logits

    # Tokenizer / chat template goldens.
    chat = []
    for case in spec["chat_cases"]:
        text = tokenizer.apply_chat_template(
            case["messages"],
            tools=case["tools"],
            add_generation_prompt=case["add_generation_prompt"],
            tokenize=False,
            **case["extra"],
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        chat.append({**case, "text": text, "ids": ids})

    encode = []
    for text, add in encode_cases(spec["special_sample"], add_special):
        encode.append({"text": text, "add_special_tokens": add, "ids": tokenizer(text, add_special_tokens=add)["input_ids"]})
    decode = []
    for ids in [chat[0]["ids"], chat[3]["ids"], encode[1]["ids"], encode[4]["ids"], inputs[2]]:
        decode.append({"ids": ids, "skip_special_tokens": False, "text": tokenizer.decode(ids, skip_special_tokens=False)})

    golden = {
        "model": name,
        "model_dir": f"fixtures/models/{name}",
        "adapter_dir": f"fixtures/adapters/{name}-lora",
        "tensors": f"{name}.safetensors",
        "vocab_size": model.config.vocab_size,
        "tokenizer_size": len(tokenizer),
        "add_special_tokens": add_special,
        "inputs": inputs,
        "input_texts": INPUT_TEXTS,
        "greedy": greedy,
        "chat": chat,
        "encode": encode,
        "decode": decode,
        "meta": {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "peft": peft.__version__,
            "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__,
            "dtype": "float32",
            "attn_implementation": model.config._attn_implementation,
            "chat_template_location": chat_template_location(model_dir),
            "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token,
            "pad_token": tokenizer.pad_token,
            "lora": {"r": 4, "lora_alpha": 8, "scaling": 2.0, "merged": False, "target_modules": LORA_TARGETS},
            "notes": [
                rope_config_note(model_dir),
                "logits.N / lora_logits.N in the safetensors file have shape [len(inputs[N]), vocab_size]; "
                "each input was run alone (batch 1, no padding, no KV cache).",
                "greedy: model.generate(do_sample=False, max_new_tokens=16) with eos_token_id=None; min_margin is "
                "the smallest top1-top2 logit gap over the 16 steps.",
                "chat: text = tokenizer.apply_chat_template(messages, tools=tools, "
                "add_generation_prompt=add_generation_prompt, tokenize=False, **extra); ids = encode(text, "
                "add_special_tokens=False). transformers renders with jinja2 trim_blocks=True, lstrip_blocks=True "
                "and a custom tojson = json.dumps(x, ensure_ascii=False, indent=indent, separators=None, "
                "sort_keys=False): no HTML escaping of < > & ', non-ASCII kept, ', ' / ': ' separators, "
                "dict keys in insertion order.",
                "decode: tokenizer.decode(ids, skip_special_tokens=False) (clean_up_tokenization_spaces is "
                f"{tokenizer.clean_up_tokenization_spaces}).",
                *spec.get("notes", []),
            ],
        },
    }
    golden_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, golden_dir / f"{name}.safetensors")
    (golden_dir / f"{name}.json").write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------------
# Verification: reload everything from disk and compare
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def verify(name: str) -> None:
    golden = json.loads((FIXTURES / "golden" / f"{name}.json").read_text(encoding="utf-8"))
    tensors = load_file(FIXTURES / "golden" / f"{name}.safetensors")
    model_dir = ROOT / golden["model_dir"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for i, ids in enumerate(golden["inputs"]):
        torch.testing.assert_close(forward_logits(model, ids), tensors[f"logits.{i}"], rtol=0, atol=1e-5)
    for case in golden["greedy"]:
        assert greedy_case(model, case["prompt_ids"])["new_ids"] == case["new_ids"]
    for case in golden["chat"]:
        text = tokenizer.apply_chat_template(
            case["messages"], tools=case["tools"], add_generation_prompt=case["add_generation_prompt"],
            tokenize=False, **case["extra"],
        )
        assert text == case["text"], (name, text, case["text"])
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == case["ids"]
    for case in golden["encode"]:
        assert tokenizer(case["text"], add_special_tokens=case["add_special_tokens"])["input_ids"] == case["ids"]
    # The raw tokenizer.json (what the Rust `tokenizers` crate loads) must agree with transformers.
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for case in golden["encode"]:
        assert raw.encode(case["text"], add_special_tokens=case["add_special_tokens"]).ids == case["ids"], case
    for case in golden["chat"]:
        assert raw.encode(case["text"], add_special_tokens=False).ids == case["ids"], case["text"]
    for case in golden["decode"]:
        assert raw.decode(case["ids"], skip_special_tokens=False) == case["text"], case

    peft_model = PeftModel.from_pretrained(model, ROOT / golden["adapter_dir"]).eval()
    for i, ids in enumerate(golden["inputs"]):
        torch.testing.assert_close(forward_logits(peft_model, ids), tensors[f"lora_logits.{i}"], rtol=0, atol=1e-5)
    print(f"[{name}] verified: logits, greedy, chat, encode/decode, LoRA")


# --------------------------------------------------------------------------------------------------


def model_specs(chatml: Tokenizer, llama3: Tokenizer) -> list[dict]:
    common = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        attn_implementation="eager",
    )
    im_end, endoftext = chatml.token_to_id("<|im_end|>"), chatml.token_to_id("<|endoftext|>")
    bos, eot, eot_text = (llama3.token_to_id(t) for t in ("<|begin_of_text|>", "<|eot_id|>", "<|end_of_text|>"))
    # Like the real Qwen checkpoints, the Qwen embedding matrices are padded past the tokenizer size.
    qwen_vocab = 1024
    qwen_notes = [
        f"vocab_size ({qwen_vocab}) > tokenizer size ({chatml.get_vocab_size()}), as in real Qwen checkpoints.",
        "generation_config.json eos_token_id is a list [<|im_end|>, <|endoftext|>]; config.json eos_token_id is an int.",
        "<think>, </think>, <tool_call>, </tool_call> are added tokens with special=false (as in real Qwen).",
    ]
    return [
        {
            "name": "tiny-llama",
            "seed": 1,
            "config_cls": LlamaConfig,
            "model_cls": LlamaForCausalLM,
            "config": dict(
                common,
                vocab_size=llama3.get_vocab_size(),
                max_position_embeddings=512,
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                rms_norm_eps=1e-5,
                tie_word_embeddings=False,
                attention_bias=False,
                mlp_bias=False,
                bos_token_id=bos,
                eos_token_id=eot,
                pad_token_id=None,
            ),
            "generation": dict(bos_token_id=bos, eos_token_id=[eot, eot_text]),
            "tokenizer": wrap_llama3(llama3, LLAMA3_TEMPLATE),
            "add_special_tokens": True,
            "special_sample": "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>",
            "chat_cases": llama_chat_cases(),
            "notes": [
                "generation_config.json eos_token_id is a list [<|eot_id|>, <|end_of_text|>]; config.json eos_token_id is an int.",
                "tokenizer.json post_processor prepends <|begin_of_text|> when add_special_tokens=True.",
                "The Llama 3.1 template tojson()s tool message content even when it is a string "
                "('is iterable' is true for strings), as the real template does.",
            ],
        },
        {
            "name": "tiny-qwen2",
            "seed": 2,
            "config_cls": Qwen2Config,
            "model_cls": Qwen2ForCausalLM,
            "config": dict(
                common,
                vocab_size=qwen_vocab,
                max_position_embeddings=32768,
                rope_theta=1000000.0,
                rms_norm_eps=1e-6,
                tie_word_embeddings=True,
                use_sliding_window=False,
                bos_token_id=None,
                eos_token_id=im_end,
                pad_token_id=endoftext,
            ),
            "generation": dict(eos_token_id=[im_end, endoftext], pad_token_id=endoftext),
            "max_shard_size": "200KB",
            "tokenizer": wrap_chatml(chatml, QWEN2_TEMPLATE),
            "add_special_tokens": True,  # no BOS: nothing is added either way
            "special_sample": "<|im_start|>user\nHi!<|im_end|>\n<tool_call>\n{}\n</tool_call><|endoftext|>",
            "chat_cases": qwen2_chat_cases(),
            "notes": qwen_notes
            + ["Qwen2 always has q/k/v biases (no attention_bias key in config.json); weights are sharded."],
        },
        {
            "name": "tiny-qwen3",
            "seed": 3,
            "config_cls": Qwen3Config,
            "model_cls": Qwen3ForCausalLM,
            "config": dict(
                common,
                vocab_size=qwen_vocab,
                head_dim=32,
                max_position_embeddings=40960,
                rope_theta=1000000.0,
                rms_norm_eps=1e-6,
                tie_word_embeddings=False,
                attention_bias=False,
                use_sliding_window=False,
                bos_token_id=None,
                eos_token_id=im_end,
                pad_token_id=endoftext,
            ),
            "generation": dict(eos_token_id=[im_end, endoftext], pad_token_id=endoftext),
            "tokenizer": wrap_chatml(chatml, QWEN3_TEMPLATE),
            "add_special_tokens": True,
            "special_sample": "<|im_start|>assistant\n<think>\nhmm\n</think>\n\nok<|im_end|>",
            "chat_cases": qwen3_chat_cases(),
            "notes": qwen_notes
            + ["head_dim (32) != hidden_size / num_attention_heads (16); q_norm / k_norm are RMSNorms over head_dim."],
        },
    ]


def directory_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def write_readme() -> None:
    (FIXTURES / "README.md").write_text(README, encoding="utf-8")


README = """# Test fixtures

Generated by `scripts/make_fixtures.py`; do not edit by hand. Regenerate (deterministic, CPU only, no
downloads) from the repository root with:

    /opt/pyref/bin/python scripts/make_fixtures.py

(any Python with `scripts/requirements-fixtures.txt` installed works).

## Layout

- `models/tiny-llama/` -- `LlamaForCausalLM` (hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128,
  llama3 rope scaling with original_max_position_embeddings 64, untied embeddings) with a Llama-3 style
  byte-level BPE tokenizer (BOS `<|begin_of_text|>` added by the post-processor, EOS `<|eot_id|>`) and a
  Llama-3.1 style chat template.
- `models/tiny-qwen2/` -- `Qwen2ForCausalLM` (same sizes, q/k/v bias, tied embeddings), saved **sharded**
  (`model.safetensors.index.json` + several `model-0000N-of-0000M.safetensors`), ChatML tokenizer and a
  Qwen2.5 style chat template.
- `models/tiny-qwen3/` -- `Qwen3ForCausalLM` (head_dim 32 != hidden/heads, q_norm/k_norm, untied), ChatML
  tokenizer and a Qwen3 style chat template (thinking, tools).

  Each model dir holds what `save_pretrained` writes: `config.json`, `generation_config.json`, safetensors
  weights (float32), `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja`.
- `adapters/<model>-lora/` -- PEFT LoRA adapters (r=4, alpha=8, all attention and MLP projections,
  non-zero A and B): `adapter_config.json` + `adapter_model.safetensors` with PEFT key names.
- `golden/<model>.json` -- reference results from Hugging Face transformers (float32, eval, no_grad):
  - `inputs`: three token-id sequences; `input_texts` the texts they were cut from.
  - `greedy`: `{prompt_text, prompt_ids, new_ids, min_margin}`; 16 greedy tokens, EOS ignored.
  - `chat`: `{messages, tools, add_generation_prompt, extra, text, ids}`; `text` is
    `apply_chat_template(messages, tools=tools, add_generation_prompt=..., tokenize=False, **extra)`,
    `ids` its encoding with `add_special_tokens=False`.
  - `encode`: `{text, add_special_tokens, ids}`; `decode`: `{ids, skip_special_tokens, text}`.
  - `meta`: library versions, where the chat template was saved, notes (rope config keys, ...).
- `golden/<model>.safetensors` -- float32 `logits.{0,1,2}` and `lora_logits.{0,1,2}` (adapter applied,
  not merged), each of shape `[len(inputs[i]), vocab_size]`.
"""


def main() -> None:
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # bit-stable CPU reductions
    if FIXTURES.exists():
        shutil.rmtree(FIXTURES)
    FIXTURES.mkdir()

    corpus = make_corpus()
    for spec in model_specs(train_chatml(corpus), train_llama3(corpus)):
        make_model_fixtures(spec)
    write_readme()

    for name in ("tiny-llama", "tiny-qwen2", "tiny-qwen3"):
        verify(name)
    size = directory_size(FIXTURES)
    print(f"fixtures/: {size / 1e6:.2f} MB")
    if size > MAX_FIXTURE_BYTES:
        sys.exit(f"fixtures/ is {size} bytes, over the {MAX_FIXTURE_BYTES} byte budget")


if __name__ == "__main__":
    main()
