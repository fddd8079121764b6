"""A conversation as the target sees it: chat messages (OpenAI's form, tools included) → prompt token ids, and
tool calls read back out of what the target wrote.

Tools travel in the Hermes format that Qwen's chat templates use: the assistant calls a tool by writing

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that renders tools itself (Qwen3's) gets the tools and the messages as they are.  One that
does not (SmolLM2's, the micro target's) gets them rendered here, in that same format: the tools' JSON
schemas and the instruction above at the end of the system message, an assistant's tool calls as
``<tool_call>`` blocks after its text, and a tool's result as a user message in ``<tool_response>`` tags.
"""

from __future__ import annotations

import json
import re
import uuid

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# a call as the assistant writes it: CALL_HEAD + the name as JSON + CALL_ARGUMENTS + the arguments' JSON object + CALL_TAIL
CALL_HEAD, CALL_ARGUMENTS, CALL_TAIL = TOOL_CALL_OPEN + '\n{"name": ', ', "arguments": ', "}\n" + TOOL_CALL_CLOSE
TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
# the default form's instruction, written into the system message where {tools} stands
TOOLS_INSTRUCTION = (
    "You may call one or more functions to assist with the user query. The functions are described in JSON "
    "schema within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a JSON "
    "object with the function name and arguments within <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def chat_prompt_ids(tokenizer, messages: list[dict], thinking: bool, tools: list[dict] | None = None) -> list[int]:
    """The token ids the target sees for ``messages`` (with ``tools`` offered), with its chat template when it has
    one; a template that does not render tools gets them, and the messages that carry tool calls and results, in
    the default form above.  OpenAI's developer role is the system's."""
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    if not tokenizer.chat_template:
        return tokenizer("\n\n".join(m.get("content") or "" for m in messages))["input_ids"]
    template = tokenizer.chat_template
    if isinstance(template, str) and not renders_tools(template):
        template = template_with_tools(template)
    return tokenizer.apply_chat_template(
        messages, tools=tools or None, chat_template=template, add_generation_prompt=True, tokenize=True, return_dict=False,
        enable_thinking=thinking,
    )


def renders_tools(template: str | dict) -> bool:
    """Whether a chat template renders the tools it is given itself."""
    return "tools" in (template if isinstance(template, str) else json.dumps(template))


def template_with_tools(template: str) -> str:
    """``template`` (one that does not render tools) behind a preamble that writes the tools, tool calls and tool results
    into plain-text contents, in the default form above, before it renders the messages: dlite's engine and vLLM's
    server (``--chat-template``) render an agent's request alike."""
    head, tail = (json.dumps(part) for part in TOOLS_INSTRUCTION.split("{tools}"))
    call_head, call_arguments, call_tail = (json.dumps(part) for part in (CALL_HEAD, CALL_ARGUMENTS, CALL_TAIL))  # Jinja strings
    return (
        "{%- set ns = namespace(messages=[]) -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'assistant' and m.tool_calls -%}"
        "{%- set text = namespace(value=m.content or '') -%}"
        "{%- for call in m.tool_calls -%}"
        "{%- set arguments = call.function.arguments if call.function.arguments is string else call.function.arguments | tojson -%}"
        "{%- set text.value = (text.value ~ '\\n' if text.value else '') ~ " + call_head
        + " ~ call.function.name | tojson ~ " + call_arguments + " ~ arguments ~ " + call_tail + " -%}"
        "{%- endfor -%}"
        "{%- set ns.messages = ns.messages + [{'role': 'assistant', 'content': text.value}] -%}"
        "{%- elif m.role == 'tool' -%}"
        "{%- set ns.messages = ns.messages + [{'role': 'user', 'content': '<tool_response>\\n' ~ (m.content or '') ~ '\\n</tool_response>'}] -%}"
        "{%- else -%}"
        "{%- set ns.messages = ns.messages + [{'role': 'system' if m.role == 'developer' else m.role, 'content': m.content or ''}] -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if tools -%}"
        "{%- set instruction = " + head + " ~ tools | map('tojson') | join('\\n') ~ " + tail + " -%}"
        "{%- if ns.messages and ns.messages[0].role == 'system' -%}"
        "{%- set ns.messages = [{'role': 'system', 'content': ns.messages[0].content ~ '\\n\\n' ~ instruction}] + ns.messages[1:] -%}"
        "{%- else -%}"
        "{%- set ns.messages = [{'role': 'system', 'content': instruction}] + ns.messages -%}"
        "{%- endif -%}"
        "{%- endif -%}"
        "{%- set messages = ns.messages -%}"
    ) + template


def parse_tool_call(body: str) -> dict | None:
    """The text between ``<tool_call>`` tags → an OpenAI tool call (arguments as JSON text), or None where it is not
    a JSON object with a string ``name``."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)}}
