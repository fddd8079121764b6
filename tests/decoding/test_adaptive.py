"""Adaptive draft length: the cost rule, the online calibration, and a row's recent gain."""

import time
from types import SimpleNamespace

import torch

from dlite_cli.decoding.adaptive import GAIN_DECAY, GAIN_HOPE, PRIOR_WEIGHT, Calibration, Candidate, RowGain, VerifyCosts
from dlite_cli.decoding.proposers.base import Draft
from dlite_cli.decoding.proposers.hybrid import HybridDrafter
from dlite_cli.decoding.proposers.model import ModelDrafter
from dlite_cli.decoding.proposers.ngram import NgramDrafter
from dlite_cli.models.model import greedy_pick


def drafts(costs: VerifyCosts, gain: tuple[float, float], draft_ms: float) -> bool:
    """Whether a row with this recent gain is drafted when no other row of its round is."""
    return costs.rows_to_draft([gain], draft_ms) == [0]


def test_best_length_proposes_while_the_next_token_pays_for_its_verify():
    flat = VerifyCosts([40.0] * 5)  # a pass costs the same whatever it holds (a GPU at batch 1)
    assert flat.best_length([[0.2, 0.1, 0.1, 0.1]], draft_ms=5) == 4
    nearly_flat = VerifyCosts([40.0, 40.5, 41.0, 41.5, 42.0])
    assert nearly_flat.best_length([[0.2, 0.1, 0.1, 0.1]], draft_ms=5) == 2  # the third token adds 0.002 expected, for 0.5 ms
    steep = VerifyCosts([40.0, 60.0, 80.0, 100.0, 120.0])  # each token adds half a step
    assert steep.best_length([[0.2, 0.1, 0.1, 0.1]], draft_ms=5) == 0  # a fifth of a token is not worth half a step
    assert steep.best_length([[0.95, 0.9, 0.3, 0.1]], draft_ms=5) == 2  # (1 + .95 + .855) / 85 beats the rest
    assert steep.best_length([[]], draft_ms=5) == steep.best_length([], draft_ms=5) == 0
    assert VerifyCosts([40.0, 41.0, 39.0, 39.0, 39.0]).best_length([[0.9]], draft_ms=5) == 1  # never past the proposals there are


def test_a_batched_round_proposes_one_length_for_its_rows_at_what_a_pass_over_them_costs():
    """Every row of a batched pass pays for the widest: the rows share one length, weighed at the batch's costs.
    Compute-bound (a CPU), a pass over 4 rows of 2 tokens costs what 8 tokens do at batch 1; on a flat curve
    (a GPU's fixed-shape path) a batch costs what a row does."""
    steep = VerifyCosts([40.0 + 10 * i for i in range(8)])  # each token a quarter of a step
    assert steep.at(1) is steep and steep.at(4).batch == 4 and steep.at(4) is steep.at(4)
    assert steep.at(4).ms == [70.0, 110.0, 150.0, 190.0, 230.0, 270.0, 310.0, 350.0]  # T_1 at 4, 8, 12, … tokens
    assert steep.best_length([[0.8, 0.5]], draft_ms=5) == 2  # alone: (1 + .8 + .4) / 65 beats 1 / 40
    assert steep.at(4).best_length([[0.8, 0.5]], draft_ms=5) == 0  # one row of four: 4.8 / 115 < 4 / 75
    assert steep.at(4).best_length([[0.9, 0.8]] * 4, draft_ms=5) == 2  # all four likely: (4 + 4 × 1.62) / 155 beats 7.6 / 115 and 4 / 75
    assert not drafts(steep.at(4), (0.8, 1.0), draft_ms=5) and drafts(steep, (0.8, 1.0), draft_ms=5)
    flat = VerifyCosts([40.0] * 8, padded=8)
    assert flat.at(4).ms == [40.0] * 8 and flat.at(4).best_length([[0.5] * 7, [0.1] * 7], draft_ms=5) == 7
    for _ in range(60):  # observed passes over 4 rows correct that batch's curve alone, its other widths with them
        steep.at(4).observe(1, 140.0)
    assert abs(steep.at(4).cost(1) - 140.0) < 1 and steep.at(4).cost(2) > 1.7 * 110.0 and steep.cost(1) == 40.0


