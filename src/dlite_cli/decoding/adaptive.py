"""How many tokens to propose: a drafter keeps proposing only while the next token pays for its verify.

A round over B rows that proposes L tokens a row costs T_draft + T_B(L+1), where T_B(q) is the target's
pass over B rows of q tokens on this machine (``TargetRunner.pass_costs``, then the passes the engine runs),
and commits on average

    B + Σ_rows Σ_{i ≤ L} Π_{j ≤ i} a_j        a_j = P(draft j is accepted | drafts 1..j−1 were)

tokens.  Per row and round the drafter estimates each a_j (:class:`Calibration`: what the target
accepted of earlier proposals that looked alike — e.g. the same draft probability) and the round proposes
the L that maximises tokens per millisecond (:meth:`VerifyCosts.best_length`): every row of a batched pass
pays for its widest row, so the rows share one L, chosen for all of them together.  On a CPU, where a verify of 8 tokens may cost 1.5 steps
(and a pass over 4 rows of 8 tokens far more), that cuts the proposals a weak drafter would waste; where a
wider pass costs nothing extra (a GPU's fixed-shape path) it keeps all K.  A row is drafted at all only
while its recent drafted rounds, at the lengths they proposed, with the other rows drafted beside it, commit
tokens faster than plain steps would (:meth:`VerifyCosts.rows_to_draft`, from the rows' :class:`RowGain`): where a wide pass costs more
than a step and the drafter is weak, rows are mostly decoded plainly and probed now and then.  A new
row starts where recent rows ended, so short turns (a chat's, 32 tokens in the bench) do not each
relearn that drafting does not pay.  The draft round's cost is measured at start-up, warm, like the
batch-1 verify costs; a batch's costs start from those (:meth:`VerifyCosts.at`), and both follow what the rounds the
engine runs take (:meth:`VerifyCosts.observe`, ``ModelDrafter._observe_round``).  Any such rule leaves
the output exact: it depends only on the drafter's side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRIOR_WEIGHT = 4.0  # pseudo-observations behind a calibration's prior
# How fast a row's recent gain forgets, per drafted round: about the last 10 rounds, since one round's
# acceptance is mostly 0 or a few tokens (a shorter memory skips rows on a run of bad luck).
GAIN_DECAY = 0.9
# How much a skipped row's expected gain recovers per round, so that it is probed again.  Where drafting
# does not pay, a probe loses at most the threshold's worth of a step and comes every (1 − GAIN_DECAY)·(threshold
# − gain) / GAIN_HOPE rounds: at most about GAIN_HOPE / (1 − GAIN_DECAY) = 2.5 % of plain decoding.  (At 0.005,
# a drafter nearly paying on MT-Bench's short chats, on a 2-core AVX2 EPYC, was drafted every ~8 rounds: 0.95×.)
GAIN_HOPE = 0.0025
ROW_MEMORY = 0.5  # how far an ended row's last gain moves where new rows start (about the last 2 rows)
# How far one pass the engine ran moves its batch's curve: all of it (the level, which the rows' context sets:
# about the last 10 passes), and its own width a quarter as far again (the shape, which a context hardly moves).
COST_MEMORY = 0.1
SHAPE_MEMORY = 0.025


@dataclass
class VerifyCosts:
    """T_B(q), ms of a target pass over ``batch`` = B rows of q = 1..K+1 tokens each (index q − 1).  The batch-1
    curve is measured at start-up at one context; every curve is then corrected by the passes the engine really
    runs (:meth:`observe`), since the context the rows are at changes them: in float32 on a 2-core AVX2 EPYC a
    step cost 72 ms after 256 tokens and 118 ms after 6 k, while a pass of 5 tokens stayed 1.5–1.6 steps (and a
    pass of 3 tokens cost more than one of 5, at every context)."""

    ms: list[float]
    padded: int = 1  # passes narrower than this are padded to it (the static path): they cost what it does
    batch: int = 1
    batches: dict = field(default_factory=dict)  # B > 1 → this curve's VerifyCosts for passes over B rows (:meth:`at`)

    def at(self, batch: int) -> "VerifyCosts":
        """The costs of passes over ``batch`` rows.  Until passes over that many rows are observed, T_B(q) is the
        batch-1 curve read at B·q tokens (past its last width, continued at its mean slope): compute-bound, as on a
        CPU, a batch costs what its tokens do; on a fixed-shape path, where the curve is flat, it stays flat."""
        if batch <= 1:
            return self
        if batch not in self.batches:
            K1 = len(self.ms)
            slope = (self.ms[-1] - self.ms[0]) / (K1 - 1) if K1 > 1 else 0.0
            tokens_ms = [self.cost(batch * q) if batch * q <= K1 else self.ms[-1] + slope * (batch * q - K1) for q in range(1, K1 + 1)]
            self.batches[batch] = VerifyCosts(tokens_ms, self.padded, batch=batch)
        return self.batches[batch]

    def _index(self, width: int) -> int:
        """Where T(width) is kept: a pass narrower than ``padded`` is run padded to it."""
        return min(max(width, self.padded), len(self.ms)) - 1

    def cost(self, width: int) -> float:
        """T_B(width), ms."""
        return self.ms[self._index(width)]

    def observe(self, width: int, ms: float) -> None:
        """A pass of ``width`` tokens over this curve's rows took ``ms``.  Every width moves by part of the surprise
        (the level: what the rows' context costs now), and that width by a smaller part more (its cost against
        the others').  A width not run for a while so follows the context the rows are at instead of keeping
        what it cost at an earlier one, and passes of several widths at one context settle each on its cost."""
        i = self._index(width)
        surprise = ms / self.ms[i]
        self.ms[:] = [cost * surprise**COST_MEMORY for cost in self.ms]
        self.ms[i] *= surprise**SHAPE_MEMORY

    def best_length(self, accepts: list[list[float]], draft_ms: float) -> int:
        """The L in 0..K that maximises the round's rate (B + Σ_rows Σ_{i≤L} Π_{j≤i} a_j) / (draft_ms + T_B(L+1)),
        ``accepts`` holding each drafted row's a_1, a_2, … (rows of the batch not in it commit one token)."""
        best, best_rate, expected = 0, self.batch / (draft_ms + self.cost(1)), float(self.batch)
        reach = [1.0] * len(accepts)
        for i in range(1, min(len(self.ms) - 1, max(map(len, accepts), default=0)) + 1):
            for r, accept in enumerate(accepts):
                reach[r] *= accept[i - 1] if i <= len(accept) else 0.0
                expected += reach[r]
            rate = expected / (draft_ms + self.cost(i + 1))
            if rate > best_rate:
                best, best_rate = i, rate
        return best

    def rate(self, accepted: float, proposed: float, draft_ms: float) -> float:
        """Tokens per ms of a round in which one row proposes ``proposed`` tokens, of which ``accepted`` are
        accepted, and the batch's other rows take a plain step: (B + accepted) / (draft_ms + T_B(proposed + 1))."""
        return (self.batch + accepted) / (draft_ms + self.cost(round(proposed) + 1))

    def rows_to_draft(self, gains: list[tuple[float, float]], draft_ms: float) -> list[int]:
        """Which rows of a round over B rows to draft, at each row's recent (accepted, proposed) per drafted round
        (:meth:`RowGain.expected`): the rows in order of accepted tokens, as long as together they commit tokens at
        least as fast as plain steps would, (B + Σ accepted) / (draft_ms + T_B(widest proposed + 1)) > B / T_B(1),
        and the set that commits fastest; none where no set pays.  Over four rows a pass of 2 tokens a row may cost
        1.5 steps: one row's likely token does not pay for it, four rows' do."""
        best, best_rate, chosen, accepted, widest = [], self.rate(0.0, 0.0, 0.0), [], 0.0, 0.0
        for row in sorted(range(len(gains)), key=lambda r: -gains[r][0]):
            chosen.append(row)
            accepted, widest = accepted + gains[row][0], max(widest, gains[row][1])
            rate = self.rate(accepted, widest, draft_ms)
            if rate > best_rate:
                best, best_rate = list(chosen), rate
        return sorted(best)


@dataclass
class Calibration:
    """P(a proposal is accepted | the ones before it were), per kind of proposal (``key``), learnt online
    from what the target accepted, starting from ``prior(key)`` worth PRIOR_WEIGHT observations."""

    prior: object  # key → probability
    counts: dict = field(default_factory=dict)  # key → [accepted, reached]

    def estimate(self, key) -> float:
        accepted, reached = self.counts.get(key, (0.0, 0.0))
        return (accepted + PRIOR_WEIGHT * self.prior(key)) / (reached + PRIOR_WEIGHT)

    def observe(self, keys: list, accepted: int) -> None:
        """``keys`` of a round's proposals in order, of which the first ``accepted`` were accepted: those
        and the first rejected one were reached; the rest tell nothing."""
        for i, key in enumerate(keys[: accepted + 1]):
            counts = self.counts.setdefault(key, [0.0, 0.0])
            counts[0] += i < accepted
            counts[1] += 1

    def observe_round(self, candidate: "Candidate", accepted: int, next_token: int | None) -> None:
        """Learn from a round in which ``candidate.proposed`` of the candidate tokens were proposed and
        ``accepted`` accepted.  When all were, the target's next token (greedy rows: what it would have
        accepted) also tells the fate of the first candidate that was cut, so cut candidates are learnt
        about too and a pessimistic start does not stay unchallenged."""
        reached = candidate.proposed
        if accepted == reached < len(candidate.tokens) and next_token is not None:
            accepted += candidate.tokens[reached] == next_token
            reached += 1
        self.observe(candidate.keys[:reached], accepted)


@dataclass
class Candidate:
    """What a drafter had for a row this round: every candidate token and its calibration key, of which
    the first ``proposed`` were proposed."""

    tokens: list[int]
    keys: list
    proposed: int


@dataclass
class RowGain:
    """Per row, recently: accepted drafts and proposed tokens per drafted round.  A row starts from ``start``,
    where recent rows ended (the first starts hopeful, one of one, so it is drafted); a row skipped to its end
    carries its recovered hope on, so that later rows are probed again."""

    gains: dict = field(default_factory=dict)  # slot → (accepted, proposed) per drafted round, decayed
    drafting: set = field(default_factory=set)  # slots drafted this round, until their outcome is known
    start: tuple[float, float] = (1.0, 1.0)  # where a new row starts

    def expected(self, slot: int) -> tuple[float, float]:
        return self.gains.setdefault(slot, self.start)

    def drafted(self, slot: int, accepted: int, proposed: int) -> None:
        self.drafting.discard(slot)
        self.gains[slot] = _toward(self.expected(slot), (accepted, proposed), 1 - GAIN_DECAY)

    def skipped(self, slot: int) -> None:
        accepted, proposed = self.expected(slot)
        self.gains[slot] = (accepted + GAIN_HOPE, proposed)

    def forget(self, slot: int) -> None:
        """The row in ``slot`` ended: where it ended moves where new rows start."""
        if slot in self.gains:
            self.start = _toward(self.start, self.gains.pop(slot), ROW_MEMORY)
        self.drafting.discard(slot)


def _toward(old: tuple[float, float], new: tuple[float, float], weight: float) -> tuple[float, float]:
    """``old`` moved ``weight`` of the way to ``new``, element by element."""
    return tuple(o + weight * (n - o) for o, n in zip(old, new))
