import dataclasses
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dlite_cli.core.config import RegenConfig, SourceConfig, load_config
from dlite_cli.core.errors import DliteError
from dlite_cli.data.prompts import Prompt, plan_prompts
from dlite_cli.data.split import is_heldout
from dlite_cli.models.chat import chat_prompt_ids
from dlite_cli.models.targets import load_model, load_tokenizer, prepare_target
from dlite_cli.models.runner import TargetRunner
from dlite_cli.training.features import engine_passes, kept_sequences
from dlite_cli.training.sequences import read_sequences
from dlite_cli.training.regen import EngineBackend, _generate_batch, kept_feature_files, parse_shard, written_spans


def chunk_records(run: Path) -> dict[str, dict]:
    records = {}
    for chunk in sorted((run / "regen" / "chunks").glob("*.jsonl")):
        for line in chunk.read_text().splitlines():
            record = json.loads(line)
            records[record["id"]] = record
    return records


def manifest(run: Path) -> dict:
    return json.loads((run / "regen" / "manifest.json").read_text())


def test_regen_micro_end_to_end(run_cli, tmp_path):
    first = run_cli("regen", "--target", "micro", env={"DLITE_PROGRESS_INTERVAL": "0.05"})
    # stderr is not a terminal: progress comes as lines at a steady interval, the last one complete
    progress = [line for line in first.stderr.splitlines() if re.fullmatch(r"regen[^:]*: \d+/32 \(\d+%\), [\d.]+/s, elapsed \d+:\d\d, eta \S+", line)]
    assert len(progress) >= 2 and "32/32 (100%)" in progress[-1]
    run = tmp_path / "runs" / "micro"
    records = chunk_records(run)
    assert len(records) == 24 + 8  # the configured counts of usable prompts: regenerated, then kept originals
    ok = list(records.values())
    assert all(r["source"] == "stdlib-code" and "error" not in r for r in ok)
    for r in ok:
        assert 0 < r["prompt_len"] <= 192 and r["prompt_len"] < len(r["input_ids"]) <= r["prompt_len"] + 16
        assert r["finish_reason"] in ("stop", "length") and r["messages"][-1]["role"] == "user"
    originals = [r for r in ok if r.get("labels") == "target"]
    assert len(originals) == 8 and all(r["response"].startswith("```python") for r in originals)  # the function's own code
    # prompts over max_prompt_tokens are skipped with the reason and replaced by the next ones
    skipped = [json.loads(line) for line in (run / "regen" / "skipped.jsonl").read_text().splitlines()]
    assert any("over regen.max_prompt_tokens=192" in s["reason"] for s in skipped)
    assert all("over regen.max_prompt_tokens=192" in s["reason"] or s["reason"] == "no original response to keep" for s in skipped)
    assert not {s["id"] for s in skipped} & set(records)
    m = manifest(run)
    assert m["status"] == "done" and m["summary"]["records"] == 32 and m["summary"]["skipped"] == len(skipped)
    assert m["summary"]["original_responses"] == 8
    assert m["inputs"]["target"] and m["versions"]["torch"]

    again = run_cli("regen", "--target", "micro")
    assert "already done" in again.stderr
    refused = run_cli("regen", "--target", "micro", "--max-new-tokens", "8", check=False)
    assert refused.returncode == 2 and "different config" in refused.stderr and "--force" in refused.stderr
    run_cli("regen", "--target", "micro", "--max-new-tokens", "8", "--force")
    assert all(len(r["input_ids"]) <= r["prompt_len"] + 8 for r in chunk_records(run).values() if "error" not in r)

    status = run_cli("status", "--target", "micro")
    assert "regen" in status.stdout and "done" in status.stdout and "32/32 prompts" in status.stdout
    assert "train-teacher" in status.stdout and "missing" in status.stdout


def test_shards_are_disjoint_and_complete(micro_run, run_cli, tmp_path):
    full, shared = micro_run.directory, tmp_path / "sharded"  # the session's micro run's regen, on the CPU as here
    cpu = ("--set", "target.device=cpu")
    first = run_cli("regen", "--target", "micro", *cpu, "--run-dir", str(shared), "--shard", "0/2")
    assert "wait for other shards" in first.stderr and manifest(shared)["status"] == "running"
    part = set(chunk_records(shared))
    run_cli("regen", "--target", "micro", *cpu, "--run-dir", str(shared), "--shard", "1/2")
    both = chunk_records(shared)
    assert manifest(shared)["status"] == "done"
    assert part and part < set(both)  # shard 0 did part of the work, shard 1 the rest
    assert both == chunk_records(full)  # together: exactly the unsharded records


