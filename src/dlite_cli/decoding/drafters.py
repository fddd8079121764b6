"""Drafters behind one small interface, each a thin adapter the engine calls once per round.

    propose(rows, pick) → Draft          up to K proposals per row (fewer where they would not pay)
    observe(row, accepted)               how many of this round's proposals the target accepted
    begin(row, prompt_features)          a row joins (history drafters build their draft KV cache)
    extend(row, features)                positions that became history this round (history drafters)
    end(row)                             a row leaves
    kv_bytes(row)                        draft-side KV cache held for the row (0 for DLite)

After ``adapt(costs)`` (the target's measured verify cost per tokens in the pass, adaptive.py; a model
drafter then times its own round) a drafter proposes per row only as many tokens as are expected to
pay for their verify, and a model drafter skips rows whose drafted rounds have lately been slower than
plain steps; without, every row gets K.

``row`` is the engine's Request: ``slot``, ``tokens`` (committed ids, the anchor last), ``pivot``
(S, H) target features at the position before the anchor, ``anchor`` and ``position`` (its
absolute position).  Methods: ``none`` (autoregressive), ``ngram`` (prompt lookup), ``suffix`` (suffix
decoding over the prompt and earlier responses), ``dlite`` and
``parallel`` (W = 0 checkpoints, with or without the sequential head), ``history`` (W ≠ 0: the
teacher or a sliding-window drafter, which must keep a KV cache over the history — the cost
DLite removes), and ``dlite+ngram`` / ``dlite+suffix`` (the copy where it is expected to beat DLite,
DLite elsewhere; neither keeps a draft KV cache).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..core.config import SuffixConfig
from ..core.devices import median_ms
from ..core.errors import DliteError
from ..core.precision import decide
from ..data.hub import from_hub, is_hub_id
from ..models.draft_round import DraftRound
from ..models.graphs import BUCKETS, CudaGraphs, bucket_for
from ..models.model import FULL_HISTORY, Drafter, History, greedy_pick
from ..models.release import is_release, load_drafter
from .adaptive import Calibration, Candidate, RowGain, VerifyCosts

WITHOUT_CHECKPOINT = ("none", "ngram", "suffix")  # proposers that load no drafter
# drafter names → the run-directory stage whose export they load
STAGE_OF = {"dlite": "stable", "history": "train-teacher", "parallel": "stable-parallel", "scratch": "stable-scratch"}
NGRAM_SIZES = (3, 2, 1)  # prompt lookup tries the longest suffix first
LOOKUP_PRIOR = {3: 0.6, 2: 0.4, 1: 0.2}  # a lookup proposal's chance of acceptance by match length, before any is seen
CONFIDENCE_BINS = 20  # a model drafter's probabilities are calibrated per bin of this width (1/20)
NGRAM_PAIRING = "+ngram"  # NAME+ngram: the drafter paired with prompt lookup
SUFFIX_PAIRING = "+suffix"  # NAME+suffix: the drafter paired with suffix decoding
FIXED_SUFFIX = ":fixed"
ARCTIC_INSTALL = ("pip install nanobind==2.9.2 cmake ninja, then, with the environment's bin first on PATH, "
                  "pip install --no-build-isolation --no-deps arctic-inference==0.3.0 (make install does both)")


@dataclass
class Draft:
    tokens: torch.Tensor  # (B, K) long; positions at or beyond a row's length are padding
    lengths: list[int]  # (B,) proposals per row
    logits: torch.Tensor | None  # (B, K, V) the drafter's logits for sampling rows, or None: each proposal is certain (point mass)
    confidence: torch.Tensor | None = None  # (B, K) the drafter's probability of each proposal, if it has one


class NoDrafter:
    """Plain autoregressive decoding: nothing proposed, one target step per token."""

    name, draft_tokens, needs_all_features = "none", 0, False
    target_layers: list[int] = []  # the target layers whose states the drafter reads
    costs: VerifyCosts | None = None  # set by ``adapt``: then proposals are adaptive

    def adapt(self, costs: VerifyCosts) -> None:
        """Propose adaptively from now on, at the target's verify ``costs`` measured on this machine."""
        self.costs = costs

    def propose(self, rows, pick) -> Draft:
        return Draft(torch.zeros(len(rows), 0, dtype=torch.long), [0] * len(rows), None)

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


