"""``dlite`` (and ``parallel``, ``scratch``): a history-free (W = 0) drafter checkpoint."""

from __future__ import annotations

import torch

from ...models.draft_round import DraftRound
from ...models.graphs import BUCKETS, CudaGraphs, bucket_for
from ...models.model import Drafter, History, greedy_pick
from .base import Draft
from .model import ModelDrafter, draft_round_ms


class DLiteAdapter(ModelDrafter):
    """A W = 0 checkpoint (DLite, or the parallel ablation): one block from the pivot features and the anchor.

    Its round (models/draft_round.py) has fixed shapes whatever the context, so with ``graphs`` a greedy round
    is one CUDA graph per batch bucket (rows padded with copies of the first)."""

    def __init__(self, drafter: Drafter, embed, name: str, graphs: bool = False):
        super().__init__(name, drafter.spec.draft_tokens, drafter.spec.target_layer_ids)
        self.drafter, self.embed = drafter, embed
        self.round = DraftRound(drafter) if drafter.spec.history_window == 0 else None
        self.graphs = CudaGraphs(enabled=graphs)

    def _model_draft(self, rows, pick) -> Draft:
        context, group = self._inputs(rows)
        if self.graphs.enabled and pick is greedy_pick:
            B = len(rows)
            rows_padded = [*range(B), *[0] * (bucket_for(B, max(B, BUCKETS[-1])) - B)]
            tokens, logits, confidence = self.graphs.run(len(rows_padded), self._block, context[rows_padded], group[rows_padded])
            tokens, logits, confidence = tokens[:B], logits[:B], confidence[:B]
        else:
            tokens, logits, confidence = self._block(context, group, pick, self._history(rows))
        logits = None if pick is greedy_pick else self.drafter.full_vocab_logits(logits)
        return Draft(tokens, [self.draft_tokens] * len(rows), logits, confidence)

    def _inputs(self, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' pivot features (B, S, H) in the drafter's dtype and anchor groups (B, G) (the anchor last), on its device."""
        group = [row.last_tokens(self.drafter.spec.anchor_group) for row in rows]
        return torch.stack([row.pivot for row in rows]).to(self._dtype), torch.tensor(group, device=self._device)

    def _block(self, context, group, pick=greedy_pick, history: History | None = None):
        """context (B, S, H), anchor groups (B, G) → draft tokens (B, K), logits (B, K, V'), confidence (B, K)."""
        if self.round is not None:
            return self.round(context, group, self.embed, pick)
        return self.drafter.draft(context, group, self.embed, history, pick)

    def _history(self, rows) -> History | None:
        return None

    def round_ms(self) -> float:
        return draft_round_ms(self.drafter, self.embed)

    @property
    def _device(self) -> torch.device:
        return self.drafter.norm.weight.device

    @property
    def _dtype(self) -> torch.dtype:
        return self.drafter.norm.weight.dtype