def test_a_row_is_drafted_only_while_its_rounds_beat_plain_steps_at_the_width_they_verify():
    flat = VerifyCosts([40.0] * 5)
    # where a wide pass costs what a step does, a fifth of a token a round pays for a 5 ms draft: 1.2 × 40 ≥ 5 + 40
    assert drafts(flat, (0.2, 4.0), draft_ms=5) and not drafts(flat, (0.1, 4.0), draft_ms=5)
    steep = VerifyCosts([40.0, 60.0, 80.0, 100.0, 120.0])  # float32 on an AVX2 CPU: each token adds half a step
    assert not drafts(steep, (0.6, 1.0), draft_ms=5)  # 1.6 × 40 < 5 + 60
    assert drafts(steep, (0.7, 1.0), draft_ms=5)  # 1.7 × 40 ≥ 5 + 60
    assert not drafts(steep, (0.7, 4.0), draft_ms=5)  # the same gain over four proposals: a verify of 5 tokens
    assert not drafts(steep, (0.0, 0.0), draft_ms=0)  # a round that gains nothing is not drafted, costly or not


def test_the_rows_of_a_batched_pass_propose_one_length_weighed_for_all_of_them():
    """Each row alone would propose what pays for it; together they share the length that pays for the pass they share:
    at nearly flat costs the likely row's 2 tokens, which the unlikely row proposes too, for nothing more."""
    lookup = NgramDrafter(4)
    lookup.adapt(VerifyCosts([40.0, 42.0, 44.0, 46.0, 48.0]))
    likely = SimpleNamespace(slot=0, tokens=[1, 2, 3, 4, 5, 6, 1, 2, 3])  # a 3-token match: [4, 5, 6, 1] follows
    unlikely = SimpleNamespace(slot=1, tokens=[7, 8, 9, 7])  # a 1-token match: [8, 9, 7]
    costs, accepts = lookup.costs.at(2), [lookup.accepts(lookup.candidate(row)) for row in (likely, unlikely)]
    assert [costs.best_length([accept], 0.0) for accept in accepts] == [2, 1]  # each as if the other proposed nothing
    assert costs.best_length(accepts, 0.0) == 2
    draft = lookup.propose([likely, unlikely], greedy_pick)
    assert draft.lengths == [2, 2] and draft.tokens.tolist() == [[4, 5, 6, 1], [8, 9, 7, 0]]
    assert lookup.proposed[1].proposed == 2  # what the calibration learns from: the second token was reached too


def test_rows_are_drafted_together_where_together_they_pay_for_the_pass_they_share():
    """Over four rows a pass of 2 tokens a row costs 1.5 steps: one likely row's token does not pay for it, four do,
    and a row that gains nothing is left out of a round the likely ones pay for."""
    costs = VerifyCosts([40.0 + 10 * i for i in range(8)]).at(4)  # 70, 110, …: T_1 at 4, 8, … tokens
    likely, unlikely = (0.9, 1.0), (0.05, 1.0)
    assert costs.rows_to_draft([likely, unlikely, unlikely, unlikely], draft_ms=5) == []  # (4 + 0.9 + 0.15) / 115 < 4 / 70
    assert costs.rows_to_draft([likely] * 4, draft_ms=5) == [0, 1, 2, 3]  # (4 + 3.6) / 115 ≥ 4 / 70
    assert costs.rows_to_draft([likely, likely, (0.0, 1.0), likely], draft_ms=5) == [0, 1, 3]


