"""The base of the proposers that copy (``ngram``, ``suffix``): continuations found in token ids alone, no model run."""

from __future__ import annotations

import torch

from ..adaptive import Calibration, Candidate
from .base import Draft, Proposer, cut


class LookupDrafter(Proposer):
    """A drafter that copies: each round a row's ``candidate`` continuation, found in token ids alone, with a
    calibration key per token, of which as much is proposed as is expected to pay.  Its proposals are
    deterministic (q is one-hot), so sampling stays exact."""

    def __init__(self, draft_tokens: int, calibration: Calibration):
        self.draft_tokens, self.calibration = draft_tokens, calibration
        self.proposed: dict[int, Candidate] = {}  # slot → this round's candidate

    def propose(self, rows, pick) -> Draft:
        tokens = torch.zeros(len(rows), self.draft_tokens, dtype=torch.long)
        candidates = [self.candidate(row) for row in rows]
        if self.costs is not None:  # one length for the batch, weighed for all its rows at what their pass costs
            cut(candidates, self.costs.at(len(rows)).best_length([self.accepts(c) for c in candidates], 0.0))
        for b, (row, candidate) in enumerate(zip(rows, candidates)):
            self.proposed[row.slot] = candidate
            tokens[b, : len(candidate.tokens)] = torch.tensor(candidate.tokens)
        return Draft(tokens, [c.proposed for c in candidates], None)

    def candidate(self, row) -> Candidate:
        """The continuation for ``row``, all of it proposed (a round over several rows cuts it to the length they share)."""
        continuation, keys = self.continuation(row)
        return Candidate(continuation, keys, len(keys))

    def accepts(self, candidate: Candidate) -> list[float]:
        """Each of the candidate's tokens' chance of acceptance, given the ones before it were accepted."""
        return [self.calibration.estimate(k) for k in candidate.keys]

    def continuation(self, row) -> tuple[list[int], list]:
        """Up to K token ids that may follow ``row``'s tokens, and the calibration key of each."""
        raise NotImplementedError

    def expected_gain(self, candidate: Candidate, length: int) -> float:
        """Expected accepted tokens of the candidate's first ``length`` tokens, proposed."""
        expected, reach = 0.0, 1.0
        for key in candidate.keys[:length]:
            reach *= self.calibration.estimate(key)
            expected += reach
        return expected

    def observe(self, row, accepted: int, next_token: int | None) -> None:
        if row.slot in self.proposed:
            self.calibration.observe_round(self.proposed.pop(row.slot), accepted, next_token)

