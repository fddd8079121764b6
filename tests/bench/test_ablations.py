import json

import pandas as pd
import torch

from dlite_cli.training.features import FeatureCache

ABLATE = ("ablate", "--target", "micro")


def test_the_study_trains_every_variant_benches_them_and_writes_table_5_and_figure_5(micro_run, run_cli, tmp_path):
    run = tmp_path / "runs" / "micro"
    refused = run_cli(*ABLATE, check=False)
    assert refused.returncode == 2 and "needs a finished `regen` stage" in refused.stderr
    micro_run.copy(run)
    first = run_cli(*ABLATE)
    study = run / "ablations"

    # configs/micro.yaml's axes: layers 2 (base 3), the other composition, rank 8 and no head (base 16), W = 0 (and full)
    names = {"base", "layers-2", "composition-feature", "rank-8", "no-head", "two-stage", "window-0"}
    assert names <= {p.name for p in study.iterdir() if p.is_dir()}
    for name, key, value in (("layers-2", "target_layer_ids", [0, 3]), ("base", "target_layer_ids", [0, 2, 3]), ("no-head", "sequential_head", False),
                             ("rank-8", "head_rank", 8), ("composition-feature", "composition", "feature")):
        spec = json.loads((study / name / "stable" / "drafter" / "config.json").read_text())
        assert spec[key] == value, (name, spec)
    assert json.loads((study / "window-0" / "train-teacher" / "manifest.json").read_text())["config"]["train"]["teacher_window"] == 0
    # one feature cache of every variant's layers; a variant reads its own, as a cache of just those layers holds them
    assert json.loads((study / "features" / "manifest.json").read_text())["config"]["layers"] == [0, 2, 3]
    micro_run.copy(run, ("features",))  # the run's own cache, of the base drafter's layers
    own = FeatureCache(run).load()
    picked = FeatureCache(study).load([0, 3])
    assert [s.features.shape[1] for s in picked[:2]] == [2, 2]
    assert torch.equal(FeatureCache(study).load([0, 2, 3])[5].features, own[5].features)
    assert torch.equal(picked[5].features, own[5].features[:, [0, 2]])

    table = json.loads((study / "table5_design_space.json").read_text())
    ours = [r for r in table["rows"] if r["target"] == "micro"]
    assert [(r["factor"], r["variant"]) for r in ours] == [
        ("target hidden states", "base"), ("target hidden states", "layers-2"), ("composition", "base"), ("composition", "composition-feature"),
        ("sequential head rank", "base"), ("sequential head rank", "rank-8"), ("sequential head rank", "no-head")]
    assert all(r["τ SWE-Bench"].endswith(" (synthetic)") and float(r["τ SWE-Bench"].split()[0]) >= 1 for r in ours)
    assert all(float(r["held-out τ"]) >= 1 and float(r["τ mean"]) >= 1 and float(r["draft ms/round"]) > 0 for r in ours)
    assert {r["value"] for r in table["rows"] if r["target"] == "Qwen3-8B (paper)"} == {"sequence", "feature", "256", "512", "full, 4096"}
    assert any(note.startswith("SWE-Bench: synthetic") for note in table["notes"])
    for ext in ("md", "csv", "tex"):
        assert (study / f"table5_design_space.{ext}").stat().st_size > 0

    figure = pd.read_csv(study / "figure5_training.csv")
    assert set(zip(figure.panel, figure.series)) == {("training strategy", "single-stage"), ("training strategy", "two-stage"),
                                                      ("draft KV window", "W = 0"), ("draft KV window", "W = full")}
    two_stage = figure[figure.series == "two-stage"]  # warmup's steps, then stable's after them
    assert list(two_stage.stage.unique()) == ["warmup", "stable"] and two_stage.step.is_monotonic_increasing
    assert two_stage.step.max() == figure[figure.series == "single-stage"].step.max()  # the same W = 0 budget
    assert (study / "figure5_training.png").read_bytes()[:4] == b"\x89PNG"
    assert "Table 5" in (study / "summary.md").read_text() and "above single-stage throughout training" in (study / "summary.md").read_text()

    again = run_cli(*ABLATE)  # everything is there: nothing is trained or measured again
    assert again.stderr.count("already done") == 9 and "measured 0" in again.stderr
    assert "measured 0" not in first.stderr


def test_an_unknown_workload_is_refused_before_anything_trains(run_cli, tmp_path):
    refused = run_cli(*ABLATE, "--set", "ablations.workloads=[swe_bench,nope]", check=False)
    assert refused.returncode == 2 and "ablations.workloads: unknown workload 'nope'" in refused.stderr
    assert not (tmp_path / "runs").exists()
