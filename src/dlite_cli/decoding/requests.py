"""A request to decode and what decoding it fills in: its sampling parameters, its output and text as they arrive,
and the counters of how it was decoded (Stats, also an engine's over all its requests)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.errors import DliteError
from ..models.runner import Prefill
from .grammar import Grammar


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None  # None: none; k: each written token's log-probability and the k likeliest tokens' (sampling.logprobs)

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise DliteError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise DliteError(f"temperature must be ≥ 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise DliteError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DliteError(f"top_k must be ≥ 0, got {self.top_k}")
        if self.logprobs is not None and self.logprobs < 0:
            raise DliteError(f"logprobs must be ≥ 0, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Stats:
    """Decoding counters of one request, or of a whole engine (then times are per batched step)."""

    draft_tokens: int = 0  # K
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0  # of those, found in the slot's cache and not computed again
    generated_tokens: int = 0
    rounds: int = 0  # verify rounds, per row
    committed: int = 0  # tokens accepted by those rounds (accepted drafts + the target's own token)
    steps: int = 0  # batched verify passes the times below cover
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    overhead_seconds: float = 0.0  # acceptance and bookkeeping between the two
    capture_seconds: float = 0.0  # CUDA graphs captured during the rounds: taken out of the times above
    draft_kv_bytes: int = 0  # peak draft-side KV cache (0 for DLite)
    proposed: list[int] = field(default_factory=list)  # per draft position: rounds that proposed it
    accepted: list[int] = field(default_factory=list)  # … and that accepted it

    def __post_init__(self):
        self.proposed = self.proposed or [0] * self.draft_tokens
        self.accepted = self.accepted or [0] * self.draft_tokens

    @property
    def tau(self) -> float:
        return self.committed / self.rounds if self.rounds else 1.0

    def as_dict(self) -> dict:
        def per_step(seconds: float) -> float:
            return round(1000 * seconds / self.steps, 3) if self.steps else 0.0

        return {
            "tau": round(self.tau, 4),
            "prompt_tokens": self.prompt_tokens,
            "reused_prompt_tokens": self.reused_prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "rounds": self.rounds,
            "acceptance": [round(a / p, 4) if p else None for a, p in zip(self.accepted, self.proposed)],
            "prefill_ms": round(1000 * self.prefill_seconds, 3),
            "draft_ms_per_round": per_step(self.draft_seconds),
            "verify_ms_per_round": per_step(self.verify_seconds),
            "overhead_ms_per_round": per_step(self.overhead_seconds),
            "decode_seconds": round(self.draft_seconds + self.verify_seconds + self.overhead_seconds, 4),
            "capture_seconds": round(self.capture_seconds, 4),
            "draft_kv_bytes": self.draft_kv_bytes,
        }


@dataclass
class Logprob:
    """A written token's log-probability under the target's own distribution (its logits, before temperature, top-k,
    top-p or a grammar's mask), and the likeliest tokens there with theirs."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(eq=False)  # compared by identity: a request is one live object
class Request:
    """One sequence: its prompt and parameters, then (filled by the engine) its output and state."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    output_ids: list[int] = field(default_factory=list)  # the anchor is the last one while decoding
    text: str = ""
    finish_reason: str | None = None  # stop | length | cancelled | error
    error: Exception | None = None  # what failed, where finish_reason is error
    stats: Stats | None = None
    output_text: OutputText | None = None  # the text of output_ids so far, as they arrive
    slot: int = -1
    pivot: torch.Tensor | None = None  # (S, H) target features at the position before the anchor
    seed: int = 0  # its sampled tokens' seed in dlite's engine: params.seed, else a random one (sampling.draw)
    generator: torch.Generator | None = None  # in vLLM's proposer: a sampling row's proposals are drawn from q with it
    prefill: Prefill | None = None  # while its prompt is being prefilled
    grammar: Grammar | None = None  # what its output must match, where it has a format (grammar.py)
    logprobs: list[Logprob] = field(default_factory=list)  # one per output token but EOS, where params.logprobs asks

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def anchor(self) -> int:
        return self.output_ids[-1]

    def last_tokens(self, count: int) -> list[int]:
        """The last ``count`` tokens, the anchor last (the first one repeated where the sequence is shorter)."""
        tail = (self.prompt_ids[-count:] + self.output_ids[-count:])[-count:]
        return [tail[0]] * (count - len(tail)) + tail

    @property
    def position(self) -> int:
        """The anchor's absolute position (the tokens before it are in the target's cache)."""
        return len(self.prompt_ids) + len(self.output_ids) - 1


class OutputText:
    """A request's output text, decoded as its tokens arrive.  New tokens are decoded with those of the last whole
    characters before them for context (a byte-level token can end inside a character, and a tokenizer may space a
    token by its neighbour), and only once the text they add is whole: an output costs time linear in its length,
    and its text only ever grows, so a stream of it never has to take text back."""

    def __init__(self, decode):
        self.decode, self.ids, self.text = decode, [], ""
        self.context = 0  # ids[context:settled] are in ``text`` and decoded again as context for the next ones
        self.settled = 0  # ids[:settled] are in ``text``

    def extend(self, ids: list[int], final: bool = False) -> None:
        """Add ``ids``; ``final``: no more will come, so a trailing partial character is kept as it decodes."""
        self.ids += ids
        if self.settled == len(self.ids):
            return
        known = self.decode(self.ids[self.context : self.settled])
        whole = self.decode(self.ids[self.context :])
        if whole.endswith("\ufffd") and not final:
            return
        self.text += whole[len(known) :]
        self.context, self.settled = self.settled, len(self.ids)


# ---------------------------------------------------------------- sampling
