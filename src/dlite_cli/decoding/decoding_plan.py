"""A decoding engine's memory plan: the peak bytes of its rows, drafters and trees, known before anything loads (core/memory.py)."""

from __future__ import annotations

import dataclasses

import torch

from ..core.config import Config
from ..core.memory import MIN_CONTEXT, MemoryPlan, device_memory, fake_mode, kv_bytes_per_token, module_bytes, most_that_fit, planned_dtype, refuse, size
from ..models.linears import packed_bytes, quantized_bytes
from ..models.model import FULL_HISTORY, Drafter, DrafterSpec
from ..models.targets import random_target
from .methods import Method, parse_method

# host bytes per token of suffix decoding's trees (arctic-inference, max_tree_depth 24): 256 000 Zipf-distributed ids
SUFFIX_TREE_BYTES_PER_TOKEN = 260


def verify_tokens(config: Config, draft_tokens: int | None = None) -> int:
    """Tokens in an engine's widest verify pass: K + 1, K the proposer's ``draft_tokens`` (None: the config's
    ``drafter.draft_tokens``, as before a proposer is loaded), or the config's K where that is wider and
    ``decode.identical_text`` gives every method, plain decoding too, passes of one width (as the bench's)."""
    K = config.drafter.draft_tokens if draft_tokens is None else draft_tokens
    return 1 + (max(K, config.drafter.draft_tokens) if config.decode.identical_text else K)


def suffix_tree_bytes(config: Config, slots: int, tokens: int, response_tokens: int) -> int:
    """Host memory suffix decoding's trees may come to: the global tree over ``suffix.max_cached_requests`` responses of
    ``response_tokens`` each, and a tree over each of ``slots`` rows of ``tokens``."""
    return SUFFIX_TREE_BYTES_PER_TOKEN * (config.suffix.max_cached_requests * response_tokens + slots * tokens)


def decoding_plan(config: Config, arch, stage: str, slots: int, tokens: int, device_type: str, history_drafter: bool = False,
                  single_row_tokens: int = 0, slots_keep_features: bool = True, suffix_responses: int = 0) -> MemoryPlan:
    """The peak of a decoding engine with ``slots`` rows holding ``tokens`` positions each (KV caches grow by
    need, so this is what rows of that length cost): the target in its planned dtype, a DLite drafter and, with
    ``history_drafter``, the history drafter, its draft KV per position and the target features kept for a next
    turn (in the slots unless ``slots_keep_features`` is off); ``single_row_tokens`` adds a batch-1 runner holding
    that many, which keeps them (the bench's, kept beside its concurrency sweep); ``suffix_responses``: suffix decoding's
    trees over responses of that many tokens (counted on a CPU, where host memory is the device's)."""
    dtype = planned_dtype(config.target.dtype, device_type)
    draft_dtype = planned_dtype(config.decode.draft_dtype, device_type)
    spec = DrafterSpec.for_target(arch, config.drafter, 0)
    with fake_mode():
        target = random_target(arch, dtype, torch.device("cpu"))
        drafters = [Drafter(spec)] + ([Drafter(dataclasses.replace(spec, history_window=FULL_HISTORY))] if history_drafter else [])
    # a module of fake tensors cannot be cast in place: its floating tensors are counted in the draft dtype
    drafter_bytes = sum(t.numel() * (draft_dtype.itemsize if t.is_floating_point() else t.element_size())
                        for d in drafters for t in [*d.parameters(), *d.buffers()])
    per_token = kv_bytes_per_token(arch.num_hidden_layers, spec.num_kv_heads, spec.head_dim, dtype)
    features_per_token = 0
    if history_drafter:  # its draft KV, and the target's features the runner keeps for the next turn
        per_token += kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim, draft_dtype)
        features_per_token = len(spec.target_layer_ids) * spec.hidden_size * dtype.itemsize
    kept = (slots * tokens if slots_keep_features else 0) + single_row_tokens
    parts = {"target weights": module_bytes(target).live, "drafter weights": drafter_bytes,
             "KV caches" + (" (target + draft) and features" if history_drafter else ""):
                 (slots * tokens + single_row_tokens) * per_token + kept * features_per_token}
    if packed_bytes(target, device_type):
        parts["packed target weights (oneDNN)"] = packed_bytes(target, device_type)
    if quantized_bytes(target, device_type):
        parts["4- and 8-bit target weights (where they are)"] = quantized_bytes(target, device_type)
    if suffix_responses and device_type == "cpu":
        parts["suffix trees"] = suffix_tree_bytes(config, slots, tokens, suffix_responses)
    width = verify_tokens(config)
    parts["widest pass's logits"] = slots * width * arch.vocab_size * (dtype.itemsize + 4)  # and as float32 for sampling
    if config.decode.path == "graphs" or (config.decode.path == "auto" and device_type == "cuda"):
        parts["CUDA graph pool"] = slots * width * arch.vocab_size * dtype.itemsize  # the captured passes' logits
    setting = f"{slots} slots × {tokens} tokens" + (f" and one row of {single_row_tokens}" if single_row_tokens else "")
    return MemoryPlan(stage, setting, parts, sum(parts.values()))


def bench_plan(config: Config, arch, device_type: str, names: list[str], concurrency: list[int], max_new_tokens: int) -> MemoryPlan:
    """``dlite bench``: its concurrency sweep's widest level (first turns of chat prompts, planned at
    regen.max_prompt_tokens of prompt and ``max_new_tokens``) beside the batch-1 runner at the target's context."""
    methods = [parse_method(name) for name in names]
    return decoding_plan(config, arch, "bench", max(concurrency, default=1), config.regen.max_prompt_tokens + max_new_tokens,
                         device_type, any(m.keeps_history for m in methods), single_row_tokens=arch.max_position_embeddings,
                         slots_keep_features=False,  # the sweep's requests have one turn
                         suffix_responses=max_new_tokens if any(m.uses_suffix_trees for m in methods) else 0)


def engine_context(config: Config, arch, method: Method, slots: int, context: int | None, device: torch.device, log=print,
                   response_tokens: int = 0) -> int:
    """The positions per row an engine of ``slots`` rows may hold on ``device``: ``context`` where it was asked
    for and fits (else refused, naming the rows that fit); none asked, the target's context, or as much of it
    as fits (said in one line), as vLLM sizes its model length to the KV cache it has room for.  Suffix decoding's
    trees are planned for responses of ``response_tokens`` (0: as long as a row)."""
    capacity, history = device_memory(device), method.keeps_history
    wanted = context or arch.max_position_embeddings

    def plan_at(rows: int, tokens: int) -> MemoryPlan:
        suffix = (response_tokens or tokens) if method.uses_suffix_trees else 0
        return decoding_plan(config, arch, "the engine", rows, tokens, device.type, history, suffix_responses=suffix)

    plan = plan_at(slots, wanted)
    if plan.fits(capacity):
        return wanted
    tokens = most_that_fit(lambda n: plan_at(slots, n).peak, capacity)
    if context is None and tokens >= MIN_CONTEXT:
        log(f"{plan.describe()}: {tokens} tokens a row fit the {size(capacity)} free (--max-batch or --max-context choose otherwise)")
        return tokens
    rows = most_that_fit(lambda n: plan_at(n, wanted).peak, capacity)
    refuse(plan, capacity, f"--max-batch {rows} fits" if rows else f"not one row of {wanted} tokens fits: pass a smaller --max-context")
