"""The bench's tables and plots, laid out like the paper's, with its published rows beside ours.

    table1_general_tau      τ on the general workloads
    table2_longbench_v2     speedup and τ on the LongBench v2 subsets
    table3_agentic          speedup and τ on the agentic workloads
    table4_throughput       tokens/s and speedup vs autoregressive at each concurrency
    tau_by_context          τ and first-position acceptance against context, within each long-context and agentic workload

Each is written as Markdown, CSV, JSON and LaTeX into the plan's folder (bench.py), through pandas.  Every row names its
target, method, drafter checkpoint and hardware; the paper's rows come from
``configs/paper_results.yaml`` and a cell it does not publish stays empty.  A value measured on a
synthetic stand-in is marked ``(synthetic)``.  Plots: τ vs context length (all workloads pooled, and within each
agentic workload), throughput vs concurrency, acceptance by draft position; ``summary.md`` links it all.
"""

from __future__ import annotations

import random
from pathlib import Path

import pandas as pd
import yaml

from ..core.config import CONFIG_DIRS
from ..core.files import atomic_write_json, atomic_write_text
from ..data.workloads import BY_NAME
from ..decoding.methods import parse_method

PAPER_METHOD = {"DLite": "dlite"}  # paper method names that are ours too
CONTEXT_BINS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
PLOTS = ("tau_vs_context.png", "tau_vs_context_by_workload.png", "throughput_vs_concurrency.png", "acceptance_by_position.png")
RESAMPLES = 2000  # bootstrap resamples of a workload's episodes behind a speedup's interval


def paper_results() -> dict:
    for directory in CONFIG_DIRS:
        path = directory / "paper_results.yaml"
        if path.is_file():
            return yaml.safe_load(path.read_text())
    return {}


# ---------------------------------------------------------------- aggregation


def aggregate(results: list[dict]) -> dict[tuple[str, str], dict]:
    """(workload, method) → τ, decode time per token, tokens/s, times per round, acceptance, source, and on how many
    turns the method wrote its engine's plain decoding's text (``same_text``: [turns alike, turns compared])."""
    groups = _groups(results)
    return {(workload, method): _summary(g, _baseline(groups, workload, method)) for (workload, method), g in groups.items()}


def _groups(results: list[dict]) -> dict[tuple[str, str], dict]:
    """(workload, method) → the totals of its measured turns, per episode too (``by_episode``: [decode s, tokens])."""
    plain_text = {(r["workload"], r["episode"], r["method"], i): t.get("output_sha") for r in results for i, t in enumerate(r["turns"])}
    groups: dict[tuple[str, str], dict] = {}
    for record in results:
        group = groups.setdefault((record["workload"], record["method"]), {
            "rounds": 0, "committed": 0, "prefill_s": 0.0, "draft_s": 0.0, "verify_s": 0.0,
            "proposed": None, "accepted": None, "episodes": 0, "source": record["source"], "drafter": record["drafter"],
            "origin": record.get("origin", ""), "draft_kv_bytes": 0, "by_episode": {}, "tree_responses": [], "same_text": [0, 0],
        })
        group["episodes"] += 1
        if "suffix_tree" in record:
            group["tree_responses"].append(record["suffix_tree"]["responses"])
        episode = group["by_episode"].setdefault(record["episode"], [0.0, 0])
        plain = parse_method(record["method"]).plain
        for index, turn in enumerate(record["turns"]):
            if "skipped" in turn:
                continue
            episode[0] += turn["draft_s"] + turn["verify_s"] + turn["overhead_s"]
            episode[1] += turn["generated_tokens"]
            _add_turn(group, turn)
            plain_sha = plain_text.get((record["workload"], record["episode"], plain, index))
            if plain_sha and record["method"] != plain:
                group["same_text"][0] += turn.get("output_sha") == plain_sha
                group["same_text"][1] += 1
    for g in groups.values():  # the workload's totals are its episodes'
        g["decode_s"], g["tokens"] = (sum(values) for values in zip(*g["by_episode"].values()))
    return groups


