"""Memory plans (memory.py): traced on tensors without storage, checked against the same work on real tensors."""

import pytest
import torch

from dlite_cli.core.config import load_config
from dlite_cli.core.errors import DliteError
from dlite_cli.core.memory import LiveBytes, most_that_fit
from dlite_cli.decoding.decoding_plan import SUFFIX_TREE_BYTES_PER_TOKEN, bench_plan, decoding_plan, engine_context
from dlite_cli.decoding.methods import parse_method
from dlite_cli.models.targets import architecture
from dlite_cli.training.training_plan import stage_plans, training_plan


def test_live_bytes_counts_each_storage_once_while_it_is_alive():
    counter = LiveBytes()
    with counter:
        a = torch.zeros(1000)  # 4 000 bytes
        view = a[:10].view(2, 5)  # shares a's storage
        b = a * 2
        del b
        c = torch.ones(250)  # 1 000 bytes
    assert counter.live == 5000 and counter.peak == 8000  # a and b together
    del a, view
    assert counter.live == 1000 and c.sum() == 250


@pytest.mark.parametrize("stage, features", [("train-teacher", "cached"), ("warmup", "online"), ("stable", "online")])
def test_a_training_plan_is_what_the_same_steps_hold_on_real_tensors(cache_dir, stage, features):
    config = load_config("micro", [f"train.features={features}", 'train.mixed_precision="bf16"', "train.global_batch=4"])
    arch = architecture(config)
    planned = training_plan(config, arch, stage, "cpu")
    measured = training_plan(config, arch, stage, "cpu", fake=False)
    assert planned.peak == measured.peak and planned.parts == measured.parts
    assert planned.parts["optimizer state"] > 0 and planned.parts["training step"] > 0
    assert ("target feature pass" in planned.parts) == (features == "online")
    # more sequences a micro-batch hold more, and two processes add DDP's gradient buckets
    assert training_plan(config, arch, stage, "cpu", micro_batch=4).peak > planned.peak
    assert training_plan(config, arch, stage, "cpu", processes=2).parts["gradient buckets (DDP)"] > 0


def test_decoding_plans_are_linear_in_rows_and_positions_and_size_a_server(cache_dir):
    config = load_config("micro")
    arch = architecture(config)
    capacity = decoding_plan(config, arch, "serve", 4, 1000, "cuda").peak * 2
    tokens = most_that_fit(lambda n: decoding_plan(config, arch, "serve", 4, n, "cuda").peak, capacity)
    assert decoding_plan(config, arch, "serve", 4, tokens, "cuda").fits(capacity)
    assert not decoding_plan(config, arch, "serve", 4, tokens + 1, "cuda").fits(capacity)
    slots = most_that_fit(lambda n: decoding_plan(config, arch, "serve", n, 1000, "cuda", True).peak, capacity)
    assert decoding_plan(config, arch, "serve", slots, 1000, "cuda", True).fits(capacity)
    assert not decoding_plan(config, arch, "serve", slots + 1, 1000, "cuda", True).fits(capacity)
    assert "CUDA graph pool" in decoding_plan(config, arch, "serve", 1, 1, "cuda").parts  # graphs are the GPU's path
    assert "CUDA graph pool" not in decoding_plan(config, arch, "serve", 1, 1, "cpu").parts
    room = decoding_plan(config, arch, "serve", config.decode.max_batch, 2000, "cuda").peak  # 16 rows of 2 000 of micro's 4 096
    plans = stage_plans(config, arch, "cuda", room)
    assert [p.stage for p in plans] == ["train-teacher", "warmup", "stable", "stable-parallel", "bench", "serve"]
    tokens = most_that_fit(lambda n: decoding_plan(config, arch, "serve", 16, n, "cuda").peak, room)
    assert plans[-1].setting == f"16 slots × {tokens} tokens" and plans[-1].fits(room) and 1024 < tokens < 2000


