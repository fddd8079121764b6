"""An agent framework from PyPI (the OpenAI Agents SDK) runs a 5-turn tool-calling session against `dlite serve`, in
dlite's engine and in vLLM's.  Its target is the micro model trained here for a few seconds to answer every chat
with the same call of the agent's tool, so that the framework really calls it, turn after turn.  Then the framework
asks for what only constrained decoding gives such a model: a typed output, and a call of a tool it never learnt."""

import asyncio
import json
import random
import shutil
import textwrap
from typing import Literal

import httpx
import openai
import pydantic
import pytest
import torch

from dlite_cli.bench.sessions import dlite_serve_argv
from dlite_cli.core.config import MicroConfig, TargetConfig
from dlite_cli.core.processes import free_port, started
from dlite_cli.models.chat import chat_prompt_ids
from dlite_cli.models.targets import load_model, load_tokenizer, prepare_target

agents = pytest.importorskip("agents", reason="the dev extra is not installed (make test installs it)")

CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "textwrap.py"}}\n</tool_call>'  # the target's every answer
INSTRUCTIONS = "You are a coding agent. Read the file with the tool, a part at a time."
RESULT = textwrap.dedent.__doc__.splitlines()[0]  # what the tool returns
TURNS = 5


@agents.function_tool
def read_file(path: str) -> str:
    """Read a file of the repository."""
    return RESULT


@agents.function_tool
def set_mode(mode: Literal["fast", "slow"]) -> str:
    """Set the reader's mode."""
    return f"reading {mode}"


class Verdict(pydantic.BaseModel):
    mode: Literal["fast", "slow"]
    done: bool


def agent_tools() -> list[dict]:
    return [{"type": "function", "function": {"name": read_file.name, "description": read_file.description, "parameters": read_file.params_json_schema}}]


def conversation(turns: int, question: str) -> list[dict]:
    """What the framework sends after ``turns`` calls of the tool: its instructions, the question, each call and result."""
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": question}]
    for turn in range(turns):
        call = {"id": f"call_{turn}", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "textwrap.py"}'}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": call["id"], "content": RESULT},
                     {"role": "user", "content": "Go on."}]
    return messages


def batch(prompts: list[list[int]], reply: list[int], pad: int) -> dict:
    """Prompts each followed by ``reply``, left-padded into one batch, the loss on the reply alone."""
    width = max(map(len, prompts)) + len(reply)
    ids, mask = torch.full((len(prompts), width), pad), torch.zeros(len(prompts), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) - len(reply):] = torch.tensor(prompt + reply)
        mask[row, width - len(prompt) - len(reply):] = 1
        labels[row, width - len(reply):] = torch.tensor(reply)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.fixture(scope="module")
