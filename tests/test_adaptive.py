"""Adaptive draft length: the cost rule, the online calibration, and a row's recent gain."""

from dlite_cli.adaptive import PRIOR_WEIGHT, Calibration, RowGain, VerifyCosts


def test_best_length_proposes_while_the_next_token_pays_for_its_verify():
    flat = VerifyCosts([40.0] * 5)  # a pass costs the same whatever it holds (a GPU at batch 1)
    assert flat.best_length([0.2, 0.1, 0.1, 0.1], draft_ms=5) == 4
    nearly_flat = VerifyCosts([40.0, 40.5, 41.0, 41.5, 42.0])
    assert nearly_flat.best_length([0.2, 0.1, 0.1, 0.1], draft_ms=5) == 2  # the third token adds 0.002 expected, for 0.5 ms
    steep = VerifyCosts([40.0, 60.0, 80.0, 100.0, 120.0])  # each token adds half a step
    assert steep.best_length([0.2, 0.1, 0.1, 0.1], draft_ms=5) == 0  # a fifth of a token is not worth half a step
    assert steep.best_length([0.95, 0.9, 0.3, 0.1], draft_ms=5) == 2  # (1 + .95 + .855) / 85 beats the rest
    assert steep.best_length([], draft_ms=5) == 0
    assert flat.worth_drafting(expected_gain=0.2, draft_ms=5) and not flat.worth_drafting(expected_gain=0.1, draft_ms=5)


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
    assert costs.worth_drafting(gain.expected(0), draft_ms=8)  # hopeful at first
    for _ in range(10):
        gain.drafted(0, accepted=0)
    assert not costs.worth_drafting(gain.expected(0), draft_ms=8)
    skipped = 0
    while not costs.worth_drafting(gain.expected(0), draft_ms=8):
        gain.skipped(0)
        skipped += 1
    assert 1 < skipped < 10  # a few rounds without drafting, then a probe