class LookupDrafter(NoDrafter):
    """A drafter that copies: each round a row's ``candidate`` continuation, found in token ids alone, with a
    calibration key per token, of which as much is proposed as is expected to pay.  Its proposals are
    deterministic (q is one-hot), so sampling stays exact."""

    needs_all_features = False

    def __init__(self, draft_tokens: int, calibration: Calibration):
        self.draft_tokens, self.calibration = draft_tokens, calibration
        self.proposed: dict[int, Candidate] = {}  # slot → this round's candidate

    def propose(self, rows, pick) -> Draft:
        tokens = torch.zeros(len(rows), self.draft_tokens, dtype=torch.long)
        candidates = [self.candidate(row, len(rows)) for row in rows]
        widen(candidates, max(c.proposed for c in candidates))
        for b, (row, candidate) in enumerate(zip(rows, candidates)):
            self.proposed[row.slot] = candidate
            tokens[b, : len(candidate.tokens)] = torch.tensor(candidate.tokens)
        return Draft(tokens, [c.proposed for c in candidates], None)

    def candidate(self, row, batch: int = 1) -> Candidate:
        """The continuation for ``row``, of which the part worth proposing in a round over ``batch`` rows is proposed."""
        continuation, keys = self.continuation(row)
        accept = [self.calibration.estimate(k) for k in keys]
        proposed = len(keys) if self.costs is None else self.costs.at(batch).best_length([accept], 0.0)
        return Candidate(continuation, keys, proposed)

    def continuation(self, row) -> tuple[list[int], list]:
        """Up to K token ids that may follow ``row``'s tokens, and the calibration key of each."""
        raise NotImplementedError

    def expected_gain(self, candidate: Candidate) -> float:
        """Expected accepted tokens of the candidate's proposal."""
        expected, reach = 0.0, 1.0
        for key in candidate.keys[: candidate.proposed]:
            reach *= self.calibration.estimate(key)
            expected += reach
        return expected

    def observe(self, row, accepted: int, next_token: int | None) -> None:
        if row.slot in self.proposed:
            self.calibration.observe_round(self.proposed.pop(row.slot), accepted, next_token)


