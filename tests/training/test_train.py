import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import MICRO_RUN_OPTIONS
from safetensors.torch import load_file

from dlite_cli.core.config import load_config
from dlite_cli.core.precision import bf16_instructions
from dlite_cli.training.train import Trainer

STAGES = ("train-teacher", "warmup", "stable")


def summary(run: Path, stage: str) -> dict:
    return json.loads((run / stage / "manifest.json").read_text())


def test_micro_pipeline_end_to_end(micro_run, run_cli, tmp_path):
    # the session's micro run trained train-teacher, warmup, stable and stable-parallel; here a copy of it trains stable-scratch
    run = tmp_path / "runs" / "micro"
    options = ("--target", "micro", *MICRO_RUN_OPTIONS)
    refused = run_cli("warmup", *options, check=False)
    assert refused.returncode == 2 and "needs a finished `regen` stage" in refused.stderr
    micro_run.copy(run)
    refused = run_cli("warmup", *options, check=False)
    assert refused.returncode == 2 and "run `dlite train-teacher` first" in refused.stderr
    micro_run.copy(run, ("features", *STAGES, "stable-parallel"))
    run_cli("stable", *options, "--from-scratch")
    for stage in STAGES + ("stable-scratch", "stable-parallel"):
        manifest = summary(run, stage)
        assert manifest["status"] == "done" and 1 <= manifest["summary"]["eval_tau"] <= 5
        assert (run / stage / "drafter" / "model.safetensors").is_file() and not (run / stage / "checkpoint").exists()
        lines = [json.loads(line) for line in (run / stage / "metrics.jsonl").read_text().splitlines()]
        assert any("loss" in line for line in lines) and any("eval_tau" in line for line in lines)
        # micro's train.mixed_precision is auto: each stage timed its own step both ways (on a CPU with bfloat16
        # instructions; without, float32 unmeasured) and recorded the decision
        (decision,) = [d for d in manifest.get("precision", []) if d["setting"] == "train.mixed_precision"]
        assert set(decision["ms"]) == ({"no", "bf16"} if bf16_instructions() else set()) and stage in decision["work"]
        assert decision["choice"] in ("no", "bf16") if bf16_instructions() else decision["choice"] == "no"
    assert "history_fuse.weight" in load_file(run / "train-teacher" / "drafter" / "model.safetensors")
    assert "history_fuse.weight" not in load_file(run / "stable" / "drafter" / "model.safetensors")
    assert "head.gate.weight" in load_file(run / "stable-scratch" / "drafter" / "model.safetensors")
    assert "head.gate.weight" not in load_file(run / "stable-parallel" / "drafter" / "model.safetensors")
    assert summary(run, "stable-scratch")["summary"]["steps"] == 2 * summary(run, "stable")["summary"]["steps"]
    again = run_cli("stable", *options)
    assert "already done" in again.stderr
    generated = {}  # the trained drafters decode through the engine, and never change the target's output
    for drafter in ("dlite", "history", "none"):
        done = run_cli("generate", *options, "--drafter", drafter, "-p", "def read(path):", "--max-new-tokens", "16", "--json")
        generated[drafter] = json.loads(done.stdout)
    assert generated["dlite"]["text"] == generated["history"]["text"] == generated["none"]["text"]
    assert generated["history"]["draft_kv_bytes"] > 0 == generated["dlite"]["draft_kv_bytes"]
    assert (micro_run.directory / "features" / "manifest.json").is_file()  # computed once, shared by every stage


def test_stages_run_in_one_process_each_train_in_the_precision_they_decided(micro_run, tmp_path):
    # `dlite run` runs every stage in one process, and train.mixed_precision: auto may decide differently per stage
    run = micro_run.copy(tmp_path / "run")
    for stage, precision in (("train-teacher", "no"), ("warmup", "bf16"), ("stable", "no")):
        trainer = Trainer(load_config("micro", [f"train.mixed_precision={precision}"]), run, stage, log=lambda _: None)
        assert trainer.accelerator.mixed_precision == precision
        assert trainer.run(force=False)["steps"] > 0

def test_kill_9_mid_training_resumes_to_the_same_weights(micro_run, run_cli, cache_dir, tmp_path):
    # on the CPU (MICRO_RUN_OPTIONS): bitwise-equal weights need deterministic kernels, and CUDA's attention and gather
    # backward are not; the session's micro run trained the uninterrupted reference
    options = ["--target", "micro", *MICRO_RUN_OPTIONS]
    reference, killed = micro_run.directory, micro_run.copy(tmp_path / "killed")

    process = subprocess.Popen(
        [sys.executable, "-m", "dlite_cli", "train-teacher", *options, "--run-dir", str(killed)],
        env={**os.environ, "DLITE_CACHE": str(cache_dir)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    checkpoint = killed / "train-teacher" / "checkpoint" / "state.pt"
    deadline = time.time() + 120
    while not checkpoint.exists():
        assert time.time() < deadline and process.poll() is None, "training finished before it could be killed"
        time.sleep(0.01)
    time.sleep(0.3)  # let it run on past the checkpoint
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert summary(killed, "train-teacher")["status"] == "running"

    resumed = run_cli("train-teacher", *options, "--run-dir", str(killed))
    assert "resuming train-teacher from step" in resumed.stderr
    final = lambda run: load_file(run / "train-teacher" / "drafter" / "model.safetensors")  # noqa: E731
    a, b = final(reference), final(killed)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # bitwise
    steps = [json.loads(line)["step"] for line in (killed / "train-teacher" / "metrics.jsonl").read_text().splitlines() if "loss" in json.loads(line)]
    assert steps == sorted(set(steps)) and steps[-1] == summary(killed, "train-teacher")["summary"]["steps"]


def test_two_process_accelerate_launch_on_cpu(micro_run, run_cli, cache_dir, tmp_path):
    single, double = micro_run.copy(tmp_path / "single"), micro_run.copy(tmp_path / "double")
    cpu = ["--set", "target.device=cpu"]  # cpu-2proc.yaml: two processes on one machine (gloo), whatever GPUs it has
    # the launch runs in the precision its config names ('no'); the single process is given the same
    run_cli("train-teacher", "--target", "micro", "--run-dir", str(single), *cpu, "--set", "train.mixed_precision=no")
    repo = Path(__file__).resolve().parents[2]
    launch = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", str(repo / "configs" / "accelerate" / "cpu-2proc.yaml"),
        "--main_process_port", "29517",
        "-m", "dlite_cli", "train-teacher", "--target", "micro", "--run-dir", str(double), *cpu,
    ]
    done = subprocess.run(launch, env={**os.environ, "DLITE_CACHE": str(cache_dir)}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    one, two = summary(single, "train-teacher")["summary"], summary(double, "train-teacher")["summary"]
    assert two["processes"] == 2 and one["processes"] == 1
    assert two["steps"] == one["steps"]  # the same global batch, split over two processes
    a = load_file(single / "train-teacher" / "drafter" / "model.safetensors")
    b = load_file(double / "train-teacher" / "drafter" / "model.safetensors")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-4  # same updates, up to reduction order


def test_online_mode_runs_the_target_inside_the_loop(micro_run, run_cli, tmp_path):
    run = micro_run.copy(tmp_path / "runs" / "micro")
    run_cli("stable", "--target", "micro", "--from-scratch", "--set", "train.features=online", "--set", "train.target_batch=2")  # passes of 2
    assert summary(run, "stable-scratch")["status"] == "done"
    assert not (run / "features").exists()  # nothing cached
