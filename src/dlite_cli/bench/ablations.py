"""``dlite ablate``: the paper's Table 5 (design space) and Figure 5 (training strategy, draft KV cache) as artifacts.

The study varies one thing at a time around the config's drafter, along the axes of the config's ``ablations``
section, every W = 0 drafter trained for the same ``ablations.epochs``:

    Table 5    base                the config's drafter, stage 2 alone (single-stage)
               layers-S            S target hidden states instead of the config's
               composition-X       the other composition of the context slots (feature-wise: one slot)
               rank-R, no-head     the sequential head at rank R; without it
    Figure 5   two-stage           teacher (W = full) → warmup → stable, warmup and stable together as long as base
               window-W            the teacher stage (token CE) with a draft history window W (full: two-stage's teacher)

Each variant is a run directory of its own, ``<run>/ablations/<variant>/``, whose stages resume like any other.
They read the run's regen and one feature cache of every variant's layers (``<run>/ablations/features/``).  The
Table 5 variants are benched side by side on the same episodes, each proposing all K tokens every round as in the
paper (``<run>/ablations/bench/``); Figure 5 plots the held-out τ the stages log as they train.

    <run>/ablations/table5_design_space.{md,csv,json,tex}
    <run>/ablations/figure5_training.{png,csv}
    <run>/ablations/summary.md
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..core.artifacts import Stage
from ..core.config import Config, load_config
from ..core.devices import hardware, resolve_device
from ..core.errors import DliteError
from ..core.files import atomic_path, atomic_write_text
from ..data.workloads import BY_NAME
from ..decoding.methods import PLAIN
from ..models.model import FULL_HISTORY, DrafterSpec
from ..models.targets import target_config
from ..training.steps import stage_plan
from ..training.train import SharedInputs, Trainer, launched, mixed_precision
from .bench import Bench, BenchPlan, read_lines
from .report import Table, _cell, aggregate, paper_results

TABLE5_FACTORS = ("target hidden states", "composition", "sequential head rank")
TABLE5 = "table5_design_space"
FIGURE5 = "figure5_training"


@dataclass
class Variant:
    name: str
    factor: str  # "base", one of TABLE5_FACTORS, "training" or "draft KV window"
    value: str  # the factor's value, as the table and the figure show it
    stages: tuple[str, ...]  # training stages in order; the last one's export is the variant's drafter
    overrides: list[str]  # --set items over the target config

    def method(self, study_dir: Path) -> str:
        """The bench's method for this variant: its drafter, proposing all K tokens every round."""
        return f"{study_dir / self.name / self.stages[-1] / 'drafter'}:fixed"


def base_values(config: Config) -> dict[str, str]:
    """The config's drafter on each Table 5 axis."""
    drafter = config.drafter
    return {"target hidden states": str(drafter.num_target_layers), "composition": drafter.composition,
            "sequential head rank": str(drafter.head_rank) if drafter.sequential_head else "none"}


