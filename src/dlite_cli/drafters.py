"""Drafters behind one small interface, each a thin adapter the engine calls once per round.

    propose(rows, pick) → Draft          K proposals per row (fewer where a row has nothing to say)
    begin(row, prompt_features)          a row joins (history drafters build their draft KV cache)
    extend(row, features)                positions that became history this round (history drafters)
    end(row)                             a row leaves
    kv_bytes(row)                        draft-side KV cache held for the row (0 for DLite)

``row`` is the engine's Request: ``slot``, ``tokens`` (committed ids, the anchor last), ``pivot``
(S, H) target features at the position before the anchor, ``anchor`` and ``position`` (its
absolute position).  Methods: ``none`` (autoregressive), ``ngram`` (prompt lookup), ``dlite`` and
``parallel`` (W = 0 checkpoints, with or without the sequential head), ``history`` (W ≠ 0: the
teacher or a sliding-window drafter, which must keep a KV cache over the history — the cost
DLite removes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import DliteError
from .graphs import BUCKETS, CudaGraphs, bucket_for
from .model import FULL_HISTORY, Drafter, History, greedy_pick

# drafter names → the run-directory stage whose export they load
STAGE_OF = {"dlite": "stable", "history": "train-teacher", "parallel": "stable-parallel", "scratch": "stable-scratch"}
NGRAM_SIZES = (3, 2, 1)  # prompt lookup tries the longest suffix first


@dataclass
class Draft:
    tokens: torch.Tensor  # (B, K) long; positions at or beyond a row's length are padding
    lengths: list[int]  # (B,) proposals per row
    logits: torch.Tensor | None  # (B, K, V) the drafter's logits, or None: each proposal is certain (point mass)


class NoDrafter:
    """Plain autoregressive decoding: nothing proposed, one target step per token."""

    name, draft_tokens, needs_all_features = "none", 0, False
    target_layers: list[int] = []  # the target layers whose states the drafter reads

    def propose(self, rows, pick) -> Draft:
        return Draft(torch.zeros(len(rows), 0, dtype=torch.long), [0] * len(rows), None)

    def begin(self, row, prompt_features) -> None:
        pass

    def extend(self, row, features) -> None:
        pass

    def end(self, row) -> None:
        pass

    def kv_bytes(self, row) -> int:
        return 0


class NgramDrafter(NoDrafter):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens and propose
    the K tokens that followed it.  Training-free; strong when outputs copy from the context."""

    name, needs_all_features = "ngram", False

    def __init__(self, draft_tokens: int):
        self.draft_tokens = draft_tokens

    def propose(self, rows, pick) -> Draft:
        proposals = [self._lookup(torch.tensor(row.tokens)) for row in rows]
        tokens = torch.zeros(len(rows), self.draft_tokens, dtype=torch.long)
        for b, proposal in enumerate(proposals):
            tokens[b, : len(proposal)] = proposal
        return Draft(tokens, [len(p) for p in proposals], None)

    def _lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        for n in NGRAM_SIZES:
            if len(tokens) <= n:
                continue
            windows = tokens[:-1].unfold(0, n, 1)  # (T − n, n): every earlier n-gram
            hits = (windows == tokens[-n:]).all(dim=1).nonzero().flatten()
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start : start + self.draft_tokens]
        return tokens[:0]


