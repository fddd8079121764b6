"""Chat messages with tools → prompt ids: the template's own rendering where it has one, dlite's default where not."""

import json

import pytest
from conftest import AGENT_MESSAGES, AGENT_TOOLS

from dlite_cli.core.config import TargetConfig
from dlite_cli.models.chat import chat_prompt_ids, parse_tool_call, template_with_tools
from dlite_cli.models.targets import load_tokenizer, prepare_target

# A template that renders tools itself, as Qwen3's does (in brief)
TOOLS_TEMPLATE = ("{% for tool in tools %}[tool {{ tool.function.name }}]{% endfor %}{% for m in messages %}<{{ m.role }}>{{ m.content or '' }}"
                  "{% for call in m.tool_calls or [] %}[call {{ call.function.name }} {{ call.function.arguments }}]{% endfor %}{% endfor %}")


@pytest.fixture(scope="module")
def tokenizer(cache_dir):
    return load_tokenizer(prepare_target(TargetConfig(model="micro"), log=lambda _: None))


def text_of(tokenizer, messages, tools):
    return tokenizer.decode(chat_prompt_ids(tokenizer, messages, False, tools))


def test_a_template_without_tools_gets_them_in_dlites_default_form(tokenizer):
    prompt = text_of(tokenizer, AGENT_MESSAGES, AGENT_TOOLS)
    system, user, assistant, tool = prompt.split("<|im_start|>")[1:5]
    assert system.startswith("system\nYou are a coding agent.") and "<tools>\n" + json.dumps(AGENT_TOOLS[0]) + "\n</tools>" in system
    assert user.startswith("user\nWhat does textwrap.dedent do?")
    assert assistant == 'assistant\n<tool_call>\n{"name": "read_file", "arguments": {"path": "textwrap.py"}}\n</tool_call><|im_end|>\n'
    assert tool.startswith("user\n<tool_response>\ndef dedent(text):")
    assert "<tools>" not in text_of(tokenizer, AGENT_MESSAGES, None)  # tool calls and results still rendered, no tools offered
    assert text_of(tokenizer, [{"role": "user", "content": "hi"}], AGENT_TOOLS).startswith("<|im_start|>system\nYou may call")  # a system message of its own


def test_the_default_form_leaves_a_chat_without_tools_as_the_template_renders_it(tokenizer):
    chat = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "more"}]
    plain = tokenizer.apply_chat_template([{**m, "role": "system"} if m["role"] == "developer" else m for m in chat], tokenize=False)
    assert tokenizer.apply_chat_template(chat, chat_template=template_with_tools(tokenizer.chat_template), tokenize=False) == plain


def test_a_template_that_renders_tools_gets_them_and_the_messages_as_they_are(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", TOOLS_TEMPLATE)
    assert text_of(tokenizer, AGENT_MESSAGES, AGENT_TOOLS) == (
        '[tool read_file]<system>You are a coding agent. Use the tools.<user>What does textwrap.dedent do?'
        '<assistant>[call read_file {"path": "textwrap.py"}]<tool>def dedent(text):\n    """Remove any common leading whitespace."""')


def test_a_tool_call_is_a_json_object_with_a_name():
    call = parse_tool_call(' {"name": "f", "arguments": {"x": [1, "é"]}} ')
    assert call["type"] == "function" and call["function"] == {"name": "f", "arguments": '{"x": [1, "é"]}'}
    assert parse_tool_call('{"name": "f", "arguments": "{\\"x\\": 1}"}')["function"]["arguments"] == '{"x": 1}'
    assert parse_tool_call("not json") is None and parse_tool_call('["f"]') is None and parse_tool_call('{"arguments": {}}') is None
