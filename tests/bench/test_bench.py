"""`dlite bench` on the micro target: side-by-side runs, multi-turn replay, resume, the paper's tables."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import DEVICE, cli

from dlite_cli.core.config import DrafterConfig, TargetConfig
from dlite_cli.data.workloads import BY_NAME
from dlite_cli.models.model import Drafter, DrafterSpec
from dlite_cli.models.runner import decode_path
from dlite_cli.models.targets import load_model, prepare_target

BENCH = ["bench", "--target", "micro", "--limit", "1", "--max-new-tokens", "6", "--concurrency", "1,2"]
TABLES = ("table1_general_tau", "table2_longbench_v2", "table3_agentic", "table4_throughput", "tau_by_context")


@pytest.fixture(scope="module")
def bench_dir(cache_dir, tmp_path_factory):
    """One micro bench over every suite: autoregressive, n-gram and an (untrained) DLite checkpoint."""
    workdir = tmp_path_factory.mktemp("bench")
    model = load_model(prepare_target(TargetConfig(model="micro"), log=lambda _: None), "float32", DEVICE)
    spec = DrafterSpec.for_target(model.config, DrafterConfig(num_target_layers=3, draft_tokens=4, num_layers=1, head_rank=16), 0)
    torch.manual_seed(0)
    Drafter(spec).save(workdir / "mydrafter")
    cli(cache_dir, workdir, *BENCH, "--methods", "ar,ngram,mydrafter,history")
    return workdir / "runs" / "micro" / "bench"


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_table_in_every_format_and_the_plots(bench_dir):
    for table in TABLES + ("details",):
        for ext in ("md", "csv", "json", "tex"):
            assert (bench_dir / f"{table}.{ext}").stat().st_size > 0
    for plot in ("tau_vs_context.png", "tau_vs_context_by_workload.png", "throughput_vs_concurrency.png", "acceptance_by_position.png"):
        assert (bench_dir / plot).read_bytes()[:4] == b"\x89PNG"
    summary = (bench_dir / "summary.md").read_text()
    assert all(f"({t}.md)" in summary for t in TABLES)


def test_tables_have_the_papers_columns_and_rows_beside_ours(bench_dir):
    with open(bench_dir / "table1_general_tau.csv") as f:
        header = next(csv.reader(f))
    assert header == ["target", "method", "engine", "drafter", "origin", "hardware", "GSM8K", "MATH-500", "HumanEval", "MBPP", "LiveCodeBench", "MT-Bench", "Alpaca",
                      "ShareGPT (held-out)"]  # the paper's workloads, then the suite's others
    table2 = json.loads((bench_dir / "table2_longbench_v2.json").read_text())
    assert table2["columns"][6:] == [f"{w} {m}" for w in ("Multi-Doc QA", "Long ICL", "Code Repo", "Long Dialogue") for m in ("speedup", "tau")]
    ours = {row["method"]: row for row in table2["rows"] if row["target"] == "micro"}
    assert set(ours) == {"ar", "ngram", "mydrafter"} and ours["ar"]["Code Repo speedup"] == "1.00 (synthetic)"
    table3 = json.loads((bench_dir / "table3_agentic.json").read_text())
    paper = next(r for r in table3["rows"] if r["target"] == "Qwen3-4B (paper)" and r["method"] == "DLite")
    assert paper["SWE-Bench speedup"] == "2.68" and paper["SWE-Bench tau"] == "3.15" and paper["AgentMemoryBench tau"] == ""
    assert table3["columns"][-6:] == [f"{w} {m}" for w in ("SWE-Bench", "ToolTalk", "τ²-bench airline") for m in ("speedup", "tau")]
    assert not paper.get("ToolTalk speedup")  # the paper has no ToolTalk column
    assert paper["hardware"] == "NVIDIA H800 (SGLang)" and ours["mydrafter"]["drafter"] == "mydrafter"
    assert (paper["engine"], ours["mydrafter"]["engine"]) == ("SGLang", "dlite")
    assert (paper["origin"], ours["mydrafter"]["origin"], ours["ngram"]["origin"]) == ("paper", "unknown", "no checkpoint")
    notes = " ".join(table3["notes"])  # a workload whose data is missing says why; a missing method too
    assert "AgentLongBench: not measured" in notes and "--data agent_long_bench=FILE" in notes
    assert "method history: not run" in notes
    assert "ToolTalk: nvidia-tooltalk 26.3 wheel" in notes and "SWE-Bench: synthetic" in notes  # every measured workload's source
    table4 = json.loads((bench_dir / "table4_throughput.json").read_text())
    assert {(r["method"], r["concurrency"]) for r in table4["rows"] if r["target"] == "micro"} == {(m, c) for m in ("ar", "ngram", "mydrafter") for c in (1, 2)}


def test_tau_against_context_is_binned_within_each_long_and_agentic_workload(bench_dir):
    """Each long-context and agentic workload's turns apart, per drafting method: the bins add up to the method's turns
    there."""
    table = json.loads((bench_dir / "tau_by_context.json").read_text())
    rows = table["rows"]
    assert {r["method"] for r in rows} == {"ngram", "mydrafter"}  # plain decoding left out
    assert {"ToolTalk", "Code Repo"} <= {r["workload"] for r in rows} <= {w.title for w in BY_NAME.values() if w.suite in ("long", "agentic")}
    results = [r for r in lines(bench_dir / "results.jsonl") if r["workload"] == "tooltalk" and r["method"] == "mydrafter"]
    turns = [t for r in results for t in r["turns"] if "skipped" not in t and t["rounds"]]
    mine = [r for r in rows if r["workload"] == "ToolTalk" and r["method"] == "mydrafter"]
    assert sum(r["turns"] for r in mine) == len(turns) and sum(r["rounds"] for r in mine) == sum(t["rounds"] for t in turns)
    for row in mine:  # each bin holds the turns whose prompt falls in it
        lower, upper = (int(x) for x in row["context tokens"].split("–"))
        assert row["turns"] == sum(lower <= t["context_tokens"] <= upper for t in turns) and (lower - 1) * 2 in (0, upper)
    assert all(0 <= float(r["first-position acceptance"] or 0) <= 1 and float(r["tau"]) >= 1 for r in rows)


def test_methods_see_the_same_episodes_and_write_the_same_greedy_text(bench_dir):
    results = lines(bench_dir / "results.jsonl")
    by_episode = {}
    for record in results:
        by_episode.setdefault((record["workload"], record["episode"]), {})[record["method"]] = [t.get("output_sha") for t in record["turns"]]
    assert len(by_episode) >= 6
    for methods in by_episode.values():
        assert set(methods) == {"ar", "ngram", "mydrafter"} and len({tuple(v) for v in methods.values()}) == 1


def test_multi_turn_replay_grows_the_context(bench_dir):
    results = lines(bench_dir / "results.jsonl")
    mt_bench = next(r for r in results if r["workload"] == "mt_bench")
    first, second = mt_bench["turns"]
    assert second["context_tokens"] > first["context_tokens"] + first["generated_tokens"]  # reply and the next question
    swe = next(r for r in results if r["workload"] == "swe_bench")
    contexts = [t["context_tokens"] for t in swe["turns"]]
    assert contexts == sorted(contexts) and len(contexts) >= 2


def test_a_killed_bench_resumes_without_duplicating(cache_dir, run_cli, tmp_path):
    args = (*BENCH, "--suite", "agentic", "--methods", "ar,ngram", "--limit", "2", "--concurrency", "")
    process = subprocess.Popen([sys.executable, "-m", "dlite_cli", *args], cwd=tmp_path, env={**os.environ, "DLITE_CACHE": str(cache_dir)},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = tmp_path / "runs" / "micro" / "bench" / "results.jsonl"
    deadline = time.time() + 300
    while not (results.exists() and len(results.read_text().splitlines()) >= 2):
        assert time.time() < deadline and process.poll() is None, "the bench finished before it could be killed"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    before = len(lines(results))
    run_cli(*args)
    keys = Counter((r["workload"], r["episode"], r["method"]) for r in lines(results))
    assert before >= 2 and max(keys.values()) == 1 and len(keys) == 4 * 2 * 2  # (bfcl_v3, tooltalk, tau2_airline, swe_bench) x 2 episodes x 2 methods
    again = run_cli(*args)
    assert "measured 0, reused 16" in again.stderr and len(lines(results)) == 16


def test_a_second_plan_reuses_the_first_plans_measurements_and_force_measures_again(run_cli, tmp_path):
    def bench(*args: str) -> None:
        run_cli(*BENCH, *args)

    run = tmp_path / "runs" / "micro" / "bench"
    bench("--suite", "agentic", "--methods", "ar,ngram")  # bfcl_v3, tooltalk, tau2_airline and swe_bench, one episode each
    first = lines(run / "results.jsonl")
    bench("--workload", "swe_bench", "--limit", "2", "--methods", "ar,ngram,ngram:fixed")  # more episodes, one more method
    records = lines(run / "results.jsonl")
    plans = {folder.name.split("-")[0]: folder for folder in (run / "plans").iterdir()}
    assert set(plans) == {"agentic", "swe_bench"}
    plan = json.loads((plans["swe_bench"] / "plan.json").read_text())
    reused = {r["id"] for r in first if r["workload"] == "swe_bench"}
    new = records[len(first):]
    assert len(reused) == 2 and len(new) == 4 and plan["measured"] == 4 and plan["reused"] == 2
    assert set(plan["measurements"]["episodes"]) == reused | {r["id"] for r in new}  # nothing decoded twice
    assert Counter(r["method"] for r in new) == {"ar": 1, "ngram": 1, "ngram:fixed": 2}
    for folder in plans.values():  # each plan keeps its tables; the latest is also at the top
        assert (folder / "table3_agentic.md").stat().st_size > 0
    assert (run / "summary.md").read_text() == (plans["swe_bench"] / "summary.md").read_text()
    table3 = json.loads((run / "table3_agentic.json").read_text())
    assert {r["method"] for r in table3["rows"] if r["target"] == "micro"} == {"ar", "ngram", "ngram:fixed"}

    bench("--workload", "swe_bench", "--limit", "2", "--methods", "ar,ngram,ngram:fixed", "--force")
    again = json.loads((plans["swe_bench"] / "plan.json").read_text())
    assert again["measured"] == 6 and not set(again["measurements"]["episodes"]) & set(plan["measurements"]["episodes"])
    assert len(lines(run / "results.jsonl")) == len(records) + 6


def test_suffix_decoding_measures_an_episode_holding_the_workloads_earlier_ones_and_a_later_plan_rebuilds_that_tree(run_cli, tmp_path):
    """Three episodes at once, and two then a third in another run: the third is measured on the same global tree (its
    proposals, all K every round, are the same), the second time built from the first two's stored responses."""
    def bench(run: str, limit: int) -> list[dict]:
        run_cli(*BENCH, "--workload", "swe_bench", "--limit", str(limit), "--methods", "ar,suffix:fixed", "--concurrency", "", "--run-dir", run)
        return [r for r in lines(tmp_path / run / "bench" / "results.jsonl") if r["method"] == "suffix:fixed"]

    at_once = bench("at-once", 3)
    episodes = [r["episode"] for r in at_once]
    for index, record in enumerate(at_once):
        decoded = [turn for turn in record["turns"] if "skipped" not in turn]
        assert decoded and all(len(turn["output_ids"]) == turn["generated_tokens"] for turn in decoded)
        responses = sum("skipped" not in t for r in at_once[:index] for t in r["turns"])
        assert record["suffix_tree"] == {"episodes": episodes[:index], "responses": responses}
    assert sum(sum(t.get("accepted", [])) for t in at_once[2]["turns"]) > 0  # proposals from the tree were accepted
    bench("in-turn", 2)
    third = bench("in-turn", 3)[-1]
    assert third["suffix_tree"] == at_once[2]["suffix_tree"]
    assert [(t.get("rounds"), t.get("accepted")) for t in third["turns"]] == [(t.get("rounds"), t.get("accepted")) for t in at_once[2]["turns"]]
    details = json.loads((tmp_path / "at-once" / "bench" / "details.json").read_text())
    assert {r["method"]: r["suffix tree"] for r in details["rows"]} == {"ar": "", "suffix:fixed": "0–2"}


