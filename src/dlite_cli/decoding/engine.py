"""Speculative decoding for a continuous batch of requests: prefill, draft, verify, accept.

One round, for the B active rows (each row is a Request):

    draft    the proposer proposes up to K tokens d_1..d_K after each row's anchor (proposers/)
    verify   the target runs [anchor, d_1..d_L] of every row in one batched pass (runner.py)
    accept   greedy: the longest prefix equal to the target's argmax, plus the target's next token;
             sampling: the longest prefix equal to the target's own draws, seeded by (seed, position), plus
             its next draw (sampling.py): exactly the target's samples, the same for a seed whatever was
             proposed.  Each row keeps its own count n; its KV cache is cut back to the
             accepted length, the target state at the last accepted position becomes the new pivot
             and the target's extra token the new anchor.

A row whose reply has a format (a JSON schema, an enforced tool call) decodes under its grammar (grammar.py): its
proposals are walked through the grammar, which adds the tokens it forces and cuts those it refuses, and its verify
logits are masked by what the grammar allows at each position.

A row leaves on EOS, a stop string or its token budget, and a waiting request takes a free slot,
the one holding the longest prefix of its prompt (else the one freed longest ago), and is prefilled
a chunk per round (continuous batching), so a long prompt arriving delays the running rows by one
chunk a round, not by its whole prefill.  A request the engine fails on leaves with finish reason ``error`` and its
exception; the others go on.  τ = tokens committed per verify round.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

import torch

from ..core.devices import now
from ..core.errors import DliteError
from ..models.graphs import CAPTURES
from ..models.model import greedy_pick
from ..models.runner import TargetRunner, decode_path, pass_width
from .adaptive import VerifyCosts
from .engines import DecodingEngine
from .grammar import Grammars
from .requests import Logprob, OutputText, Request, Stats
from .sampling import accept_greedy, accept_sampled, draw, logprobs


class RoundClock:
    """A round's seconds on the device-synchronised clock (now()), by step: ``draft`` (proposing and the drafter's KV
    upkeep), ``verify`` and ``overhead`` (accepting, emitting).  A CUDA graph captured in a lap (CAPTURES) is not the
    round's work: it is taken out of the lap and counted in ``captured``."""

    def __init__(self, device: torch.device):
        self.device, self.time = device, now(device)
        self.captures_at_start = self.captures = CAPTURES.seconds
        self.draft = self.verify = self.overhead = 0.0

    def lap(self) -> float:
        """Seconds since the last lap (or the start), less the graphs captured in between."""
        time, captures = now(self.device), CAPTURES.seconds
        seconds = time - self.time - (captures - self.captures)
        self.time, self.captures = time, captures
        return seconds

    @property
    def captured(self) -> float:
        """Seconds of graph captures since the start."""
        return self.captures - self.captures_at_start


@dataclass
class Proposals:
    """A round's proposals for its B rows: ``lengths`` (B,) proposals per row, of which the first ``own`` (B,) are the
    drafter's; ``tokens`` (B, 1 + width) to verify, each row's anchor then its proposals, padded to the longest; and
    ``masks``, for each row b under a grammar, (lengths[b] + 1, V) what the grammar allows at each position of the pass."""

    lengths: list[int]
    own: list[int]
    tokens: torch.Tensor
    masks: dict[int, torch.Tensor]


@dataclass
class Outcome:
    """A row's round: ``accepted`` proposals, the ``tokens`` it writes (those, then the target's next token) and their
    log-probabilities where the request asks for them."""

    accepted: int
    tokens: list[int]
    logprobs: list[Logprob] | None


