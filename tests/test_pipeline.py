"""`dlite run`: the micro pipeline end to end, --from / --until, kill -9 and resume, launched stages."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import MICRO_RUN_OPTIONS
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
STAGES = ("regen", "train-teacher", "warmup", "stable", "stable-parallel", "bench")
TABLES = ("table1_general_tau", "table2_longbench_v2", "table3_agentic", "table4_throughput")


def status(run: Path, stage: str) -> str | None:
    path = run / stage / "manifest.json"
    return json.loads(path.read_text())["status"] if path.exists() else None


def ran(output: str) -> list[str]:
    """The stage names `dlite run` announced, in order."""
    return [line.split("] ", 1)[1].split(":", 1)[0] for line in output.splitlines() if line.startswith("[")]


def measured(run: Path) -> dict:
    """What a bench measured, timings aside: per episode and method, the text hashes and acceptance counts."""
    results = {}
    for line in (run / "bench" / "results.jsonl").read_text().splitlines():
        record = json.loads(line)
        turns = [(t.get("output_sha"), t.get("rounds"), t.get("accepted"), t.get("skipped")) for t in record["turns"]]
        results[record["workload"], record["episode"], record["method"]] = turns
    return results


def tau_columns(run: Path, table: str) -> list[dict]:
    rows = json.loads((run / "bench" / f"{table}.json").read_text())["rows"]
    timing = ("speedup", "tokens/s", "drafter")  # the drafter column names the run directory
    return [{k: v for k, v in row.items() if not any(word in k for word in timing)} for row in rows]


def test_micro_pipeline_runs_every_stage_until_and_from_where_asked_then_has_nothing_left_to_do(micro_run, run_cli, tmp_path):
    # the session's micro run was made by `dlite run micro --until stable`, then `--from stable-parallel`
    until, rest = micro_run.until, micro_run.rest
    assert ran(until.stderr) == ["prepare-target", "regen", "train-teacher", "warmup", "stable"]
    assert ran(rest.stderr) == ["stable-parallel", "bench"]
    run = micro_run.copy(tmp_path / "runs" / "micro", STAGES)
    assert all(status(run, stage) == "done" for stage in STAGES)
    for table in TABLES:
        assert (run / "bench" / f"{table}.md").stat().st_size > 0
    methods = {json.loads(line)["method"] for line in (run / "bench" / "results.jsonl").read_text().splitlines()}
    assert methods == {"ar", "dlite", "dlite:fixed", "history", "parallel", "ngram", "suffix", "dlite+ngram", "dlite+suffix"}  # every trained drafter was benched
    assert "wall time per stage" in rest.stderr and "total" in rest.stderr

    again = run_cli("run", "micro", *MICRO_RUN_OPTIONS)
    assert again.stderr.count("(done before)") == len(STAGES)
    assert "already done" in again.stderr and "measured 0" in again.stderr  # the bench reused every measurement

    for args, message in ((["--from", "serve"], "has no such stage"), (["--from", "bench", "--until", "regen"], "comes after")):
        refused = run_cli("run", "micro", *args, check=False)
        assert refused.returncode == 2 and message in refused.stderr

    shown = run_cli("status", "--target", "micro", "--verbose", env={"COLUMNS": "80"}).stdout
    assert max(len(line) for line in shown.splitlines()) <= 80
    steps = json.loads((run / "train-teacher" / "manifest.json").read_text())["summary"]["steps"]
    assert f"{steps}/{steps} steps" in shown and "stable: config " in shown  # a finished stage shows its full count


def test_a_bad_stage_is_refused_before_anything_runs(run_cli, tmp_path):
    pipeline = tmp_path / "broken.yaml"
    pipeline.write_text("target: micro\nstages:\n  - name: regen\n  - name: bench\n    args: [--limit, '0']\n")
    refused = run_cli("run", str(pipeline), check=False)
    assert refused.returncode == 2 and "stage bench" in refused.stderr and "--limit" in refused.stderr
    assert not (tmp_path / "runs").exists()  # regen did not start
    pipeline.write_text("target: micro\nstages:\n  - name: regen\n  - name: regen\n")
    refused = run_cli("run", str(pipeline), check=False)
    assert refused.returncode == 2 and "distinct names, regen repeats" in refused.stderr


def _kill_when(process: subprocess.Popen, ready, what: str) -> None:
    deadline = time.time() + 240
    while not ready():
        assert process.poll() is None and time.time() < deadline, f"the pipeline ended before {what}"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()


def test_kill_9_anywhere_then_run_again_gives_the_same_tables(micro_run, run_cli, cache_dir, tmp_path):
    options = list(MICRO_RUN_OPTIONS)  # the session's micro run is the uninterrupted reference
    reference, killed = micro_run.directory, tmp_path / "killed"

    command = [sys.executable, "-m", "dlite_cli", "run", "micro", *options, "--run-dir", str(killed)]
    env = {**os.environ, "DLITE_CACHE": str(cache_dir)}
    results = killed / "bench" / "results.jsonl"
    kill_points = (
        (lambda: (killed / "train-teacher" / "checkpoint" / "state.pt").exists(), "mid-training"),
        (lambda: results.exists() and results.read_text().count("\n") >= 3, "mid-bench"),
    )
    for ready, what in kill_points:
        process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if what == "mid-training":  # while one runner works in the run directory, a second is refused
            while not (killed / "regen" / "manifest.json").exists():
                time.sleep(0.02)
            second = run_cli("run", "micro", *options, "--run-dir", str(killed), check=False)
            assert second.returncode == 2 and f"is working in {killed}" in second.stderr
        _kill_when(process, ready, what)
    assert status(killed, "bench") == "running"

    resumed = run_cli("run", "micro", *options, "--run-dir", str(killed))
    assert "(done before)" in resumed.stderr and all(status(killed, stage) == "done" for stage in STAGES)
    a, b = (load_file(run / "stable" / "drafter" / "model.safetensors") for run in (reference, killed))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert measured(killed) == measured(reference)  # no episode lost or run twice, the same text and acceptance
    for table in TABLES[:3]:
        assert tau_columns(killed, table) == tau_columns(reference, table)


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_a_launched_stage_runs_under_accelerate_and_dies_with_the_runner(micro_run, run_cli, cache_dir, tmp_path):
    launch = f"accelerate launch --config_file {REPO / 'configs' / 'accelerate' / 'cpu-2proc.yaml'} --main_process_port 29523"
    pipeline = tmp_path / "two-processes.yaml"
    pipeline.write_text(f"target: micro\nstages:\n  - name: regen\n  - name: train-teacher\n    launch: {launch}\n")
    run = micro_run.copy(tmp_path / "launched")  # its regen: done before
    # ~70 steps: it is killed at its first checkpoint (step 2); cpu-2proc.yaml needs the CPU (gloo), whatever GPUs
    options = ["--run-dir", str(run), "--set", "train.teacher_epochs=10", "--set", "target.device=cpu"]
    process = subprocess.Popen([sys.executable, "-m", "dlite_cli", "run", str(pipeline), *options], cwd=tmp_path,
                               env={**os.environ, "DLITE_CACHE": str(cache_dir)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _kill_when(process, lambda: (run / "train-teacher" / "checkpoint" / "state.pt").exists(), "the launched stage checkpointed")
    deadline = time.time() + 10
    while _processes_mentioning(str(run)):  # the launcher and both training processes go with the runner
        assert time.time() < deadline, f"processes outlived the killed runner: {_processes_mentioning(str(run))}"
        time.sleep(0.2)
    assert status(run, "train-teacher") == "running"  # they were killed, not finished

    done = run_cli("run", str(pipeline), *options)
    assert "accelerate launch" in done.stderr
    summary = json.loads((run / "train-teacher" / "manifest.json").read_text())["summary"]
    assert summary["processes"] == 2 and status(run, "train-teacher") == "done"