def variants(config: Config) -> list[Variant]:
    """The study's variants, base first: every value of each axis that the config's drafter does not already have."""
    study, base = config.ablations, base_values(config)
    epochs, warmup = study.epochs, max(1, study.epochs // 4)  # the paper's warmup is a quarter of warmup + stable
    every = [f"train.checkpoint_every={study.eval_every}"]
    single = every + ["train.stable_init=scratch", f"train.stable_epochs={epochs}"]
    found = [Variant("base", "base", ", ".join(f"{k} {v}" for k, v in base.items()), ("stable",), single)]
    for count in study.target_layers:
        if str(count) != base["target hidden states"]:
            found.append(Variant(f"layers-{count}", "target hidden states", str(count), ("stable",), single + [f"drafter.num_target_layers={count}"]))
    other = "feature" if base["composition"] == "sequence" else "sequence"
    found.append(Variant(f"composition-{other}", "composition", other, ("stable",), single + [f"drafter.composition={other}"]))
    for rank in study.head_ranks:
        value = str(rank) if rank else "none"
        if value != base["sequential head rank"]:
            change = [f"drafter.head_rank={rank}", "drafter.sequential_head=true"] if rank else ["drafter.sequential_head=false"]
            found.append(Variant(f"rank-{rank}" if rank else "no-head", "sequential head rank", value, ("stable",), single + change))
    found.append(Variant("two-stage", "training", "two-stage", ("train-teacher", "warmup", "stable"),
                         every + ["train.stable_init=warmup", f"train.teacher_epochs={epochs}", f"train.warmup_epochs={warmup}",
                                  f"train.stable_epochs={epochs - warmup}", f"train.teacher_window={FULL_HISTORY}"]))
    for window in study.windows:
        if window != FULL_HISTORY:  # the full-history teacher is two-stage's first stage
            found.append(Variant(f"window-{window}", "draft KV window", str(window), ("train-teacher",),
                                 every + [f"train.teacher_epochs={epochs}", f"train.teacher_window={window}"]))
    return found


class Study:
    def __init__(self, target: str, overrides: list[str], run_dir: Path, log=print):
        self.target, self.overrides, self.run_dir, self.log = target, list(overrides), Path(run_dir), log
        self.config = load_config(target, self.overrides)
        self.dir = self.run_dir / "ablations"
        self.variants = variants(self.config)
        unknown = [w for w in self.config.ablations.workloads if w not in BY_NAME]
        if unknown:
            raise DliteError(f"ablations.workloads: unknown workload {unknown[0]!r} (expected one of {', '.join(BY_NAME)})")

    def run(self) -> None:
        """Train what is missing, bench what is not measured, write Table 5, Figure 5 and summary.md."""
        self.train()
        results = self.bench()
        device = resolve_device(self.config.target.device)
        table = table5(self.config, self.variants, self.dir, results, hardware(device))
        table.write(self.dir)
        figure = figure5(self.config, self.dir)
        summary = self.summary(table, figure)
        self.log(f"wrote Table 5 ({TABLE5}.md, csv, json, tex), Figure 5 ({FIGURE5}.png, csv) and {summary}")

    def _config(self, variant: Variant, stage: str, pins: dict[str, str]) -> Config:
        precision = [f"train.mixed_precision={pins[stage]}"] if stage in pins else []
        return load_config(self.target, [*self.overrides, *variant.overrides, *precision])

    def _precision(self, spec: DrafterSpec) -> dict[str, str]:
        """``train.mixed_precision: auto``, decided once per training stage for the base drafter's shapes, so that every
        variant trains in the same precision and none times its own (a bfloat16 step without native support: ~30 s)."""
        train = self.config.train
        if train.mixed_precision != "auto" or launched():
            return {}
        device = resolve_device(self.config.target.device)
        stages = dict.fromkeys(stage for v in self.variants for stage in v.stages)
        return {stage: mixed_precision(stage_plan(stage, train), train, spec, device, self.log) for stage in stages}

    def train(self) -> None:
        """Every variant's stages in order (a finished one does nothing), after the feature cache of all their layers."""
        arch = target_config(self.config, self.log)
        drafters = [self._config(v, v.stages[-1], {}).drafter for v in self.variants]
        layers = sorted({i for drafter in drafters for i in DrafterSpec.for_target(arch, drafter, 0).target_layer_ids})
        shared = SharedInputs(self.run_dir, self.dir, layers)
        pins = self._precision(DrafterSpec.for_target(arch, self.config.drafter, 0))
        for index, variant in enumerate(self.variants, 1):
            for stage in variant.stages:
                self.log(f"ablation [{index}/{len(self.variants)}] {variant.name} ({variant.factor}: {variant.value}): {stage}")
                Trainer(self._config(variant, stage, pins), self.dir / variant.name, stage, self.log, shared).run()

    def bench(self) -> list[dict]:
        """Plain decoding and every Table 5 variant proposing all K tokens, side by side → the measurements."""
        study = self.config.ablations
        methods = [PLAIN] + [v.method(self.dir) for v in self.variants if v.factor in ("base", *TABLE5_FACTORS)]
        plan = BenchPlan("table5", study.workloads, methods, study.limit, study.max_new_tokens, 0.0, [], {})
        return Bench(self.config, self.dir, plan, self.log).run()

    def summary(self, table: Table, figure: pd.DataFrame) -> Path:
        """``summary.md``: Table 5, Figure 5 with the paper's findings, and what each variant cost to train."""
        trained = Table("variants", "The variants: what each trained, and for how long", ["variant", "varies", "stages", "steps", "minutes", "held-out τ"])
        for variant in self.variants:
            manifests = [Stage(self.dir / variant.name, stage).manifest() for stage in variant.stages]
            trained.rows.append({"variant": variant.name, "varies": f"{variant.factor}: {variant.value}", "stages": " → ".join(variant.stages),
                                 "steps": " + ".join(str(m["summary"]["steps"]) for m in manifests),
                                 "minutes": f"{sum(m['elapsed_s'] for m in manifests) / 60:.1f}",
                                 "held-out τ": f"{manifests[-1]['summary']['eval_tau']:.3f}"})
        trained.notes.append(f"{self.variants[0].name}'s minutes include the feature cache of every variant's layers, which it built first")
        found = paper_results().get("figure5_ablation", {})
        last = figure.groupby(["panel", "series"], sort=False).last()  # each series' last evaluation
        lines = [f"# dlite ablations: {self.config.target.model}", "", table.markdown(), "### Figure 5: held-out τ during training",
                 "", f"![Figure 5]({FIGURE5}.png) ([csv]({FIGURE5}.csv))", ""]
        lines += [f"- {panel}, {series}: τ {row.eval_tau:.3f} after {row.step} steps" for (panel, series), row in last.iterrows()]
        lines += [f"- the paper ({key.replace('_', ' ')}): {text}" for key, text in found.items()]
        lines += ["", trained.markdown()]
        path = self.dir / "summary.md"
        atomic_write_text(path, "\n".join(lines))
        return path


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def table5(config: Config, found: list[Variant], study_dir: Path, results: list[dict], machine: str) -> Table:
    """Table 5: per axis, the base drafter and its variants — held-out τ, τ per workload and its mean, draft ms per
    round and speedup over plain decoding — with the paper's rows for Qwen3-8B beside them."""
    study, stats = config.ablations, aggregate(results)
    titles = [BY_NAME[w].title for w in study.workloads]
    columns = ["target", "factor", "value", "variant", "held-out τ", *[f"τ {t}" for t in titles], "τ mean", "draft ms/round", "speedup", "hardware"]
    table = Table(TABLE5, f"Table 5: the design space, {config.target.model} (every drafter {study.epochs} epochs of stage 2)", columns)
    base, values = found[0], base_values(config)
    for factor in TABLE5_FACTORS:
        for variant in [base] + [v for v in found if v.factor == factor]:
            cells = [stats.get((w, variant.method(study_dir))) for w in study.workloads]
            taus = [c and c["tau"] for c in cells]
            summary = Stage(study_dir / variant.name, variant.stages[-1]).manifest()["summary"]
            row = {"target": config.target.model, "factor": factor, "value": values[factor] if variant is base else variant.value,
                   "variant": variant.name, "held-out τ": _cell(summary["eval_tau"], 3),
                   **{f"τ {t}": _cell(tau, source=c["source"] if c else "") for t, c, tau in zip(titles, cells, taus)}, "τ mean": _cell(_mean(taus)),
                   "draft ms/round": _cell(_mean([c and c["draft_ms_per_round"] for c in cells]), 1),
                   "speedup": _cell(_mean([c and c["speedup"] for c in cells])), "hardware": machine}
            table.rows.append(row)
    paper = paper_results()
    published, setup = paper.get("table5_design_space_qwen3_8b", {}), paper.get("setup", {})
    for factor, key in (("composition", "composition"), ("sequential head rank", "sequential_head_rank")):
        for value, tau in published.get(key, {}).items():
            shown = str(value).removesuffix("_wise").replace("full_", "full, ")
            table.rows.append({"target": "Qwen3-8B (paper)", "factor": factor, "value": shown, "variant": "published",
                               "τ mean": _cell(tau), "hardware": f"{setup.get('hardware', '?')} ({setup.get('engine', '?')})"})
    if "target_hidden_states" in published:
        table.notes.append(f"the paper on target hidden states (Qwen3-8B, 36 layers): {published['target_hidden_states']}")
    if "note" in published:
        table.notes.append(f"the paper: {published['note']}")
    table.notes.append("the paper's τ mean is over Alpaca, GSM8K, MBPP and Multi-Doc QA after training on an 80 K-sample subset; "
                       f"ours over {', '.join(titles)} ({study.limit} episodes of each, {study.max_new_tokens} new tokens a turn, greedy)")
    table.notes.append("τ: tokens committed per verify round, every variant proposing all K tokens every round (the paper's protocol); "
                       "held-out τ: simulated on the held-out regenerated sequences after training; speedup: the mean over workloads of plain "
                       "decoding's time per token over the variant's (prefill excluded), measured side by side")
    for workload in study.workloads:
        source = next((s["source"] for (w, _), s in stats.items() if w == workload), None)
        table.notes.append(f"{BY_NAME[workload].title}: {source or 'not measured (no offline source: see dlite bench --data)'}")
    return table


def figure5(config: Config, study_dir: Path) -> pd.DataFrame:
    """Figure 5 as ``figure5_training.csv`` and ``.png``: held-out τ against training steps, single-stage against
    two-stage (the W = 0 drafter's steps, warmup then stable) and the teacher stage at each draft KV window → the points."""
    curves = [("training strategy", "single-stage", "base", ("stable",)), ("training strategy", "two-stage", "two-stage", ("warmup", "stable"))]
    curves += [("draft KV window", f"W = {'full' if w == FULL_HISTORY else w}", "two-stage" if w == FULL_HISTORY else f"window-{w}", ("train-teacher",))
               for w in config.ablations.windows]
    points = []
    for panel, series, name, stages in curves:
        offset = 0
        for stage in stages:
            points += [{"panel": panel, "series": series, "variant": name, "stage": stage, "step": offset + r["step"],
                        "eval_tau": r["eval_tau"], "eval_tau_walk": r["eval_tau_walk"]}
                       for r in read_lines(study_dir / name / stage / "metrics.jsonl") if "eval_tau" in r]
            offset += Stage(study_dir / name, stage).manifest()["summary"]["steps"]
    frame = pd.DataFrame(points, columns=["panel", "series", "variant", "stage", "step", "eval_tau", "eval_tau_walk"])
    atomic_write_text(study_dir / f"{FIGURE5}.csv", frame.to_csv(index=False))
    _plot(frame, study_dir / f"{FIGURE5}.png", config.target.model)
    return frame


def _plot(frame: pd.DataFrame, path: Path, target: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    titles = {"training strategy": "training strategy (the W = 0 drafter)", "draft KV window": "draft KV window W (teacher stage, token CE)"}
    for axis, (panel, title) in zip(axes, titles.items()):
        for (series, points), style in zip(frame[frame.panel == panel].groupby("series", sort=False), ("-", "--", "-.", ":")):
            axis.plot(points.step, points.eval_tau, style, marker="o", label=series)  # styles: curves that coincide stay visible
        axis.set(xlabel="training steps", title=title)
        axis.legend()
    axes[0].set_ylabel("held-out τ (simulated)")
    figure.suptitle(f"Figure 5: {target}")
    figure.tight_layout()
    with atomic_path(path) as tmp:
        figure.savefig(tmp, dpi=120, format="png")
    plt.close(figure)
