"""The sampling math of speculative decoding: the distribution a row samples from, and accepting a round's
proposals, greedy (the longest prefix equal to the target's argmax) or by speculative rejection sampling, which keeps
the output distributed exactly as the target's own samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .requests import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits (..., V) → the distribution to sample from, after temperature, top-k and top-p."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the tokens ranked above
        sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Where to sample after rejecting a draft: norm(max(p − q, 0)) (p, q (V,))."""
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    return residual / total if total > 0 else p


def accept_sampled(target_logits, drafts, draft_logits, params, generator) -> tuple[int, int]:
    """Speculative rejection sampling for one row.

    target_logits (L+1, V); drafts (L,); draft_logits (L, V) or None for certain proposals.
    Draft i is kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the
    next token comes from the residual; if all L are kept, from p_{L+1}.  → (accepted n, next token).
    """
    p = probabilities(target_logits.cpu(), params)
    if draft_logits is None:
        q = torch.nn.functional.one_hot(drafts.cpu(), p.shape[-1]).float()
    else:
        q = probabilities(draft_logits.cpu(), params)
    for i, token in enumerate(drafts.tolist()):
        if torch.rand((), generator=generator) * q[i, token] < p[i, token]:
            continue
        return i, sample(residual_distribution(p[i], q[i]), generator)
    return len(drafts), sample(p[len(drafts)], generator)


def accept_greedy(choice: torch.Tensor, draft: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """choice (B, L+1) the target's argmax, draft (B, L), lengths (B,) → accepted n (B,), next tokens (B,)."""
    L = draft.shape[1]
    agree = (draft == choice[:, :L]) & (torch.arange(L, device=draft.device) < lengths[:, None])
    n = agree.long().cumprod(dim=1).sum(dim=1)
    return n, choice.gather(1, n[:, None])[:, 0]


@dataclass
class SamplingPick:
    """A drafter's choice of each proposal for ``rows``: logits (B, V), row b of them ``rows[b]``'s → (B,) a sample
    from the tempered/top-k/top-p distribution the target will use for that row, with its generator (argmax for a
    greedy row).  A drafter that drafts only some rows picks for them with :meth:`subset`."""

    rows: list

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        chosen = logits.argmax(-1)
        for b, row in enumerate(self.rows):
            if not row.params.greedy:
                chosen[b] = sample(probabilities(logits[b], row.params), row.generator)
        return chosen

    def subset(self, indices: list[int]) -> "SamplingPick":
        """The pick for ``rows[i]`` for each i in ``indices``, in that order."""
        return SamplingPick([self.rows[i] for i in indices])
