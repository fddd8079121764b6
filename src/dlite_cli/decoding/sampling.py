"""The sampling math of speculative decoding: the distribution a row samples from, and accepting a round's proposals.

Greedy, a proposal is kept while it equals the target's argmax.  Sampling, the target draws its token at each position
of the pass from its own distribution there, with randomness that depends on the request's seed and the position alone
(:func:`draw`), and a proposal is kept exactly when it equals the target's draw.  Every token written is then the
target's own sample given the text before it, so the output is distributed exactly as plain sampling's; and since no
draw depends on what was proposed, or on which rows shared the pass, the same seed writes the same text whatever the
method, drafter, batch or proposals (up to the rounding that also lets greedy texts differ below float32).  The cost:
a proposal is kept with the target's probability of it, p(d), where rejection sampling of a proposal drawn from the
drafter's q keeps it with 1 − TV(p, q); drafters therefore propose their argmax for sampling rows too.

vLLM's rejection sampler verifies its own way: :class:`SamplingPick` draws dlite's proposals from q for it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .requests import Logprob, SamplingParams


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


def draw(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """logits (V,) → the token a sampling request with ``seed`` draws at output ``position`` (0: its first token): a
    sample of its distribution there (:func:`probabilities`) with a generator seeded by (seed, position) alone."""
    generator = torch.Generator().manual_seed((seed * 0x9E3779B97F4A7C15 + position) % 2**64)
    return sample(probabilities(logits, params), generator)


def accept_sampled(target_logits: torch.Tensor, drafts: list[int], params: SamplingParams, seed: int, start: int) -> tuple[int, int]:
    """One sampling row's round: target_logits (L+1, V) at output positions start .. start + L, drafts (L,) →
    (accepted n, the next token): the target draws at each position in turn (:func:`draw`) and a draft is kept while
    it equals the draw; the first draw that differs, or the one after the last draft, is the next token."""
    for i, proposed in enumerate(drafts):
        token = draw(target_logits[i], params, seed, start + i)
        if token != proposed:
            return i, token
    return len(drafts), draw(target_logits[len(drafts)], params, seed, start + len(drafts))


def logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[Logprob]:
    """logits (T, V) at the positions where ``tokens`` (T,) were written → each one's log-probability under the
    target's own distribution and the ``top`` likeliest tokens' there."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    chosen = log_probs.gather(-1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    best = log_probs.topk(top, dim=-1) if top else None
    tops = [list(zip(ids, values)) for ids, values in zip(best.indices.tolist(), best.values.tolist())] if best else [[] for _ in tokens]
    return [Logprob(token, value, top_tokens) for token, value, top_tokens in zip(tokens, chosen, tops)]


def accept_greedy(choice: torch.Tensor, draft: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """choice (B, L+1) the target's argmax, draft (B, L), lengths (B,) → accepted n (B,), next tokens (B,)."""
    L = draft.shape[1]
    agree = (draft == choice[:, :L]) & (torch.arange(L, device=draft.device) < lengths[:, None])
    n = agree.long().cumprod(dim=1).sum(dim=1)
    return n, choice.gather(1, n[:, None])[:, 0]


@dataclass
class SamplingPick:
    """A drafter's choice of each proposal for ``rows`` in vLLM (whose rejection sampler reads q): logits (B, V), row b
    of them ``rows[b]``'s → (B,) a sample from the tempered/top-k/top-p distribution the target will use for that row,
    with its generator (argmax for a greedy row).  A drafter that drafts only some rows picks for them with
    :meth:`subset`."""

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
