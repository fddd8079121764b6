"""The interface every proposer has, and what building one may use.

    propose(rows, pick) → Draft          up to K proposals per row (fewer where they would not pay)
    observe(row, accepted, next_token)   how many of this round's proposals the target accepted
    begin(row, prompt_features)          a row joins (history drafters build their draft KV cache)
    extend(row, features)                positions that became history this round (history drafters)
    end(row)                             a row leaves
    kv_bytes(row)                        draft-side KV cache held for the row (0 for DLite)
    adapt(costs)                         propose adaptively from now on (adaptive.py)
    build(setup) (class method)          a new one from a ProposerSetup: what decoding/methods.py's registry calls
    vllm_config(K, suffix) (class method) vLLM's speculative_config for it, or a one-sentence refusal (the default)

``row`` is the engine's Request: ``slot``, ``tokens`` (committed ids, the anchor last), ``pivot`` (S, H) target
features at the position before the anchor, ``anchor`` and ``position`` (its absolute position).  A proposer owns
its K (``draft_tokens``: the most it proposes a round; a checkpoint's own, else the config's ``drafter.draft_tokens``),
and the engine, its passes and its room for new tokens all read K from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...core.config import SuffixConfig
from ...core.errors import DliteError
from ...models.model import greedy_pick
from ..adaptive import Candidate, VerifyCosts

CONFIDENCE_BINS = 20  # a proposal's estimated probability is calibrated per bin of this width (1/20)


@dataclass
class Draft:
    tokens: torch.Tensor  # (B, K) long; positions at or beyond a row's length are padding
    lengths: list[int]  # (B,) proposals per row
    logits: torch.Tensor | None  # (B, K, V) the drafter's logits for sampling rows, or None: each proposal is certain (point mass)
    confidence: torch.Tensor | None = None  # (B, K) the drafter's probability of each proposal, if it has one


@dataclass
class ProposerSetup:
    """What building a proposer may use (decoding/methods.py fills it from the config and the loaded target)."""

    draft_tokens: int  # K for a proposer without a checkpoint (a checkpoint's own K wins)
    suffix: SuffixConfig  # suffix decoding's settings
    target_model: Any = None  # the loaded target: a checkpoint's drafter takes its device, config and embeddings
    capacity: int = 0  # positions per row: a history drafter's KV cache grows up to this
    dtype: str = "float32"  # a checkpoint's drafter runs in this dtype (auto: model.draft_dtype)
    path: str = "eager"  # the decode path: graphs captures DLite's rounds as CUDA graphs
    log: Callable[[str], None] = print


class Proposer:
    """The base of every proposer: the interface above, each hook doing nothing until a proposer needs it."""

    name, draft_tokens, needs_all_features = "", 0, False  # needs_all_features: every position's target features, not the pivot's alone
    target_layers: list[int] = []  # the target layers whose states the proposer reads
    costs: VerifyCosts | None = None  # set by ``adapt``: then proposals are adaptive

    @classmethod
    def build(cls, setup: ProposerSetup) -> Proposer:
        """A new proposer from ``setup``: how the registry (decoding/methods.PROPOSERS) makes one."""
        raise NotImplementedError

    @classmethod
    def vllm_config(cls, draft_tokens: int, suffix: SuffixConfig) -> dict | None:
        """vLLM's ``speculative_config`` for this proposer drafting up to ``draft_tokens`` (None: vLLM decodes plainly),
        with suffix decoding's ``suffix`` settings; refused in one sentence where vLLM has no such method, as here."""
        raise DliteError(f"vLLM has no speculative method for {cls.name}: decode it in dlite's engine (--engine dlite)")

    def adapt(self, costs: VerifyCosts) -> None:
        """Propose adaptively from now on, at the target's verify ``costs`` measured on this machine."""
        self.costs = costs

    def propose(self, rows, pick) -> Draft:
        """Up to K proposals for each of ``rows``; ``pick`` chooses a proposal from logits (greedy_pick, or vLLM's sampling.SamplingPick)."""
        raise NotImplementedError

    def observe(self, row, accepted: int, next_token: int | None) -> None:
        """The target accepted ``accepted`` of this round's proposals for ``row``; ``next_token`` is its own
        next token for a greedy row (None when sampled)."""

    def begin(self, row, prompt_features) -> None:
        pass

    def extend(self, row, features) -> None:
        pass

    def end(self, row) -> None:
        pass

    def kv_bytes(self, row) -> int:
        return 0


def cut(candidates: list[Candidate], length: int) -> None:
    """Each candidate proposes as many of its tokens as fit ``length``, the round's one length: a batched pass
    costs its widest row, so every row proposes up to it."""
    for candidate in candidates:
        candidate.proposed = min(len(candidate.tokens), length)


def for_rows(pick, indices: list[int]):
    """``pick`` (greedy_pick, or vLLM's sampling.SamplingPick for all the round's rows) for the rows ``indices`` alone:
    a sampling row's proposals are drawn with its own parameters and generator, whichever rows are drafted."""
    return pick if pick is greedy_pick else pick.subset(indices)


def one_hot_logits(tokens: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits (B, K, V) of proposals that are certain: 0 at each token, −inf elsewhere (q is a point mass), in
    ``dtype`` (a model drafter's, where its rows' logits are copied in)."""
    logits = torch.full((*tokens.shape, vocab_size), float("-inf"), device=tokens.device, dtype=dtype)
    return logits.scatter_(-1, tokens[..., None], 0.0)


def merged(tokens: torch.Tensor, lengths: list[int], rows: list[int], draft: Draft) -> Draft:
    """The round's Draft over all B rows: ``draft``, a model's for the round's rows ``rows``, written into ``tokens``
    (B, K), whose other rows hold certain proposals (or none)."""
    index = torch.tensor(rows, device=tokens.device)
    tokens.index_copy_(0, index, draft.tokens.to(tokens.device))
    if draft.logits is None:
        return Draft(tokens, lengths, None)
    logits = one_hot_logits(tokens, draft.logits.shape[-1], draft.logits.dtype).index_copy_(0, index, draft.logits.to(tokens.device))
    return Draft(tokens, lengths, logits)