def test_reuse_from_takes_the_records_a_smaller_mix_wrote_and_generates_only_the_rest(micro_run, run_cli, tmp_path):
    full = chunk_records(micro_run.directory)  # the whole micro plan: 24 regenerated + 8 originals
    cpu = ("--set", "target.device=cpu")
    small, grown = tmp_path / "small", tmp_path / "grown"
    run_cli("regen", "--target", "micro", *cpu, "--run-dir", str(small), "--set", "regen.sources=[{name: stdlib-code, count: 12}]")
    chunk = min((small / "regen" / "chunks").glob("*.jsonl"))
    lines = [json.loads(line) for line in chunk.read_text().splitlines()]
    marked = lines[0]["id"]
    lines[0]["response"] = "written by the smaller run"  # the grown run must carry it, not write it again
    chunk.write_text("".join(json.dumps(r) + "\n" for r in lines))

    result = run_cli("regen", "--target", "micro", *cpu, "--run-dir", str(grown), "--reuse-from", str(small))
    assert "reused 12 records" in result.stderr and manifest(grown)["reused"] == {"from": str(small), "records": 12}
    records = chunk_records(grown)
    assert records[marked]["response"] == "written by the smaller run"
    del records[marked], full[marked]
    assert records == full  # the smaller run's 12 spread over the grown plan's chunks; the rest generated as a fresh run would
    assert not list((grown / "regen" / "chunks").glob("*.partial"))

    # under another max_length, a one-turn record is taken only where its reply fits under both limits
    shorter = run_cli("regen", "--target", "micro", *cpu, "--run-dir", str(tmp_path / "shorter"), "--set", "regen.max_length=140",
                      "--set", "regen.max_prompt_tokens=130", "--reuse-from", str(small))
    lengths = [r["prompt_len"] for r in chunk_records(small).values()]
    planned, fits = sum(n <= 130 for n in lengths), sum(n + 16 <= 140 for n in lengths)
    assert 0 < fits < planned and f"reused {fits} records" in shorter.stderr

    refused = run_cli("regen", "--target", "micro", "--run-dir", str(tmp_path / "other"), "--max-new-tokens", "8", "--reuse-from", str(small), check=False)
    assert refused.returncode == 2 and "regen.max_new_tokens 16 there, 8 here" in refused.stderr


def test_kill_9_then_resume_equals_an_uninterrupted_run(run_cli, cache_dir, tmp_path):
    options = ["--target", "micro", "--max-new-tokens", "96"]
    reference = tmp_path / "reference"
    run_cli("regen", *options, "--run-dir", str(reference))

    killed = tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "dlite_cli", "regen", *options, "--run-dir", str(killed)],
        env={**__import__("os").environ, "DLITE_CACHE": str(cache_dir)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    partial = killed / "regen" / "chunks" / "00000.partial"
    while not (partial.exists() and partial.read_text().count("\n") >= 1):
        assert time.time() < deadline and process.poll() is None, "regen finished before it could be killed"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert manifest(killed)["status"] == "running"
    assert len(chunk_records(killed)) < 24

    resumed = run_cli("regen", *options, "--run-dir", str(killed))
    assert "regen done" in resumed.stderr
    assert chunk_records(killed) == chunk_records(reference)
    assert not list((killed / "regen" / "chunks").glob("*.partial"))


def test_malformed_records_are_skipped_and_reported(run_cli, tmp_path):
    data = tmp_path / "chats.jsonl"
    good = [
        {"id": f"c{i}", "conversations": [{"from": "human", "value": f"Tell me about {i}."}, {"from": "gpt", "value": "x"}]}
        for i in range(40)
    ]
    lines = [json.dumps(r) for r in good[:3]]
    lines += [
        "{not json",
        json.dumps({"id": "no-human", "conversations": [{"from": "gpt", "value": "hello"}]}),
        json.dumps({"id": "no-conversations"}),
        json.dumps({"id": "empty", "conversations": [{"from": "human", "value": "  "}]}),
        json.dumps(["a", "list"]),
    ]
    lines += [json.dumps(r) for r in good[3:]]
    data.write_text("\n".join(lines) + "\n")
    sources = f"regen.sources=[{{name: sharegpt, count: 12, path: {data}}}]"
    done = run_cli("regen", "--target", "micro", "--set", sources)
    run = tmp_path / "runs" / "micro"
    records = chunk_records(run)
    assert len(records) == 12 and all(r["source"] == "sharegpt" for r in records.values())
    assert all(not is_heldout(i) for i in records)
    reasons = [json.loads(line)["reason"] for line in (run / "regen" / "skipped.jsonl").read_text().splitlines()]
    assert any("not valid JSON" in r for r in reasons)
    assert sum("malformed record" in r for r in reasons) == 4
    assert "skipped" in done.stderr


def test_heldout_ids_never_reach_training(tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [{"from": "human", "value": f"Q{i}?"}]}) + "\n" for i in range(400)))
    prompts, _ = plan_prompts(RegenConfig(sources=[SourceConfig("sharegpt", 1000, str(chats))]), log=lambda _: None)
    assert 360 < len(prompts) < 400 and not any(is_heldout(p.id) for p in prompts)
    ids = [f"sharegpt:{i}" for i in range(10000)]
    assert 0.04 < sum(map(is_heldout, ids)) / len(ids) < 0.06


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "nope"], "unknown target 'nope'"),
        (["--set", "regen.sources=[{name: sharegpt, count: 3, path: /does/not/exist.jsonl}]"], "does not exist"),
        (["--set", "regen.max_prompt_tokens=1"], "no usable prompt (first skip: prompt has"),
        (["--backend", "openai"], "needs --base-url"),
        (["--backend", "openai", "--base-url", "http://127.0.0.1:9/v1"], "did not list a model"),
        (["--shard", "2/2"], "expected 0 <= i < n"),
        (["--backend", "sglang"], "needs SGLang installed"),
    ],
)
def test_bad_input_is_one_clear_error(run_cli, args, message):
    if args[:2] == ["--target", "nope"]:
        done = run_cli("regen", *args, check=False)
    else:
        done = run_cli("regen", "--target", "micro", *args, check=False)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_parse_shard():
    assert parse_shard("1/4") == (1, 4)
    with pytest.raises(DliteError):
        parse_shard("4")


