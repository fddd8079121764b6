"""The ``dlite`` command line: one subcommand per pipeline stage, plus helpers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from .core.config import DEFAULT_TARGET, Config, load_config
from .core.errors import DliteError

# What a chat request without max_tokens may write.  A slot reserves KV cache for its prompt and this many
# tokens; the room the context leaves (≈ 40 k for Qwen3) made one such request reserve it on every slot.
DEFAULT_MAX_TOKENS = 2048

app = typer.Typer(
    help="DLite history-free speculative decoding: regenerate data, train drafters, serve and benchmark them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: each value shown by its name (N, PATH, LIST), not typer's type tags
    context_settings={"max_content_width": 120},  # the terminal's width, up to 120 columns
)
console = Console(stderr=True, highlight=False)  # messages and progress; stdout is left for results

TargetOption = Annotated[
    str,
    typer.Option("--target", "-t", metavar="NAME", help="Config name in configs/ (smollm2-135m, micro, qwen3-4b, qwen3-8b) or a YAML path."),
]
RunDirOption = Annotated[Optional[Path], typer.Option("--run-dir", metavar="DIR", help="Run directory (default: runs/<target>).")]
SetOption = Annotated[
    Optional[list[str]], typer.Option("--set", metavar="KEY=VALUE", help="Override a config value: section.key=value (repeatable).")
]
DrafterOption = Annotated[
    str, typer.Option(metavar="NAME", help="dlite, history, parallel, scratch (the run's exports), ngram, suffix, none, a drafter directory "
                           "(dlite's, or the public DLite release's format) or a hub id; "
                           "NAME+ngram adds prompt lookup, NAME+suffix suffix decoding, NAME:fixed proposes all K tokens every round.")
]
ForceOption = Annotated[bool, typer.Option("--force", help="Discard a stage made with a different config and redo it.")]
EngineOption = Annotated[Optional[str], typer.Option("--engine", metavar="ENGINE", help="auto, vllm or dlite: decode in vLLM (the vllm extra, with dlite's "
                                                     "plugin) or in dlite's own engine; auto takes vLLM where it is installed "
                                                     "(default: decode.engine of the config).")]


def log(message: str) -> None:
    console.print(message, markup=False, soft_wrap=True)  # a long line stays one line in a log


def _load(target: str, overrides: list[str] | None) -> Config:
    config = load_config(target, overrides or [])  # a bad config is refused before the libraries load
    _quiet_libraries()
    return config


def _run_dir(config: Config, run_dir: Path | None) -> Path:
    return run_dir if run_dir is not None else Path("runs") / config.name


def _quiet_libraries() -> None:
    """Our own progress bars and messages replace the libraries' per-file bars and warnings (once the torch
    extensions transformers would import are known to load)."""
    from .core.devices import check_torch_extensions

    check_torch_extensions()
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@app.command("prepare-target")
def prepare_target_command(target: TargetOption = DEFAULT_TARGET, set_: SetOption = None) -> None:
    """Materialise the target model as a plain Hugging Face checkpoint (stages also do this when needed)."""
    from .models.targets import prepare_target

    config = _load(target, set_)
    prepared = prepare_target(config.target, log)
    log(f"target {prepared.name} is ready at {prepared.path} (fingerprint {prepared.fingerprint})")
    print(prepared.path)


@app.command()
def regen(
    target: TargetOption = DEFAULT_TARGET,
    run_dir: RunDirOption = None,
    set_: SetOption = None,
    backend: Annotated[Optional[str], typer.Option(metavar="NAME", help="hf (transformers generate), dlite (dlite's own engine), openai (a server) or sglang (offline engine).")] = None,
    base_url: Annotated[Optional[str], typer.Option(metavar="URL", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1.")] = None,
    concurrency: Annotated[int, typer.Option(metavar="N", min=1, help="Requests in flight with the openai backend.")] = 16,
    model: Annotated[Optional[str], typer.Option(metavar="NAME", help="Model name on the server (default: its first model).")] = None,
    limit: Annotated[Optional[int], typer.Option(metavar="N", min=1, help="Use only the first N prompts of the plan.")] = None,
    shard: Annotated[str, typer.Option(metavar="I/N", help="Run worker i of n: i/n. Workers share the run directory.")] = "0/1",
    temperature: Annotated[Optional[float], typer.Option(metavar="T", help="Sampling temperature (0 = greedy).")] = None,
    top_p: Annotated[Optional[float], typer.Option(metavar="P", help="Nucleus sampling mass.")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(metavar="N", help="Most new tokens per response.")] = None,
    thinking: Annotated[Optional[bool], typer.Option("--thinking/--no-thinking", help="Qwen3 thinking mode.")] = None,
    reuse_from: Annotated[Optional[Path], typer.Option(metavar="DIR", help=(
        "Take the records another run's regen already wrote for prompts of this plan instead of generating them again"
        " (the same target, sampling and max-new-tokens; a mix that grows regenerates only what is new), with the target"
        " features its engine kept of them."))] = None,
    force: ForceOption = False,
) -> None:
    """Regenerate the training responses with the target model (resumable, shardable)."""
    from .training.regen import parse_shard, run_regen

    flags = {
        "regen.backend": backend,
        "regen.temperature": temperature,
        "regen.top_p": top_p,
        "regen.max_new_tokens": max_new_tokens,
        "target.thinking": thinking,
    }
    config = _load(target, (set_ or []) + [f"{key}={value}" for key, value in flags.items() if value is not None])
    run_regen(
        config,
        _run_dir(config, run_dir),
        limit=limit,
        shard=parse_shard(shard),
        base_url=base_url,
        concurrency=concurrency,
        model_name=model,
        force=force,
        reuse_from=reuse_from,
        log=log,
    )


def _train(stage: str, target: str, run_dir: Path | None, set_: list[str] | None, force: bool) -> None:
    from .training.train import run_stage

    config = _load(target, set_)
    run_stage(config, _run_dir(config, run_dir), stage, force=force, log=log)


@app.command("train-teacher")
def train_teacher(target: TargetOption = DEFAULT_TARGET, run_dir: RunDirOption = None, set_: SetOption = None, force: ForceOption = False) -> None:
    """Stage 0: train the history-aware teacher (full draft history, token CE)."""
    _train("train-teacher", target, run_dir, set_, force)


@app.command()
def warmup(target: TargetOption = DEFAULT_TARGET, run_dir: RunDirOption = None, set_: SetOption = None, force: ForceOption = False) -> None:
    """Stage 1: distil the frozen teacher into the history-free DLite drafter (forward KL)."""
    _train("warmup", target, run_dir, set_, force)


@app.command()
def stable(
    target: TargetOption = DEFAULT_TARGET,
    run_dir: RunDirOption = None,
    set_: SetOption = None,
    force: ForceOption = False,
    from_scratch: Annotated[bool, typer.Option("--from-scratch", help="Single-stage baseline: skip teacher and warmup (Figure 5).")] = False,
    parallel: Annotated[bool, typer.Option("--parallel", help="Single-stage, without the sequential head: the pure-parallel ablation.")] = False,
) -> None:
    """Stage 2: train DLite against the target (λ_CE·CE + λ_TV·TV); its export is the drafter to serve."""
    _train("stable-parallel" if parallel else "stable-scratch" if from_scratch else "stable", target, run_dir, set_, force)


@app.command()
def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", metavar="TEXT", help="The user message ('-' reads it from stdin).")],
    target: TargetOption = DEFAULT_TARGET,
    run_dir: RunDirOption = None,
    set_: SetOption = None,
    drafter: DrafterOption = "dlite",
    max_new_tokens: Annotated[int, typer.Option(metavar="N", min=1, help="Most new tokens.")] = 128,
    temperature: Annotated[float, typer.Option(metavar="T", min=0, help="Sampling temperature (0 = greedy).")] = 0.0,
    top_p: Annotated[float, typer.Option(metavar="P", min=0, max=1, help="Nucleus sampling mass.")] = 1.0,
    top_k: Annotated[int, typer.Option(metavar="K", min=0, help="Sample among the k likeliest tokens (0 = all).")] = 0,
    seed: Annotated[Optional[int], typer.Option(metavar="N", help="Seed for sampling.")] = None,
    stop: Annotated[Optional[list[str]], typer.Option(metavar="TEXT", help="Stop string (repeatable).")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Feed the prompt as it is, without the chat template.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (text, tau and all statistics).")] = False,
    engine: EngineOption = None,
) -> None:
    """Decode one prompt with speculative decoding and print the text and its acceptance statistics."""
    from .decoding.requests import SamplingParams
    from .serve.generate import generate as run_generate

    config = _load(target, set_)
    text = sys.stdin.read() if prompt == "-" else prompt
    params = SamplingParams(max_new_tokens, temperature, top_p, top_k, tuple(stop or ()), seed)
    run_generate(config, _run_dir(config, run_dir), text, drafter, params, raw, as_json, engine, log)


@app.command()
def serve(
    target: TargetOption = DEFAULT_TARGET,
    run_dir: RunDirOption = None,
    set_: SetOption = None,
    drafter: DrafterOption = "dlite",
    host: Annotated[str, typer.Option("--host", metavar="HOST", help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", metavar="PORT", min=0, max=65535, help="TCP port.")] = 8000,
    max_batch: Annotated[Optional[int], typer.Option(metavar="N", min=1, help="Requests decoded together (default: decode.max_batch).")] = None,
    max_queue: Annotated[int, typer.Option(metavar="N", min=0, help="Requests allowed to wait for a slot; beyond that, 429.")] = 64,
    max_context: Annotated[Optional[int], typer.Option(metavar="N", min=16, help="Longest prompt + completion in tokens (default: the target's).")] = None,
    max_tokens: Annotated[int, typer.Option(metavar="N", min=1, help="Completion tokens of a chat request that names no max_tokens "
                                            "(at most the room its prompt leaves): what its slot reserves KV cache for.")] = DEFAULT_MAX_TOKENS,
    engine: Annotated[Optional[str], typer.Option("--engine", metavar="ENGINE", help="auto, vllm or dlite (default: decode.engine of the config). vllm: "
                                                  "vLLM's OpenAI server drafting with the same drafter (the vllm extra); what differs there: "
                                                  "beyond --max-queue it answers 503 (dlite's: 429), /metrics holds vLLM's own series, and "
                                                  "replies carry no dlite acceptance statistics. auto: vLLM where it is installed and can "
                                                  "draft with the drafter, else dlite's own server.")] = None,
) -> None:
    """Serve the target with speculative decoding behind an OpenAI-compatible API (/v1/completions, /v1/chat/completions)."""
    from .serve.serve import serve as run_server

    config = _load(target, set_)
    run_server(config, _run_dir(config, run_dir), drafter, host, port, max_batch, max_queue, max_context, max_tokens, engine, log)


@app.command()
def bench(
    target: TargetOption = DEFAULT_TARGET,
    run_dir: RunDirOption = None,
    set_: SetOption = None,
    suite: Annotated[str, typer.Option("--suite", metavar="SUITE", help="general, long, agentic or all.")] = "all",
    workload: Annotated[Optional[str], typer.Option(metavar="NAME", help="Run only this workload (e.g. gsm8k, swe_bench).")] = None,
    methods: Annotated[Optional[str], typer.Option(metavar="LIST", help="Comma-separated: ar, dlite, history, parallel, scratch, ngram, suffix, drafter directories or hub ids; "
                                               "NAME+ngram / NAME+suffix pairs a drafter with prompt lookup / suffix decoding, NAME:fixed proposes all K every round; "
                                               "vllm:NAME measures NAME in vLLM (vllm:suffix is vLLM's own suffix method) "
                                               "(default: bench.methods of the config, all of these).")] = None,
    limit: Annotated[Optional[int], typer.Option(min=1, metavar="N", help="Episodes per workload (default: bench.limit of the config).")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(min=1, metavar="N", help="Most new tokens per assistant turn (default: bench.max_new_tokens).")] = None,
    temperature: Annotated[float, typer.Option(min=0, metavar="T", help="Sampling temperature (0 = greedy: every method writes the same text).")] = 0.0,
    concurrency: Annotated[Optional[str], typer.Option(metavar="LIST", help="Concurrency levels for Table 4, comma-separated, '' to skip (default: bench.concurrency).")] = None,
    data: Annotated[Optional[list[str]], typer.Option(metavar="WORKLOAD=PATH", help="Where a workload's data is: a file, a directory or a hub id (repeatable).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Measure the whole plan again instead of reusing earlier measurements.")] = False,
    engine: Annotated[Optional[str], typer.Option("--engine", metavar="ENGINE", help="auto, vllm or dlite (default: decode.engine of the config): where the "
                                                  "methods run; vllm:NAME always runs in vLLM. In vLLM, a history drafter (which vLLM cannot "
                                                  "run) stays in dlite's engine. The config's bench.compare methods also run in the other "
                                                  "engine (in vLLM only where it is installed). auto: vllm where it is installed.")] = None,
) -> None:
    """Benchmark methods side by side and write the paper's Tables 1-4, plots and summary.md.

    Every measurement is kept under a key of what determines it, so a later plan in the same run directory
    (another suite, more episodes, other methods) measures only what is missing; interrupted, it resumes.
    """
    from .bench.bench import Bench, plan_from

    config = _load(target, set_)
    plan = plan_from(config, suite, workload, methods, limit, max_new_tokens, temperature, concurrency, data or [],
                     engine, log)
    Bench(config, _run_dir(config, run_dir), plan, log).run(force=force)


@app.command()
def sessions(
    target: TargetOption = DEFAULT_TARGET,
    run_dir: RunDirOption = None,
    set_: SetOption = None,
    methods: Annotated[Optional[str], typer.Option(metavar="LIST", help="Comma-separated, as bench names them: ar (plain decoding), dlite, ngram, suffix, "
                                               "dlite+suffix, a drafter directory …; vllm:NAME serves NAME in vLLM (default: sessions.methods).")] = None,
    concurrency: Annotated[Optional[str], typer.Option(metavar="LIST", help="Sessions at once, comma-separated (default: sessions.concurrency).")] = None,
    count: Annotated[Optional[int], typer.Option("--sessions", min=1, metavar="N", help="Sessions, taken in turn from the agentic workloads (default: sessions.sessions).")] = None,
    turns: Annotated[Optional[int], typer.Option(min=1, metavar="N", help="Turns per session, at most (default: sessions.turns).")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(min=1, metavar="N", help="Tokens per reply (default: sessions.max_tokens).")] = None,
    url: Annotated[Optional[str], typer.Option(metavar="URL", help="Measure this running OpenAI-compatible server (e.g. http://127.0.0.1:8000) "
                                         "instead of starting dlite's; --methods then only names its rows, and its caches carry from one run to the next.")] = None,
    tool_choice: Annotated[Optional[str], typer.Option(metavar="auto|required", help="Offer each session's tools (BFCL-v3's and ToolTalk's, "
                                                 "those its system prompt describes) as OpenAI tools with this tool_choice, and count the replies that "
                                                 "are valid calls of them (default: the messages alone).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Measure every run again instead of reusing earlier ones.")] = False,
) -> None:
    """Agent sessions end to end through a server, prefill included: episodes of the agentic workloads replayed turn by
    turn, each turn resending the whole conversation, N sessions C at a time. Writes RUN/sessions/sessions.md (csv, json,
    tex): per method and concurrency, completion tokens/s and speedup, time to first token, inter-token latency, cached
    prompt tokens and text identity with plain decoding.

    Each run gets a fresh `dlite serve` as a user starts it (decode.max_batch slots; vllm:NAME: vLLM's server), so no run is
    served from another's caches; interrupted, the command resumes with the run it was in.
    """
    from .bench.bench import method_names
    from .bench.sessions import SessionsPlan, run_sessions

    if tool_choice not in (None, "auto", "required"):
        raise DliteError(f"--tool-choice must be auto or required, got {tool_choice!r}")
    config = _load(target, set_)
    defaults = config.sessions
    plan = SessionsPlan(method_names(methods, defaults.methods), _numbers("--concurrency", concurrency, int) or defaults.concurrency,
                        count or defaults.sessions, turns or defaults.turns, max_tokens or defaults.max_tokens, url.rstrip("/") if url else None,
                        tool_choice)
    run_sessions(config, target, _run_dir(config, run_dir), set_ or [], plan, force, log)


@app.command()
def ablate(target: TargetOption = DEFAULT_TARGET, run_dir: RunDirOption = None, set_: SetOption = None) -> None:
    """The paper's ablations around the config's drafter (its ablations section): train every variant, bench them side
    by side, and write Table 5 (design space) and Figure 5 (held-out τ during training) to RUN/ablations/.

    Each variant is a run directory under RUN/ablations/ that reads the run's regen (run `dlite regen` first); every
    one resumes, so run the command again after an interruption.
    """
    from .bench.ablations import Study

    config = _load(target, set_)
    Study(target, set_ or [], _run_dir(config, run_dir), log).run()


@app.command()
def export(
    out: Annotated[Path, typer.Option(metavar="DIR", help="The directory to write (replaced if it exists).")],
    target: TargetOption = DEFAULT_TARGET,
    run_dir: RunDirOption = None,
    set_: SetOption = None,
    drafter: Annotated[str, typer.Option(metavar="NAME", help="dlite, history, parallel, scratch (the run's exports), a drafter directory or a hub id.")] = "dlite",
    format_: Annotated[str, typer.Option("--format", metavar="FORMAT", help="dlite_v1: the public DLite release's DLiteDraftModel.")] = "dlite_v1",
) -> None:
    """Write a drafter in the public DLite release's format, for its engine and the tools built on it.

    The drafter must use the release's conventions (the Qwen3 configs train in them); one that uses a
    dlite-only option (learned placeholders, a reduced draft vocabulary, ...) is refused with the reason.
    """
    from .decoding.checkpoints import export_drafter

    config = _load(target, set_)
    export_drafter(config, _run_dir(config, run_dir), drafter, out, format_, log)


@app.command()
def profile(
    target: TargetOption = DEFAULT_TARGET,
    set_: SetOption = None,
    contexts: Annotated[Optional[str], typer.Option(metavar="LIST", help="Context lengths, comma-separated (default: 1024,8192,32768 on a GPU, 512,2048 on a CPU).")] = None,
    batches: Annotated[Optional[str], typer.Option(metavar="LIST", help="Batch sizes, comma-separated (default: 1,16,64 on a GPU, 1,4 on a CPU).")] = None,
    widths: Annotated[Optional[str], typer.Option(metavar="LIST", help="Tokens per target pass, comma-separated (default: 1,2,3,4,K+1,2(K+1)).")] = None,
    tau: Annotated[Optional[str], typer.Option(metavar="LIST", help="τ values to predict the speedup at (default: the paper's Table 3 τ).")] = None,
    repeats: Annotated[Optional[int], typer.Option(metavar="N", min=1, help="Timed repeats per measurement; the median is reported (default: 15 on a GPU, 5 on a CPU).")] = None,
    train_steps: Annotated[Optional[int], typer.Option(metavar="N", min=0, help="Timed training steps per stage (0 skips training; default 3).")] = None,
    out: Annotated[Optional[Path], typer.Option(metavar="PATH", help="Where to write the JSON (default: runs/<target>/profile-<device>.json).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the JSON instead of the tables.")] = False,
    memory: Annotated[Optional[float], typer.Option(metavar="GB", min=0.001, help="Only print every stage's memory plan for a GPU with this many GB "
                                                    "free, and exit non-zero if one does not fit (nothing is timed).")] = None,
    engine: Annotated[Optional[str], typer.Option("--engine", metavar="ENGINE", help="auto, vllm or dlite (default: decode.engine of the config): with vLLM, "
                                                  "the same passes are also timed inside vLLM, with its host and draft time per step.")] = None,
) -> None:
    """Time a decode round and a training step at the target's real shapes (its own weights where they are on this
    machine, a hub id's random: no download), after every stage's memory plan: what it holds at its peak on this
    device, traced before anything loads."""
    from .bench.profile import print_memory_plans, run_profile

    config = _load(target, set_)
    if memory is not None:
        return print_memory_plans(config, memory, log)
    choices = {"contexts": _numbers("--contexts", contexts, int), "batches": _numbers("--batches", batches, int),
               "widths": _numbers("--widths", widths, int), "taus": _numbers("--tau", tau, float), "repeats": repeats, "train_steps": train_steps}
    run_profile(config, choices, out, as_json, engine, log)


def _numbers(option: str, text: str | None, kind):
    """'1,4,16' → [1, 4, 16]; None stays None; anything else is a one-sentence error."""
    if text is None:
        return None
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise DliteError(f"{option} must be comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise DliteError(f"{option} must list positive numbers, got {text!r}")
    return values


@app.command("run")
def run_command(
    pipeline: Annotated[str, typer.Argument(metavar="PIPELINE", hidden=True)],  # described in the docstring: help would tag it <str>
    run_dir: RunDirOption = None,
    set_: SetOption = None,
    first: Annotated[Optional[str], typer.Option("--from", metavar="STAGE", help="Start at this stage (the earlier ones are not checked).")] = None,
    last: Annotated[Optional[str], typer.Option("--until", metavar="STAGE", help="Stop after this stage.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print each stage's command line and run nothing.")] = False,
) -> None:
    """Run a pipeline's stages in order, skipping finished ones and resuming a partial one; print each stage's share of the time.

    PIPELINE is a name in pipelines/ (smollm2-135m, micro, qwen3-4b, qwen3-8b) or a YAML path.
    """
    from .core.config import load_pipeline
    from .pipeline import run_pipeline, timing_table

    chosen = load_pipeline(pipeline)
    config = _load(chosen.target, set_)
    directory = _run_dir(config, run_dir)
    log(f"pipeline {chosen.name}: {chosen.description}" if chosen.description else f"pipeline {chosen.name}")
    timings = run_pipeline(chosen, typer.main.get_command(app), directory, set_ or [], first, last, dry_run, log)
    if dry_run:
        return
    console.print(timing_table(chosen.name, timings, directory))
    for stage in chosen.stages:
        summary = directory / stage.name / "summary.md"
        if summary.is_file():
            log(f"tables, plots and summary: {summary}")


@app.command()
def status(
    target: TargetOption = DEFAULT_TARGET,
    run_dir: RunDirOption = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also say what produced each stage: its config and target hashes, and when.")] = False,
) -> None:
    """Show each stage of a run directory: done, partial (with progress) or missing, its size and time."""
    from .core.artifacts import status_lines

    Console().print(*status_lines(_run_dir(load_config(target), run_dir), verbose))


@app.command()
def precision(
    forget: Annotated[bool, typer.Option("--forget", help="Delete every remembered decision: each is measured again when next needed.")] = False,
) -> None:
    """List the precision decisions this machine remembers (auto dtypes and autocast): each option's median time,
    the rounds, their spread, the other processes' load while timing, and whether it will be measured again."""
    from .core.precision import decisions_table, records_dir
    from .core.precision import forget as forget_all

    if forget:
        log(f"forgot {forget_all()} precision decisions in {records_dir()}")
        return
    Console().print(decisions_table())


def main() -> None:
    try:
        app()
    except DliteError as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        console.print("interrupted; run the same command again to resume")
        sys.exit(130)
