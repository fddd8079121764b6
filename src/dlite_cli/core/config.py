"""Typed configuration: one schema with sections, loaded and validated in one place.

A config is a YAML file (``configs/<target>.yaml`` or any path) with the sections
``target``, ``regen``, ``drafter``, ``train``, ``decode``, ``bench`` and ``ablations``.  Every key is checked against
the dataclasses below: an unknown key, a wrong type or an impossible value is a
one-sentence :class:`DliteError` naming the file and the key.  ``--set
section.key=value`` overrides are applied to the raw YAML before validation, so
they are checked exactly like the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .errors import DliteError

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # src/dlite_cli (configs/ and pipelines/ sit beside it in a wheel)
DEFAULT_TARGET = "smollm2-135m"


def _checked(default: Any = dataclasses.MISSING, *, check, says: str):
    """A dataclass field whose value must satisfy ``check``; ``says`` completes 'must ...'."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"check": check, "says": says})
    return field(default=default, metadata={"check": check, "says": says})


def positive(default: Any = dataclasses.MISSING):
    return _checked(default, check=lambda v: v > 0, says="be > 0")


def non_negative(default: Any = dataclasses.MISSING):
    return _checked(default, check=lambda v: v >= 0, says="be >= 0")


def fraction(default: Any = dataclasses.MISSING):
    return _checked(default, check=lambda v: 0 <= v <= 1, says="be between 0 and 1")


@dataclass
class MicroConfig:
    """A tiny randomly initialised target for tests, built from this section and a seed."""

    family: Literal["llama", "qwen3"] = "llama"
    vocab_size: int = positive(512)
    hidden_size: int = positive(64)
    num_layers: int = positive(4)
    num_heads: int = positive(4)
    num_kv_heads: int = positive(2)
    intermediate_size: int = positive(128)
    max_position_embeddings: int = positive(4096)
    seed: int = 0


DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass
class TargetConfig:
    """The target model: a built-in name (``smollm2-135m``, ``micro``), a hub id or a local path."""

    model: str
    # auto: bfloat16 on a GPU; on a CPU whichever of float32 and bfloat16 does the stage's work at least 10 % faster
    # in interleaved timings, else float32 (precision.py): batched passes for regen and the feature pass, a decode
    # round for decoding
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    # Where every stage runs the target and the drafter: auto (CUDA when available), cpu, cuda, cuda:N.
    # Under `accelerate launch` each process uses its own GPU and only cpu vs cuda is taken from here.
    device: str = _checked("auto", check=lambda v: DEVICE_PATTERN.fullmatch(v) is not None, says="be auto, cpu, cuda or cuda:N")
    thinking: bool = False  # Qwen3's enable_thinking in the chat template
    micro: MicroConfig = field(default_factory=MicroConfig)

    def identity(self) -> dict:
        """What determines the target's outputs, for stage hashes: everything but where it runs."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "device"}


PromptSourceName = Literal["open-perfectblend", "nemotron-v2", "sharegpt", "stdlib-code", "bfcl-v3", "tooltalk", "tau2-airline", "swe-stdlib"]


@dataclass
class SourceConfig:
    """One prompt source and how many prompts to take from it."""

    name: PromptSourceName
    count: int = positive()
    path: str | None = None  # hub id or local file/dir; None = the source's default
    # regenerate: the target writes the response (the paper's data).  original: the response the source
    # already has (ShareGPT's answer, the stdlib function's own code) is kept as it is and the target only
    # reads it, teacher-forced, at prefill speed; its labels are then the target's own next tokens,
    # never the text's.  A later source skips the prompts an earlier one took.
    responses: Literal["regenerate", "original"] = "regenerate"
    # its prompts (a trace's first turn) longer than this are skipped; None: regen.max_prompt_tokens.  Agent traces
    # begin with long system prompts (tool documentation) and go on up to regen.max_length
    max_prompt_tokens: int | None = None


@dataclass
class RegenConfig:
    """``dlite regen``: the target rewrites the responses to these prompts."""

    sources: list[SourceConfig]
    # hf: transformers' generate on padded batches; dlite: dlite's own engine on the same batches (no padding, a
    # finished row leaves the pass); openai: any OpenAI-compatible server; sglang: SGLang's offline engine (GPUs)
    backend: Literal["hf", "dlite", "openai", "sglang"] = "hf"
    temperature: float = non_negative(0.0)
    top_p: float = _checked(1.0, check=lambda v: 0 < v <= 1, says="be in (0, 1]")
    max_new_tokens: int = positive(4096)
    max_length: int = positive(4096)  # prompt + response tokens
    max_prompt_tokens: int = positive(2048)  # longer prompts are skipped, with the reason
    batch_size: int = positive(32)  # prompts per generate call (hf, sglang)
    chunk_size: int = positive(512)  # prompts per output shard; the unit of --shard
    seed: int = 0


@dataclass
class DrafterConfig:
    """The DLite drafter (DESIGN.md §1)."""

    num_target_layers: int = positive(12)  # S context slots
    draft_tokens: int = positive(7)  # K proposals per round
    num_layers: int = positive(5)  # N backbone layers
    head_rank: int = positive(320)  # R of the sequential head
    sequential_head: bool = True
    composition: Literal["sequence", "feature"] = "sequence"
    head_init: Literal["random", "target-svd"] = "random"  # target-svd: rank-R SVD of the target's LM head
    # The head scores only the N most frequent tokens of the training responses (EAGLE-3's reduced
    # vocabulary); a token outside them is never proposed.  0 = the target's whole vocabulary.
    draft_vocab: int = non_negative(0)
    # Conventions (model.py, release.py).  dlite's own, or those of the public DLite release (DAI-System/DLite,
    # "dlite_v1"), which `dlite export --format dlite_v1` needs: layers release, context_position 0, a mask token.
    layers: Literal["even", "release"] = "even"  # release: 0, 1, evenly spaced, L−2 and the final-normed last layer
    context_position: int = _checked(-1, check=lambda v: v in (-1, 0), says="be -1 (the pivot before the anchor) or 0 (the release's)")
    mask_token_id: int = _checked(-1, check=lambda v: v >= -1, says="be -1 (learned placeholders) or a token id")
    anchor_group: int = positive(1)  # G: the anchor and the G − 1 tokens before it are real-token queries


@dataclass
class TrainConfig:
    """The three training stages (paper App. A.1)."""

    lr: float = positive(4e-4)
    weight_decay: float = non_negative(0.0)
    grad_clip: float = positive(1.0)
    global_batch: int = positive(32)  # sequences per optimizer step, over all processes
    micro_batch: int = positive(4)  # sequences per forward pass of one process (the rest is accumulated)
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_ratio: float = fraction(0.04)
    teacher_window: int = _checked(-1, check=lambda v: v == -1 or v >= 0, says="be -1 (full history) or >= 0")
    teacher_epochs: int = positive(8)
    warmup_epochs: int = positive(2)
    stable_epochs: int = positive(6)
    # warmup: stage 2 starts from stage 1, after the teacher (the paper's schedule); scratch: from the
    # drafter's own initialisation, stage 2 alone (what measures best where compute is short)
    stable_init: Literal["warmup", "scratch"] = "warmup"
    gamma: float = positive(4.0)
    lambda_ce: float = non_negative(0.1)
    lambda_tv: float = non_negative(1.0)
    # each stage's loss, by its name in training/losses.py: the teacher's CE on the regenerated tokens, warmup's forward
    # KL to the frozen teacher, and stage 2's (and the single-stage drafters') λ_CE · CE + λ_TV · TV
    teacher_loss: str = "ce"
    warmup_loss: str = "kl"
    stable_loss: str = "stable"
    max_length: int = positive(4096)
    anchors_per_sample: int = positive(512)
    features: Literal["online", "cached"] = "online"
    # The drafter's forward and backward under autocast (weights and optimizer stay float32).  auto: what
    # `accelerate launch` was configured with; else bf16 on a GPU, and on a CPU whichever of a bf16-autocast and
    # a float32 training step is clearly the faster here, else no autocast (train.mixed_precision, precision.py).
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    target_top_k: int = positive(32)  # p^T kept as its top-k (the TV loss is exact for that truncation)
    target_batch: int = positive(8)  # sequences per no-grad target pass
    eval_samples: int = positive(32)  # regenerated sequences held out for the simulated tau
    checkpoint_every: int = positive(50)  # optimizer steps between checkpoints (and simulated-tau evaluations)
    seed: int = 0


@dataclass
class DecodeConfig:
    """The speculative-decoding engine (``generate``, ``bench``, ``serve``); never changes what was trained."""

    # The drafter only proposes, so its precision cannot change the output, only the time.  auto: bfloat16 on a
    # GPU; on a CPU whichever of float32 and bfloat16 drafts a round clearly faster here, else float32
    # (precision.py).  With AVX-512 BF16, bfloat16 took a smollm2-135m round from 39 to 22 ms (same tau).
    draft_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # How a decode round runs (outputs are the same on every path):
    #   eager   shapes follow the batch (rows, tokens in the pass, context): the reference, fastest on a CPU
    #   static  fixed shapes: rows padded to a bucket (1, 2, 4, … 64), the whole allocated KV cache
    #           attended under a mask built on the device, one host read per round
    #   graphs  static, each (bucket, width) target pass and the DLite draft round captured as a CUDA graph
    #   auto    graphs on CUDA; on a CPU eager (static with identical_text below float32)
    path: Literal["auto", "eager", "static", "graphs"] = "auto"
    # Greedy text is the same for every method in float32.  Below it (bfloat16), passes of different widths round
    # differently, so methods write the same text only up to rounding, as in vLLM and SGLang.  true: below float32 every
    # pass is padded to K + 1 tokens on fixed shapes (the static path), so that every method writes plain decoding's
    # exact text, at a cost: on a 2-core AVX-512 EPYC such a pass took 1.3-2.1x a one-token step (docs/precision.md).
    identical_text: bool = False
    # Propose per row only the tokens expected to pay for their verify, at the verify cost measured at
    # start-up (adaptive.py; eager path).  A method name ending in :fixed always proposes K, as the paper does.
    adaptive: bool = True
    # Under a grammar (a JSON response format, an enforced tool choice), propose the text it forces (keys, punctuation,
    # a tool's name) without the drafter, ahead of the drafter's own proposals, up to K tokens a round
    forced_drafting: bool = True
    prefill_chunk: int = positive(512)  # prompt tokens per target pass while prefilling
    max_batch: int = positive(16)  # rows decoded together (continuous batching)
    # Which engine generate, serve, bench and profile decode in (their --engine overrides it): vllm (vLLM with dlite's plugin,
    # the vllm extra), dlite (dlite's own engine, everything above), or auto: vLLM where it is installed
    engine: Literal["auto", "vllm", "dlite"] = "auto"


@dataclass
class SuffixConfig:
    """Suffix decoding (methods ``suffix`` and ``NAME+suffix``): arctic-inference's trees, with vLLM's defaults."""

    max_tree_depth: int = positive(24)  # the longest match and continuation the trees hold
    # responses kept in the global tree across requests, the oldest evicted first; 0 keeps none (prompt trees only)
    max_cached_requests: int = non_negative(10_000)
    max_spec_factor: float = 1.0  # a proposal is at most this times the match's length long
    min_token_prob: float = _checked(0.1, check=lambda v: 0.0 <= v <= 1.0, says="be in [0, 1]")


@dataclass
class VllmConfig:
    """vLLM as the engine (``dlite bench`` methods ``vllm:…``, ``dlite serve --engine vllm``; the ``vllm`` extra)."""

    # vLLM compiles the target with torch.compile unless eager: decoding is faster, start-up slower (SmolLM2-135M on a
    # 2-core EPYC: 49.7 against 45.9 tok/s, 125 against 27 s)
    enforce_eager: bool = False
    # KV cache per vLLM engine (the bench runs one per method; otherwise vLLM takes 90 % of the device, of the RAM on a CPU)
    kv_cache_gib: float = _checked(2.0, check=lambda v: v > 0, says="be > 0")
    max_model_len: int = non_negative(0)  # the longest sequence vLLM accepts (0: the target's context, as dlite's engine)


@dataclass
class BenchConfig:
    """``dlite bench``'s plan where the command line does not choose.  The pipeline's bench stage takes it as
    it is, so a later ``dlite bench --suite agentic`` asks for the same measurements and reuses them."""

    methods: list[str] = _checked(["ar", "dlite", "dlite:fixed", "history", "parallel", "ngram", "suffix", "dlite+ngram", "dlite+suffix"],
                                  check=lambda v: len(v) > 0, says="name at least one method")
    # also measured in the other engine, side by side with the methods: in vLLM (where it is installed) when the bench
    # runs in dlite's engine, in dlite's when it runs in vLLM (decode.engine, --engine); [] measures one engine only
    compare: list[str] = field(default_factory=lambda: ["ar", "ngram", "suffix", "dlite", "dlite+ngram", "dlite+suffix"])
    limit: int = positive(8)  # episodes per workload
    max_new_tokens: int = positive(64)  # per assistant turn
    concurrency: list[int] = _checked([1, 4, 16, 64], check=lambda v: all(c >= 1 for c in v), says="be levels >= 1 ([] skips Table 4)")


@dataclass
class SessionsConfig:
    """``dlite sessions``' plan where the command line does not choose: agent sessions end to end through a server."""

    # as the bench names them; vllm:NAME runs NAME in vLLM's server (vllm:ar its plain decoding, vllm:ngram, vllm:suffix
    # its own methods, vllm:dlite+suffix the drafter through dlite's plugin)
    methods: list[str] = _checked(["ar", "dlite", "suffix", "dlite+suffix"], check=lambda v: len(v) > 0, says="name at least one method")
    concurrency: list[int] = _checked([1, 4], check=lambda v: len(v) > 0 and all(c >= 1 for c in v), says="be levels >= 1")
    sessions: int = positive(8)  # taken in turn from the agentic workloads
    turns: int = positive(5)  # per session (SWE-Bench★'s transcripts have 4)
    max_tokens: int = positive(48)  # per reply