def test_hub_sources_read_local_files_in_their_schema(tmp_path):
    nemotron = tmp_path / "nemotron"
    nemotron.mkdir()
    rows = [
        {"uuid": f"u{i}", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Q{i}?"},
                                        {"role": "assistant", "content": "A."}]}
        for i in range(30)
    ]
    (nemotron / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    blend = tmp_path / "blend.json"
    blend.write_text(json.dumps([{"conversations": [{"from": "human", "value": f"Hi {i}"}, {"from": "gpt", "value": "x"}]} for i in range(30)]))
    regen = RegenConfig(
        sources=[SourceConfig("nemotron-v2", 10, str(nemotron)), SourceConfig("open-perfectblend", 10, str(blend))]
    )
    prompts, skipped = plan_prompts(regen, log=lambda _: None)
    by_source = {s: [p for p in prompts if p.source == s] for s in ("nemotron-v2", "open-perfectblend")}
    assert len(by_source["nemotron-v2"]) == 10 and len(by_source["open-perfectblend"]) == 10
    first = by_source["nemotron-v2"][0]
    assert first.id.startswith("nemotron-v2:u") and [m["role"] for m in first.messages] == ["system", "user"]
    assert by_source["open-perfectblend"][0].messages[-1]["content"].startswith("Hi ")
    assert first.original == "A." and not first.keep_original  # the source's own answer, regenerated by default
    assert plan_prompts(regen, log=lambda _: None)[0] == prompts  # the same plan every time
    limited, _ = plan_prompts(regen, limit=5, log=lambda _: None)
    assert limited == prompts[:5]


def test_a_later_source_keeps_originals_of_prompts_no_earlier_source_took(tmp_path):
    chats = tmp_path / "chats.jsonl"
    rows = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Q{i}?"}] + ([{"from": "gpt", "value": f"A{i}."}] if i % 3 else [])}
            for i in range(40)]
    chats.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    regen = RegenConfig(sources=[SourceConfig("sharegpt", 6, str(chats)), SourceConfig("sharegpt", 10, str(chats), responses="original")])
    prompts, skipped = plan_prompts(regen, log=lambda _: None)
    rewritten, kept = [p for p in prompts if not p.keep_original], [p for p in prompts if p.keep_original]
    assert len(rewritten) == 6 and len(kept) == 10 and not {p.id for p in rewritten} & {p.id for p in kept}
    assert all(p.original == f"A{p.id.split(':c')[1]}." for p in kept)
    assert {s.reason for s in skipped} == {"no original response to keep"}  # the conversations with no answer


