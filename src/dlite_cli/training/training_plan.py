"""A training stage's memory plan: its own step traced on tensors without storage (core/memory.py), and every stage's plan at once."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import warnings
from pathlib import Path

import torch

from ..core.artifacts import TRAINING_STAGES
from ..core.config import Config, config_hash
from ..core.files import atomic_write_text, cache_dir
from ..core.memory import MIN_CONTEXT, MemoryPlan, fake_mode, module_bytes, most_that_fit, planned_dtype
from ..decoding.decoding_plan import bench_plan, decoding_plan
from ..models.linears import packed_bytes
from ..models.model import Drafter, DrafterSpec
from ..models.targets import random_target
from .features import LayerCapture, target_pass
from .losses import position_weights
from .steps import AUTOCAST, stage_batches, stage_loss, stage_plan, synthetic_sequences


def training_plan(config: Config, arch, stage: str, device_type: str, autocast: str | None = None, micro_batch: int | None = None,
                  processes: int = 1, fake: bool = True) -> MemoryPlan:
    """The peak of one training process of ``stage`` at ``micro_batch`` sequences (default train.micro_batch)
    under ``autocast`` (train.mixed_precision's decision; None: what auto means on ``device_type``).  A traced
    plan is remembered in the dlite cache, keyed by everything it depends on, dlite's code included.
    ``fake=False`` runs the same steps on real tensors (on the CPU): what the plan is checked against."""
    train = dataclasses.replace(config.train, micro_batch=micro_batch or config.train.micro_batch)
    if autocast is None:
        autocast = config.train.mixed_precision if config.train.mixed_precision != "auto" else ("bf16" if device_type == "cuda" else "no")
    key = config_hash(train, config.drafter, arch.to_json_string(), config.target.dtype,
                      [stage, device_type, autocast, processes, torch.__version__, _code_digest()])
    remembered = cache_dir() / "memory-plans" / f"{key}.json"
    if fake and remembered.is_file():
        return MemoryPlan(**json.loads(remembered.read_text()))
    plan = _traced_training_plan(config, train, arch, stage, device_type, autocast, processes, fake)
    if fake:
        atomic_write_text(remembered, json.dumps(plan.as_dict()))  # the parts in their order
    return plan


@functools.cache
def _code_digest() -> str:
    """A hash of dlite's source: a remembered plan is of the code that traced it."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(Path(__file__).resolve().parents[1].rglob("*.py")))).hexdigest()[:16]


def _traced_training_plan(config: Config, train, arch, stage: str, device_type: str, autocast: str, processes: int, fake: bool) -> MemoryPlan:
    plan = stage_plan(stage, train)
    base_spec = DrafterSpec.for_target(arch, config.drafter, 0)
    mode = fake_mode() if fake else contextlib.nullcontext()  # one for every fake tensor: tensors of two modes do not mix
    with mode:
        target = random_target(arch, planned_dtype(config.target.dtype, device_type), torch.device("cpu"))
        drafter = Drafter(plan.drafter_spec(base_spec))
        teacher = Drafter(stage_plan(plan.init_from, train).drafter_spec(base_spec)).eval().requires_grad_(False) if plan.needs_teacher else None
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=train.lr, foreach=device_type == "cuda")
    parts: dict[str, int] = {}
    counter = module_bytes(target)
    parts["target weights"] = counter.live
    counter.add([*drafter.parameters(), *drafter.buffers(), *(teacher.parameters() if teacher else [])])
    parts["drafter weights"] = counter.live - parts["target weights"]
    packed = packed_bytes(target, device_type) if train.features == "cached" else 0  # the feature pass packs the target's linears
    if packed:
        parts["packed target weights (oneDNN)"] = packed
    if train.features == "online":
        records = [{"input_ids": [0] * train.max_length, "prompt_len": train.max_length // 4}] * train.micro_batch
        capture = LayerCapture(target, base_spec.target_layer_ids)
        try:
            with counter.phase(parts, "target feature pass"):
                sequences = target_pass(target, capture, records, train.target_top_k)
        finally:
            capture.remove()
    else:
        with mode:
            sequences = synthetic_sequences(base_spec, train)
        with counter.phase(parts, "micro-batch features"):
            counter.add(t for s in sequences for t in (s.features, s.top_probs, s.top_ids))
    weights = position_weights(base_spec.draft_tokens, train.gamma)
    held = counter.live
    with counter.phase(parts, "training step"), warnings.catch_warnings():  # activations and gradients
        warnings.simplefilter("ignore")  # autocast on the CPU warns of the norms it cannot fuse: the plan is not that run
        for _ in range(min(2, train.global_batch // (train.micro_batch * processes))):  # the second holds the first's gradients
            batches = stage_batches(plan, train, drafter, teacher, sequences, list(range(len(sequences))), base_spec.draft_tokens)
            with mode:  # the tensors the loss makes from shapes alone (positions, masks) are fake too: nothing is computed
                with torch.autocast("cpu", dtype=AUTOCAST.get(autocast, torch.bfloat16), enabled=autocast in AUTOCAST):
                    loss = stage_loss(plan, train, drafter, teacher, target.get_input_embeddings(), batches, weights, torch.device("cpu"))
                loss.backward()
            del batches, loss
    with counter:
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    parts["optimizer state"] = counter.live - held
    # every later step repeats the first with the optimizer's state held throughout
    peak = max(counter.peak, held + parts["training step"] + parts["optimizer state"])
    if processes > 1:  # DDP's gradient buckets, held for the whole run: a copy of the gradients
        parts["gradient buckets (DDP)"] = sum(p.numel() * p.element_size() for p in drafter.parameters() if p.requires_grad)
    setting = f"micro-batch {train.micro_batch} × {train.max_length} tokens, {train.anchors_per_sample} anchors each, autocast {autocast}"
    return MemoryPlan(stage, setting, parts, peak + parts.get("gradient buckets (DDP)", 0) + packed)


def fitting_micro_batch(config: Config, arch, stage: str, device_type: str, capacity: int, autocast: str | None, processes: int = 1) -> int | None:
    """The largest micro-batch below train.micro_batch that divides a process's share of the global batch and
    fits ``capacity`` (a binary search: plans grow with the micro-batch), or None."""
    share = config.train.global_batch // processes
    sizes = [size for size in range(1, config.train.micro_batch) if share % size == 0]
    low, high, best = 0, len(sizes) - 1, None
    while low <= high:
        middle = (low + high) // 2
        if training_plan(config, arch, stage, device_type, autocast, sizes[middle], processes).fits(capacity):
            best, low = sizes[middle], middle + 1
        else:
            high = middle - 1
    return best


def stage_plans(config: Config, arch, device_type: str, capacity: int) -> list[MemoryPlan]:
    """Every stage's plan at the config's settings on a device with ``capacity`` bytes free: the training stages,
    the bench, and the server (decode.max_batch rows, the context :func:`engine_context` gives them)."""
    # stable-scratch trains what stable trains, on the same shapes: its plan is stable's
    plans = [training_plan(config, arch, stage, device_type) for stage in TRAINING_STAGES if stage != "stable-scratch"]
    bench = config.bench
    plans.append(bench_plan(config, arch, device_type, bench.methods, bench.concurrency, bench.max_new_tokens))
    slots = config.decode.max_batch
    tokens = min(arch.max_position_embeddings, most_that_fit(lambda n: decoding_plan(config, arch, "serve", slots, n, device_type).peak, capacity))
    plans.append(decoding_plan(config, arch, "serve", slots, max(tokens, MIN_CONTEXT), device_type))
    return plans