@dataclass
class AblationConfig:
    """``dlite ablate``: the paper's Table 5 and Figure 5 around the config's drafter, one thing varied at a time
    (ablations.py).  The defaults are the paper's axes for Qwen3-8B."""

    # Every variant's W = 0 drafter trains this many epochs (two-stage: its warmup and stable together; the
    # teacher and the window variants' teacher stage as many)
    epochs: int = _checked(2, check=lambda v: v >= 2, says="be >= 2 (two-stage splits them between warmup and stable)")
    eval_every: int = positive(50)  # optimizer steps between held-out τ evaluations: Figure 5's points
    target_layers: list[int] = _checked([7, 14, 20, 36], check=lambda v: all(c >= 2 for c in v), says="be counts >= 2")
    head_ranks: list[int] = _checked([256, 512, 4096, 0], check=lambda v: all(r >= 0 for r in v), says="be ranks >= 0 (0: no sequential head)")
    windows: list[int] = _checked([0, 128, 512, -1], check=lambda v: all(w >= -1 for w in v), says="be -1 (full) or >= 0")
    # Table 5's bench: these workloads, this many episodes and new tokens a turn, every variant proposing K tokens
    workloads: list[str] = _checked(["alpaca", "gsm8k", "mbpp", "multi_document_qa"], check=lambda v: len(v) > 0, says="name at least one workload")
    limit: int = positive(8)
    max_new_tokens: int = positive(64)


