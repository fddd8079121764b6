"""Precision by measurement (precision.py): the rule, the memory of a decision, and each setting's timed work."""

import json
from pathlib import Path

import pytest
import torch

from dlite_cli.core import precision
from dlite_cli.core.config import CONFIG_DIRS, TargetConfig, load_config
from dlite_cli.core.errors import DliteError
from dlite_cli.core.precision import decide
from dlite_cli.models.targets import Work, load_model, prepare_target

CPU = torch.device("cpu")


def timings(**sequences):
    """Options whose timings (ms) come from the given lists in turn, the untimed warm-up run first."""
    its = {name: iter(values) for name, values in sequences.items()}
    return {name: lambda it=it: next(it) for name, it in its.items()}


def test_a_clear_win_is_chosen_from_the_medians_of_interleaved_rounds():
    calls = []
    options = {name: lambda name=name, ms=ms: calls.append(name) or ms for name, ms in {"float32": 30.0, "bfloat16": 20.0}.items()}
    rounds = precision.measure(options)
    assert calls == ["float32", "bfloat16"] + ["float32", "bfloat16", "bfloat16", "float32"] * 2 + ["float32", "bfloat16"]
    assert len(rounds) == precision.ROUNDS == 5
    medians, choice, reason, decisive = precision.verdict(rounds, "float32")
    assert medians == {"float32": 30.0, "bfloat16": 20.0} and choice == "bfloat16" and decisive and "50% faster" in reason


def test_a_one_off_spike_neither_decides_nor_survives_the_median():
    # the micro teacher's step once took 2 375.8 ms in float32 against 62.4 in bfloat16: here the warm-up
    # (first-call costs) and one round are slow, the rest say float32 is the faster
    rounds = precision.measure(timings(no=[2375.8, 15.9, 2375.8, 16.1, 15.8, 16.0], bf16=[62.4, 20.9, 21.0, 20.8, 21.1, 20.7]))
    assert [r["no"] for r in rounds] == [15.9, 2375.8, 16.1, 15.8, 16.0]
    medians, choice, _, decisive = precision.verdict(rounds, "no")
    assert medians == {"no": 16.0, "bf16": 20.9} and choice == "no" and decisive  # the spike lost one round of five


def test_a_thin_margin_or_rounds_that_disagree_give_the_conventional_choice():
    thin = precision.measure(timings(float32=[577.0] * 6, bfloat16=[575.6] * 6))  # 0.2 % apart
    _, choice, reason, decisive = precision.verdict(thin, "float32")
    assert choice == "float32" and not decisive and "within 10%" in reason
    split = precision.measure(timings(float32=[0, 30, 30, 10, 10, 30], bfloat16=[0, 10, 10, 30, 30, 10]))
    _, choice, reason, decisive = precision.verdict(split, "float32")  # bfloat16 wins 3 of 5 rounds
    assert choice == "float32" and not decisive and "disagree" in reason


def test_two_rounds_that_part_by_more_than_five_times_end_the_timing_early():
    calls = []
    clear = {"no": 1230.0, "bf16": 24900.0}  # a bf16-autocast step without native bfloat16: 20x
    rounds = precision.measure({name: lambda name=name: calls.append(name) or clear[name] for name in clear})
    assert len(rounds) == 2 and len(calls) == 6
    assert precision.verdict(rounds, "no")[1] == "no"


def test_a_decision_is_remembered_with_its_rounds_and_printed_once(cache_dir):
    lines, calls = [], []
    options = {"float32": lambda: calls.append("float32") or 30.0, "bfloat16": lambda: calls.append("bfloat16") or 20.0}
    start = precision.mark()
    key = {"test": "remembered", "cache": str(cache_dir)}
    assert decide("decode.draft_dtype", key, options, "a draft round", CPU, lines.append) == "bfloat16"
    assert len(calls) == 12
    (line,) = lines
    assert "30.0 ms in float32" in line and "20.0 ms in bfloat16" in line and "medians of 5 interleaved rounds" in line
    assert "using bfloat16: 50% faster" in line
    record = Path(line.split("remembered in ")[1].split(";")[0].removesuffix(")"))  # the session's cache holds other tests' decisions
    saved = json.loads(record.read_text())
    assert record.parent == cache_dir / "precision" and saved["ms"] == {"float32": 30.0, "bfloat16": 20.0} and len(saved["rounds"]) == 5

    def never():
        raise AssertionError("a settled decision is not measured again")

    if not saved["settled"]:  # the machine was busy while it was timed (the test's own machine may be)
        pytest.skip(f"other processes kept {saved['load']:.0%} of the cores busy: the decision is not settled")
    assert decide("decode.draft_dtype", key, {"float32": never, "bfloat16": never}, "a draft round", CPU, lines.append) == "bfloat16"
    assert len(lines) == 1  # printed once per process
    (made,) = precision.made(start)
    assert made["setting"] == "decode.draft_dtype" and made["choice"] == "bfloat16" and made["settled"]


def test_a_thin_margin_is_measured_again_and_settles_the_second_time(cache_dir, monkeypatch):
    monkeypatch.setattr(precision, "_made", {})  # a new process each time
    key = {"test": "thin", "cache": str(cache_dir)}
    close = {"float32": lambda: 100.0, "bfloat16": lambda: 97.0}
    lines = []
    assert decide("target.dtype (decoding)", key, close, "a step", CPU, lines.append) == "float32"
    if "measured while other processes" in lines[-1]:
        pytest.skip("the machine was busy while the options were timed")
    assert "within 10%" in lines[-1] and "measured again next time" in lines[-1]
    monkeypatch.setattr(precision, "_made", {})
    assert decide("target.dtype (decoding)", key, close, "a step", CPU, lines.append) == "float32"
    assert "measured again" not in lines[-1]  # thin twice on a quiet machine: the options are close, float32 stands


