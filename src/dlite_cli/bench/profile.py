"""``dlite profile``: what a decode round and a training step cost at a target's real shapes.

The target is the real one where it is on this machine (the embedded default and micro, built once, or a
checkpoint directory): its weights choose the kernels (a 4-bit model's are read as 4 bits, linears.py).  A
hub id is not downloaded: its shapes come from ``configs/architectures/<config>.json`` (the public
``config.json`` facts of Qwen3-4B/8B) and its weights are random.  Everything runs on the decode path the
engine would use (``decode.path``).  Measured, median of ``repeats``:

    passes     the target's pass time against tokens per pass (1 = a decode step, K + 1 = a verify),
               per batch and context, with the bytes a step must read (weights as the step's kernels read
               them + KV cache) and the bandwidth achieved, against the device's own copy bandwidth (the floor)
    drafts     the DLite draft round and the history teacher's, with the teacher's draft KV bytes
    overhead   the engine's host time per round, from a real decode at batch 1
    empty      ms per token of plain decoding beside adaptive DLite's with random weights, which proposes only what it
               expects to pay for: where a wider pass costs more, nearly nothing, and then what a method's empty round costs
    predicted  τ·T_step / (T_draft + T_verify + T_overhead) at the τ values asked for
    training   a training step of each stage (one process), and the target's feature pass (online mode)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..core.artifacts import PAPER_TRAINING
from ..core.config import Config
from ..core.devices import hardware, median_ms, resolve_device
from ..core.errors import DliteError
from ..core.memory import GB, HEADROOM, MemoryPlan, device_memory, kv_bytes_per_token, size
from ..core.progress import progress_bar
from ..data.hub import is_hub_id
from ..decoding.engine import Engine
from ..decoding.methods import model_proposer
from ..decoding.proposers.base import ProposerSetup
from ..decoding.proposers.model import ModelDrafter, draft_dtype
from ..decoding.proposers.none import NoDrafter
from ..decoding.requests import Request, SamplingParams
from ..models.linears import linear_bytes, target_linears
from ..models.model import FULL_HISTORY, Drafter, DrafterSpec, greedy_pick
from ..models.runner import TargetRunner, decode_path
from ..models.targets import Work, architecture, load_model, prepare_target, random_target, target_dtype
from ..training.features import LayerCapture, target_pass
from ..training.sequences import Sequence
from ..training.steps import stage_plan, synthetic_sequences, valid_anchors
from ..training.train import mixed_precision, step_seconds
from ..training.training_plan import stage_plans
from .report import paper_results

COPY_BYTES = 1 << 28  # the buffer the device's copy bandwidth is measured with
OVERHEAD_TOKENS = 24  # decoded at batch 1 to measure the engine's host time per round


@dataclasses.dataclass
class ProfilePlan:
    contexts: list[int]
    batches: list[int]
    widths: list[int]  # tokens per target pass
    taus: list[float]
    repeats: int
    train_steps: int  # 0 = skip the training measurements


def default_plan(config: Config, device: torch.device) -> ProfilePlan:
    """Contexts and batches a GPU (paper scale) or a CPU (the embedded default) is measured at."""
    k = config.drafter.draft_tokens
    if device.type == "cuda":
        contexts, batches, repeats = [1024, 8192, 32768], [1, 16, 64], 15
    else:
        contexts, batches, repeats = [512, 2048], [1, 4], 5
    widths = sorted({1, 2, 3, 4, k + 1, 2 * (k + 1)})
    return ProfilePlan(contexts, batches, widths, paper_taus(config), repeats, train_steps=3)


def paper_taus(config: Config) -> list[float]:
    """The paper's published DLite τ on its agentic workloads (Table 3) for this target, or for Qwen3-4B."""
    published = paper_results()["table3_agentic"]["tau"]
    model = "Qwen3-8B" if "8b" in config.name.lower() else "Qwen3-4B"
    return [t for t in published[model]["DLite"] if t is not None]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second the device moves in a large copy (read + write): the memory-bound floor."""
    source = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    seconds = median_ms(lambda: target.copy_(source), 5, device) / 1000
    return 2 * COPY_BYTES / seconds


def weight_bytes(model) -> int:
    """Bytes of weights a decode step reads: every parameter once, the linears as the engine's kernels read them (a
    4-bit copy's bytes where there is one), less an untied input embedding (a lookup)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters()) - linear_bytes(model) + target_linears(model).step_bytes
    embedding, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total if embedding is head else total - embedding.numel() * embedding.element_size()


