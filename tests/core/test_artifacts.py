import json

import pytest

from dlite_cli.core.artifacts import Stage, stage_rows
from dlite_cli.core.errors import DliteError
from dlite_cli.core.files import atomic_directory, atomic_write_text


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "out.txt"
    atomic_write_text(path, "old")

    with pytest.raises(TypeError):
        atomic_write_text(path, 123)  # fails mid-write
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]  # no temporary left behind


def test_atomic_directory_appears_only_when_complete(tmp_path):
    target = tmp_path / "model"
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as tmp:
            (tmp / "half.bin").write_text("x")
            raise RuntimeError("killed")
    assert not target.exists() and list(tmp_path.iterdir()) == []
    with atomic_directory(target) as tmp:
        (tmp / "whole.bin").write_text("x")
    assert (target / "whole.bin").read_text() == "x"


def test_stage_lifecycle_and_status(tmp_path):
    stage = Stage(tmp_path, "regen")
    assert stage.begin("h1", {"a": 1}, {"target": "t1"})
    stage.update(progress={"done": 2, "total": 5, "unit": "prompts"})
    rows = {r["stage"]: r for r in stage_rows(tmp_path)}
    assert rows["regen"]["status"] == "partial" and rows["regen"]["progress"] == "2/5 prompts"
    assert rows["stable"]["status"] == "missing"

    resumed = Stage(tmp_path, "regen")
    assert resumed.begin("h1", {"a": 1}, {"target": "t1"})  # interrupted: claim it again
    resumed.finish(summary={"records": 5})
    assert json.loads(stage.manifest_path.read_text())["runs"] == 2
    assert not Stage(tmp_path, "regen").begin("h1", {"a": 1}, {"target": "t1"})  # done: nothing to do
    assert {r["stage"]: r for r in stage_rows(tmp_path)}["regen"]["status"] == "done"

    with pytest.raises(DliteError, match="different config"):
        Stage(tmp_path, "regen").begin("h2", {"a": 2}, {"target": "t1"})
    (stage.dir / "old-output").write_text("stale")
    assert Stage(tmp_path, "regen").begin("h2", {"a": 2}, {"target": "t1"}, force=True)
    assert not (stage.dir / "old-output").exists()