def test_sampled_regen_is_reproducible_for_a_seed(run_cli, tmp_path):
    sampled = ["--target", "micro", "--temperature", "0.9", "--top-p", "0.95", "--limit", "8"]
    first, second, greedy = tmp_path / "a", tmp_path / "b", tmp_path / "greedy"
    run_cli("regen", *sampled, "--run-dir", str(first))
    run_cli("regen", *sampled, "--run-dir", str(second))
    run_cli("regen", "--target", "micro", "--limit", "8", "--run-dir", str(greedy))
    assert chunk_records(first) == chunk_records(second)  # fixed per-batch seeds: resume-safe sampling
    assert chunk_records(first) != chunk_records(greedy)


def test_the_dlite_backend_writes_the_greedy_records_generate_does_and_samples_reproducibly(run_cli, tmp_path):
    ask = ["--target", "micro", "--limit", "8", "--set", "target.dtype=float32"]
    runs = {backend: tmp_path / backend for backend in ("hf", "dlite")}
    for backend, run in runs.items():
        run_cli("regen", *ask, "--backend", backend, "--run-dir", str(run))
    hf, dlite = chunk_records(runs["hf"]), chunk_records(runs["dlite"])
    assert hf == dlite and any(r.get("labels") != "target" and len(r["input_ids"]) > r["prompt_len"] + 1 for r in hf.values())
    sampled = [*ask, "--backend", "dlite", "--temperature", "0.9", "--top-p", "0.95"]
    run_cli("regen", *sampled, "--run-dir", str(tmp_path / "a"))
    run_cli("regen", *sampled, "--run-dir", str(tmp_path / "b"))
    assert chunk_records(tmp_path / "a") == chunk_records(tmp_path / "b") != dlite


LATER_TURNS = [[{"role": "user", "content": '[tool AddAlarm({"time": "07:00"})]\n{"alarm_id": "a1"}'}], [{"role": "user", "content": "Thanks."}]]


@pytest.fixture
def trace_and_chat(cache_dir):
    """micro's config (8 new tokens a reply), its tokenizer and float32 model, and two prompts with their ids: a trace
    of three turns (LATER_TURNS after its first reply and its second) and a one-turn chat."""
    config = load_config("micro", ["regen.max_new_tokens=8"])
    target = prepare_target(config.target, log=lambda _: None)
    tokenizer, model = load_tokenizer(target), load_model(target, "float32", torch.device("cpu"))
    first = [{"role": "system", "content": "You call tools."}, {"role": "user", "content": "Wake me at 7."}]
    prompts = [Prompt("t:1", "tooltalk", first, later_turns=LATER_TURNS), Prompt("c:1", "stdlib-code", [{"role": "user", "content": "Sort a list."}])]
    return config, tokenizer, model, prompts, [chat_prompt_ids(tokenizer, p.messages, False) for p in prompts]