def test_a_decision_taken_while_another_process_loads_the_cpu_is_measured_again(cache_dir, monkeypatch):
    import subprocess
    import sys
    import time

    monkeypatch.setattr(precision, "_made", {})
    start = precision.mark()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        def work():  # sleeps, so that this process uses little CPU and the burners do
            time.sleep(0.05)
            return 50.0

        lines = []
        key = {"test": "busy", "cache": str(cache_dir)}
        assert decide("decode.draft_dtype", key, {"float32": work, "bfloat16": lambda: work() / 2}, "a round", CPU, lines.append) == "bfloat16"
    finally:
        for burner in burners:
            burner.kill()
    assert "measured while other processes kept" in lines[0] and "measured again next time" in lines[0]
    (made,) = precision.made(start)
    assert made["load"] >= precision.BUSY and not made["settled"]


def test_dlite_precision_lists_the_remembered_decisions_and_forgets_them(run_cli, cache_dir):
    (cache_dir / "precision").mkdir(exist_ok=True)
    (cache_dir / "precision" / "decode.draft_dtype-old.json").write_text(json.dumps(
        {"setting": "decode.draft_dtype", "choice": "float32", "ms": {"float32": 317.3, "bfloat16": 8.0}, "work": "w", "hardware": "h"}))
    listed = run_cli("precision").stdout
    assert "precision decisions remembered in" in listed and "older dlite" in listed
    forgot = run_cli("precision", "--forget")
    assert "forgot" in forgot.stderr and not list((cache_dir / "precision").glob("*.json"))


def test_on_a_gpu_auto_is_bfloat16_unmeasured(monkeypatch):
    monkeypatch.setattr(precision, "hardware", lambda device: "a GPU")  # no GPU here: only the rule is checked
    lines = []
    choice = decide("train.mixed_precision", {"test": "gpu"}, {"no": pytest.fail, "bf16": pytest.fail}, "a step",
                    torch.device("cuda"), lines.append, gpu_choice="bf16")
    assert choice == "bf16" and "not measured" in lines[0]


def test_compute_bound_work_is_float32_unmeasured_on_a_cpu_without_bfloat16_instructions(monkeypatch):
    monkeypatch.setattr(precision, "bf16_instructions", lambda: False)
    lines = []
    choice = decide("train.mixed_precision", {"test": "no bf16"}, {"no": pytest.fail, "bf16": pytest.fail}, "a step", CPU, lines.append,
                    cpu_choice="no", compute_bound=True)
    assert choice == "no" and lines[0].endswith("(a CPU without bfloat16 instructions: not measured)")
    timed = decide("decode.draft_dtype", {"test": "no bf16"}, {"float32": lambda: 1.0, "bfloat16": lambda: 2.0}, "a round", CPU, lines.append)
    assert timed == "float32" and "1.0 ms in float32, 2.0 ms in bfloat16" in lines[1]  # a decode step may still win: measured


def test_target_dtype_auto_times_the_work_it_is_loaded_for(cache_dir, monkeypatch):
    monkeypatch.setattr(precision, "bf16_instructions", lambda: True)  # the batched pass too, whatever this CPU has
    prepared = prepare_target(TargetConfig(model="micro"), log=lambda _: None)
    lines = []
    batched = load_model(prepared, "auto", CPU, lines.append, Work("batched", batch=4))
    decoding = load_model(prepared, "auto", CPU, lines.append, Work("decoding", draft_tokens=4))
    assert len(lines) == 2 and "a pass over 4 rows" in lines[0] and "a decode step + verifies of 2, 4, 5 tokens" in lines[1]
    for line, model in zip(lines, (batched, decoding)):
        assert "in float32" in line and "in bfloat16" in line
        assert f"; using {str(model.dtype).removeprefix('torch.')}: " in line and "(remembered in " in line


def test_a_decode_precision_decision_is_timed_again_for_other_cpu_kernels(cache_dir, monkeypatch):
    """The kernels' source is part of what a decoding decision was timed with: after an upgrade that changed them, the
    remembered choice is not reused."""
    from dlite_cli.models import cpu_kernels, targets

    assert cpu_kernels.VERSION in targets.KERNELS
    prepared = prepare_target(TargetConfig(model="micro"), log=lambda _: None)
    lines = []
    for kernels in (targets.KERNELS, targets.KERNELS, targets.KERNELS.replace("kernels ", "kernels 0000")):
        monkeypatch.setattr(targets, "KERNELS", kernels)
        load_model(prepared, "auto", CPU, lines.append, Work("decoding", draft_tokens=3))  # a decision no other test took
    assert len(lines) == 2 and all("in float32" in line and "in bfloat16" in line for line in lines)  # timed, reused, timed


def test_set_takes_a_literal_fields_word_as_the_string_it_names(tmp_path):
    assert load_config("micro", ["train.mixed_precision=no"]).train.mixed_precision == "no"
    assert load_config("micro", ["decode.adaptive=off"]).decode.adaptive is False  # a bool field still reads YAML's words
    with pytest.raises(DliteError, match="train.mixed_precision must be one of auto, no, bf16, fp16, got 'off'"):
        load_config("micro", ["train.mixed_precision=off"])  # only the word the Literal names
    shipped = (CONFIG_DIRS[1] / "micro.yaml").read_text()
    written = tmp_path / "file.yaml"
    written.write_text(shipped.replace("  seed: 0\n\nbench", "  seed: 0\n  mixed_precision: no\n\nbench"))
    assert load_config(str(written)).train.mixed_precision == "no"  # in a file too
