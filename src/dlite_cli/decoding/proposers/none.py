"""``none``: plain autoregressive decoding, nothing proposed."""

from __future__ import annotations

import torch

from .base import Draft, Proposer, ProposerSetup


class NoDrafter(Proposer):
    """Plain autoregressive decoding: nothing proposed, one target step per token."""

    name = "none"

    @classmethod
    def build(cls, setup: ProposerSetup) -> NoDrafter:
        return cls()

    @classmethod
    def vllm_config(cls, draft_tokens: int, suffix) -> None:
        return None

    def propose(self, rows, pick) -> Draft:
        return Draft(torch.zeros(len(rows), 0, dtype=torch.long), [0] * len(rows), None)