@dataclass
class Config:
    target: TargetConfig
    regen: RegenConfig
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)
    ablations: AblationConfig = field(default_factory=AblationConfig)
    name: str = ""  # defaults to the file's stem; names the run directory
    description: str = ""

    def check(self) -> list[tuple[str, str]]:
        """Cross-field constraints, as (key, what is wrong)."""
        problems = []
        if self.regen.max_prompt_tokens >= self.regen.max_length:
            problems.append(("regen.max_prompt_tokens", "must be smaller than regen.max_length"))
        for index, source in enumerate(self.regen.sources):
            if source.max_prompt_tokens is not None and not 0 < source.max_prompt_tokens < self.regen.max_length:
                problems.append((f"regen.sources[{index}].max_prompt_tokens", "must be > 0 and smaller than regen.max_length"))
        if self.train.global_batch % self.train.micro_batch:
            problems.append(("train.global_batch", "must be a multiple of train.micro_batch"))
        return problems


@dataclass
class PipelineStage:
    """One step of a pipeline: a dlite command line, run in process or under a launcher."""

    name: str  # what --from / --until and the timing table call it
    command: str = ""  # the dlite subcommand; default: the name
    args: list[str] = field(default_factory=list)  # its options; --target, --run-dir and --set are added
    # A multi-process launcher; ``-m dlite_cli COMMAND ARGS`` is appended, e.g.
    # "accelerate launch --config_file configs/accelerate/gpu-8.yaml".  None = in this process.
    launch: str | None = None


@dataclass
class Pipeline:
    """``pipelines/<name>.yaml``: the stages ``dlite run`` runs in order, all with one target config."""

    target: str  # config name or path (--target of every stage)
    stages: list[PipelineStage]
    name: str = ""  # defaults to the file's stem
    description: str = ""

    def check(self) -> list[tuple[str, str]]:
        names = [stage.name for stage in self.stages]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        return [("stages", f"must have distinct names, {', '.join(duplicated)} repeats")] if duplicated else []


# ---------------------------------------------------------------- loading


def _search_dirs(kind: str) -> tuple[Path, ...]:
    """Where ``configs`` or ``pipelines`` live: inside a packaged wheel, or at the top of a checkout."""
    return (PACKAGE_DIR / kind, PACKAGE_DIR.parents[1] / kind)


CONFIG_DIRS = _search_dirs("configs")


