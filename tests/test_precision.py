"""Precision by measurement (precision.py): the rule, the memory of a decision, and each setting's timed work."""

import json
from pathlib import Path

import pytest
import torch

from dlite_cli import precision
from dlite_cli.config import CONFIG_DIRS, TargetConfig, load_config
from dlite_cli.errors import DliteError
from dlite_cli.precision import decide, fastest
from dlite_cli.targets import Work, load_model, prepare_target

CPU = torch.device("cpu")


def test_the_rule_takes_whichever_option_its_own_timings_favour():
    # timings of the kinds of CPU measured (ms): a batched regen pass, a training step, a decode round
    avx2_only = {"float32": 410.0, "bfloat16": 1830.0}  # no native bfloat16: about 4x slower batched
    amx = {"float32": 780.0, "bfloat16": 410.0}  # AMX / AVX-512 BF16: bfloat16 the faster
    assert fastest(avx2_only) == "float32" and fastest(amx) == "bfloat16"
    assert fastest({"no": 1230.0, "bf16": 24900.0}) == "no" and fastest({"no": 1470.0, "bf16": 760.0}) == "bf16"
    assert fastest({"float32": 5.0, "bfloat16": 5.0}) == "float32"  # a tie keeps the first named


def test_each_option_keeps_its_best_of_two_timings_taken_in_mirrored_order():
    timings = {"float32": iter([30.0, 31.0]), "bfloat16": iter([90.0, 20.0])}  # bfloat16's first timing hit a passing load
    ms = precision.measure({name: lambda times=times: next(times) for name, times in timings.items()})
    assert ms == {"float32": 30.0, "bfloat16": 20.0} and fastest(ms) == "bfloat16"
    calls = []
    clear = {"no": 1230.0, "bf16": 24900.0}  # a bf16-autocast step without native bfloat16: 20x, timed once
    assert precision.measure({name: lambda name=name: calls.append(name) or clear[name] for name in clear}) == clear and calls == ["no", "bf16"]


def test_a_decision_is_measured_once_per_machine_remembered_and_printed_with_both_timings(cache_dir):
    lines, calls = [], []
    options = {"float32": lambda: calls.append("float32") or 30.0, "bfloat16": lambda: calls.append("bfloat16") or 20.0}
    start = precision.mark()
    key = {"test": "remembered", "cache": str(cache_dir)}
    assert decide("decode.draft_dtype", key, options, "a draft round", CPU, lines.append) == "bfloat16"
    assert calls == ["float32", "bfloat16", "bfloat16", "float32"]
    (line,) = lines
    assert "30.0 ms in float32" in line and "20.0 ms in bfloat16" in line and "using bfloat16" in line
    record = Path(line.split("remembered in ")[1].removesuffix(")"))  # the session's cache holds other tests' decisions
    assert record.parent == cache_dir / "precision" and json.loads(record.read_text())["ms"] == {"float32": 30.0, "bfloat16": 20.0}

    def never():
        raise AssertionError("a remembered decision is not measured again")

    assert decide("decode.draft_dtype", key, {"float32": never, "bfloat16": never}, "a draft round", CPU, lines.append) == "bfloat16"
    assert len(lines) == 1  # printed once per process
    (made,) = precision.made(start)
    assert made["setting"] == "decode.draft_dtype" and made["choice"] == "bfloat16"


def test_on_a_gpu_auto_is_bfloat16_unmeasured(monkeypatch):
    monkeypatch.setattr(precision, "hardware", lambda device: "a GPU")  # no GPU here: only the rule is checked
    lines = []
    choice = decide("train.mixed_precision", {"test": "gpu"}, {"no": pytest.fail, "bf16": pytest.fail}, "a step",
                    torch.device("cuda"), lines.append, gpu_choice="bf16")
    assert choice == "bf16" and "not measured" in lines[0]


def test_target_dtype_auto_times_the_work_it_is_loaded_for(cache_dir):
    prepared = prepare_target(TargetConfig(model="micro"), log=lambda _: None)
    lines = []
    batched = load_model(prepared, "auto", CPU, lines.append, Work("batched", batch=4))
    decoding = load_model(prepared, "auto", CPU, lines.append, Work("decoding", draft_tokens=4))
    assert len(lines) == 2 and "a pass over 4 rows" in lines[0] and "a decode step + a 5-token verify" in lines[1]
    for line, model in zip(lines, (batched, decoding)):
        assert "in float32" in line and "in bfloat16" in line
        assert line.endswith(f"using {str(model.dtype).removeprefix('torch.')} (remembered in {line.split('remembered in ')[1]}")


def test_set_takes_a_literal_fields_word_as_the_string_it_names(tmp_path):
    assert load_config("micro", ["train.mixed_precision=no"]).train.mixed_precision == "no"
    assert load_config("micro", ["decode.adaptive=off"]).decode.adaptive is False  # a bool field still reads YAML's words
    with pytest.raises(DliteError, match="train.mixed_precision must be one of auto, no, bf16, fp16, got 'off'"):
        load_config("micro", ["train.mixed_precision=off"])  # only the word the Literal names
    shipped = (CONFIG_DIRS[1] / "micro.yaml").read_text()
    written = tmp_path / "file.yaml"
    written.write_text(shipped.replace("  seed: 0\n\nbench", "  seed: 0\n  mixed_precision: no\n\nbench"))
    assert load_config(str(written)).train.mixed_precision == "no"  # in a file too