def test_calibration_learns_acceptance_of_the_positions_that_were_reached():
    calibration = Calibration(prior=lambda key: 0.5)
    assert calibration.estimate("a") == 0.5
    for _ in range(20):
        calibration.observe(["a", "b", "c"], accepted=0)  # a rejected; b and c never reached
    assert calibration.estimate("a") == (0 + PRIOR_WEIGHT * 0.5) / (20 + PRIOR_WEIGHT) and calibration.estimate("b") == 0.5
    calibration.observe(["b", "c"], accepted=2)
    assert calibration.estimate("b") > 0.5 and calibration.estimate("c") > 0.5


def test_a_row_that_gains_nothing_is_skipped_then_probed_again():
    gain, costs = RowGain(), VerifyCosts([40.0, 41.0])
    assert drafts(costs, gain.expected(0), draft_ms=8)  # hopeful at first
    for _ in range(30):
        gain.drafted(0, accepted=0, proposed=1)
    assert not drafts(costs, gain.expected(0), draft_ms=8)
    skipped = 0
    while not drafts(costs, gain.expected(0), draft_ms=8):
        gain.skipped(0)
        skipped += 1
    # 0.9^30 ≈ 0.04 accepted per round recovers to the threshold (8 + 41 − 40) / 40 at GAIN_HOPE a round
    assert skipped == round((9 / 40 - GAIN_DECAY**30) / GAIN_HOPE + 0.5)


def test_where_drafting_never_pays_probes_cost_a_few_percent_of_plain_decoding():
    """A drafter that is never right, on a CPU where a 2-token verify costs 1.5 steps: after its first
    rounds it is only probed, and the probes cost at most ~2.5 % over plain decoding."""
    gain, costs, draft_ms = RowGain(), VerifyCosts([40.0, 60.0]), 5.0
    plain_ms = spent_ms = 0.0
    for round_ in range(3000):
        drafted = drafts(costs, gain.expected(0), draft_ms)
        if drafted:
            gain.drafted(0, accepted=0, proposed=1)
        else:
            gain.skipped(0)
        if round_ >= 1000:  # past the hopeful start
            plain_ms += costs.ms[0]
            spent_ms += draft_ms + costs.ms[1] if drafted else costs.ms[0]
    assert 1.0 < spent_ms / plain_ms <= 1.03


def test_short_rows_start_where_recent_rows_ended():
    """Turns of 25 rounds each (a chat's 32 tokens), one after another in one slot, on the CPU above.  With a
    drafter that is never right only the first rows learn that drafting does not pay, and probes stay within
    ~2.5 % of plain decoding (a hopeful start for every row would draft 5 of each 25 rounds: 12 %).  With a
    drafter that is always right every round of every row is drafted."""
    costs, draft_ms = VerifyCosts([40.0, 60.0]), 5.0

    def drafted_rounds(accepted: int) -> list[bool]:
        gain, drafted = RowGain(), []
        for _ in range(200):
            for _ in range(25):
                drafted.append(drafts(costs, gain.expected(0), draft_ms))
                gain.drafted(0, accepted, proposed=1) if drafted[-1] else gain.skipped(0)
            gain.forget(0)
        return drafted

    later = drafted_rounds(accepted=0)[25 * 20 :]  # past the first 20 rows
    spent_ms = sum(draft_ms + costs.ms[1] if drafted else costs.ms[0] for drafted in later)
    assert 1.0 < spent_ms / (len(later) * costs.ms[0]) <= 1.03
    assert all(drafted_rounds(accepted=1))


