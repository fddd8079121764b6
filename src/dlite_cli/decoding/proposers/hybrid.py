"""``NAME+ngram``, ``NAME+suffix``: a history-free drafter paired with a copying proposer, row by row."""

from __future__ import annotations

import torch

from ...models.model import greedy_pick
from ..adaptive import Candidate, VerifyCosts
from .base import Draft, Proposer, cut, for_rows, merged, one_hot_logits
from .copying import LookupDrafter
from .model import ModelDrafter


class HybridDrafter(Proposer):
    """``dlite+ngram`` and ``dlite+suffix``: per row and round, the copying drafter's continuation (prompt lookup's or
    suffix decoding's) when it is expected to commit tokens at least as fast as the model drafter's recent rounds for
    that row did (adaptive: per ms, the model's round paying its draft and its wider verify; fixed: per round), the
    model's block otherwise.  Copying reads the token ids the engine holds and DLite keeps no history, so the hybrid
    holds no draft KV cache either; rows that take the copy cost the model nothing."""

    def __init__(self, model: ModelDrafter, lookup: LookupDrafter, vocab_size: int):
        self.model, self.lookup, self.vocab_size = model, lookup, vocab_size
        self.name = f"{model.name}+{lookup.name}"
        self.draft_tokens, self.target_layers = model.draft_tokens, model.target_layers

    def adapt(self, costs: VerifyCosts) -> None:
        super().adapt(costs)
        self.model.adapt(costs)
        self.lookup.adapt(costs)

    def propose(self, rows, pick) -> Draft:
        B, K = len(rows), self.draft_tokens
        tokens = torch.zeros(B, K, dtype=torch.long, device=self.model._device)
        lookups = {}  # row → its lookup candidate, where the lookup drafts it
        for b, row in enumerate(rows):
            candidate = self.lookup.candidate(row)
            if candidate.tokens and self._lookup_first(candidate, row.slot):
                lookups[b] = self.lookup.proposed[row.slot] = candidate
        by_model = [b for b in range(B) if b not in lookups]
        accepts = [self.lookup.accepts(c) for c in lookups.values()]
        draft = self.model.propose([rows[b] for b in by_model], for_rows(pick, by_model), batch=B, others=accepts) if by_model else None
        lengths = [0] * B
        for i, b in enumerate(by_model):
            lengths[b] = draft.lengths[i]
        if self.costs is None:
            length = K
        elif any(lengths):  # the model's rows and the lookup's share the length the model weighed for all of them
            length = max(lengths)
        else:
            length = self.costs.at(B).best_length(accepts, 0.0)
        cut(list(lookups.values()), length)
        for b, candidate in lookups.items():
            tokens[b, : len(candidate.tokens)] = torch.tensor(candidate.tokens)
            lengths[b] = candidate.proposed
        if draft is None:
            return Draft(tokens, lengths, None if pick is greedy_pick else one_hot_logits(tokens, self.vocab_size))
        return merged(tokens, lengths, by_model, draft)

    def _lookup_first(self, candidate: Candidate, slot: int) -> bool:
        """Whether the lookup's ``candidate`` is expected to commit at least what the model's rounds did for the row.
        Adaptive, each at the length that pays best for it (the candidate's as if the row were drafted alone: which of
        the two suits the row does not depend on the rest of the batch, which then decides the length they share)."""
        accepted, proposed = self.model.gain.expected(slot)
        if self.costs is None:
            return self.lookup.expected_gain(candidate, len(candidate.tokens)) >= accepted
        length = self.costs.best_length([self.lookup.accepts(candidate)], 0.0)
        expected = self.lookup.expected_gain(candidate, length)
        return length > 0 and self.costs.rate(expected, length, 0.0) >= self.costs.rate(accepted, proposed, self.model.draft_ms)

    def observe(self, row, accepted: int, next_token: int | None) -> None:
        self.lookup.observe(row, accepted, next_token)  # whichever of the two proposed for the row this round
        self.model.observe(row, accepted, next_token)

    def begin(self, row, prompt_features) -> None:
        self.model.begin(row, prompt_features)
        self.lookup.begin(row, prompt_features)

    def end(self, row) -> None:
        self.model.end(row)
        self.lookup.end(row)
