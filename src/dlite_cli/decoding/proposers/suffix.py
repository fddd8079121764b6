"""``suffix``: suffix decoding (SuffixDecoding), on arctic-inference's cache."""

from __future__ import annotations

import dataclasses

from ...core.config import SuffixConfig
from ...core.errors import DliteError
from ..adaptive import Calibration
from .base import CONFIDENCE_BINS, ProposerSetup
from .copying import LookupDrafter

ARCTIC_INSTALL = ("pip install nanobind==2.9.2 cmake ninja, then, with the environment's bin first on PATH, "
                  "pip install --no-build-isolation --no-deps arctic-inference==0.3.0 (make install does both)")


class SuffixDrafter(LookupDrafter):
    """Suffix decoding (SuffixDecoding; arctic-inference's cache, as vLLM's ``suffix`` method uses it): a suffix tree
    over each row's prompt and response, and a global one over the responses this drafter has produced before, at
    most ``settings.max_cached_requests`` of them (the oldest go first).  Each round it proposes the likeliest
    continuation of the longest match, with the tree's estimate of each token's probability; the chance of
    acceptance is learnt per bin of that estimate (the step's, given the tokens before it)."""

    name = "suffix"

    def __init__(self, draft_tokens: int, settings: SuffixConfig):
        super().__init__(draft_tokens, Calibration(prior=lambda key: (key + 0.5) / CONFIDENCE_BINS))  # key: the estimate's bin
        self.settings = settings
        self.cache = suffix_cache(settings)
        self.requests: dict[int, list[int]] = {}  # slot → [the cache's id for its request, response tokens added so far]
        self.started = 0  # requests begun: each gets the next id

    @classmethod
    def build(cls, setup: ProposerSetup) -> SuffixDrafter:
        return cls(setup.draft_tokens, setup.suffix)

    @classmethod
    def vllm_config(cls, draft_tokens: int, suffix: SuffixConfig) -> dict:
        """vLLM's own suffix decoding, with dlite's settings."""
        return {"method": "suffix", "num_speculative_tokens": draft_tokens, **vllm_suffix_fields(suffix)}

    def begin(self, row, prompt_features) -> None:
        self.cache.start_request(self.started, row.prompt_ids)
        self.requests[row.slot] = [self.started, 0]
        self.started += 1

    def continuation(self, row) -> tuple[list[int], list]:
        request = self._caught_up(row)
        settings = self.settings
        draft = self.cache.speculate(request, row.tokens[-settings.max_tree_depth :], self.draft_tokens, settings.max_spec_factor,
                                     0.0, settings.min_token_prob)
        steps = [p / q for p, q in zip(draft.probs, [1.0] + draft.probs[:-1])]  # the tree gives each path's probability
        return list(draft.token_ids), [min(int(step * CONFIDENCE_BINS), CONFIDENCE_BINS - 1) for step in steps]

    def end(self, row) -> None:
        self.cache.stop_request(self._caught_up(row))  # its response stays in the global tree
        del self.requests[row.slot]

    def reset(self, responses: list[list[int]] = ()) -> None:
        """A global tree anew, holding ``responses`` (finished responses' token ids, the oldest first), as if this drafter
        had just produced them; no row may be active."""
        self.cache = suffix_cache(self.settings)
        for response in responses:
            self.cache.start_request(self.started, [])
            self.cache.add_active_response(self.started, response)
            self.cache.stop_request(self.started)
            self.started += 1

    def _caught_up(self, row) -> int:
        """The cache's id for ``row``'s request, once the response tokens committed since the last round are in its trees."""
        request, added = self.requests[row.slot]
        if len(row.output_ids) > added:
            self.cache.add_active_response(request, row.output_ids[added:])
            self.requests[row.slot][1] = len(row.output_ids)
        return request


def suffix_part(proposer) -> SuffixDrafter | None:
    """The suffix-decoding drafter ``proposer`` is, or is paired with (``NAME+suffix``); None where there is none."""
    return next((part for part in (proposer, getattr(proposer, "lookup", None)) if isinstance(part, SuffixDrafter)), None)


def suffix_cache_class():
    """arctic-inference's suffix-decoding cache class, or one sentence on how to install it."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError:
        raise DliteError(f"suffix decoding needs arctic-inference, which PyPI has as source only: {ARCTIC_INSTALL}") from None
    return SuffixDecodingCache


def suffix_cache(settings: SuffixConfig):
    """A new suffix-decoding cache (no trees yet) with ``settings``."""
    return suffix_cache_class()(settings.max_tree_depth, settings.max_cached_requests)


def vllm_suffix_fields(settings: SuffixConfig) -> dict:
    """vLLM's ``speculative_config`` fields for suffix decoding (its own method's, which dlite's plugin reads for
    ``DIR+suffix`` too) with ``settings``; arctic-inference must be importable."""
    suffix_cache_class()  # or the sentence on how to install it
    return {f"suffix_decoding_{field.name}": getattr(settings, field.name) for field in dataclasses.fields(SuffixConfig)}