def test_a_trace_is_written_turn_by_turn_and_ends_where_its_context_leaves_no_room(trace_and_chat):
    """A trace's replies are the target's, each after the context its earlier replies and the tool results made
    (rendered by the chat template, as the bench renders it); the record is the whole trace, and a turn whose
    context leaves no room for a reply ends it."""
    config, tokenizer, model, prompts, ids = trace_and_chat

    def write(regen, backend=None):
        return _generate_batch(prompts, ids, backend or EngineBackend(model, tokenizer, regen), 0, tokenizer, regen, False)

    backend = EngineBackend(model, tokenizer, config.regen)
    trace, chat = write(config.regen, backend)
    stats = backend.engine.stats  # each later turn found the trace's turn before in its slot, its prompt and its reply
    assert stats.reused_prompt_tokens >= len(ids[0]) + trace["spans"][0][1] - trace["spans"][0][0] - 1
    assert f"({stats.reused_prompt_tokens} more found in a slot" in backend.timing()
    assert [m["role"] for m in trace["messages"]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert trace["messages"][3:] == [*LATER_TURNS[0], trace["messages"][4], *LATER_TURNS[1]]
    last_turn = chat_prompt_ids(tokenizer, trace["messages"], False)
    assert trace["input_ids"][: len(last_turn)] == last_turn and trace["spans"][-1] == [len(last_turn), len(trace["input_ids"])]
    assert trace["prompt_len"] == len(ids[0]) and trace["spans"] == sorted(trace["spans"])
    assert "spans" not in chat and chat == write(config.regen)[1]  # a single-turn prompt's record is as it was
    cut = write(dataclasses.replace(config.regen, max_length=len(last_turn)))[0]  # the last turn's context leaves no room
    assert [m["role"] for m in cut["messages"]][-2:] == ["assistant", "user"] and len(cut["messages"]) == 4


def test_the_engine_keeps_each_records_features_and_p_t_as_the_feature_pass_computes_them(trace_and_chat, tmp_path):
    """Where training caches features, regen's engine keeps each sequence's features at the drafter's layers and its
    p^T: a trace's are those of its last turn, whose prompt took the turns before from the slot, features too."""
    config, tokenizer, model, prompts, ids = trace_and_chat
    plain, keeping = EngineBackend(model, tokenizer, config.regen), EngineBackend(model, tokenizer, config.regen, ([1, 3], 8))
    records = _generate_batch(prompts, ids, keeping, 0, tokenizer, config.regen, False)
    assert records == _generate_batch(prompts, ids, plain, 0, tokenizer, config.regen, False)
    # the next turn computes only what is new, as without keeping: the reply before's features were kept with it
    assert keeping.engine.stats.reused_prompt_tokens == plain.engine.stats.reused_prompt_tokens > 0
    keeping.write_kept(records, tmp_path / "kept.features.safetensors")
    assert not keeping.kept
    kept, metadata = read_sequences(tmp_path / "kept.features.safetensors")
    assert json.loads(metadata["ids"]) == ["t:1", "c:1"] and json.loads(metadata["layers"]) == [1, 3]
    computed, _ = engine_passes(TargetRunner(model, [1, 3, 4], 1, 512), [1, 3], records, 8)
    for ours, theirs, record in zip(kept, computed, records):
        assert ours.input_ids.tolist() == record["input_ids"] and ours.responses() == theirs.responses()
        assert torch.allclose(ours.features[:-1].float(), theirs.features[:-1], atol=1e-3)  # half precision
        assert not ours.features[-1].any()  # the last token's: no pass reads it, nor any pivot
        read = theirs.scored_positions()
        assert torch.equal(ours.top_ids[read], theirs.top_ids[read])
        assert torch.allclose(ours.top_probs[read].float(), theirs.top_probs[read], atol=1e-3)


def test_the_feature_stage_takes_what_regens_engine_kept_and_computes_the_rest(run_cli, tmp_path):
    ask = ["--target", "micro", "--run-dir", str(tmp_path / "run"), "--set", "regen.backend=dlite", "--set", "train.teacher_epochs=1"]
    small = ["--target", "micro", "--run-dir", str(tmp_path / "small"), "--set", "regen.backend=dlite"]
    run_cli("regen", *small, "--set", "regen.sources=[{name: stdlib-code, count: 4}]")
    reused = run_cli("regen", *ask, "--limit", "12", "--reuse-from", str(tmp_path / "small"))
    records = chunk_records(tmp_path / "run")
    regenerated = {i for i, r in records.items() if r.get("labels") != "target"}
    taken = int(re.search(r"reused (\d+) records", reused.stderr).group(1))  # with the features the smaller run's engine kept
    assert 0 < taken < len(regenerated) and len(kept_feature_files(tmp_path / "run")) >= 2
    assert set(kept_sequences(tmp_path / "run", [0, 2, 3], 8)) == regenerated  # micro's drafter reads layers 0, 2 and 3
    assert not kept_sequences(tmp_path / "run", [0, 1], 8) and not kept_sequences(tmp_path / "run", [0, 2, 3], 4)
    run_cli("train-teacher", *ask)
    summary = json.loads((tmp_path / "run" / "features" / "manifest.json").read_text())["summary"]
    originals = [r for r in records.values() if r.get("labels") == "target"]  # read teacher-forced: never generated
    assert summary["kept_from_regen"] == len(regenerated) and summary["sequences"] == len(records)
    assert 0 < summary["computed_tokens"] <= sum(len(r["input_ids"]) for r in originals)


def test_a_reply_is_a_span_as_far_as_the_next_turn_reads_back_the_ids_the_target_wrote():
    trace = [1, 2, 3, 10, 11, 4, 5, 20, 21, 22]  # prompt 1 2 3, reply 10 11, tool result 4 5, reply 20 21 22
    assert written_spans(trace, [([1, 2, 3], [10, 11]), ([1, 2, 3, 10, 11, 4, 5], [20, 21, 22])]) == [[3, 5], [7, 10]]
    assert written_spans(trace, [([1, 2, 3], [10, 12])]) == [[3, 4]]  # its text re-read as other ids from the second on
    assert written_spans(trace, [([1, 2, 9], [10, 11])]) == []  # its prompt is not the trace's: no span
