import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from dlite_cli.config import load_config
from dlite_cli.precision import bf16_instructions
from dlite_cli.train import Trainer

STAGES = ("train-teacher", "warmup", "stable")


def summary(run: Path, stage: str) -> dict:
    return json.loads((run / stage / "manifest.json").read_text())


def test_micro_pipeline_end_to_end(run_cli, tmp_path):
    run = tmp_path / "runs" / "micro"
    refused = run_cli("warmup", "--target", "micro", check=False)
    assert refused.returncode == 2 and "needs a finished `regen` stage" in refused.stderr
    run_cli("regen", "--target", "micro")
    refused = run_cli("warmup", "--target", "micro", check=False)
    assert refused.returncode == 2 and "run `dlite train-teacher` first" in refused.stderr
    for stage in STAGES:
        run_cli(stage, "--target", "micro")
    run_cli("stable", "--target", "micro", "--from-scratch")
    run_cli("stable", "--target", "micro", "--parallel")
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
    again = run_cli("stable", "--target", "micro")
    assert "already done" in again.stderr
    generated = {}  # the trained drafters decode through the engine, and never change the target's output
    for drafter in ("dlite", "history", "none"):
        done = run_cli("generate", "--target", "micro", "--drafter", drafter, "-p", "def read(path):", "--max-new-tokens", "16", "--json")
        generated[drafter] = json.loads(done.stdout)
    assert generated["dlite"]["text"] == generated["history"]["text"] == generated["none"]["text"]
    assert generated["history"]["draft_kv_bytes"] > 0 == generated["dlite"]["draft_kv_bytes"]
    assert (run / "features" / "manifest.json").is_file()  # computed once, shared by every stage


def test_stages_run_in_one_process_each_train_in_the_precision_they_decided(run_cli, tmp_path):
    # `dlite run` runs every stage in one process, and train.mixed_precision: auto may decide differently per stage
    run = tmp_path / "run"
    run_cli("regen", "--target", "micro", "--run-dir", str(run))
    for stage, precision in (("train-teacher", "no"), ("warmup", "bf16"), ("stable", "no")):
        trainer = Trainer(load_config("micro", [f"train.mixed_precision={precision}"]), run, stage, log=lambda _: None)
        assert trainer.accelerator.mixed_precision == precision
        assert trainer.run(force=False)["steps"] > 0

def test_kill_9_mid_training_resumes_to_the_same_weights(run_cli, cache_dir, tmp_path):
    # on the CPU: bitwise-equal weights need deterministic kernels, and CUDA's attention and gather backward are not
    options = ["--target", "micro", "--set", "train.teacher_epochs=12", "--set", "target.device=cpu"]
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    for run in (reference, killed):
        run_cli("regen", "--target", "micro", "--run-dir", str(run))
    run_cli("train-teacher", *options, "--run-dir", str(reference))

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


def test_two_process_accelerate_launch_on_cpu(run_cli, cache_dir, tmp_path):
    single, double = tmp_path / "single", tmp_path / "double"
    for run in (single, double):
        run_cli("regen", "--target", "micro", "--run-dir", str(run))
    cpu = ["--set", "target.device=cpu"]  # cpu-2proc.yaml: two processes on one machine (gloo), whatever GPUs it has
    # the launch runs in the precision its config names ('no'); the single process is given the same
    run_cli("train-teacher", "--target", "micro", "--run-dir", str(single), *cpu, "--set", "train.mixed_precision=no")
    repo = Path(__file__).resolve().parents[1]
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


def test_online_mode_runs_the_target_inside_the_loop(run_cli, tmp_path):
    run = tmp_path / "runs" / "micro"
    run_cli("regen", "--target", "micro")
    run_cli("stable", "--target", "micro", "--from-scratch", "--set", "train.features=online", "--set", "train.target_batch=2")  # passes of 2
    assert summary(run, "stable-scratch")["status"] == "done"
    assert not (run / "features").exists()  # nothing cached