class NgramDrafter(LookupDrafter):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens and propose
    the K tokens that followed it.  Training-free; strong when outputs copy from the context.  Its
    chance of acceptance is learnt per match length and position."""

    name = "ngram"

    def __init__(self, draft_tokens: int):
        super().__init__(draft_tokens, Calibration(prior=lambda key: LOOKUP_PRIOR[key[0]]))  # key: (match length, position)

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


def copying_drafter(kind: str, draft_tokens: int, suffix: SuffixConfig | None = None) -> LookupDrafter:
    """``ngram`` (prompt lookup) or ``suffix`` (suffix decoding, with ``suffix``'s settings) proposing up to K tokens."""
    return NgramDrafter(draft_tokens) if kind == "ngram" else SuffixDrafter(draft_tokens, suffix or SuffixConfig())


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


class ModelDrafter(NoDrafter):
    """A drafter that runs a model for K proposals with a probability each (``_model_draft``).  Adaptive,
    each proposal's chance of acceptance is learnt per bin of that probability, and a row is drafted
    only while its recent gain pays for the round."""

    def __init__(self, name: str, draft_tokens: int, target_layers: list[int]):
        self.name, self.draft_tokens, self.target_layers = name, draft_tokens, target_layers
        self.calibration = Calibration(prior=lambda key: (key + 0.5) / CONFIDENCE_BINS)  # key: the probability's bin
        self.gain = RowGain()
        self.proposed: dict[int, Candidate] = {}  # slot → this round's candidate (absent: not drafted)
        self.draft_ms = 0.0  # a model round's time at batch 1, measured warm by ``adapt``

    def adapt(self, costs: VerifyCosts) -> None:
        super().adapt(costs)
        self.draft_ms = self.round_ms()

    def round_ms(self) -> float:
        """ms of one draft round at batch 1 here (warm, median)."""
        raise NotImplementedError

    def propose(self, rows, pick, batch: int | None = None) -> Draft:
        """Up to K proposals for each of ``rows``, the round's (or, given ``batch``, some of its ``batch`` rows: the
        hybrid's); adaptive, the drafted rows share one length, since the pass costs its widest row."""
        B, K = len(rows), self.draft_tokens
        costs = None if self.costs is None else self.costs.at(batch or B)
        drafted = [b for b, row in enumerate(rows) if costs is None or costs.worth_drafting(self.gain.expected(row.slot), self.draft_ms)]
        for b in set(range(B)) - set(drafted):
            self.gain.skipped(rows[b].slot)
        tokens = torch.zeros(B, K, dtype=torch.long, device=self._device)
        if not drafted:
            return Draft(tokens, [0] * B, None)
        draft = self._model_draft([rows[b] for b in drafted], for_rows(pick, drafted))
        lengths = [0] * B
        if self.costs is None:
            lengths = [K if b in drafted else 0 for b in range(B)]
        else:  # one read of the drafts and their probabilities
            read = torch.cat([draft.tokens.float(), draft.confidence.float()], dim=1).tolist()
            keys = [[min(int(c * CONFIDENCE_BINS), CONFIDENCE_BINS - 1) for c in row_read[K:]] for row_read in read]
            proposed = costs.best_length([[self.calibration.estimate(k) for k in row_keys] for row_keys in keys], self.draft_ms)
            for i, b in enumerate(drafted):
                self.proposed[rows[b].slot] = Candidate([int(t) for t in read[i][:K]], keys[i], proposed)
                lengths[b] = proposed
        for b in drafted:
            self.gain.drafting.add(rows[b].slot)
        if len(drafted) == B:
            return Draft(draft.tokens, lengths, draft.logits, draft.confidence)
        index = torch.tensor(drafted, device=self._device)
        logits = None if draft.logits is None else one_hot_logits(tokens, draft.logits.shape[-1], draft.logits.dtype).index_copy_(0, index, draft.logits)
        return Draft(tokens.index_copy_(0, index, draft.tokens), lengths, logits)

    def observe(self, row, accepted: int, next_token: int | None) -> None:
        candidate = self.proposed.pop(row.slot, None)
        if candidate is not None:
            self.calibration.observe_round(candidate, accepted, next_token)
        if row.slot in self.gain.drafting:  # it was drafted this round
            self.gain.drafted(row.slot, accepted, candidate.proposed if candidate is not None else self.draft_tokens)

    def end(self, row) -> None:
        self.gain.forget(row.slot)

    def _model_draft(self, rows, pick) -> Draft:
        """K proposals for every row: tokens, logits (over the target's vocabulary, for sampling rows), confidence."""
        raise NotImplementedError

    @property
    def _device(self) -> torch.device:
        raise NotImplementedError


class DLiteAdapter(ModelDrafter):
    """A W = 0 checkpoint (DLite, or the parallel ablation): one block from the pivot features and the anchor.

    Its round (models/draft_round.py) has fixed shapes whatever the context, so with ``graphs`` a greedy round
    is one CUDA graph per batch bucket (rows padded with copies of the first)."""

    needs_all_features = False

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


class HybridDrafter(NoDrafter):
    """``dlite+ngram`` and ``dlite+suffix``: per row and round, the copying drafter's continuation (prompt lookup's or
    suffix decoding's) when it is expected to commit tokens at least as fast as the model drafter's recent rounds for
    that row did (adaptive: per ms, the model's round paying its draft and its wider verify; fixed: per round), the
    model's block otherwise.  Copying reads the token ids the engine holds and DLite keeps no history, so the hybrid
    holds no draft KV cache either; rows that take the copy cost the model nothing."""

    needs_all_features = False

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
        lengths, lookups, by_model = [0] * B, {}, []  # lookups: row → its lookup candidate; by_model: rows the model drafts
        for b, row in enumerate(rows):
            candidate = self.lookup.candidate(row, B)
            if candidate.proposed and self._lookup_first(candidate, row.slot, B):
                lookups[b] = self.lookup.proposed[row.slot] = candidate
                tokens[b, : len(candidate.tokens)] = torch.tensor(candidate.tokens)
                lengths[b] = candidate.proposed
            else:
                by_model.append(b)
        draft = self.model.propose([rows[b] for b in by_model], for_rows(pick, by_model), batch=B) if by_model else None
        for i, b in enumerate(by_model):
            lengths[b] = draft.lengths[i]
        candidates = {**lookups, **{b: self.model.proposed[rows[b].slot] for b in by_model if rows[b].slot in self.model.proposed}}
        widen(list(candidates.values()), max(lengths))
        for b, candidate in candidates.items():
            lengths[b] = candidate.proposed
        if draft is None:
            return Draft(tokens, lengths, None if pick is greedy_pick else one_hot_logits(tokens, self.vocab_size))
        index = torch.tensor(by_model, device=tokens.device)
        tokens.index_copy_(0, index, draft.tokens.to(tokens.device))
        logits = None if draft.logits is None else one_hot_logits(tokens, self.vocab_size, draft.logits.dtype).index_copy_(0, index, draft.logits.to(tokens.device))
        return Draft(tokens, lengths, logits)

    def _lookup_first(self, candidate: Candidate, slot: int, batch: int = 1) -> bool:
        """Whether the lookup's ``candidate`` is expected to commit at least what the model's rounds did for the row,
        in a round over ``batch`` rows."""
        expected, (accepted, proposed) = self.lookup.expected_gain(candidate), self.model.gain.expected(slot)
        if self.costs is None:
            return expected >= accepted
        costs = self.costs.at(batch)
        return costs.rate(expected, candidate.proposed, 0.0) >= costs.rate(accepted, proposed, self.model.draft_ms)

    def observe(self, row, accepted: int, next_token: int | None) -> None:
        self.lookup.observe(row, accepted, next_token)  # whichever of the two proposed for the row this round
        self.model.observe(row, accepted, next_token)

    def begin(self, row, prompt_features) -> None:
        self.model.begin(row, prompt_features)
        self.lookup.begin(row, prompt_features)

    def end(self, row) -> None:
        self.model.end(row)
        self.lookup.end(row)


def widen(candidates: list[Candidate], width: int) -> None:
    """Each candidate proposes as many of its tokens as fit ``width``, the round's widest proposal: a batched pass
    costs its widest row, so the other rows' further tokens are verified for nothing."""
    for candidate in candidates:
        candidate.proposed = max(candidate.proposed, min(len(candidate.tokens), width))


def for_rows(pick, indices: list[int]):
    """``pick`` (greedy_pick, or the engine's SamplingPick for all the round's rows) for the rows ``indices`` alone:
    a sampling row's proposals are drawn with its own parameters and generator, whichever rows are drafted."""
    return pick if pick is greedy_pick else pick.subset(indices)


def draft_round_ms(drafter: Drafter, embed, repeats: int = 5) -> float:
    """ms of one draft round of ``drafter`` at batch 1 on its device and in its dtype, as the engine runs it (a random
    pivot: the round's cost does not depend on the values; a history drafter's is timed without history)."""
    spec, weight = drafter.spec, drafter.norm.weight
    context = torch.randn(1, len(spec.target_layer_ids), spec.hidden_size, device=weight.device, dtype=weight.dtype)
    group = torch.zeros(1, spec.anchor_group, dtype=torch.long, device=weight.device)
    draft = DraftRound(drafter) if spec.history_window == 0 else lambda *inputs: drafter.draft(*inputs)
    return median_ms(lambda: draft(context, group, embed), repeats, weight.device)


def draft_dtype(setting: str, drafter: Drafter, embed, log=print) -> str:
    """``decode.draft_dtype`` → a dtype name; auto: bfloat16 on a GPU, and on a CPU whichever of float32 and
    bfloat16 drafts a round faster here (precision.py).  The drafter only proposes: its dtype never changes
    the output, only the time (and, a little, τ)."""
    if setting != "auto":
        return setting
    copies = {name: copy.deepcopy(drafter).to(dtype=getattr(torch, name)) for name in ("float32", "bfloat16")}
    options = {name: lambda name=name: draft_round_ms(copies[name], embed) for name in copies}
    return decide("decode.draft_dtype", {"spec": dataclasses.asdict(drafter.spec)}, options, "a draft round (batch 1)",
                  drafter.norm.weight.device, log)


def one_hot_logits(tokens: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Logits (B, K, V) of proposals that are certain: 0 at each token, −inf elsewhere (q is a point mass), in
    ``dtype`` (a model drafter's, where its rows' logits are copied in)."""
    logits = torch.full((*tokens.shape, vocab_size), float("-inf"), device=tokens.device, dtype=dtype)
    return logits.scatter_(-1, tokens[..., None], 0.0)


class HistoryAdapter(DLiteAdapter):
    """A W ≠ 0 checkpoint (the teacher, or a sliding window): keeps, per row, a draft KV cache of
    per-layer keys/values over every history position, extended as tokens are accepted.  A row's cache
    holds what it needs, grown by doubling up to ``capacity`` (allocated up front it was ≈ 840 MB a row
    for Qwen3 in bfloat16)."""

    needs_all_features = True

    def __init__(self, drafter: Drafter, embed, name: str, capacity: int):
        super().__init__(drafter, embed, name)  # its cache grows every round: never a CUDA graph
        self.capacity = capacity
        self.window = drafter.spec.history_window
        self.cache: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], int]] = {}

    def begin(self, row, prompt_features) -> None:
        """prompt_features (P, S, H): positions 0..P−2 are history, P−1 is the pivot."""
        spec = self.drafter.spec
        shape = (1, spec.num_kv_heads, 0, spec.head_dim)
        empty = [torch.zeros(shape, dtype=self._dtype, device=self._device) for _ in range(2 * spec.num_layers)]
        self.cache[row.slot] = (empty[: spec.num_layers], empty[spec.num_layers :], 0)
        self.extend(row, prompt_features[:-1])

    @torch.no_grad()
    def extend(self, row, features) -> None:
        """features (n, S, H) of the next n history positions."""
        keys, values, length = self.cache[row.slot]
        if length + len(features) > keys[0].shape[2]:
            grown = max(length + len(features), min(self.capacity, 2 * keys[0].shape[2]))
            keys, values = [[F.pad(t, (0, 0, 0, grown - t.shape[2])) for t in ts] for ts in (keys, values)]
        if len(features):
            new = self.drafter.history_kv(features.to(self._dtype).flatten(1)[None], start=length)
            for layer, (k, v) in enumerate(new):
                keys[layer][:, :, length : length + len(features)] = k
                values[layer][:, :, length : length + len(features)] = v
        self.cache[row.slot] = (keys, values, length + len(features))

    def end(self, row) -> None:
        super().end(row)
        self.cache.pop(row.slot, None)

    def kv_bytes(self, row) -> int:
        keys, values, length = self.cache[row.slot]
        per_position = sum(k[:, :, :1].numel() * k.element_size() for k in keys + values)
        return per_position * self._visible(length)

    def _visible(self, length: int) -> int:
        return length if self.window == FULL_HISTORY else min(length, self.window)

    def _history(self, rows) -> History:
        """The rows' caches, left-aligned and padded to the longest, with a mask of real entries;
        a sliding window reads only its last W entries."""
        spans = []
        for row in rows:
            length = self.cache[row.slot][2]
            spans.append((length - self._visible(length), length))
        width = max(end - start for start, end in spans)
        if len(rows) == 1:
            keys, values, _ = self.cache[rows[0].slot]
            start, end = spans[0]
            kv = [(k[:, :, start:end], v[:, :, start:end]) for k, v in zip(keys, values)]
            mask = torch.ones(1, width, dtype=torch.bool, device=self._device)
        else:
            spec, device = self.drafter.spec, self._device
            kv = []
            for layer in range(spec.num_layers):
                k = torch.zeros(len(rows), spec.num_kv_heads, width, spec.head_dim, dtype=self._dtype, device=device)
                v = torch.zeros_like(k)
                for b, (row, (start, end)) in enumerate(zip(rows, spans)):
                    keys, values, _ = self.cache[row.slot]
                    k[b, :, : end - start] = keys[layer][0, :, start:end]
                    v[b, :, : end - start] = values[layer][0, :, start:end]
                kv.append((k, v))
            lengths = torch.tensor([end - start for start, end in spans], device=device)
            mask = torch.arange(width, device=device)[None] < lengths[:, None]
        return History(kv, mask, torch.tensor([row.position for row in rows], device=self._device))



def split_fixed(name: str) -> tuple[str, bool]:
    """``NAME:fixed`` → (NAME, False): the drafter proposes all K tokens every round, as in the paper;
    ``NAME`` → (NAME, True): it proposes adaptively (when ``decode.adaptive``)."""
    return (name.removesuffix(FIXED_SUFFIX), False) if name.endswith(FIXED_SUFFIX) else (name, True)


def split_lookup(name: str) -> tuple[str, str]:
    """``NAME+ngram`` / ``NAME+suffix`` → (NAME, the copying drafter it is paired with); ``NAME`` → (NAME, "")."""
    for pairing in (NGRAM_PAIRING, SUFFIX_PAIRING):
        if name.endswith(pairing):
            return name.removesuffix(pairing), pairing.removeprefix("+")
    return name, ""


def resolve_drafter_path(name: str, run_dir: Path) -> Path:
    """``dlite``/``history``/``parallel``/``scratch`` → the run directory's export; a hub id → its local snapshot;
    anything else is a path (a dlite export, or a checkpoint in the public release's format)."""
    name = split_lookup(name)[0]
    if name in STAGE_OF:
        path = Path(run_dir) / STAGE_OF[name] / "drafter"
        if not (path / "config.json").is_file():
            raise DliteError(f"no {name} drafter in {run_dir}: {path} does not exist (train the `{STAGE_OF[name]}` stage first, or pass a path)")
        return path
    if is_hub_id(name):
        from huggingface_hub import snapshot_download

        local = "pass a local copy of it as a directory instead, or point HF_HOME at a cache that holds it and set HF_HUB_OFFLINE=1"
        return Path(from_hub(lambda repo, **only: snapshot_download(repo, **only), name, f"the drafter {name}", local))
    path = Path(name)
    if not path.is_dir():
        raise DliteError(f"unknown drafter {name!r}: expected none, ngram, suffix, {', '.join(STAGE_OF)}, a drafter directory or a hub id "
                         f"(any of the last three may end in {NGRAM_PAIRING}, {SUFFIX_PAIRING} or {FIXED_SUFFIX})")
    return path


def checkpoint_of(name: str, run_dir: Path) -> Path | None:
    """The checkpoint directory of the drafter named (as ``--drafter`` names it; see resolve_drafter_path), or None for
    the proposers that have none (``none``, ``ngram``, ``suffix``)."""
    base = split_fixed(name)[0]
    return None if base in WITHOUT_CHECKPOINT else resolve_drafter_path(base, run_dir)


def drafter_origin(directory: Path) -> str:
    """What made a checkpoint, for the bench's tables: the dlite stage that trained it (also kept through an export
    in the release's format), ``release`` for the public release's own, ``unknown`` for an export that does not say."""
    raw = json.loads((Path(directory) / "config.json").read_text())
    stage = Path(directory).parent.name
    return raw.get("origin") or ("release" if is_release(raw) else stage if stage in STAGE_OF.values() else "unknown")


def load_proposer(name: str, run_dir: Path, target_model, capacity: int, ngram_tokens: int = 7, dtype: str = "float32", path: str = "eager",
                  log=print, suffix: SuffixConfig | None = None):
    """The drafter adapter for ``name`` (see resolve_drafter_path; ``NAME+ngram`` / ``NAME+suffix`` is the hybrid of
    that drafter and prompt lookup / suffix decoding, with ``suffix``'s settings), fitted to ``target_model``, run in
    ``dtype`` (or auto: :func:`draft_dtype`) on the target's device; ``path`` graphs captures DLite's rounds as CUDA
    graphs."""
    name, _ = split_fixed(name)
    if name == "none":
        return NoDrafter()
    if name in ("ngram", "suffix"):
        return copying_drafter(name, ngram_tokens, suffix)
    base, lookup = split_lookup(name)
    directory = resolve_drafter_path(name, run_dir)
    drafter = load_drafter(directory, target_model.config).eval().to(next(target_model.parameters()).device)
    embed = target_model.get_input_embeddings()
    drafter.to(dtype=getattr(torch, draft_dtype(dtype, drafter, embed, log)))
    label = base if base in STAGE_OF else directory.name
    if drafter.spec.history_window != 0:
        if lookup:
            raise DliteError(f"{name}: {lookup} pairs with a history-free drafter, and {directory} keeps a draft history (W ≠ 0)")
        return HistoryAdapter(drafter, embed, label, capacity)
    model = DLiteAdapter(drafter, embed, label, graphs=path == "graphs")
    return HybridDrafter(model, copying_drafter(lookup, model.draft_tokens, suffix), drafter.spec.vocab_size) if lookup else model


def export_drafter(config, run_dir: Path, drafter: str, out: Path, format_: str, log) -> None:
    """``dlite export``: the drafter named (as ``--drafter`` names it) written to ``out`` in ``format_``, the public
    release's (release.py); refused in one sentence where its spec uses a dlite-only option."""
    from ..models.release import ARCHITECTURE_VERSION, export_release
    from ..models.targets import load_target_config, prepare_target

    if format_ != ARCHITECTURE_VERSION:
        raise DliteError(f"unknown export format {format_!r}: expected {ARCHITECTURE_VERSION}")
    directory = resolve_drafter_path(drafter, run_dir)
    target_config = load_target_config(prepare_target(config.target, log))
    export_release(load_drafter(directory, target_config), target_config, out, str(directory), drafter_origin(directory))
    log(f"wrote {directory} in the {ARCHITECTURE_VERSION} format to {out}")