def tool_caller(cache_dir, tmp_path_factory):
    """A checkpoint of the micro target (heads of 32, as vLLM's CPU attention takes) whose greedy answer to a chat is one
    call of read_file and the end of its turn: trained on short chats every step and on the agent's conversations every
    fifth (about 15 s)."""
    prepared = prepare_target(TargetConfig(model="micro", micro=MicroConfig(num_heads=2, num_kv_heads=1)), log=lambda _: None)
    tokenizer, model = load_tokenizer(prepared), load_model(prepared, "float32", torch.device("cpu"))
    reply = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    words = ["explain", "read", "the", "file", "part", "next", "go", "on", "what", "is", "in", "it", "module", "text", "wrap", "fill", "indent"]
    rng = random.Random(0)
    chats = [chat_prompt_ids(tokenizer, [{"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(2, 12)))}], False) for _ in range(16)]
    conversations = [chat_prompt_ids(tokenizer, conversation(turns, "Explain textwrap.py."), False, agent_tools()) for turns in (0, 2, 4)]
    batches = [batch(chats, reply, tokenizer.pad_token_id), batch(conversations, reply, tokenizer.pad_token_id)]
    model.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for step in range(200):
        loss = model(**batches[step % 5 == 4]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().requires_grad_(False)
    held_out = chat_prompt_ids(tokenizer, conversation(3, "Summarise textwrap.py."), False, agent_tools())
    with torch.no_grad():
        answer = model(input_ids=torch.tensor([held_out + reply])).logits[0, len(held_out) - 1 : -1].argmax(-1).tolist()
    assert answer == reply, "the micro target did not learn to call the tool"
    path = tmp_path_factory.mktemp("tool-caller")
    shutil.copytree(prepared.path, path, dirs_exist_ok=True)
    model.save_pretrained(path)
    return path


async def framework_model(url: str) -> tuple[agents.OpenAIChatCompletionsModel, list[dict]]:
    """The SDK's model for the server at ``url``, and the list the chat requests it sends are kept in."""
    sent = []

    async def keep(request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            sent.append(json.loads(request.content))

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, http_client=httpx.AsyncClient(event_hooks={"request": [keep]}))
    return agents.OpenAIChatCompletionsModel(model=(await client.models.list()).data[0].id, openai_client=client), sent


async def agent_session(url: str) -> tuple[list[str], list[dict]]:
    """TURNS runs of an agent that stops at its first tool call, each continuing the conversation → the runs' final
    outputs and the chat requests the framework sent."""
    model, sent = await framework_model(url)
    agent = agents.Agent(name="coder", instructions=INSTRUCTIONS, tools=[read_file], model=model, tool_use_behavior="stop_on_first_tool",
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=64))
    outputs, conversation_so_far = [], "Explain textwrap.py."
    for _ in range(TURNS):
        result = await agents.Runner.run(agent, conversation_so_far)
        outputs.append(result.final_output)
        conversation_so_far = result.to_input_list() + [{"role": "user", "content": "Go on."}]
    return outputs, sent


async def constrained_runs(url: str) -> tuple[Verdict, str, list[dict]]:
    """An agent whose output is a Verdict, and one that must call set_mode (tool_choice required) → the verdict, the
    tool's result and the chat requests the framework sent."""
    model, sent = await framework_model(url)
    settings = dict(temperature=0, max_tokens=300)
    typed = agents.Agent(name="judge", instructions="Judge the reading.", output_type=Verdict, model=model, model_settings=agents.ModelSettings(**settings))
    forced = agents.Agent(name="switch", instructions=INSTRUCTIONS, tools=[set_mode], model=model, tool_use_behavior="stop_on_first_tool",
                          model_settings=agents.ModelSettings(**settings, tool_choice="required"))
    verdict = (await agents.Runner.run(typed, "Was textwrap.py read fast?")).final_output
    return verdict, (await agents.Runner.run(forced, "Explain textwrap.py.")).final_output, sent


@pytest.mark.parametrize("engine", ["dlite", "vllm"])
def test_an_agent_framework_runs_a_five_turn_tool_session(engine, tool_caller, tmp_path):
    if engine == "vllm":
        pytest.importorskip("vllm", reason="the vllm extra is not installed (make test installs it)")
    agents.set_tracing_disabled(True)  # the SDK would send its traces to OpenAI
    overrides = [f"target.model={tool_caller}", "vllm.enforce_eager=true", "vllm.kv_cache_gib=0.25"]
    port = free_port()
    method = "ar" if engine == "dlite" else "vllm:ar"
    with started(dlite_serve_argv(method, "micro", tmp_path, overrides, port), tmp_path / "serve.log", port) as server:
        outputs, sent = asyncio.run(agent_session(server.url))
        verdict, result, constrained = asyncio.run(constrained_runs(server.url))
    assert outputs == [RESULT] * TURNS  # every turn the framework read a tool call out of the reply and ran it
    assert len(sent) == TURNS and all(body["tools"][0]["function"]["name"] == "read_file" for body in sent)
    last = sent[-1]["messages"]
    calls = [m for m in last if m["role"] == "assistant" and m.get("tool_calls")]
    results = [m for m in last if m["role"] == "tool"]
    assert len(calls) == len(results) == TURNS - 1 and [r["tool_call_id"] for r in results] == [c["tool_calls"][0]["id"] for c in calls]
    # a typed output and an enforced call of a tool the target never learnt to call: both parse, as the grammar makes them
    assert isinstance(verdict, Verdict) and result in ("reading fast", "reading slow")
    assert constrained[0]["response_format"]["type"] == "json_schema" and constrained[0]["response_format"]["json_schema"]["strict"]
    assert constrained[1]["tool_choice"] == "required" and [t["function"]["name"] for t in constrained[1]["tools"]] == ["set_mode"]