def test_costs_follow_the_passes_the_engine_runs_at_the_rows_context():
    """The start-up curve is measured at one context.  Passes of several widths at another settle each width on
    what it costs there; when the context grows and only plain steps run, the widths not run rise with them
    instead of keeping what they cost at the shorter context (where drafting would still look paid for)."""
    costs = VerifyCosts([73.0, 82.0, 95.0])
    for _ in range(200):
        costs.observe(1, 52.0)
        costs.observe(2, 69.0)
    assert abs(costs.cost(1) - 52.0) < 0.5 and abs(costs.cost(2) - 69.0) < 0.5 and costs.cost(3) < 95.0  # unrun: with the level
    grown = VerifyCosts([73.0, 82.0, 95.0])
    for _ in range(100):
        grown.observe(1, 73.0)
        grown.observe(3, 95.0)
    for _ in range(60):  # the context grows: a step costs 110 ms, and no row is drafted
        grown.observe(1, 110.0)
    assert abs(grown.cost(1) - 110.0) < 0.5 and grown.cost(3) > 125.0  # 95 ms at the shorter context
    assert not drafts(grown, (0.25, 2.0), draft_ms=12)  # at 95 ms it would have looked paid for: 1.25 / 107 > 1 / 110
    padded = VerifyCosts([50.0] * 4, padded=4)  # the static path: every pass is 4 wide
    for _ in range(60):
        padded.observe(1, 40.0)
    assert abs(padded.cost(1) - 40.0) < 0.5 and padded.cost(1) == padded.cost(3) == padded.cost(4)


def test_the_hybrid_takes_the_lookup_where_it_commits_more_per_ms_than_the_models_recent_rounds():
    model = ModelDrafter("dlite", 7, [])
    hybrid = HybridDrafter(model, NgramDrafter(7), vocab_size=10)
    model.gain.gains[0], model.draft_ms = (1.2, 7.0), 10.0  # recent rounds: 1.2 of 7 proposals accepted
    lookup = Candidate([5], [(3, 0)], proposed=1)  # one token after a 3-token match: expected 0.6 accepted
    assert not hybrid._lookup_first(lookup, 0)  # fixed (no costs): per round, 0.6 < 1.2 tokens
    hybrid.costs = VerifyCosts([40.0] * 8)  # a wide pass costs a step: (1 + 1.2) / (10 + 40) beats 1.6 / 40
    assert not hybrid._lookup_first(lookup, 0)
    hybrid.costs = VerifyCosts([40.0 + 20 * i for i in range(8)])  # each token half a step: 2.2 / 190 < 1.6 / 60
    assert hybrid._lookup_first(lookup, 0)
    # a continuation of 7 is weighed at the length that pays for it (1 token: 1.6 / 60), not at all 7 (2.45 / 180),
    # against a model whose rounds committed 0.8 of 2 proposals (1.8 / 90)
    model.gain.gains[0] = (0.8, 2.0)
    assert hybrid._lookup_first(Candidate(list(range(7)), [(3, i) for i in range(7)], proposed=7), 0)


class SlowDrafter(ModelDrafter):
    """Proposes K = 2 tokens at 0.9 each in rounds that take 25 ms, though timed warm at start-up they take 5."""

    _device = torch.device("cpu")

    def round_ms(self):
        return 5.0

    def _model_draft(self, rows, pick):
        time.sleep(0.025)
        return Draft(torch.zeros(len(rows), 2, dtype=torch.long), [2] * len(rows), None, torch.full((len(rows), 2), 0.9))


def test_a_drafter_prices_its_rounds_at_what_they_take_in_the_engine():
    """A round's cost starts where start-up timed it, and the rounds the engine runs move it: a row whose gain pays
    for a 5 ms round ((1 + 0.4) / (5 + 50) > 1 / 40) stops being drafted once its rounds are seen to take 25."""
    drafter = SlowDrafter("slow", 2, [])
    drafter.adapt(VerifyCosts([40.0, 50.0, 60.0]))
    assert drafter.draft_ms == 5.0 and drafts(drafter.costs, (0.4, 1.0), drafter.draft_ms)
    rounds = 0
    for _ in range(20):
        drafter.gain.gains[0] = (0.4, 1.0)  # the row's gain held where a 5 ms round pays
        rounds += drafter.propose([SimpleNamespace(slot=0)], greedy_pick).lengths[0] > 0
        drafter.proposed.clear()  # as if the engine had observed the round
        drafter.gain.drafting.clear()
    assert 1 <= rounds <= 3 and drafter.draft_ms > 6.0 and not drafts(drafter.costs, (0.4, 1.0), drafter.draft_ms)