def test_a_named_data_file_that_gives_no_episode_is_an_error(run_cli, tmp_path):
    data = tmp_path / "humaneval.jsonl"
    data.write_text("not json\n{broken\n")
    done = run_cli(*BENCH, "--workload", "humaneval", "--data", f"humaneval={data}", "--methods", "ar", check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"--data humaneval={data}: no humaneval records found: 2 unreadable, the first because line 1 is not valid JSON" in done.stderr
    assert not (tmp_path / "runs" / "micro" / "bench").exists()  # refused before anything was written


def test_a_speedups_interval_pairs_each_episode_with_plain_decodings_on_it():
    from dlite_cli.bench.report import speedup_interval

    plain = {"a": (1.0, 10), "b": (3.0, 10), "c": (2.0, 10), "d": (1.5, 10)}  # episodes of very different speeds
    twice = {e: (s / 2, n) for e, (s, n) in plain.items()}
    assert speedup_interval(plain, twice) == (2.0, 2.0)  # paired, the spread across episodes does not blur it
    mixed = {"a": (0.8, 10), "b": (3.3, 10), "c": (1.8, 10), "d": (1.6, 10)}  # faster on two, slower on two
    low, high = speedup_interval(plain, mixed)
    assert low < 1.0 < high
    assert speedup_interval(plain, {"a": (0.5, 10)}) is None  # one shared episode: no interval


def test_a_method_run_in_vllm_is_timed_against_vllms_plain_decoding():
    from dlite_cli.bench.report import aggregate

    def record(method: str, seconds: float) -> dict:
        turn = {"draft_s": 0.0, "verify_s": 0.0, "overhead_s": seconds, "generated_tokens": 10, "rounds": 10, "committed": 10,
                "prefill_s": 0.0, "draft_kv_bytes": 0, "proposed": [0], "accepted": [0]}
        return {"workload": "w", "method": method, "episode": "e", "source": "s", "drafter": method, "turns": [turn]}

    stats = aggregate([record("ar", 4.0), record("dlite", 2.0), record("vllm:ar", 1.0), record("vllm:dlite", 0.5)])
    assert stats["w", "dlite"]["speedup"] == 2.0 and stats["w", "vllm:dlite"]["speedup"] == 2.0


def test_log_axes_are_labelled_with_plain_numbers_only():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dlite_cli.bench.report import _plain_log_ticks

    figure, axis = plt.subplots()
    axis.plot([256, 512, 1024, 4096], [1, 2, 3, 4])
    _plain_log_ticks(axis, [256, 512, 1024, 4096])
    figure.canvas.draw()
    assert [t.get_text() for t in axis.get_xticklabels()] == ["256", "512", "1k", "4k"]
    assert [t.get_text() for t in axis.get_xticklabels(minor=True)] == []
    plt.close(figure)


def test_in_bfloat16_passes_are_as_wide_as_their_tokens_and_the_details_count_the_turns_with_plain_decodings_text(bench_dir, run_cli, tmp_path):
    """Below float32 every pass has just its own tokens (plain decoding one), so no padded plain decoding is timed,
    and the methods' texts agree with plain decoding's only up to rounding: the details table says on how many turns."""
    drafter = bench_dir.parent.parent.parent / "mydrafter"
    run_cli(*BENCH, "--suite", "general", "--methods", f"ar,ngram,{drafter}", "--concurrency", "", "--set", "target.dtype=bfloat16")
    run = tmp_path / "runs" / "micro" / "bench"
    manifest = json.loads((run / "manifest.json").read_text())
    expected_path = decode_path("auto", DEVICE, torch.bfloat16)  # eager on a CPU, graphs on CUDA
    assert manifest["summary"]["decode_path"] == expected_path
    methods = {r["method"] for r in lines(run / "results.jsonl")}
    assert methods == {"ar", "ngram", str(drafter)} or expected_path == "graphs"  # no ar:fastest beside ar (a GPU's graphs pad)
    shas = {(r["workload"], r["episode"], r["method"], t["turn"]): t["output_sha"] for r in lines(run / "results.jsonl") for t in r["turns"]
            if "output_sha" in t}
    rows = json.loads((run / "details.json").read_text())["rows"]
    for row in rows:
        if row["method"] == "ar" or row["method"] == "ar:fastest":
            assert row["text as plain"] == "" or row["method"] == "ar:fastest"
            continue
        turns = [k for k in shas if k[0] == row["workload"] and k[2] == row["method"]]
        same = sum(shas[k] == shas[k[0], k[1], "ar", k[3]] for k in turns)
        assert row["text as plain"] == f"{same}/{len(turns)}" and turns


def test_with_identical_text_every_method_writes_plain_decodings_text_in_bfloat16_and_the_fastest_plain_decoding_is_timed(bench_dir, run_cli, tmp_path):
    """decode.identical_text pads every pass to K + 1 tokens on fixed shapes (static path), so the adaptive drafter,
    its fixed-K variant, the hybrid and padded plain decoding agree on every turn; ar:fastest (one token a pass,
    eager) is timed beside them and is the speedup's baseline."""
    drafter = bench_dir.parent.parent.parent / "mydrafter"
    methods = f"ar,ngram,{drafter},{drafter}:fixed,{drafter}+ngram"
    run_cli(*BENCH, "--suite", "general", "--methods", methods, "--concurrency", "", "--set", "target.dtype=bfloat16",
            "--set", "decode.identical_text=true")
    run = tmp_path / "runs" / "micro" / "bench"
    expected_path = decode_path("auto", DEVICE, torch.bfloat16, identical_text=True)  # static on a CPU, graphs on CUDA
    summary = json.loads((run / "manifest.json").read_text())["summary"]
    assert summary["decode_path"] == expected_path
    assert (summary["graph_captures"] > 0) == (expected_path == "graphs")  # the static path captures nothing
    assert all(t["capture_s"] == 0 for r in lines(run / "results.jsonl") for t in r["turns"]) or expected_path == "graphs"
    by_episode = {}
    for record in lines(run / "results.jsonl"):
        by_episode.setdefault(record["episode"], {})[record["method"]] = [t.get("output_sha") for t in record["turns"]]
    assert len(by_episode) >= 3
    for texts in by_episode.values():
        assert "ar:fastest" in texts and len({tuple(v) for m, v in texts.items() if m != "ar:fastest"}) == 1
    details = json.loads((run / "details.json").read_text())
    for row in details["rows"]:
        if row["method"] not in ("ar", "ar:fastest"):
            same, total = map(int, row["text as plain"].split("/"))
            assert same == total >= 1


def test_without_vllm_bench_compare_is_left_out_in_one_line(monkeypatch):
    from dlite_cli.bench.bench import plan_from
    from dlite_cli.core.config import BenchConfig, load_config
    from dlite_cli.decoding import engines

    monkeypatch.setattr(engines, "installed_vllm", lambda: None)
    config = load_config("micro")
    config.bench = BenchConfig(compare=["ar", "dlite"])
    lines = []
    plan = plan_from(config, "all", None, "ar,ngram", None, None, 0.0, None, [], "auto", lines.append)
    assert plan.methods == ["ar", "ngram"]
    assert lines == [f"vLLM is not installed: decoding in dlite's own engine ({engines.VLLM_INSTALL} to decode in vLLM)",
                     f"bench.compare's methods are not measured in vLLM: it is not installed ({engines.VLLM_INSTALL})"]