class DLiteAdapter(NoDrafter):
    """A W = 0 checkpoint (DLite, or the parallel ablation): one block from the pivot features and the anchor.

    Its round has fixed shapes whatever the context, so with ``graphs`` a greedy round is one CUDA
    graph per batch bucket (rows padded with copies of the first)."""

    needs_all_features = False

    def __init__(self, drafter: Drafter, embed, name: str, graphs: bool = False):
        self.drafter, self.embed, self.name = drafter, embed, name
        self.draft_tokens, self.target_layers = drafter.spec.draft_tokens, drafter.spec.target_layer_ids
        self.graphs = CudaGraphs(enabled=graphs)

    def propose(self, rows, pick) -> Draft:
        context, anchors = self._inputs(rows)
        if self.graphs.enabled and pick is greedy_pick:
            B = len(rows)
            rows_padded = [*range(B), *[0] * (bucket_for(B, max(B, BUCKETS[-1])) - B)]
            tokens, logits = self.graphs.run(len(rows_padded), self._block, context[rows_padded], anchors[rows_padded])
            tokens, logits = tokens[:B], logits[:B]
        else:
            tokens, logits = self._block(context, anchors, pick)
        return Draft(tokens, [self.draft_tokens] * len(rows), logits)

    def _inputs(self, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' pivot features (B, S, H) in the drafter's dtype and anchors (B,), on its device."""
        return torch.stack([row.pivot for row in rows]).to(self._dtype), torch.tensor([row.anchor for row in rows], device=self._device)

    def _block(self, context, anchors, pick=greedy_pick, history: History | None = None):
        """context (B, S, H), anchors (B,) → draft tokens (B, K), logits (B, K, V)."""
        return self.drafter.draft(context, self.embed(anchors).to(self._dtype), anchors, history, pick)

    @property
    def _device(self) -> torch.device:
        return self.drafter.placeholders.device

    @property
    def _dtype(self) -> torch.dtype:
        return self.drafter.placeholders.dtype


class HistoryAdapter(DLiteAdapter):
    """A W ≠ 0 checkpoint (the teacher, or a sliding window): keeps, per row, a draft KV cache of
    per-layer keys/values over every history position, extended as tokens are accepted."""

    needs_all_features = True

    def __init__(self, drafter: Drafter, embed, name: str, capacity: int):
        super().__init__(drafter, embed, name)  # its cache grows every round: never a CUDA graph
        self.capacity = capacity
        self.window = drafter.spec.history_window
        self.cache: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], int]] = {}

    def begin(self, row, prompt_features) -> None:
        """prompt_features (P, S, H): positions 0..P−2 are history, P−1 is the pivot."""
        spec = self.drafter.spec
        shape = (1, spec.num_kv_heads, self.capacity, spec.head_dim)
        zeros = [torch.zeros(shape, dtype=self._dtype, device=self._device) for _ in range(2 * spec.num_layers)]
        self.cache[row.slot] = (zeros[: spec.num_layers], zeros[spec.num_layers :], 0)
        self.extend(row, prompt_features[:-1])

    @torch.no_grad()
    def extend(self, row, features) -> None:
        """features (n, S, H) of the next n history positions."""
        keys, values, length = self.cache[row.slot]
        if len(features):
            new = self.drafter.history_kv(features.to(self._dtype).flatten(1)[None], start=length)
            for layer, (k, v) in enumerate(new):
                keys[layer][:, :, length : length + len(features)] = k
                values[layer][:, :, length : length + len(features)] = v
        self.cache[row.slot] = (keys, values, length + len(features))

    def propose(self, rows, pick) -> Draft:
        context, anchors = self._inputs(rows)
        tokens, logits = self._block(context, anchors, pick, self._history(rows))
        return Draft(tokens, [self.draft_tokens] * len(rows), logits)

    def end(self, row) -> None:
        self.cache.pop(row.slot, None)

    def kv_bytes(self, row) -> int:
        keys, values, length = self.cache[row.slot]
        per_position = sum(k[:, :, :1].numel() * k.element_size() for k in keys + values)
        return per_position * self._visible(length)

    def _visible(self, length: int) -> int:
        return length if self.window == FULL_HISTORY else min(length, self.window)

    def _history(self, rows) -> History:
        """The rows' caches, left-aligned and padded to the longest, with a mask of real entries;
        a sliding window reads only its last W entries."""
        spans = []
        for row in rows:
            length = self.cache[row.slot][2]
            spans.append((length - self._visible(length), length))
        width = max(end - start for start, end in spans)
        if len(rows) == 1:
            keys, values, _ = self.cache[rows[0].slot]
            start, end = spans[0]
            kv = [(k[:, :, start:end], v[:, :, start:end]) for k, v in zip(keys, values)]
            mask = torch.ones(1, width, dtype=torch.bool, device=self._device)
        else:
            spec, device = self.drafter.spec, self._device
            kv = []
            for layer in range(spec.num_layers):
                k = torch.zeros(len(rows), spec.num_kv_heads, width, spec.head_dim, dtype=self._dtype, device=device)
                v = torch.zeros_like(k)
                for b, (row, (start, end)) in enumerate(zip(rows, spans)):
                    keys, values, _ = self.cache[row.slot]
                    k[b, :, : end - start] = keys[layer][0, :, start:end]
                    v[b, :, : end - start] = values[layer][0, :, start:end]
                kv.append((k, v))
            lengths = torch.tensor([end - start for start, end in spans], device=device)
            mask = torch.arange(width, device=device)[None] < lengths[:, None]
        return History(kv, mask, torch.tensor([row.position for row in rows], device=self._device))



def resolve_drafter_path(name: str, run_dir: Path) -> Path:
    """``dlite``/``history``/``parallel``/``scratch`` → the run directory's export; anything else is a path."""
    if name in STAGE_OF:
        path = Path(run_dir) / STAGE_OF[name] / "drafter"
        if not (path / "config.json").is_file():
            raise DliteError(f"no {name} drafter in {run_dir}: {path} does not exist (train the `{STAGE_OF[name]}` stage first, or pass a path)")
        return path
    path = Path(name)
    if not path.is_dir():
        raise DliteError(f"unknown drafter {name!r}: expected none, ngram, {', '.join(STAGE_OF)} or an exported drafter directory")
    return path


def load_proposer(name: str, run_dir: Path, target_model, capacity: int, ngram_tokens: int = 7, dtype: str = "float32", path: str = "eager"):
    """The drafter adapter for ``name`` (see resolve_drafter_path), fitted to ``target_model``,
    run in ``dtype`` on the target's device; ``path`` graphs captures DLite's rounds as CUDA graphs."""
    if name == "none":
        return NoDrafter()
    if name == "ngram":
        return NgramDrafter(ngram_tokens)
    path = resolve_drafter_path(name, run_dir)
    drafter = Drafter.load(path, target_model.config).eval()
    drafter.to(next(target_model.parameters()).device, getattr(torch, dtype))
    embed = target_model.get_input_embeddings()
    label = name if name in STAGE_OF else path.name
    if drafter.spec.history_window != 0:
        return HistoryAdapter(drafter, embed, label, capacity)
    return DLiteAdapter(drafter, embed, label, graphs=path == "graphs")
