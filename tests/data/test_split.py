"""The benchmarks and the drafter's training read separate parts of the data they share (split.py), checked on the real
data: the wheels of the user's dlite cache, fetched into it if missing."""

import os
import re
from pathlib import Path

import pytest

from dlite_cli.core.config import RegenConfig, SourceConfig
from dlite_cli.core.errors import DliteError
from dlite_cli.data.prompts import Prompt, plan_prompts
from dlite_cli.data.split import BENCH_MODULES, STDLIB_MODULES, TRAINING_MODULES, part_of
from dlite_cli.data.workloads import BY_NAME, Episode, load

TRACE_SOURCES = {"bfcl_v3": "bfcl-v3", "tooltalk": "tooltalk", "tau2_airline": "tau2-airline", "swe_bench": "swe-stdlib"}  # workload → source
STOCK_LINES = {"No, that's all. Thanks!"}  # ToolTalk's users close conversations of both halves with it: no task's text


@pytest.fixture(scope="module", autouse=True)
def wheel_cache():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DLITE_CACHE", os.environ.get("DLITE_WHEEL_CACHE", str(Path.home() / ".cache" / "dlite")))
        yield


def bench(workload: str, limit: int = 100_000) -> list[Episode]:
    episodes, _ = load(BY_NAME[workload], None, limit)
    return episodes


def training(source: str, count: int = 100_000) -> list[Prompt]:
    prompts, _ = plan_prompts(RegenConfig(sources=[SourceConfig(source, count)]), log=lambda _: None)
    return prompts


def user_texts(turns: list[list[dict]]) -> set[str]:
    """The user's own messages of these turns (tool results left out)."""
    return {m["content"] for turn in turns for m in turn if m["role"] == "user" and not m["content"].startswith("[tool ")}


def texts(prompt: Prompt) -> set[str]:
    return {m["content"] for turn in [prompt.messages, *prompt.later_turns] for m in turn}


def module_of(sample_id: str) -> str:
    """``stdlib-code:email.utils.parsedate`` or ``swe-stdlib:synthetic-swe-email.utils.parsedate`` → ``email.utils``."""
    return sample_id.split(":", 1)[1].removeprefix("synthetic-swe-").rpartition(".")[0]


def test_part_of_gives_the_bench_the_first_half_and_an_odd_counts_extra_record():
    assert part_of([1, 2, 3, 4], "bench") == [1, 2] and part_of([1, 2, 3, 4], "training") == [3, 4]
    assert part_of([1, 2, 3], "bench") == [1, 2] and part_of([1, 2, 3], "training") == [3]


@pytest.mark.parametrize("workload", sorted(TRACE_SOURCES))
def test_no_bench_episode_of_an_agentic_data_set_is_trained_on(workload):
    source = TRACE_SOURCES[workload]
    episodes, prompts = bench(workload), training(source)
    assert episodes and prompts
    assert not {f"{source}:{e.id}" for e in episodes} & {p.id for p in prompts}
    trained = set().union(*map(texts, prompts))
    assert not (set().union(*(user_texts(e.turns) for e in episodes)) - STOCK_LINES) & trained


def test_the_standard_library_is_split_by_module():
    assert len(BENCH_MODULES) + len(TRAINING_MODULES) == len(STDLIB_MODULES) == len(set(STDLIB_MODULES))
    assert set(BENCH_MODULES) | set(TRAINING_MODULES) == set(STDLIB_MODULES)
    assert {module_of(p.id) for p in training("stdlib-code") + training("swe-stdlib")} <= set(TRAINING_MODULES)
    assert {e.id.removeprefix("synthetic-swe-").rpartition(".")[0] for e in bench("swe_bench")} <= set(BENCH_MODULES)
    repositories = [e.turns[0][0]["content"] for e in bench("code_repository_understanding")]
    files = {path for text in repositories for path in re.findall(r"^### (\S+)\.py$", text, re.MULTILINE)}
    assert files and {path.replace("/", ".") for path in files} <= set(BENCH_MODULES)  # every file of its repositories


def test_held_out_sharegpt_chats_are_never_trained_on():
    held_out = bench("sharegpt", 100)  # about the first 2000 records' held-out ones
    trained = training("sharegpt", 2000)
    assert len(held_out) == 100 and not {e.id for e in held_out} & {p.id for p in trained}
    conversation = lambda sample_id: sample_id.rpartition("_")[0]  # sharegpt:<conversation>_<piece>
    assert not {conversation(e.id) for e in held_out} & {conversation(p.id) for p in trained}  # no piece of a held-out one


def test_no_held_out_sharegpt_text_is_trained_on():
    trained = set().union(*map(texts, training("sharegpt", 2000)))
    assert not set().union(*(user_texts(e.turns) for e in bench("sharegpt", 100))) & trained


@pytest.mark.parametrize("source", sorted(TRACE_SOURCES.values()))
def test_agent_trace_sources_yield_multi_turn_prompts(source, tmp_path):
    prompts = training(source)
    assert all(p.id.startswith(f"{source}:") and p.source == source and p.messages[-1]["role"] == "user" for p in prompts)
    assert sum(bool(p.later_turns) for p in prompts) > 0.9 * len(prompts)
    with pytest.raises(DliteError, match=f"source {source} is built from .* and takes no path"):
        plan_prompts(RegenConfig(sources=[SourceConfig(source, 1, str(tmp_path))]), log=lambda _: None)
