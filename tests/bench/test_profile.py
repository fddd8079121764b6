"""`dlite profile` and the device policy."""

import json

import pytest
import torch

from dlite_cli.core.config import load_config
from dlite_cli.core.devices import resolve_device
from dlite_cli.core.errors import DliteError


def test_profile_prints_its_tables_and_writes_json(run_cli, tmp_path):
    out = tmp_path / "profile.json"
    done = run_cli("profile", "--target", "micro", "--contexts", "32,96", "--batches", "1,2", "--widths", "1,5",
                   "--tau", "2,3", "--repeats", "2", "--train-steps", "1", "--out", str(out))
    for title in ("target pass", "draft round", "predicted speedup", "what it expects to pay for", "training step"):
        assert title in done.stdout
    result = json.loads(out.read_text())
    assert len(result["passes"]) == 2 * 2 * 2 and all(p["ms"] > 0 and p["floor_ms"] > 0 for p in result["passes"])
    assert {(d["batch"], d["context"]) for d in result["drafts"]} == {(1, 32), (1, 96), (2, 32), (2, 96)}
    teacher_kv = {(d["batch"], d["context"]): d["teacher_kv_bytes"] for d in result["drafts"]}
    assert teacher_kv[1, 96] > teacher_kv[1, 32] > 0 and teacher_kv[2, 96] == 2 * teacher_kv[1, 96]  # it grows; DLite holds none
    assert [r["context"] for r in result["predicted"]] == [32, 96] and set(result["predicted"][0]["speedup"]) == {"2.0", "3.0"}
    empty = result["empty"]  # adaptive DLite proposes what it expects to pay for, at most K (5 − 1) a round
    assert empty["plain"]["proposed_per_round"] == 0 and 0 <= empty["dlite"]["proposed_per_round"] <= 4 and empty["dlite"]["ms_per_token"] > 0
    assert result["overhead"]["rounds"] > 0 and result["path"] == ("graphs" if torch.cuda.is_available() else "eager")
    assert [t["stage"] for t in result["training"]] == ["train-teacher", "warmup", "stable", "target features (online)"]
    as_json = run_cli("profile", "--target", "micro", "--contexts", "32", "--batches", "1", "--widths", "1,5", "--repeats", "1",
                      "--train-steps", "0", "--out", str(out), "--json")
    assert json.loads(as_json.stdout)["training"] == []
    bad = run_cli("profile", "--target", "micro", "--batches", "1,x", check=False)
    assert bad.returncode == 2 and "--batches must be comma-separated numbers" in bad.stderr


def test_device_policy_is_checked_in_one_sentence(run_cli):
    with pytest.raises(DliteError, match="target.device must be auto, cpu, cuda or cuda:N"):
        load_config("micro", ["target.device=gpu"])
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last device (cuda:0 on a CPU-only machine)
    with pytest.raises(DliteError, match="target.device is cuda:"):
        resolve_device(missing)
    done = run_cli("generate", "--target", "micro", "--drafter", "none", "-p", "hi", "--set", f"target.device={missing}", check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr and f"target.device is {missing}" in done.stderr
