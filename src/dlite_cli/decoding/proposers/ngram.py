"""``ngram``: prompt lookup."""

from __future__ import annotations

import torch

from ..adaptive import Calibration
from .base import ProposerSetup
from .copying import LookupDrafter

NGRAM_SIZES = (3, 2, 1)  # prompt lookup tries the longest suffix first
LOOKUP_PRIOR = {3: 0.6, 2: 0.4, 1: 0.2}  # a lookup proposal's chance of acceptance by match length, before any is seen


class NgramDrafter(LookupDrafter):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens and propose
    the K tokens that followed it.  Training-free; strong when outputs copy from the context.  Its
    chance of acceptance is learnt per match length and position."""

    name = "ngram"

    def __init__(self, draft_tokens: int):
        super().__init__(draft_tokens, Calibration(prior=lambda key: LOOKUP_PRIOR[key[0]]))  # key: (match length, position)

    @classmethod
    def build(cls, setup: ProposerSetup) -> NgramDrafter:
        return cls(setup.draft_tokens)

    @classmethod
    def vllm_config(cls, draft_tokens: int, suffix) -> dict:
        """vLLM's n-gram speculator, looking up the same suffix lengths."""
        return {"method": "ngram", "prompt_lookup_min": min(NGRAM_SIZES), "prompt_lookup_max": max(NGRAM_SIZES), "num_speculative_tokens": draft_tokens}

    def continuation(self, row) -> tuple[list[int], list]:
        continuation, n = self._lookup(torch.tensor(row.tokens))
        return continuation.tolist(), [(n, i) for i in range(len(continuation))]

    def _lookup(self, tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The continuation after the latest earlier match of the longest suffix that has one, and its length n."""
        for n in NGRAM_SIZES:
            if len(tokens) <= n:
                continue
            windows = tokens[:-1].unfold(0, n, 1)  # (T − n, n): every earlier n-gram
            hits = (windows == tokens[-n:]).all(dim=1).nonzero().flatten()
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start : start + self.draft_tokens], n
        return tokens[:0], 0