def fake_rows(batch: int, context: int, features: int, hidden: int, device, dtype) -> list[Request]:
    """Rows as the engine holds them mid-decode: ``context`` tokens before the anchor, a pivot."""
    rows = []
    for b in range(batch):
        row = Request([0] * context, SamplingParams())
        row.output_ids, row.slot = [1], b
        row.pivot = torch.randn(features, hidden, device=device, dtype=dtype)
        rows.append(row)
    return rows


class Profiler:
    def __init__(self, config: Config, plan: ProfilePlan, log=print, vllm: bool = False):
        """``vllm``: also time the same passes inside vLLM (vllm_engine/profile.py)."""
        self.config, self.plan, self.log, self.vllm = config, plan, log, vllm
        self.device = resolve_device(config.target.device)
        self.arch = architecture(config)
        self.capacity = device_memory(self.device)
        self.memory = stage_plans(config, self.arch, self.device.type, self.capacity)
        too_big = [p for p in self.memory if p.stage in PAPER_TRAINING and not p.fits(self.capacity)]
        self.training_skipped = (f"{too_big[0].describe()}, more than {HEADROOM:.0%} of the {size(self.capacity)} free here"
                                 if too_big and plan.train_steps else None)
        self.model = self._target(config, log)
        self.dtype = self.model.dtype
        self.dtype_name = str(self.dtype).removeprefix("torch.")
        self.path = decode_path(config.decode.path, self.device, self.dtype, config.decode.identical_text)
        self.spec = DrafterSpec.for_target(self.arch, config.drafter, 0)
        self.draft_dtype_name = draft_dtype(config.decode.draft_dtype, Drafter(self.spec).to(self.device).eval(), self.model.get_input_embeddings(), log)
        self.draft_dtype = getattr(torch, self.draft_dtype_name)
        # one precision for every stage's timed step: stage 2's (what the training table compares across machines)
        self.mixed_precision = "no" if self.training_skipped else (
            mixed_precision(stage_plan("stable", config.train), config.train, self.spec, self.device, log) or "no")
        self.k = config.drafter.draft_tokens
        spec = self.spec
        self.target_kv = kv_bytes_per_token(self.arch.num_hidden_layers, spec.num_kv_heads, spec.head_dim, self.dtype)
        self.teacher_kv = kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.draft_dtype)

    def _target(self, config: Config, log):
        """The real target where it is here or is built here (not a hub id), else random weights of its shapes; in
        ``target.dtype`` (auto: decided on the work decoding does, as the engine decides it)."""
        work = Work.decoding(config)
        if not is_hub_id(config.target.model):
            return load_model(prepare_target(config.target, log), config.target.dtype, self.device, log, work)
        dtype = config.target.dtype
        if dtype == "auto":
            build = lambda name: random_target(self.arch, getattr(torch, name), self.device)  # noqa: E731
            dtype = target_dtype(build, self.device, work, f"random weights of {config.name}", log)
        return random_target(self.arch, getattr(torch, dtype), self.device)

    def run(self) -> dict:
        torch.manual_seed(0)
        result = {"target": self.config.name, "hardware": hardware(self.device), "device": str(self.device), "path": self.path,
                  "dtype": self.dtype_name, "draft_dtype": self.draft_dtype_name, "mixed_precision": self.mixed_precision,
                  "plan": dataclasses.asdict(self.plan), "weight_bytes": weight_bytes(self.model),
                  "kv_bytes_per_token": self.target_kv,
                  "copy_bandwidth_gbs": round(copy_bandwidth(self.device) / 1e9, 1), "passes": [], "drafts": [], "skipped": [],
                  "memory": {"free_bytes": self.capacity, "plans": [p.as_dict() for p in self.memory]}}
        dlite = model_proposer(Drafter(self.spec).to(self.device, self.draft_dtype).eval(), self.model.get_input_embeddings(), "dlite",
                               self._setup())
        teacher_spec = dataclasses.replace(self.spec, history_window=FULL_HISTORY)
        teacher = Drafter(teacher_spec).to(self.device, self.draft_dtype).eval()
        combos = [(b, c) for b in self.plan.batches for c in self.plan.contexts]
        with progress_bar("profile", total=len(combos)) as bar:
            for batch, context in combos:
                if self._fits(batch, context, result):
                    self._passes(batch, context, result)
                    self._drafts(batch, context, dlite, teacher, result)
                    self._release()
                bar.update(advance=1)
        result["overhead"] = self._overhead(dlite)
        result["empty"] = self._empty_rounds(dlite)
        result["predicted"] = self._predicted(result)
        if self.vllm:
            from ..vllm_engine.profile import profile_vllm

            result["vllm"] = profile_vllm(self.arch, self.spec, self.dtype_name, self.plan, self.config.vllm, self.log)
        result["training"] = self._training() if self.plan.train_steps and not self.training_skipped else []
        if self.training_skipped:
            result["skipped"].append({"stage": "training steps", "reason": self.training_skipped})
        return result

    def _fits(self, batch: int, context: int, result: dict) -> bool:
        """Skip a (batch, context) whose KV caches would not fit in half the free memory."""
        span = context + max(self.plan.widths)
        need = batch * span * (self.target_kv + self.teacher_kv)
        free = device_memory(self.device)
        if need <= free / 2:
            return True
        result["skipped"].append({"batch": batch, "context": context, "reason": f"needs {size(need)} of KV cache, {size(free)} free"})
        return False

    def _setup(self, capacity: int = 0) -> ProposerSetup:
        """What a drafter proposer is built with here: the config's K, this decode path, a history of ``capacity``."""
        return ProposerSetup(self.k, self.config.suffix, capacity=capacity, path=self.path)

    def _release(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _passes(self, batch: int, context: int, result: dict) -> None:
        runner = TargetRunner(self.model, self.spec.target_layer_ids, batch, context + max(self.plan.widths), path=self.path)
        slots = list(range(batch))
        for slot in slots:
            runner.commit(slot, [0] * context)  # a context of that length (its keys are zeros: the cost is the same)
        bytes_per_step = result["weight_bytes"] + batch * context * result["kv_bytes_per_token"]
        for width, ms in zip(self.plan.widths, runner.pass_costs(slots, self.plan.widths, self.plan.repeats)):
            result["passes"].append({"batch": batch, "context": context, "tokens": width, "ms": round(ms, 3),
                                     "achieved_gbs": round(bytes_per_step / ms / 1e6, 1),
                                     "floor_ms": round(1000 * bytes_per_step / (result["copy_bandwidth_gbs"] * 1e9), 3)})

    def _drafts(self, batch: int, context: int, dlite: ModelDrafter, teacher: Drafter, result: dict) -> None:
        S, H = len(self.spec.target_layer_ids), self.spec.hidden_size
        rows = fake_rows(batch, context, S, H, self.device, self.draft_dtype)
        dlite_ms = median_ms(lambda: dlite.propose(rows, greedy_pick), self.plan.repeats, self.device)
        history = model_proposer(teacher, self.model.get_input_embeddings(), "history", self._setup(capacity=context + self.k + 2))
        for row in rows:
            history.begin(row, torch.randn(context, S, H, device=self.device, dtype=self.draft_dtype))
        teacher_ms = median_ms(lambda: history.propose(rows, greedy_pick), self.plan.repeats, self.device)
        result["drafts"].append({"batch": batch, "context": context, "dlite_ms": round(dlite_ms, 3), "teacher_ms": round(teacher_ms, 3),
                                 "teacher_kv_bytes": sum(history.kv_bytes(row) for row in rows)})

    def _overhead(self, dlite: ModelDrafter) -> dict:
        """Draft, verify and host time per round of a real decode at batch 1 (random weights accept nothing)."""
        context = min(self.plan.contexts)
        runner = TargetRunner(self.model, self.spec.target_layer_ids, 1, context + 2 * OVERHEAD_TOKENS + self.k, path=self.path)
        engine = Engine(runner, dlite, set(), lambda ids: "")
        prompt = torch.randint(self.arch.vocab_size, (context,)).tolist()
        engine.run([Request(prompt, SamplingParams(max_new_tokens=4))])  # warm-up (and graph capture)
        (request,) = engine.run([Request(prompt, SamplingParams(max_new_tokens=OVERHEAD_TOKENS))])
        stats = request.stats.as_dict()
        return {"context": context, "rounds": stats["rounds"], "draft_ms": stats["draft_ms_per_round"],
                "verify_ms": stats["verify_ms_per_round"], "overhead_ms": stats["overhead_ms_per_round"]}

    def _empty_rounds(self, dlite: ModelDrafter) -> dict:
        """ms per generated token at batch 1 of plain decoding and of adaptive DLite, whose random weights are accepted
        so rarely that, once it has seen a request (the first, a warm-up), it proposes only where a wider pass costs
        (nearly) nothing more, and DLite's tokens proposed a round.
        The two decode the same prompt in turn, ``repeats`` requests each: the median request."""
        context = min(self.plan.contexts)
        prompt = torch.randint(self.arch.vocab_size, (context,)).tolist()
        adaptive = model_proposer(dlite.drafter, dlite.embed, "dlite", self._setup())
        engines = {}
        for name, drafter in (("plain", NoDrafter()), ("dlite", adaptive)):
            runner = TargetRunner(self.model, drafter.target_layers, 1, context + 2 * OVERHEAD_TOKENS + self.k, path=self.path)
            engines[name] = Engine(runner, drafter, set(), lambda ids: "", adaptive=True)
            engines[name].run([Request(prompt, SamplingParams(max_new_tokens=OVERHEAD_TOKENS))])  # warm-up; DLite learns here
        decodes = {name: [] for name in engines}
        for _ in range(self.plan.repeats):
            for name, engine in engines.items():
                (request,) = engine.run([Request(prompt, SamplingParams(max_new_tokens=OVERHEAD_TOKENS))])
                stats = request.stats
                ms = 1000 * (stats.draft_seconds + stats.verify_seconds + stats.overhead_seconds) / stats.generated_tokens
                decodes[name].append((ms, sum(stats.proposed) / stats.rounds))
        result = {"context": context}
        for name, runs in decodes.items():
            ms, proposed = sorted(runs)[len(runs) // 2]
            result[name] = {"ms_per_token": round(ms, 3), "proposed_per_round": round(proposed, 3)}
        return result

    def _predicted(self, result: dict) -> list[dict]:
        """Batch 1: a round (draft + verify of K + 1 tokens + host time) in target steps, and the speedup at each τ."""
        rows = []
        passes = {(p["batch"], p["context"], p["tokens"]): p["ms"] for p in result["passes"]}
        drafts = {(d["batch"], d["context"]): d["dlite_ms"] for d in result["drafts"]}
        for context in self.plan.contexts:
            step, verify = passes.get((1, context, 1)), passes.get((1, context, self.k + 1))
            if step is None or verify is None or (1, context) not in drafts:
                continue
            round_ms = drafts[1, context] + verify + result["overhead"]["overhead_ms"]
            rows.append({"context": context, "step_ms": step, "verify_ms": verify, "draft_ms": drafts[1, context],
                         "overhead_ms": result["overhead"]["overhead_ms"], "round_in_steps": round(round_ms / step, 3),
                         "speedup": {str(tau): round(tau * step / round_ms, 2) for tau in self.plan.taus}})
        return rows

    def _training(self) -> list[dict]:
        """Seconds per optimizer step of ``train.micro_batch`` sequences of ``train.max_length`` tokens, per stage
        (under ``train.mixed_precision``), and the target's no-grad feature pass over the same sequences (what
        ``train.features: online`` adds)."""
        train, out = self.config.train, []
        embed = self.model.get_input_embeddings()
        sequences, teacher = synthetic_sequences(self.spec, train), None
        for name in PAPER_TRAINING:
            plan = stage_plan(name, train)
            seconds, drafter = step_seconds(plan, train, self.spec, embed, sequences, self.device, self.mixed_precision, self.plan.train_steps, teacher)
            out.append(self._rate(name, seconds, sequences))
            if name == "train-teacher":
                teacher = drafter.requires_grad_(False).eval()
        capture = LayerCapture(self.model, self.spec.target_layer_ids)
        try:
            inputs = [{"input_ids": s.input_ids.tolist(), "prompt_len": s.prompt_len} for s in sequences]
            seconds = median_ms(lambda: target_pass(self.model, capture, inputs, train.target_top_k), self.plan.train_steps, self.device) / 1000
        finally:
            capture.remove()
        out.append(self._rate("target features (online)", seconds, sequences))
        return out

    def _rate(self, name: str, seconds: float, sequences: list[Sequence]) -> dict:
        anchors = sum(min(self.config.train.anchors_per_sample, len(valid_anchors(s))) for s in sequences)
        tokens = sum(len(s.input_ids) for s in sequences)
        return {"stage": name, "step_s": round(seconds, 4), "anchors_per_s": round(anchors / seconds, 1), "tokens_per_s": round(tokens / seconds, 1)}


# ---------------------------------------------------------------- the tables


def render(result: dict) -> list:
    """rich Tables of a profile result."""
    from rich.table import Table

    plan = result["plan"]
    title = f"{result['target']} on {result['hardware']} ({result['dtype']}, decode path {result['path']})"
    passes = Table(title=f"target pass, ms, by tokens per pass — {title}; floor = weights + KV read at the copy bandwidth "
                         f"({result['copy_bandwidth_gbs']} GB/s)")
    for column in ["batch", "context", *map(str, plan["widths"]), "floor", "achieved GB/s (1 token)"]:
        passes.add_column(column, justify="right")
    by_cell = {}
    for p in result["passes"]:
        by_cell.setdefault((p["batch"], p["context"]), {})[p["tokens"]] = p
    for (batch, context), cells in by_cell.items():
        one = cells[plan["widths"][0]]
        passes.add_row(str(batch), str(context), *(f"{cells[w]['ms']:.2f}" for w in plan["widths"]), f"{one['floor_ms']:.2f}", f"{one['achieved_gbs']:.0f}")
    drafts = Table(title="draft round, ms: DLite (no draft history) vs the history teacher and its draft KV cache")
    for column in ("batch", "context", "DLite", "teacher", "teacher draft KV"):
        drafts.add_column(column, justify="right")
    for d in result["drafts"]:
        drafts.add_row(str(d["batch"]), str(d["context"]), f"{d['dlite_ms']:.2f}", f"{d['teacher_ms']:.2f}", f"{d['teacher_kv_bytes'] / 1e6:.1f} MB")
    overhead = result["overhead"]
    predicted = Table(title=f"a DLite round at batch 1 (host overhead measured over {overhead['rounds']} real rounds at "
                            f"{overhead['context']} tokens: {overhead['overhead_ms']:.2f} ms) and the predicted speedup τ·T_step / T_round")
    taus = [str(t) for t in plan["taus"]]
    for column in ["context", "step", "verify", "draft", "overhead", "round / step", *(f"τ {t}" for t in taus)]:
        predicted.add_column(column, justify="right")
    for r in result["predicted"]:
        predicted.add_row(str(r["context"]), f"{r['step_ms']:.2f}", f"{r['verify_ms']:.2f}", f"{r['draft_ms']:.2f}", f"{r['overhead_ms']:.2f}",
                          f"{r['round_in_steps']:.2f}", *(f"{r['speedup'][t]:.2f}×" for t in taus))
    empty = result["empty"]
    empties = Table(title=f"decoding at batch 1 from {empty['context']} tokens, ms per token: plain decoding beside adaptive DLite with "
                          "random weights, which proposes what it expects to pay for (where a wider pass costs more, nearly nothing)")
    for column in ("method", "ms / token", "proposed / round", "× plain"):
        empties.add_column(column, justify="right")
    for name in ("plain", "dlite"):
        e = empty[name]
        empties.add_row(name, f"{e['ms_per_token']:.2f}", f"{e['proposed_per_round']:.2f}", f"{e['ms_per_token'] / empty['plain']['ms_per_token']:.2f}×")
    tables = [memory_table([MemoryPlan(**p) for p in result["memory"]["plans"]], result["memory"]["free_bytes"], result["hardware"]),
              passes, drafts, predicted, empties]
    if "vllm" in result:
        tables.append(vllm_table(result, by_cell))
    if result["training"]:
        training = Table(title="training step of one process (train.micro_batch sequences of train.max_length tokens)")
        for column in ("stage", "s / step", "anchors / s", "tokens / s"):
            training.add_column(column, justify="right")
        for t in result["training"]:
            training.add_row(t["stage"], f"{t['step_s']:.3f}", f"{t['anchors_per_s']:.0f}", f"{t['tokens_per_s']:.0f}")
        tables.append(training)
    return tables


def vllm_table(result: dict, dlite_cells: dict):
    """The same passes inside vLLM (vllm_engine/profile.py) beside dlite's, and vLLM's host and draft ms per step."""
    from rich.table import Table

    vllm = result["vllm"]
    widths = sorted({p["tokens"] for p in vllm["passes"]})
    table = Table(title=f"inside vLLM {vllm['version']} ({vllm['dtype']}, {'eager' if vllm['enforce_eager'] else 'compiled'}): the target's "
                        "forward, ms, by tokens per pass (dlite's pass in brackets), and per step vLLM's host time (step − forward − draft) "
                        "and dlite's plugin's draft round")
    for column in ["batch", "context", *map(str, widths), "host", "draft"]:
        table.add_column(column, justify="right")
    by_cell = {}
    for p in vllm["passes"]:
        by_cell.setdefault((p["batch"], p["context"]), {})[p["tokens"]] = p
    for (batch, context), cells in by_cell.items():
        ours = dlite_cells.get((batch, context), {})
        shown = [f"{cells[w]['forward_ms']:.2f}" + (f" ({ours[w]['ms']:.2f})" if w in ours else "") for w in widths]
        table.add_row(str(batch), str(context), *shown, f"{cells[widths[-1]]['host_ms']:.2f}", f"{cells[widths[-1]]['draft_ms']:.2f}")
    return table


def memory_table(plans: list[MemoryPlan], capacity: int, device: str):
    """A rich Table of memory plans against ``capacity`` bytes free."""
    from rich.table import Table

    table = Table(title=f"memory plan per stage (traced on tensors without storage, memory.py) on {device}: "
                        f"{size(capacity)} free, a plan fits in {HEADROOM:.0%} of it")
    for column in ("stage", "peak", "fits", "made of", "at"):
        table.add_column(column, justify="right" if column == "peak" else "left")
    for p in plans:
        table.add_row(p.stage, size(p.peak), "yes" if p.fits(capacity) else "NO",
                      ", ".join(f"{name} {size(nbytes)}" for name, nbytes in p.parts.items()), p.setting)
    return table


def run_profile(config: Config, choices: dict, out: Path | None, as_json: bool, engine: str | None, log) -> None:
    """``dlite profile``: the default plan for this device with ``choices`` (ProfilePlan fields; None: the default)
    applied, timed (inside vLLM too where ``engine``, or decode.engine, chooses it), written as JSON to ``out`` and shown as tables."""
    from rich.console import Console

    from ..core.files import atomic_write_json
    from ..decoding.engines import choose_engine

    device = resolve_device(config.target.device)
    plan = dataclasses.replace(default_plan(config, device), **{k: v for k, v in choices.items() if v is not None})
    result = Profiler(config, plan, log, vllm=choose_engine(config, engine, log) == "vllm").run()
    path = out or Path("runs") / config.name / f"profile-{device.type}.json"
    atomic_write_json(path, result)
    if as_json:
        print(json.dumps(result))
    else:
        for table in render(result):
            Console().print(table)
    for skipped in result["skipped"]:
        what = skipped.get("stage") or f"batch {skipped['batch']} at context {skipped['context']}"
        log(f"skipped {what}: {skipped['reason']}")
    log(f"profile written to {path}")


def print_memory_plans(config: Config, gigabytes: float, log) -> None:
    """``dlite profile --memory GB``: every stage's plan on a simulated GPU with that much free; refused if one does not fit."""
    from rich.console import Console

    capacity = int(gigabytes * GB)
    plans = stage_plans(config, architecture(config), "cuda", capacity)
    Console().print(memory_table(plans, capacity, f"a simulated {gigabytes:g} GB GPU"))
    too_big = [p.describe() for p in plans if not p.fits(capacity)]
    if too_big:
        raise DliteError(f"{'; '.join(too_big)}: more than a {gigabytes:g} GB GPU has room for")
    log(f"every stage of {config.name} fits a {gigabytes:g} GB GPU")