class Engine(DecodingEngine):
    """Continuous batching over a TargetRunner's slots with one proposer (proposers/)."""

    def __init__(self, runner, drafter, eos_ids: set[int], detokenize, adaptive: bool = False, grammars: Grammars | None = None):
        """``detokenize(ids) → text`` (for stop strings and the final text); one row per runner slot.
        ``adaptive``: the drafter proposes only what pays for its verify, at the verify and draft costs measured
        here (adaptive.py; on the static path every pass costs the same, so only whether to draft at all is weighed).
        ``grammars``: what starts a request's grammar (grammar.py), for requests whose replies have a format."""
        self.runner, self.drafter, self.eos_ids, self.detokenize = runner, drafter, set(eos_ids), detokenize
        self.grammars = grammars
        if adaptive and drafter.draft_tokens:
            drafter.adapt(VerifyCosts(runner.verify_costs(drafter.draft_tokens + 1), padded=runner.width))
        self.free = list(range(runner.slots))  # the one freed longest ago first
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()  # in a slot, their prompts part computed
        self.active: list[Request] = []
        self.stats = Stats(drafter.draft_tokens)

    @property
    def capacity(self) -> int:
        return self.runner.capacity

    @property
    def draft_tokens(self) -> int:
        return self.drafter.draft_tokens

    def validate(self, request: Request) -> None:
        """Refuse, in one sentence, a request that can never be decoded (changes nothing: thread-safe)."""
        request.params.check()
        if not request.prompt_ids:
            raise DliteError("the prompt is empty")
        room = self.room(len(request.prompt_ids))
        if room < 0:
            raise DliteError(
                f"the prompt has {len(request.prompt_ids)} tokens; with {self.draft_tokens} draft tokens it needs "
                f"{self.capacity - room} of KV cache, more than the engine's {self.capacity}"
            )

    def add(self, request: Request) -> None:
        """Queue a request (validated first)."""
        self.validate(request)
        request.stats = Stats(self.drafter.draft_tokens, prompt_tokens=len(request.prompt_ids))
        request.seed = request.params.seed if request.params.seed is not None else random.randrange(2**63)
        request.output_text = OutputText(self.detokenize)
        self.waiting.append(request)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.active)

    def run(self, requests: list[Request]) -> list[Request]:
        """Decode ``requests`` to the end (they join as slots free up) and return them; a request the engine
        fails on raises its exception."""
        for request in requests:
            self.add(request)
        while self.busy:
            for request in self.step():
                if request.error is not None:
                    raise request.error
        return requests

    def step(self) -> list[Request]:
        """Give waiting requests the free slots, run one prefill chunk (the oldest prefill's), then one round for every
        active row.  → the requests that received tokens or finished (with an error, too)."""
        while self.waiting and self.free:
            self._admit(self.waiting.popleft())
        updated = []
        if self.prefilling:
            request = self.prefilling[0]
            try:
                self._prefill_chunk(request)
            except Exception as e:  # noqa: BLE001 (this request fails, and only this one)
                self._fail(request, e)
            if request.prefill is None:
                updated.append(request)
        if self.active:
            rows = list(self.active)
            try:
                updated += self._round(rows)
            except Exception as e:  # noqa: BLE001 (the round's rows fail; the engine goes on)
                for row in rows:
                    self._fail(row, e)
                updated += rows
        return list(dict.fromkeys(updated))

    def cancel(self, request: Request) -> None:
        """Drop a request at once (a client went away), freeing its slot."""
        if request in self.waiting:
            self.waiting.remove(request)
            request.finish_reason = "cancelled"
        elif request in self.prefilling or request in self.active:
            self._finish(request, "cancelled")

    # ----- prefill, draft, verify, accept

    def _admit(self, request: Request) -> None:
        """Give ``request`` the free slot holding the longest prefix of its prompt (else the one freed longest ago)
        and start its prefill."""
        request.slot = max(self.free, key=lambda slot: self._sparing(slot, request.prompt_ids))
        self.free.remove(request.slot)
        reach = len(request.prompt_ids) + request.params.max_new_tokens + self.drafter.draft_tokens + 1
        request.prefill = self.runner.start_prefill(request.slot, request.prompt_ids, self.drafter.needs_all_features, reach)
        self.prefilling.append(request)

    def _sparing(self, slot: int, prompt: list[int]) -> int:
        """The prompt tokens ``slot`` would spare a prefill, or 0 where taking it would throw away more of what it
        holds than that: a chat template's header or a short shared preamble does not evict a conversation."""
        reused = self.runner.reusable(slot, prompt, self.drafter.needs_all_features)
        return reused if 2 * reused >= self.runner.length(slot) else 0

    def _prefill_chunk(self, request: Request) -> None:
        """The next chunk of ``request``'s prefill; after the last, its first token, and it joins the rounds."""
        start = now(self.runner.device)
        request.prefill.step()
        done = request.prefill.done
        if done:
            logits, features, reused = request.prefill.result()
            request.prefill = None
            self.prefilling.popleft()
            allowed = logits if request.grammar is None else logits.masked_fill(~request.grammar.allowed().to(logits.device), float("-inf"))
            first = int(allowed.argmax()) if request.params.greedy else draw(allowed, request.params, request.seed, 0)
            request.pivot = features[-1]
            self.active.append(request)
            self.drafter.begin(request, features)
            self.stats.prompt_tokens += len(request.prompt_ids)
            for stats in (request.stats, self.stats):
                stats.reused_prompt_tokens += reused
        seconds = now(self.runner.device) - start
        request.stats.prefill_seconds += seconds
        self.stats.prefill_seconds += seconds
        if done:
            self._emit(request, [first], self._logprobs(request, logits[None], [first]))

    def _round(self, rows: list[Request]) -> list[Request]:
        """One speculative round for the B active rows (the module docstring), counted in the stats → rows."""
        clock = RoundClock(self.runner.device)
        proposals = self._draft(rows)
        clock.draft = clock.lap()
        verified = self._verify(rows, proposals.tokens, clock)
        outcomes = self._accept(rows, proposals, verified)
        upkeep = self._advance(rows, outcomes, verified)
        clock.overhead = clock.lap() - upkeep
        clock.draft += upkeep  # draft-KV upkeep is draft time
        self._account(rows, proposals.lengths, outcomes, clock)
        return rows

    def _draft(self, rows: list[Request]) -> Proposals:
        """The round's proposals for the B rows: the drafter's, and for a row under a grammar what its grammar makes of
        them (grammar.py: forced tokens added, refused ones cut)."""
        draft = self.drafter.propose(rows, greedy_pick)  # a sampling row keeps a proposal equal to its draw: its likeliest
        lengths, own, proposed, masks = list(draft.lengths), list(draft.lengths), draft.tokens, {}
        constrained = [b for b, row in enumerate(rows) if row.grammar is not None]
        if constrained:
            proposed = draft.tokens.cpu().clone()
            drafted = proposed.tolist()
            for b in constrained:
                tokens, masks[b] = rows[b].grammar.propose(drafted[b][: lengths[b]], self.drafter.draft_tokens)
                proposed[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
                own[b] = next((i for i, (a, d) in enumerate(zip(tokens, drafted[b][: lengths[b]])) if a != d), min(len(tokens), lengths[b]))
                lengths[b] = len(tokens)
        anchors = torch.tensor([[row.anchor] for row in rows], device=self.runner.device)
        tokens = torch.cat([anchors, proposed[:, : max(lengths)].to(self.runner.device)], dim=1)
        return Proposals(lengths, own, tokens, masks)

    def _verify(self, rows: list[Request], tokens: torch.Tensor, clock: RoundClock):
        """The target's batched pass over tokens (B, 1 + width) → logits (B', 1 + width, V), features
        (B', 1 + width, S, H) and index (B,): row b's outputs are row index[b] (runner.verify).  Its seconds go to
        ``clock.verify`` and, for an adaptive drafter, to what a pass of this width over these rows costs at their
        contexts."""
        verified = self.runner.verify([row.slot for row in rows], tokens)
        clock.verify = clock.lap()
        if self.drafter.costs is not None:
            self.drafter.costs.at(len(rows)).observe(tokens.shape[1], 1000 * clock.verify)
        return verified

    def _accept(self, rows: list[Request], proposals: Proposals, verified) -> list[Outcome]:
        """Each row's accepted proposals n and the tokens it emits (those n, then the target's next token), from the
        verify pass (a row under a grammar reads its logits masked by it): greedy rows all at once, sampled rows by the
        target's draws.  The drafter observes how many of its own proposals were accepted, and the runner commits each
        row's anchor and accepted proposals."""
        logits, _, index = verified
        tokens, lengths = proposals.tokens, proposals.lengths
        masked = {b: logits[index[b], : len(allowed)].masked_fill(~allowed.to(logits.device), float("-inf")) for b, allowed in proposals.masks.items()}
        choice = logits.argmax(-1)[index]
        for b, row_logits in masked.items():
            choice[b, : len(row_logits)] = row_logits.argmax(-1)
        greedy_n, greedy_next = accept_greedy(choice, tokens[:, 1:], torch.tensor(lengths, device=self.runner.device))
        # the round's one read from the device: per row greedy n, the target's next token, [anchor, proposals]
        read = torch.cat([greedy_n[:, None], greedy_next[:, None], tokens], dim=1).tolist()
        outcomes = []
        for b, row in enumerate(rows):
            n, next_token = read[b][0], read[b][1]
            if not row.params.greedy:
                L = lengths[b]
                row_logits = masked.get(b, logits[index[b], : L + 1])
                n, next_token = accept_sampled(row_logits, read[b][3 : 3 + L], row.params, row.seed, len(row.output_ids))
            emitted = read[b][3 : 3 + n] + [next_token]
            outcomes.append(Outcome(n, emitted, self._logprobs(row, logits[index[b], : n + 1], emitted)))
            own = min(n, proposals.own[b])  # the drafter's own proposals accepted, and the token the target wrote after them
            self.drafter.observe(row, own, emitted[own] if row.params.greedy else None)
            self.runner.commit(row.slot, read[b][2 : 3 + n])  # the anchor and the accepted proposals
        return outcomes

    def _logprobs(self, request: Request, logits: torch.Tensor, tokens: list[int]) -> list[Logprob] | None:
        """Where ``request`` asks for them, the log-probabilities of ``tokens`` (T,), written at logits (T, V)."""
        return None if request.params.logprobs is None else logprobs(logits, tokens, request.params.logprobs)

    def _advance(self, rows: list[Request], outcomes: list[Outcome], verified) -> float:
        """Move each row past its accepted tokens: the drafter's history extended (if it keeps all features), the
        target's state at its last accepted position its new pivot, its tokens emitted.  → the drafter's seconds."""
        _, features, index = verified
        accepted = torch.tensor([outcome.accepted for outcome in outcomes], device=self.runner.device)
        pivots = features[index, accepted]  # (B, S, H): the target's states at each row's last accepted position
        upkeep = 0.0
        for b, (row, outcome) in enumerate(zip(rows, outcomes)):
            if self.drafter.needs_all_features:  # the old pivot, the anchor and all accepted drafts but the last are history now
                start = now(self.runner.device)
                self.drafter.extend(row, torch.cat([row.pivot[None], features[index[b], : outcome.accepted]]))
                upkeep += now(self.runner.device) - start  # on the round's synchronised clock
            row.pivot = pivots[b]
            self._emit(row, outcome.tokens, outcome.logprobs)
        return upkeep

    def _account(self, rows: list[Request], lengths: list[int], outcomes: list[Outcome], clock: RoundClock) -> None:
        """Count the round in each row's stats and the engine's: drafts proposed and accepted per position (lengths
        (B,)), tokens committed, the drafter's KV bytes (at their peak) and the round's seconds."""
        draft_kv = 0
        for row, length, outcome in zip(rows, lengths, outcomes):
            n = outcome.accepted
            kv = self.drafter.kv_bytes(row) if row.finish_reason is None else 0
            row.stats.draft_kv_bytes = max(row.stats.draft_kv_bytes, kv)
            draft_kv += kv
            for stats in (row.stats, self.stats):
                stats.rounds += 1
                stats.committed += n + 1
                for i in range(length):
                    stats.proposed[i] += 1
                    stats.accepted[i] += i < n
        self.stats.draft_kv_bytes = max(self.stats.draft_kv_bytes, draft_kv)
        for stats in [row.stats for row in rows] + [self.stats]:
            stats.steps += 1
            stats.draft_seconds += clock.draft
            stats.verify_seconds += clock.verify
            stats.overhead_seconds += clock.overhead
            stats.capture_seconds += clock.captured

    def _emit(self, request: Request, tokens: list[int], token_logprobs: list[Logprob] | None = None) -> None:
        """Append accepted tokens (with their log-probabilities, where asked), stopping at EOS, the token budget, a
        stop string or the cache's end."""
        params = request.params
        if request.grammar is not None:
            request.grammar.commit(tokens)
        for count, token in enumerate(tokens, 1):
            request.output_ids.append(token)
            request.stats.generated_tokens += 1
            self.stats.generated_tokens += 1
            if token in self.eos_ids:
                request.output_text.extend(tokens[: count - 1])
                return self._finish(request, "stop")
            if token_logprobs is not None:
                request.logprobs.append(token_logprobs[count - 1])
            if len(request.output_ids) >= params.max_new_tokens:
                request.output_text.extend(tokens[:count])
                return self._finish(request, "length")
        request.output_text.extend(tokens)
        if any(stop in request.output_text.text for stop in params.stop):
            return self._finish(request, "stop")
        if request.position + self.drafter.draft_tokens + 1 > self.runner.capacity:
            return self._finish(request, "length")

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        request.output_text.extend([], final=True)
        request.text = self.text_of(request)
        if request.prefill is not None:
            self.prefilling.remove(request)
            request.prefill = None
        else:
            self.active.remove(request)
            self.drafter.end(request)
        self.free.append(request.slot)

    def _fail(self, request: Request, error: Exception) -> None:
        """``request`` leaves with ``error``, unless it finished before the failure; its slot is emptied (its cache may
        be half written) and freed."""
        if request.finish_reason is not None:
            return
        request.error = error
        self.runner.truncate(request.slot, 0)
        self._finish(request, "error")

    def text_of(self, request: Request) -> str:
        """The output text so far: without the EOS token and cut before the first stop string."""
        text = request.output_text.text
        cuts = [text.find(stop) for stop in request.params.stop if stop in text]
        return text[: min(cuts)] if cuts else text




def load_engine(config, run_dir, drafter: str, slots: int | None = None, capacity: int | None = None, log=print, response_tokens: int = 0):
    """Target + proposer + runner for ``config`` → (engine, tokenizer).  ``slots`` defaults to ``decode.max_batch``,
    ``capacity`` (KV cache tokens per slot) to the target's context length, or as much of it as the device has room for
    (memory.engine_context: planned before the target loads, suffix decoding's trees for responses of
    ``response_tokens``)."""
    from ..core.devices import resolve_device
    from ..models.targets import Work, load_target, target_config
    from .decoding_plan import engine_context, verify_tokens
    from .methods import checkpoint_of, known_drafter, load_proposer

    decode, method, slots = config.decode, known_drafter(drafter), slots or config.decode.max_batch
    capacity = engine_context(config, target_config(config, log), method, slots, capacity, resolve_device(config.target.device), log,
                              response_tokens)
    directory = checkpoint_of(method, run_dir)  # a drafter whose stage has not run is refused before the target loads
    model, tokenizer, _ = load_target(config.target, log, Work.decoding(config))
    path = decode_path(decode.path, model.device, model.dtype, decode.identical_text)
    proposer = load_proposer(method, directory, proposer_setup(config, model, capacity, path, log))
    runner = TargetRunner(model, proposer.target_layers, slots, capacity, decode.prefill_chunk, path,
                          pass_width(verify_tokens(config, proposer.draft_tokens), model.dtype, path, decode.identical_text))
    eos_ids, detokenize = stop_tokens_and_text(model, tokenizer)
    grammars = Grammars(tokenizer, model.config.vocab_size, eos_ids, decode.forced_drafting)
    return Engine(runner, proposer, eos_ids, detokenize, adaptive=decode.adaptive and method.adaptive, grammars=grammars), tokenizer


def proposer_setup(config, model, capacity: int, path: str, log=print):
    """What building a proposer for ``config`` uses (proposers/base.ProposerSetup), on the loaded target ``model``."""
    from .proposers.base import ProposerSetup

    return ProposerSetup(config.drafter.draft_tokens, config.suffix, model, capacity, config.decode.draft_dtype, path, log)


def stop_tokens_and_text(model, tokenizer) -> tuple[set[int], object]:
    """An Engine's ``eos_ids`` and ``detokenize`` for a target: the tokenizer's EOS plus the generation
    config's, and decoding without special tokens."""
    configured = model.generation_config.eos_token_id
    eos = {tokenizer.eos_token_id, *(configured if isinstance(configured, list) else [configured])} - {None}
    return eos, lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
