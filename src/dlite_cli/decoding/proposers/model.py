"""The base of the proposers that run a model (a drafter checkpoint: ``dlite``, ``history``), and its draft round's cost."""

from __future__ import annotations

import copy
import dataclasses

import torch

from ...core.devices import median_ms, now
from ...core.precision import decide
from ...models.draft_round import DraftRound
from ...models.model import Drafter
from ..adaptive import COST_MEMORY, Calibration, Candidate, RowGain, VerifyCosts
from .base import CONFIDENCE_BINS, Draft, Proposer, for_rows, merged


class ModelDrafter(Proposer):
    """A drafter that runs a model for K proposals with a probability each (``_model_draft``).  Adaptive,
    each proposal's chance of acceptance is learnt per bin of that probability, and a row is drafted
    only while its recent gain pays for the round."""

    def __init__(self, name: str, draft_tokens: int, target_layers: list[int]):
        self.name, self.draft_tokens, self.target_layers = name, draft_tokens, target_layers
        self.calibration = Calibration(prior=lambda key: (key + 0.5) / CONFIDENCE_BINS)  # key: the probability's bin
        self.gain = RowGain()
        self.proposed: dict[int, Candidate] = {}  # slot → this round's candidate (absent: not drafted)
        self.draft_ms = 0.0  # a model round's time: measured warm at batch 1 by ``adapt``, then as the engine runs them

    def adapt(self, costs: VerifyCosts) -> None:
        super().adapt(costs)
        self.draft_ms = self.round_ms()

    def round_ms(self) -> float:
        """ms of one draft round at batch 1 here (warm, median)."""
        raise NotImplementedError

    def propose(self, rows, pick, batch: int | None = None, others: tuple[list[float], ...] = ()) -> Draft:
        """Up to K proposals for each of ``rows``, the round's (or, given ``batch``, some of its ``batch`` rows: the
        hybrid's, whose other rows propose tokens with the chances of acceptance ``others``); adaptive, the rows worth
        drafting together are drafted, and they and the others share one length, weighed for all of them, since the
        pass costs its widest row."""
        B, K = len(rows), self.draft_tokens
        costs = None if self.costs is None else self.costs.at(batch or B)
        drafted = list(range(B)) if costs is None else costs.rows_to_draft([self.gain.expected(row.slot) for row in rows], self.draft_ms)
        for b in set(range(B)) - set(drafted):
            self.gain.skipped(rows[b].slot)
        tokens = torch.zeros(B, K, dtype=torch.long, device=self._device)
        if not drafted:
            return Draft(tokens, [0] * B, None)
        start = now(self._device) if costs is not None else 0.0  # timed where adaptive (on a GPU, timing synchronises)
        draft = self._model_draft([rows[b] for b in drafted], for_rows(pick, drafted))
        lengths = [0] * B
        if self.costs is None:
            lengths = [K if b in drafted else 0 for b in range(B)]
        else:  # one read of the drafts and their probabilities
            read = torch.cat([draft.tokens.float(), draft.confidence.float()], dim=1).tolist()
            self._observe_round(1000 * (now(self._device) - start))
            keys = [[min(int(c * CONFIDENCE_BINS), CONFIDENCE_BINS - 1) for c in row_read[K:]] for row_read in read]
            proposed = costs.best_length([[self.calibration.estimate(k) for k in row_keys] for row_keys in keys] + list(others), self.draft_ms)
            for i, b in enumerate(drafted):
                self.proposed[rows[b].slot] = Candidate([int(t) for t in read[i][:K]], keys[i], proposed)
                lengths[b] = proposed
        for b in drafted:
            self.gain.drafting.add(rows[b].slot)
        if len(drafted) == B:
            return Draft(draft.tokens, lengths, draft.logits, draft.confidence)
        return merged(tokens, lengths, drafted, draft)

    def _observe_round(self, ms: float) -> None:
        """A round of the model took ``ms``: ``draft_ms`` moves part of the way there, as a verify's cost level does
        (adaptive.py), since between target passes a round costs more than warm ones back to back (on a 2-core AVX2
        EPYC, 6–10 ms against 4.8 at the agentic workloads' contexts: its weights and activations no longer in cache),
        and a round over several rows more than one over one."""
        self.draft_ms *= (ms / self.draft_ms) ** COST_MEMORY

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