def _add_turn(group: dict, turn: dict) -> None:
    """A measured turn's counts and times added to its group's."""
    for key in ("rounds", "committed", "prefill_s", "draft_s", "verify_s"):
        group[key] += turn[key]
    group["draft_kv_bytes"] = max(group["draft_kv_bytes"], turn["draft_kv_bytes"])
    for key in ("proposed", "accepted"):
        group[key] = [a + b for a, b in zip(group[key], turn[key])] if group[key] else list(turn[key])


def _baseline(groups: dict[tuple[str, str], dict], workload: str, method: str) -> dict | None:
    """The fastest plain decoding measured on ``workload`` in the method's engine: ar, or ar:fastest where the methods'
    passes are padded; vllm:ar for a method run in vLLM.  None where none was."""
    plain = [groups[workload, m] for m in parse_method(method).plain_decodings if (workload, m) in groups and groups[workload, m]["tokens"]]
    return min(plain, key=lambda a: a["decode_s"] / a["tokens"], default=None)


def _summary(g: dict, baseline: dict | None) -> dict:
    """A group's totals (:func:`_groups`) → its row of statistics, its speedup against ``baseline``'s."""
    per_token = g["decode_s"] / g["tokens"] if g["tokens"] else None
    ar_per_token = baseline["decode_s"] / baseline["tokens"] if baseline else None
    return {
        "tau": g["committed"] / g["rounds"] if g["rounds"] else None,
        "speedup": ar_per_token / per_token if ar_per_token and per_token else None,
        "speedup_interval": speedup_interval(baseline["by_episode"], g["by_episode"]) if baseline else None,
        "tokens_per_s": g["tokens"] / g["decode_s"] if g["decode_s"] else None,
        "draft_ms_per_round": 1000 * g["draft_s"] / g["rounds"] if g["rounds"] else None,
        "verify_ms_per_round": 1000 * g["verify_s"] / g["rounds"] if g["rounds"] else None,
        "prefill_s": g["prefill_s"],
        "acceptance": [a / p if p else None for a, p in zip(g["accepted"] or [], g["proposed"] or [])],
        "proposed_per_round": sum(g["proposed"] or []) / g["rounds"] if g["rounds"] else None,
        "tokens": g["tokens"], "episodes": g["episodes"], "source": g["source"], "drafter": g["drafter"], "origin": g["origin"],
        "draft_kv_bytes": g["draft_kv_bytes"], "tree_responses": g["tree_responses"], "same_text": g["same_text"],
    }


def speedup_interval(plain: dict, method: dict, level: float = 0.9) -> tuple[float, float] | None:
    """The ``level`` bootstrap interval of a workload's speedup: its episodes resampled with replacement, each
    (decode s, tokens) of plain decoding paired with the method's on the same episode (they ran one after the
    other, so a machine that slows for a while slows both).  None with fewer than two shared episodes."""
    shared = sorted(set(plain) & set(method))
    if len(shared) < 2:
        return None
    rng, ratios = random.Random(0), []
    for _ in range(RESAMPLES):
        sample = rng.choices(shared, k=len(shared))
        plain_s, plain_tokens, method_s, method_tokens = (sum(source[e][i] for e in sample) for source in (plain, method) for i in (0, 1))
        if plain_tokens and method_s:
            ratios.append((plain_s / plain_tokens) / (method_s / method_tokens))
    ratios.sort()
    tail = (1 - level) / 2
    return ratios[int(tail * len(ratios))], ratios[min(int((1 - tail) * len(ratios)), len(ratios) - 1)]


def context_bin(tokens: int) -> int:
    """The upper bound of the CONTEXT_BINS bin a context of ``tokens`` falls in (the last bin holds any longer)."""
    return next((b for b in CONTEXT_BINS if tokens <= b), CONTEXT_BINS[-1])


