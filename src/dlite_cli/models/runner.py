"""The target side of speculative decoding: a forward pass over a Hugging Face Llama/Qwen3 model's own
weights with a KV cache in which every row (slot) has its own length.

    keys[l], values[l]   (slots, kv_heads, allocated, head_dim) per target layer l; allocated grows
                         by doubling up to ``capacity``, the longest sequence the runner accepts
    cached[slot]         the token ids whose keys/values that slot holds
    features[slot]       (n, S, H): the drafter's layers at the slot's first n positions, n <= its length,
                         kept from prefills that return every position's (a history drafter's), so that
                         the next turn of a conversation computes only its new tokens there too

``verify(slots, tokens)`` runs ``tokens`` (B, Q) after each slot's held tokens and returns logits
and the hidden states of the drafter's S layers; ``commit(slot, ids)`` then records which of them the
slot keeps (the accepted ones: entries beyond a slot's length are masked now and overwritten later).
Rows of different lengths share one batched pass, which is what lets each row accept its own number
of tokens.  Its matmuls run through :func:`linears.target_linears` (on a CPU: fused, oneDNN-packed, and 4- or 8-bit
where the weights are), the rest of a layer through :func:`layer_ops.target_ops` (on a CPU: dlite's kernels, one call
an operation); where both are dlite's kernels, a narrow pass runs all the layers in one call of them (``DecoderLayers``
in cpu_kernels.cpp).  Two ways to run a pass (``decode.path``):

    eager    shapes follow the batch: the rows asked for, the tokens given, keys up to the longest row
    static   fixed shapes: the first ``bucket`` slots (the rows asked for, the others padding), ``width``
             tokens (a row's own, then padding), keys over the whole allocation under a mask built on
             the device from the slots' lengths; with ``graphs`` each (bucket, width, allocation)
             pass is a replayed CUDA graph
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.devices import median_ms
from ..core.errors import DliteError
from .graphs import CudaGraphs, bucket_for
from .layer_ops import KERNEL_TOKENS, AttentionParams, KernelOps, Norm, PassPositions, target_ops
from .linears import QUANTIZED_ROWS, target_linears
from .model import SUPPORTED_FAMILIES

INITIAL_ALLOCATION = 1024  # cache positions per slot allocated up front; grown by doubling up to capacity
SPAN_STEP = 256  # without CUDA graphs the static path attends over the keys in use, rounded up to this
COST_CONTEXT = 512  # context the verify costs are measured at (adaptive drafting, target.dtype auto)
PATHS = ("eager", "static", "graphs")


def decode_path(setting: str, device: torch.device, dtype: torch.dtype, identical_text: bool = False) -> str:
    """``decode.path`` → the path to run.  auto: graphs on CUDA; on a CPU eager, or static where ``identical_text``
    asks for the same greedy text from every method below float32 (see :func:`pass_width`)."""
    if setting == "auto":
        if device.type == "cuda":
            return "graphs"
        return "static" if identical_text and dtype != torch.float32 else "eager"
    return setting


def pass_width(widest: int, dtype: torch.dtype, path: str, identical_text: bool = False) -> int:
    """The fewest tokens in a decode pass: as many as the pass has (a step is 1 token), but the ``widest`` pass's
    (K + 1: decoding_plan.verify_tokens) below float32 where shapes are fixed: CUDA graphs (a graph per batch bucket,
    where a wider pass costs about the same), or ``identical_text``.  A lower precision's matmuls and attention round
    by shape, so only passes of one width on the static path compute a position alike in plain decoding and under
    every drafter, and give them the same greedy text; otherwise their texts agree up to rounding, as in vLLM and
    SGLang.  On a CPU the width costs: a bfloat16
    pass of 8 tokens took 1.3-2.1x a step on a 2-core AVX-512 EPYC."""
    if dtype == torch.float32 or not (path == "graphs" or identical_text):
        return 1
    return widest


class TargetRunner:
    """A target model (``AutoModelForCausalLM``, eval mode) prepared for batched, rollback-able decoding."""

    def __init__(self, model, capture_layers: list[int], slots: int, capacity: int, prefill_chunk: int = 512, path: str = "eager",
                 width: int = 1, keep_features: bool = True):
        """``width``: the fewest tokens in a decode pass (a row's own, then padding; :func:`pass_width`).  ``keep_features``:
        keep a prefill's features for a next turn (not worth their memory where requests have one turn)."""
        config = model.config
        if config.model_type not in SUPPORTED_FAMILIES:
            raise DliteError(f"target family {config.model_type!r} is not supported by the decoding engine: expected one of {', '.join(SUPPORTED_FAMILIES)}")
        if "sliding_attention" in (getattr(config, "layer_types", None) or []):
            raise DliteError("targets with sliding-window attention layers are not supported by the decoding engine")
        if path not in PATHS:
            raise DliteError(f"unknown decode path {path!r}: expected one of {', '.join(PATHS)}")
        parameter = next(model.parameters())
        if path == "graphs" and parameter.device.type != "cuda":
            raise DliteError(f"decode.path graphs needs the target on a CUDA device, and it is on {parameter.device}; use eager or static")
        self.model, self.capture_layers, self.path, self.width = model, sorted(capture_layers), path, width
        self.capacity, self.prefill_chunk = capacity, prefill_chunk
        self.layers = model.model.layers
        self.linears, self.ops = target_linears(model), target_ops(model)
        # per layer, read once: its attention's parameters, the norm after its attention, and the norm after it (the next
        # layer's first, the model's final one after the last)
        next_norms = [layer.input_layernorm for layer in self.layers][1:] + [model.model.norm]
        self.first_norm = Norm.of(self.layers[0].input_layernorm)
        self.layer_params = [(AttentionParams.of(layer.self_attn), Norm.of(layer.post_attention_layernorm), Norm.of(after))
                             for layer, after in zip(self.layers, next_norms)]
        self.kernel_layers = self._kernel_layers()
        shape = (slots, self.ops.kv_heads, min(capacity, INITIAL_ALLOCATION), self.ops.head_dim)
        self.keys = [torch.zeros(shape, dtype=parameter.dtype, device=parameter.device) for _ in self.layers]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.cached: list[list[int]] = [[] for _ in range(slots)]  # the token ids each slot holds keys/values for
        self.features: list[torch.Tensor | None] = [None] * slots  # (n, S, H) at each slot's first n positions
        self.keep_features = keep_features
        self.reach = [0] * slots  # the most tokens each slot's request may come to hold (0: unknown)
        self.graphs = CudaGraphs(enabled=path == "graphs")
        self._verify_costs: list[float] = []

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def _kernel_layers(self):
        """The decoder layers as one call of dlite's CPU kernels, for the passes that read the 4- and 8-bit copies and
        run the attention kernel (at most QUANTIZED_ROWS tokens, KERNEL_TOKENS a row): where every projection has such
        a copy and the layer ops are the kernels; else None."""
        ops, layers = self.ops, self.linears.layers
        projections = [[layer.qkv, layer.o, layer.gate_up, layer.down] for layer in layers]
        if not isinstance(ops, KernelOps) or any(p.quantized is None for ps in projections for p in ps):
            return None
        weights, numbers = [], []
        for ps, (attention, post_attention, after) in zip(projections, self.layer_params):
            q_norm, k_norm = attention.q_norm, attention.k_norm
            weights.append([t for p in ps for t in (p.quantized.codes, p.quantized.scales)]
                           + [ops.none if q_norm is None else q_norm.weight, ops.none if k_norm is None else k_norm.weight,
                              post_attention.weight, after.weight])
            numbers.append([0.0 if q_norm is None else q_norm.eps, post_attention.eps, after.eps, attention.scaling])
        return ops.kernels.DecoderLayers(weights, numbers, ops.heads)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.get_input_embeddings()(tokens.to(self.device))

    @property
    def slots(self) -> int:
        return len(self.cached)

    def length(self, slot: int) -> int:
        return len(self.cached[slot])

    def truncate(self, slot: int, length: int) -> None:
        """Roll ``slot`` back to its first ``length`` tokens."""
        del self.cached[slot][length:]
        if self.features[slot] is not None:
            self.features[slot] = self.features[slot][:length]

    def commit(self, slot: int, tokens: list[int]) -> None:
        """``slot`` keeps ``tokens``, the first of those the last pass ran after its held tokens."""
        self.cached[slot] += tokens

    @torch.no_grad()
    def prefill(self, slot: int, prompt: list[int], all_features: bool, reach: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Start ``slot`` on ``prompt`` and run its prefill to the end (:meth:`start_prefill`) → its result."""
        prefill = self.start_prefill(slot, prompt, all_features, reach)
        while not prefill.done:
            prefill.step()
        return prefill.result()

    def start_prefill(self, slot: int, prompt: list[int], all_features: bool, reach: int = 0) -> Prefill:
        """Start ``slot`` on ``prompt``: keep the longest prefix of it the slot already holds (the previous turn of a
        conversation, a shared system prompt) and leave the rest to compute in chunks (eagerly, on every path),
        one chunk per :meth:`Prefill.step`; where every position's features are needed, the prefix whose features
        the slot kept.  ``reach``: the most tokens the request may come to hold (prompt, token budget, a last
        draft), which the static path sizes its passes by."""
        self.reach[slot] = reach
        reused = self._aligned(self.reusable(slot, prompt, all_features))
        self.truncate(slot, reused)
        return Prefill(self, slot, prompt, all_features, reused)

    def reusable(self, slot: int, prompt: list[int], all_features: bool = False) -> int:
        """How many of ``prompt``'s first tokens ``slot`` holds keys/values (and, with ``all_features``, features)
        for, short of its last token, which a prefill must compute for its logits."""
        held = self.cached[slot]
        if all_features:
            held = held[: 0 if self.features[slot] is None else len(self.features[slot])]
        return common_prefix(held, prompt[:-1])

    def _aligned(self, reused: int) -> int:
        """``reused`` prompt tokens cut back to a chunk boundary where fixed-width passes run below float32: a position is
        then computed in the same chunk as by a fresh prefill, which they need for the same result (their matmuls round
        by shape)."""
        if self.width > 1 and self.keys[0].dtype != torch.float32:
            return reused - reused % self.prefill_chunk
        return reused

    def borrow(self, slot: int, prompt: list[int], held: int, all_features: bool) -> tuple[int, torch.Tensor | None]:
        """Copy into ``slot``, which holds ``prompt``'s first ``held`` tokens, the longest prefix of it that another slot
        holds, where that is longer (requests that share a system prompt and tools, traces of one data set): its keys and
        values, so that a shared prefix is computed once whichever slots its requests take.  → how many tokens it copied
        (0: no slot holds more) and, with ``all_features``, their features (n, S, H)."""
        others = [other for other in range(self.slots) if other != slot]
        lengths = [self._aligned(self.reusable(other, prompt, all_features)) for other in others]
        length = max(lengths, default=0)
        if length <= held:
            return 0, None
        source = others[lengths.index(length)]
        for keys, values in zip(self.keys, self.values):
            keys[slot, :, held:length] = keys[source, :, held:length]
            values[slot, :, held:length] = values[source, :, held:length]
        self.commit(slot, prompt[held:length])
        return length - held, self.features[source][held:length] if all_features else None

    def verify(self, slots: list[int], tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run ``tokens`` (B, Q) after ``slots``' held tokens on this runner's path → logits (B', Q, V),
        features (B', Q, S, H) and ``index`` (B,): row b's outputs are row index[b] (B' = B when eager,
        the bucket when static).  Nothing is kept until ``commit``."""
        if tokens.shape[1] < self.width:  # padding after each row's own tokens: computed, never kept
            tokens = F.pad(tokens, (0, self.width - tokens.shape[1]))
        if self.path == "eager":
            logits, features = self.forward(slots, tokens)
            return logits, features, torch.arange(len(slots), device=self.device)
        return self._forward_static(slots, tokens)

    def verify_costs(self, widths: int, context: int = COST_CONTEXT, repeats: int = 5) -> list[float]:
        """ms of a pass of 1..``widths`` tokens at batch 1 after ``context`` tokens, measured once per runner
        (on slot 0, emptied afterwards)."""
        if len(self._verify_costs) < widths:
            self.commit(0, [0] * min(context, self.capacity - widths))
            # passes padded to ``width`` tokens cost the same: measured once, not as noise between equals
            measured = self.pass_costs([0], list(range(min(widths, self.width), widths + 1)), repeats)
            self._verify_costs = [measured[0]] * (min(widths, self.width) - 1) + measured
            self.truncate(0, 0)
        return self._verify_costs[:widths]

    def pass_costs(self, slots: list[int], widths: list[int], repeats: int) -> list[float]:
        """ms of a verify of each width for ``slots`` after the tokens they hold (median of ``repeats``):
        what a round costs here against the tokens it proposes."""
        costs = []
        for width in widths:
            tokens = torch.zeros(len(slots), width, dtype=torch.long, device=self.device)
            costs.append(median_ms(lambda: self.verify(slots, tokens), repeats, self.device))
        return costs

    @torch.no_grad()
    def forward(self, slots: list[int], tokens: torch.Tensor, logits_at_last: bool = False, features_at_last: bool = False):
        """The eager pass: ``tokens`` (B, Q) after ``slots``' held tokens → logits (B, Q or 1, V) and
        features (B, Q or 1, S, H) (S = 0 when no layer is captured)."""
        B, Q = tokens.shape
        lengths = [self.length(s) for s in slots]
        starts = torch.tensor(lengths, device=self.device)
        span = max(lengths) + Q
        self._check(span)
        self._reserve(span)
        positions = starts[:, None] + torch.arange(Q, device=self.device)  # (B, Q)
        mask = None
        if B > 1 or Q > 1:  # key j is visible to query (b, i) iff j ≤ positions[b, i]
            mask = (torch.arange(span, device=self.device) <= positions[..., None])[:, None]  # (B, 1, Q, span)
        start = lengths[0] if min(lengths) == max(lengths) else None
        return self._pass(self._rows(slots), tokens.to(self.device), positions, span, mask, logits_at_last, features_at_last, start)

    def _forward_static(self, slots: list[int], tokens: torch.Tensor):
        """The fixed-shape pass over the first ``bucket`` slots; rows not in ``slots`` are padding (their
        keys/values land past their held tokens, where nothing reads them)."""
        bucket = bucket_for(max(slots) + 1, self.slots)
        Q = tokens.shape[1]
        span = max(self.length(s) for s in slots) + Q
        self._check(span)
        reach = max(span, *(min(self.reach[s], self.capacity) for s in slots))
        self._reserve(reach)
        for slot in set(range(bucket)) - set(slots):  # a padding row must not write past the allocation
            self.truncate(slot, min(self.length(slot), self.keys[0].shape[2] - Q))
        index = torch.tensor(slots, device=self.device)
        padded = torch.zeros(bucket, Q, dtype=torch.long, device=self.device).index_copy_(0, index, tokens.to(self.device))
        lengths = torch.tensor([self.length(s) for s in range(bucket)], device=self.device)
        # A graph reads the whole allocation.  Eagerly, a pass attends over what its rows' requests can
        # reach (their ``reach``, rounded up to a step): the same keys for every pass of a request, so every
        # method computes a position alike, without attending to all that was ever allocated.
        allocated = self.keys[0].shape[2]
        span = allocated if self.graphs.enabled else min(allocated, -(-reach // SPAN_STEP) * SPAN_STEP)
        logits, features = self.graphs.run((bucket, Q, span), lambda t, n: self._static_pass(t, n, span), padded, lengths)
        return logits, features, index

    def _static_pass(self, tokens: torch.Tensor, lengths: torch.Tensor, span: int):
        """tokens (bucket, Q) after lengths (bucket,) held tokens, attending over the first ``span`` cache entries."""
        positions = lengths[:, None] + torch.arange(tokens.shape[1], device=self.device)
        mask = (torch.arange(span, device=self.device) <= positions[..., None])[:, None]
        return self._pass(slice(0, tokens.shape[0]), tokens, positions, span, mask, False, False)

    @torch.no_grad()
    def _pass(self, rows, tokens, positions, span, mask, logits_at_last, features_at_last, start: int | None = None):
        """The model's layers over ``tokens`` (B, Q) at ``positions`` (B, Q) of cache ``rows``, attending to
        the first ``span`` cache entries under ``mask`` (B, 1, Q, span) or causally alone (None).  ``start``: the
        position every row's tokens begin at, where the host knows it (the keys/values are then written as a slice)."""
        inner, ops = self.model.model, self.ops
        h = inner.embed_tokens(tokens)
        at = PassPositions(rows, self._row_index(rows), positions, span, mask, start, *inner.rotary_emb(h, positions))
        x = ops.norm(h, self.first_norm)
        if self.kernel_layers is not None and tokens.numel() <= QUANTIZED_ROWS and tokens.shape[1] <= KERNEL_TOKENS:
            h, x, captured = self.kernel_layers.run(h, x, self.keys, self.values, at.cos, at.sin, at.slots, at.positions[:, 0],
                                                    self.capture_layers)
            captured = [c[:, -1:] for c in captured] if features_at_last else captured
        else:
            captured = []
            for index, ((attention, post_attention, after), linears) in enumerate(zip(self.layer_params, self.linears.layers)):
                attended = ops.attention(attention, linears.qkv.fused(x), self.keys[index], self.values[index], at)
                h, x = ops.add_norm(h, linears.o.fused(attended), post_attention)
                h, x = ops.add_norm(h, linears.down.fused(ops.gate(linears.gate_up.fused(x), linears.act)), after)
                if index in self.capture_layers:
                    captured.append(h[:, -1:] if features_at_last else h)
        if len(self.layers) in self.capture_layers:  # feature id L: the final-normed output (the release's last slot)
            captured.append(x[:, -1:] if features_at_last else x)
        B, Q = tokens.shape
        if captured:
            features = torch.stack(captured, dim=2)
        else:
            features = h.new_zeros(B, 1 if features_at_last else Q, 0, h.shape[-1])
        return self.linears.lm_head(x[:, -1:] if logits_at_last else x), features

    def _check(self, span: int) -> None:
        if span > self.capacity:
            raise DliteError(f"the sequence needs {span} tokens of KV cache, more than the engine's capacity of {self.capacity}")

    def _reserve(self, span: int) -> None:
        """Grow the cache (doubling, up to ``capacity``) so that every slot holds ``span`` tokens."""
        allocated = self.keys[0].shape[2]
        if span <= allocated:
            return
        grown = min(self.capacity, max(span, 2 * allocated))
        pad = lambda t: F.pad(t, (0, 0, 0, grown - allocated))  # noqa: E731
        self.keys = [pad(k) for k in self.keys]
        self.values = [pad(v) for v in self.values]
        self.graphs.clear()  # they read the old tensors

    def _rows(self, slots: list[int]):
        """An index for the cache's slot dimension: a slice (a view, no copy) when the slots are contiguous."""
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return slice(slots[0], slots[0] + len(slots))
        return torch.tensor(slots, device=self.device)

    def _row_index(self, rows) -> torch.Tensor:
        return torch.arange(rows.start, rows.stop, device=self.device) if isinstance(rows, slice) else rows

class Prefill:
    """A prompt's prefill into one slot, a chunk of ``prefill_chunk`` tokens per :meth:`step`, so an engine can run
    other rows' decode rounds between its chunks (``TargetRunner.start_prefill``)."""

    def __init__(self, runner: TargetRunner, slot: int, prompt: list[int], all_features: bool, reused: int):
        self.runner, self.slot, self.prompt, self.all_features, self.reused = runner, slot, prompt, all_features, reused
        self.position = reused  # prompt[:position] is in the slot's cache
        self.features = [runner.features[slot]] if all_features and reused else []
        self.logits: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self.position == len(self.prompt)

    def step(self) -> None:
        """Compute the next chunk of the prompt into the slot; before the first, copy what another slot holds of it (prefills
        run one after another, so no slot holds more of it later)."""
        runner = self.runner
        if self.logits is None:
            copied, copied_features = runner.borrow(self.slot, self.prompt, self.position, self.all_features)
            self.position, self.reused = self.position + copied, self.reused + copied
            if copied_features is not None:
                self.features.append(copied_features)
        chunk = self.prompt[self.position : self.position + runner.prefill_chunk]
        logits, features = runner.forward([self.slot], torch.tensor([chunk], device=runner.device), logits_at_last=True,
                                          features_at_last=not self.all_features)
        runner.commit(self.slot, chunk)
        self.position += len(chunk)
        self.logits = logits[0, -1]
        self.features = self.features + [features[0]] if self.all_features else [features[0]]

    def result(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """→ logits at the last position (V,), features (P, S, H) at every position if ``all_features`` else (1, S, H)
        at the last one, and how many prompt tokens were reused."""
        if not self.all_features:
            return self.logits, self.features[-1], self.reused
        features = torch.cat(self.features)
        if self.runner.keep_features:
            self.runner.features[self.slot] = features
        return self.logits, features, self.reused


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (list slices compare in C: a bisection over them)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if a[:middle] == b[:middle] else (low, middle)
    return low