def find_yaml(name: str, kind: str = "configs") -> Path:
    """``NAME`` → ``<kind>/NAME.yaml`` (kind: configs or pipelines); a path to a YAML file works too."""
    what = "target" if kind == "configs" else "pipeline"
    as_path = Path(name)
    if as_path.suffix in (".yaml", ".yml"):
        if not as_path.is_file():
            raise DliteError(f"{what} file {name} does not exist")
        return as_path
    directories = _search_dirs(kind)
    for directory in directories:
        candidate = directory / f"{name}.yaml"
        if candidate.is_file():
            return candidate
    known = sorted({p.stem for d in directories if d.is_dir() for p in d.glob("*.yaml")} - {"paper_results"})
    raise DliteError(f"unknown {what} {name!r}: expected one of {', '.join(known)} or a path to a YAML file")


class Word(str):
    """A scalar that YAML 1.1 reads as true, false or null (``no``, ``off``, ``on``, ``~``), kept as written until
    its field's type is known: a Literal field takes the word (``mixed_precision: no``), any other field the
    value YAML gives it."""


class _Loader(yaml.SafeLoader):
    """YAML as dlite reads configs: safe, with true/false/null words kept as :class:`Word`."""


for _tag in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:null"):
    _Loader.add_constructor(_tag, lambda loader, node: Word(loader.construct_scalar(node)))


def _read_mapping(path: Path) -> dict:
    try:
        raw = yaml.load(path.read_text(), Loader=_Loader) or {}
    except yaml.YAMLError as e:
        raise DliteError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise DliteError(f"{path}: expected a mapping at the top level")
    return raw


def load_config(target: str = DEFAULT_TARGET, overrides: list[str] = ()) -> Config:
    path = find_yaml(target)
    raw = _read_mapping(path)
    for item in overrides:
        _apply_override(raw, item, path)
    config = _build(Config, raw, f"{path}", "")
    for key, problem in config.check():
        raise DliteError(f"{path}: {key} {problem}")
    config.name = config.name or path.stem
    return config


def load_pipeline(name: str) -> Pipeline:
    path = find_yaml(name, "pipelines")
    pipeline = _build(Pipeline, _read_mapping(path), f"{path}", "")
    for key, problem in pipeline.check():
        raise DliteError(f"{path}: {key} {problem}")
    pipeline.name = pipeline.name or path.stem
    for stage in pipeline.stages:
        stage.command = stage.command or stage.name
    return pipeline


def _apply_override(raw: dict, item: str, path: Path) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise DliteError(f"--set {item!r}: expected section.key=value")
    *parents, leaf = key.split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise DliteError(f"{path}: --set {key}: {part} is not a section")
    node[leaf] = yaml.load(value, Loader=_Loader)


def _build(cls, data: Any, origin: str, prefix: str):
    if not isinstance(data, dict):
        raise DliteError(f"{origin}: {prefix.rstrip('.') or 'the file'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise DliteError(f"{origin}: unknown key {prefix}{key} (expected one of {', '.join(fields)})")
    values = {}
    for name, f in fields.items():
        key = prefix + name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise DliteError(f"{origin}: missing required key {key}")
            continue
        value = _coerce(data[name], hints[name], origin, key)
        check = f.metadata.get("check")
        if check is not None and not check(value):
            raise DliteError(f"{origin}: {key} must {f.metadata['says']}, got {value!r}")
        values[name] = value
    return cls(**values)


def _coerce(value: Any, tp: Any, origin: str, key: str) -> Any:
    if isinstance(value, Word):
        value = str(value) if typing.get_origin(tp) is Literal else yaml.safe_load(value)

    def wrong(expected: str):
        return DliteError(f"{origin}: {key} must be {expected}, got {value!r}")

    if dataclasses.is_dataclass(tp):
        return _build(tp, value, origin, key + ".")
    kind = typing.get_origin(tp)
    args = typing.get_args(tp)
    if kind in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, origin, key)
    if kind is Literal:
        if value not in args:
            raise wrong("one of " + ", ".join(map(str, args)))
        return value
    if kind is list:
        if not isinstance(value, list):
            raise wrong("a list")
        return [_coerce(v, args[0], origin, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise wrong("a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong("a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise wrong("a string")
        return value
    raise TypeError(f"config type {tp} of {key} is not supported")


def config_hash(*sections: Any) -> str:
    """A short, stable hash of config sections (dataclasses or plain JSON values)."""
    plain = [dataclasses.asdict(s) if dataclasses.is_dataclass(s) else s for s in sections]
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()[:16]