def test_a_training_stage_that_does_not_fit_is_refused_before_it_starts(micro_run, run_cli, tmp_path):
    micro_run.copy(tmp_path / "runs" / "micro")  # what it trains on is there: the refusal is its plan's
    # ~3.7 GB of logits and their gradients a sequence: 64 a micro-batch (240 GB) fit no test machine (an H200 neither), one fits any
    huge = ["--set", "train.micro_batch=64", "--set", "train.global_batch=64", "--set", "train.anchors_per_sample=75000",
            "--set", "train.max_length=150000", "--set", 'train.mixed_precision="no"']
    refused = run_cli("stable", "--target", "micro", "--from-scratch", *huge, check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "stable-scratch at micro-batch 64 × 150000 tokens" in refused.stderr
    assert "GB this device has free: --set train.micro_batch=" in refused.stderr and "fits" in refused.stderr
    assert not (tmp_path / "runs" / "micro" / "stable-scratch").exists()  # refused before the stage began


def test_bench_refuses_a_concurrency_that_does_not_fit_and_names_the_levels_that_do(run_cli):
    refused = run_cli("bench", "--target", "micro", "--concurrency", "1,100000000", check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "bench at 100000000 slots" in refused.stderr and "--concurrency 1 fits" in refused.stderr


def test_profile_plans_every_stage_for_a_simulated_gpu(run_cli, tmp_path):
    fits = run_cli("profile", "--target", "micro", "--memory", "1")
    assert "memory plan per stage" in fits.stdout and "every stage of micro fits a 1 GB GPU" in fits.stderr
    for stage in ("train-teacher", "warmup", "stable", "stable-parallel", "bench", "serve"):
        assert stage in fits.stdout
    refused = run_cli("profile", "--target", "micro", "--memory", "0.001", check=False)  # 1 MB: less than micro's weights and a step
    assert refused.returncode == 2 and "more than a 0.001 GB GPU has room for" in refused.stderr and "NO" in refused.stdout


def test_suffix_decodings_trees_are_bounded_by_the_responses_the_global_tree_keeps(cache_dir):
    config = load_config("micro")
    arch = architecture(config)
    plain = decoding_plan(config, arch, "serve", 2, 1000, "cpu")
    with_trees = decoding_plan(config, arch, "serve", 2, 1000, "cpu", suffix_responses=100)
    expected = SUFFIX_TREE_BYTES_PER_TOKEN * (config.suffix.max_cached_requests * 100 + 2 * 1000)
    assert with_trees.parts["suffix trees"] == expected and with_trees.peak == plain.peak + expected
    assert "suffix trees" not in decoding_plan(config, arch, "serve", 2, 1000, "cuda", suffix_responses=100).parts  # in host memory
    config.suffix.max_cached_requests = 0  # prompt trees only: a row's own
    assert decoding_plan(config, arch, "serve", 2, 1000, "cpu", suffix_responses=100).parts["suffix trees"] == SUFFIX_TREE_BYTES_PER_TOKEN * 2000


@pytest.mark.parametrize("target", ["qwen3-4b", "qwen3-8b"])
def test_the_paper_targets_bench_fits_an_80_gb_gpu(cache_dir, target):
    """Its concurrency sweep (64 rows) runs the history teacher too, whose rows keep no features there: one turn each."""
    config = load_config(target)
    bench, arch = config.bench, architecture(config)
    assert bench_plan(config, arch, "cuda", bench.methods, bench.concurrency, bench.max_new_tokens).fits(80 * 10**9)


def test_an_engine_of_more_rows_than_fit_is_refused_naming_the_rows_that_do(cache_dir):
    config = load_config("micro")
    arch = architecture(config)
    assert engine_context(config, arch, parse_method("dlite"), 1, None, torch.device("cpu")) == arch.max_position_embeddings
    with pytest.raises(DliteError, match=r"the engine at 1000000 slots × 4096 tokens needs .* free: --max-batch \d+ fits"):
        engine_context(config, arch, parse_method("dlite"), 10**6, None, torch.device("cpu"))  # ~4 TB of KV cache; not even 1 024 a row fit