def by_context(results: list[dict]) -> dict[tuple[str, str, int], dict]:
    """(workload, method, context bin upper bound) → the measured turns whose prompt falls in the bin: their count,
    verify rounds, tokens committed, and first draft positions proposed and accepted."""
    cells: dict[tuple[str, str, int], dict] = {}
    for record in results:
        for turn in record["turns"]:
            if "skipped" in turn or not turn["rounds"]:
                continue
            cell = cells.setdefault((record["workload"], record["method"], context_bin(turn["context_tokens"])),
                                    {"turns": 0, "rounds": 0, "committed": 0, "proposed": 0, "accepted": 0})
            cell["turns"] += 1
            cell["rounds"] += turn["rounds"]
            cell["committed"] += turn["committed"]
            cell["proposed"] += turn["proposed"][0] if turn["proposed"] else 0
            cell["accepted"] += turn["accepted"][0] if turn["accepted"] else 0
    return cells


def tau_by_context(results: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """method → [(context bin upper bound, τ of the turns whose context falls in it)], every workload pooled."""
    pooled: dict[str, dict[int, list[int]]] = {}
    for (_, method, bound), cell in by_context(results).items():
        sums = pooled.setdefault(method, {}).setdefault(bound, [0, 0])
        sums[0] += cell["committed"]
        sums[1] += cell["rounds"]
    return {m: [(b, c / r) for b, (c, r) in sorted(bins.items())] for m, bins in pooled.items()}


def within_workload_by_context(results: list[dict]) -> dict[tuple[str, str, int], dict]:
    """:func:`by_context` within each workload of the suites whose contexts span the bins (long-context and agentic),
    for the methods that draft, workloads in the registry's order.  Content and context are not confounded here as in
    the pooled τ vs context: each workload's turns are binned apart."""
    cells = {key: cell for key, cell in by_context(results).items()
             if BY_NAME[key[0]].suite in ("long", "agentic") and not parse_method(key[1]).is_plain}
    return dict(sorted(cells.items(), key=lambda item: (list(BY_NAME).index(item[0][0]), item[0][1], item[0][2])))


# ---------------------------------------------------------------- tables


class Table:
    """Columns and rows of one table; rows are dicts keyed by column name.  It is written through a pandas
    DataFrame (:meth:`frame`): CSV and LaTeX by its writers, Markdown from its rows, JSON with the notes."""

    def __init__(self, name: str, title: str, columns: list[str]):
        self.name, self.title, self.columns, self.rows, self.notes = name, title, columns, [], []

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame([{c: row.get(c, "") for c in self.columns} for row in self.rows], columns=self.columns)

    def write(self, directory: Path) -> None:
        atomic_write_text(directory / f"{self.name}.md", self.markdown())
        atomic_write_text(directory / f"{self.name}.csv", self.frame().to_csv(index=False))
        atomic_write_json(directory / f"{self.name}.json", {"title": self.title, "columns": self.columns, "rows": self.rows, "notes": self.notes})
        atomic_write_text(directory / f"{self.name}.tex", self.latex())

    def markdown(self) -> str:
        """A pipe table from the frame (pandas' own ``to_markdown`` needs ``tabulate``, which a GPU machine's
        python may lack)."""
        frame = self.frame().astype(str)
        lines = [f"### {self.title}", "", "| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(row) + " |" for row in frame.itertuples(index=False)]
        return "\n".join(lines + [""] + [f"- {note}" for note in self.notes]) + "\n"

    def latex(self) -> str:
        caption = self.title.replace("\\", r"\textbackslash{}")
        for special in "&%_#":
            caption = caption.replace(special, "\\" + special)
        return self.frame().to_latex(index=False, escape=True, caption=caption, position="t")


def _cell(value: float | None, digits: int = 2, source: str = "") -> str:
    if value is None:
        return ""
    text = f"{value:.{digits}f}"
    return f"{text} (synthetic)" if source.startswith("synthetic") else text


ROW_KEYS = ["target", "method", "engine", "drafter", "origin", "hardware"]  # origin: release, or the stage that trained the checkpoint


SUITE_TABLES = [  # (name, title, suite, metrics); the paper's numbers are under the same name in paper_results.yaml
    ("table1_general_tau", "Table 1: acceptance length τ on general workloads", "general", ("tau",)),
    ("table2_longbench_v2", "Table 2: speedup and τ on LongBench v2", "long", ("speedup", "tau")),
    ("table3_agentic", "Table 3: speedup and τ on agentic workloads", "agentic", ("speedup", "tau")),
]
SPEEDUP_NOTE = ("speedup = autoregressive decode time per token / the method's (prefill excluded), measured side by side in the "
                "method's engine: vllm:ar for vLLM's methods; in dlite's, the faster of ar and ar:fastest (one token a pass, where "
                "the methods share wider passes)")


def build_tables(results: list[dict], throughput: list[dict], unavailable: dict, target: str, hardware: str) -> list[Table]:
    """Tables 1-3 (a suite's workloads, a column per workload and metric) and Table 4 (throughput), each with the
    paper's published rows, and τ against context within each long-context and agentic workload."""
    stats, paper = aggregate(results), paper_results()
    methods = list(dict.fromkeys(r["method"] for r in results))
    tables = [suite_table(spec, stats, methods, unavailable, target, hardware, paper) for spec in SUITE_TABLES]
    return tables + [throughput_table(throughput, stats, target, hardware, paper), context_table(results, target, hardware)]


def column(workload: str, metric: str, metrics: tuple[str, ...]) -> str:
    """A suite table's column: the workload's title, and the metric where the table has more than one."""
    return f"{BY_NAME[workload].title} {metric if len(metrics) > 1 else ''}".strip()


def suite_table(spec: tuple, stats: dict, methods: list[str], unavailable: dict, target: str, hardware: str, paper: dict) -> Table:
    """One of Tables 1-3: a row per method, then the paper's rows; notes on where each workload's data came from."""
    name, title, suite, metrics = spec
    published = paper.get(name, {})
    paper_workloads = published.get("workloads", [])  # the paper's columns first, then the suite's others
    workloads = paper_workloads + [w.name for w in BY_NAME.values() if w.suite == suite and w.name not in paper_workloads]
    table = Table(name, title, ROW_KEYS + [column(w, m, metrics) for w in workloads for m in metrics])
    for method in methods:
        row = {"target": target, "method": method, "engine": parse_method(method).engine, "drafter": _of(stats, method, "drafter"),
               "origin": _of(stats, method, "origin"), "hardware": hardware}
        for w in workloads:
            cell = stats.get((w, method))
            for m in metrics:
                row[column(w, m, metrics)] = _cell(cell and cell[m], source=cell["source"] if cell else "")
        table.rows.append(row)
    table.rows += paper_rows(published, metrics, paper_workloads, paper.get("setup", {}))
    for w in workloads:
        if w in unavailable.get("workloads", {}):
            table.notes.append(f"{BY_NAME[w].title}: not measured — {unavailable['workloads'][w]}")
        elif any((w, m) in stats for m in methods):  # where every measured workload's data came from
            table.notes.append(f"{BY_NAME[w].title}: {next(stats[w, m]['source'] for m in methods if (w, m) in stats)}")
    table.notes += [f"method {m}: not run — {reason}" for m, reason in unavailable.get("methods", {}).items()] + [SPEEDUP_NOTE]
    return table


def paper_rows(published: dict, metrics: tuple[str, ...], workloads: list[str], setup: dict) -> list[dict]:
    """A suite table's published rows: one per (model, method) of the paper, its ``metrics`` in ``workloads``' columns."""
    rows: dict[tuple[str, str], dict] = {}
    for metric in metrics:
        for model, by_method in (published.get(metric) or {}).items():
            for method, values in by_method.items():
                row = rows.setdefault((model, method), {"target": f"{model} (paper)", "method": method, "engine": setup.get("engine", ""),
                                                        "drafter": "published", "origin": "paper", "hardware": paper_hardware(setup)})
                for w, value in zip(workloads, values):
                    row[column(w, metric, metrics)] = _cell(value)
    return list(rows.values())


def paper_hardware(setup: dict) -> str:
    return f"{setup.get('hardware', '?')} ({setup.get('engine', '?')})"


def throughput_table(throughput: list[dict], stats: dict, target: str, hardware: str, paper: dict) -> Table:
    """Table 4: each method's tokens/s at each concurrency, its speedup against its engine's plain decoding; the paper's rows."""
    table = Table("table4_throughput", "Table 4: throughput vs concurrency", ROW_KEYS + ["workload", "concurrency", "tokens/s", "speedup"])
    plain = {(r["method"], r["concurrency"]): r["tokens_per_s"] for r in throughput if r["method"] == parse_method(r["method"]).plain}
    for r in throughput:
        baseline = plain.get((parse_method(r["method"]).plain, r["concurrency"]))
        speedup = r["tokens_per_s"] / baseline if baseline else None
        table.rows.append({"target": target, "method": r["method"], "engine": parse_method(r["method"]).engine, "drafter": _of(stats, r["method"], "drafter"),
                           "origin": _of(stats, r["method"], "origin"), "hardware": hardware,
                           "workload": BY_NAME[r["workload"]].title, "concurrency": r["concurrency"],
                           "tokens/s": _cell(r["tokens_per_s"], 1), "speedup": _cell(speedup)})
    setup = paper.get("setup", {})
    for model, by_workload in (paper.get("table4_throughput") or {}).items():
        for workload, by_method in by_workload.items():
            for paper_method, levels in by_method.items():
                for level, cell in levels.items():
                    table.rows.append({"target": f"{model} (paper)", "method": paper_method, "engine": setup.get("engine", ""), "drafter": "published",
                                       "origin": "paper", "hardware": paper_hardware(setup),
                                       "workload": BY_NAME[workload].title, "concurrency": level,
                                       "tokens/s": _cell(cell.get("tps"), 0), "speedup": _cell(cell.get("speedup"))})
    table.notes.append("tokens/s over the whole batch, prefill included; every slot serves two requests; speedup against plain decoding "
                       "in the method's engine")
    return table


def context_table(results: list[dict], target: str, hardware: str) -> Table:
    """τ and first-position acceptance against context within each long-context and agentic workload
    (:func:`within_workload_by_context`): a row per (workload, drafting method, context bin)."""
    table = Table("tau_by_context", "τ against context, within each long-context and agentic workload",
                  ["target", "hardware", "workload", "method", "context tokens", "turns", "rounds", "tau", "first-position acceptance"])
    for (workload, method, bound), cell in within_workload_by_context(results).items():
        lower = max((b for b in CONTEXT_BINS if b < bound), default=0)
        table.rows.append({"target": target, "hardware": hardware, "workload": BY_NAME[workload].title, "method": method,
                           "context tokens": f"{lower + 1}–{bound}", "turns": cell["turns"], "rounds": cell["rounds"],
                           "tau": _cell(cell["committed"] / cell["rounds"]),
                           "first-position acceptance": _cell(cell["accepted"] / cell["proposed"] if cell["proposed"] else None)})
    table.notes.append("a turn is binned by its prompt's length (the context its first round drafts at); τ = tokens committed per "
                       "verify round of the bin's turns; first-position acceptance = rounds whose first draft was accepted, of those "
                       "that proposed one; plain decoding left out")
    return table


def _of(stats: dict, method: str, key: str) -> str:
    """A method's ``key`` (drafter, origin) from any of its workloads; the method's name if none was measured."""
    return next((s[key] for (w, m), s in stats.items() if m == method), method)


# ---------------------------------------------------------------- plots and summary


def write_plots(directory: Path, results: list[dict], throughput: list[dict]) -> list[str]:
    """The plots that have data, in ``directory`` → their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = [_tau_plot(plt, results), _workload_context_plot(plt, results), _throughput_plot(plt, throughput), _acceptance_plot(plt, results)]
    written = [_save(figure, directory / name) for figure, name in filter(None, plots)]
    plt.close("all")
    return written


def _tau_plot(plt, results: list[dict]):
    """τ against context, every workload pooled: (figure, file name), or None without data."""
    by_context = tau_by_context(results)
    if not by_context:
        return None
    figure, axis = plt.subplots(figsize=(6, 4))
    for method, points in by_context.items():
        axis.plot([b for b, _ in points], [t for _, t in points], marker="o", label=method)
    axis.set(xlabel="context tokens (bin upper bound)", ylabel="τ (tokens per verify round)", title="τ vs context length")
    _plain_log_ticks(axis, sorted({b for points in by_context.values() for b, _ in points}))
    axis.legend()
    return figure, "tau_vs_context.png"


def _workload_context_plot(plt, results: list[dict]):
    """τ against context within each long-context and agentic workload, a panel each: (figure, file name), or None
    without data."""
    cells = within_workload_by_context(results)
    workloads = list(dict.fromkeys(w for w, _, _ in cells))
    if not workloads:
        return None
    figure, axes = plt.subplots(1, len(workloads), figsize=(4 * len(workloads), 4), squeeze=False)
    for axis, workload in zip(axes[0], workloads):
        for method in dict.fromkeys(m for w, m, _ in cells if w == workload):
            points = [(b, c["committed"] / c["rounds"]) for (w, m, b), c in cells.items() if w == workload and m == method]
            axis.plot([b for b, _ in points], [t for _, t in points], marker="o", label=method)
        axis.set(xlabel="context tokens (bin upper bound)", ylabel="τ", title=BY_NAME[workload].title)
        _plain_log_ticks(axis, sorted({b for w, _, b in cells if w == workload}))
    axes[0][0].legend()
    return figure, "tau_vs_context_by_workload.png"


def _throughput_plot(plt, throughput: list[dict]):
    """Tokens/s against concurrency: (figure, file name), or None without data."""
    if not throughput:
        return None
    figure, axis = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in throughput):
        points = sorted((r["concurrency"], r["tokens_per_s"]) for r in throughput if r["method"] == method)
        axis.plot([c for c, _ in points], [t for _, t in points], marker="o", label=method)
    axis.set(xlabel="concurrency", ylabel="tokens/s", title="throughput vs concurrency")
    _plain_log_ticks(axis, sorted({r["concurrency"] for r in throughput}))
    axis.legend()
    return figure, "throughput_vs_concurrency.png"


def _acceptance_plot(plt, results: list[dict]):
    """Acceptance by draft position, every workload pooled: (figure, file name), or None without data."""
    figure, axis = plt.subplots(figsize=(6, 4))
    for method in dict.fromkeys(r["method"] for r in results):
        proposed = accepted = None
        for record in results:
            if record["method"] != method:
                continue
            for turn in record["turns"]:
                if "skipped" not in turn and turn["proposed"]:
                    proposed = [a + b for a, b in zip(proposed, turn["proposed"])] if proposed else list(turn["proposed"])
                    accepted = [a + b for a, b in zip(accepted, turn["accepted"])] if accepted else list(turn["accepted"])
        if proposed:
            axis.plot(range(1, len(proposed) + 1), [a / p if p else 0 for a, p in zip(accepted, proposed)], marker="o", label=method)
    if not axis.lines:
        return None
    axis.set(xlabel="draft position", ylabel="acceptance rate", title="acceptance by draft position (all workloads)")
    axis.legend()
    return figure, "acceptance_by_position.png"


def _plain_log_ticks(axis, values: list[int]) -> None:
    """A log x axis labelled only at ``values``, as plain numbers (1k for 1024): no minor labels to collide."""
    from matplotlib.ticker import NullLocator

    axis.set_xscale("log")
    axis.set_xticks(values, [f"{v // 1024}k" if v >= 1024 and v % 1024 == 0 else str(v) for v in values])
    axis.xaxis.set_minor_locator(NullLocator())
    if len(values) == 1:  # a log axis around one point
        axis.set_xlim(values[0] / 2, values[0] * 2)


def _save(figure, path: Path) -> str:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return path.name


def write_report(directory: Path, results: list[dict], throughput: list[dict], unavailable: dict, target: str, hardware: str) -> list[str]:
    """Tables, plots and summary.md in ``directory`` from a plan's measurements (bench.py's records); → the files written."""
    tables = build_tables(results, throughput, unavailable, target, hardware)
    for table in tables:
        table.write(directory)
    plots = write_plots(directory, results, throughput)
    stats = aggregate(results)
    detail = Table("details", "All workloads, every measurement", ["workload", "method", "source", "episodes", "tokens", "tau", "speedup",
                                                                    "speedup 90% interval", "tokens/s", "proposed/round", "draft ms/round", "verify ms/round", "prefill s",
                                                                    "draft KV MB", "suffix tree", "text as plain", "acceptance"])
    for (workload, method), s in sorted(stats.items()):
        detail.rows.append({"workload": workload, "method": method, "source": s["source"], "episodes": s["episodes"], "tokens": s["tokens"],
                            "tau": _cell(s["tau"]), "speedup": _cell(s["speedup"]),
                            "speedup 90% interval": "–".join(_cell(v) for v in s["speedup_interval"]) if s["speedup_interval"] else "",
                            "tokens/s": _cell(s["tokens_per_s"], 1),
                            "proposed/round": _cell(s["proposed_per_round"]),
                            "draft ms/round": _cell(s["draft_ms_per_round"], 1), "verify ms/round": _cell(s["verify_ms_per_round"], 1),
                            "prefill s": _cell(s["prefill_s"], 1), "draft KV MB": _cell(s["draft_kv_bytes"] / 1e6),
                            "suffix tree": f"{min(s['tree_responses'])}–{max(s['tree_responses'])}" if s["tree_responses"] else "",
                            "text as plain": "{}/{}".format(*s["same_text"]) if s["same_text"][1] else "",
                            "acceptance": " ".join(_cell(a) or "-" for a in s["acceptance"])})
    detail.notes.append("speedup 90% interval: the workload's episodes resampled (bootstrap), each method's time paired with plain "
                        "decoding's on the same episode; where it spans 1.00 the episodes cannot tell the method from plain decoding")
    detail.notes.append("prefill s: the target's own work, shared: a method reuses the prompt keys/values an earlier method "
                        "left on the same episode, except history drafters, which need every prompt position's features")
    detail.notes.append("text as plain: the turns on which the method wrote the text its engine's plain decoding wrote (ar, vllm:ar), "
                        "of those both decoded; greedy in float32 every turn, below float32 the same only up to rounding "
                        "(decode.identical_text makes it every turn)")
    detail.notes.append("suffix tree: the earlier responses suffix decoding's global tree held as an episode began (the workload's "
                        "earlier episodes, every turn; then it also holds the episode's own earlier turns), fewest–most; blank where it "
                        "held none (vLLM's runs, or suffix.max_cached_requests 0)")
    detail.write(directory)
    lines = [f"# dlite bench: {target} on {hardware}", ""]
    lines += [f"- [{t.title}]({t.name}.md) ([csv]({t.name}.csv), [json]({t.name}.json), [tex]({t.name}.tex))" for t in tables + [detail]]
    lines += [f"- ![{p}]({p})" for p in plots]
    lines += ["", *[table.markdown() for table in tables]]
    atomic_write_text(directory / "summary.md", "\n".join(lines))
    return [f"{t.name}.{ext}" for t in tables + [detail] for ext in ("md", "csv", "json", "tex")] + plots + ["summary.md"]

