import math

import pytest
import torch
from transformers import LlamaConfig

from dlite_cli.core.config import DrafterConfig, load_config
from dlite_cli.core.errors import DliteError
from dlite_cli.models.model import Drafter, DrafterSpec
from dlite_cli.training.losses import LOSSES, Loss, cross_entropy, dropped_mass, forward_kl, position_weights, stable_loss, total_variation
from dlite_cli.training.steps import stage_batches, stage_loss, stage_plan, synthetic_sequences

torch.manual_seed(0)
B, K, V = 3, 4, 11


def reference(per_position) -> float:
    """Σ_i w_i · loss(b, i) over valid positions, averaged over anchors, written as plain loops."""
    w = [math.exp(-i / 4.0) for i in range(K)]
    return sum(sum(w[i] * per_position(b, i) for i in range(K) if valid[b, i]) for b in range(B)) / B


logits = torch.randn(B, K, V)
teacher = torch.randn(B, K, V)
labels = torch.randint(0, V, (B, K))
valid = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
weights = position_weights(K, 4.0)


def q(b, i):
    return torch.softmax(logits[b, i], -1)


def test_position_weights():
    assert torch.allclose(weights, torch.tensor([1, math.exp(-0.25), math.exp(-0.5), math.exp(-0.75)]))


def test_cross_entropy_matches_reference():
    expected = reference(lambda b, i: -math.log(q(b, i)[labels[b, i]]))
    assert math.isclose(cross_entropy(logits, labels, valid, weights).item(), expected, rel_tol=1e-5)


def test_forward_kl_matches_reference():
    def kl(b, i):
        p = torch.softmax(teacher[b, i], -1)
        return float((p * (p.log() - q(b, i).log())).sum())

    assert math.isclose(forward_kl(teacher, logits, valid, weights).item(), reference(kl), rel_tol=1e-5)
    assert forward_kl(logits, logits, valid, weights).abs().item() < 1e-6


def test_total_variation_is_exact_with_the_full_distribution_and_bounded_when_truncated():
    p = torch.softmax(teacher, -1)
    full_probs, full_ids = p.topk(V, -1)
    expected = reference(lambda b, i: float((p[b, i] - q(b, i)).abs().sum()))
    assert math.isclose(total_variation(logits, full_probs, full_ids, valid, weights).item(), expected, rel_tol=1e-5)
    # with the top-3 only, the per-position error is at most the dropped mass
    top_probs, top_ids = p.topk(3, -1)
    truncated = total_variation(logits, top_probs, top_ids, valid, weights).item()
    bound = reference(lambda b, i: float(dropped_mass(top_probs)[b, i]))
    assert abs(truncated - expected) <= bound + 1e-6


def test_stable_loss_mixes_ce_and_tv():
    p = torch.softmax(teacher, -1)
    probs, ids = p.topk(V, -1)
    mixed = stable_loss(logits, labels, probs, ids, valid, weights, lambda_ce=0.1, lambda_tv=1.0)
    expected = 0.1 * cross_entropy(logits, labels, valid, weights) + total_variation(logits, probs, ids, valid, weights)
    assert torch.allclose(mixed, expected)


def test_tokens_outside_the_draft_vocabulary():
    """A drafter scoring only tokens 0..6 of the target's 11: its q is 0 on 7..10, which TV counts in
    full, and a label among them is one CE cannot learn, so it is skipped."""
    p = torch.softmax(teacher, -1)
    probs, ids = p.topk(V, -1)
    draft_ids = torch.where(ids < 7, ids, -1)
    small = logits[..., :7]
    q_small = torch.softmax(small, -1)
    expected = reference(lambda b, i: float((p[b, i, :7] - q_small[b, i]).abs().sum() + p[b, i, 7:].sum()))
    assert math.isclose(total_variation(small, probs, draft_ids, valid, weights).item(), expected, rel_tol=1e-5)
    draft_labels = torch.where(labels < 7, labels, -1)
    expected = reference(lambda b, i: -math.log(q_small[b, i][labels[b, i]]) if labels[b, i] < 7 else 0.0)
    assert math.isclose(cross_entropy(small, draft_labels, valid, weights).item(), expected, rel_tol=1e-5)


def test_a_new_loss_is_its_function_and_one_registry_line_and_the_config_names_it(monkeypatch):
    """A stage trains with the loss its config names; a new one is added as a user would: a function, its line in
    LOSSES (here by monkeypatch) and ``train.stable_loss`` naming it."""
    monkeypatch.setitem(LOSSES, "double_ce", Loss(lambda x: 2 * cross_entropy(x.logits, x.labels, x.valid, x.weights)))  # the registry line
    target = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    spec = DrafterSpec.for_target(target, DrafterConfig(num_target_layers=3, draft_tokens=K, num_layers=1, head_rank=16), 0)
    torch.manual_seed(0)
    drafter, embed = Drafter(spec), torch.nn.Embedding(spec.vocab_size, spec.hidden_size)
    sizes = ["train.max_length=64", "train.micro_batch=2"]
    sequences, losses = synthetic_sequences(spec, load_config("micro", sizes).train), {}
    for name in ("ce", "double_ce"):
        train = load_config("micro", [f"train.stable_loss={name}", *sizes]).train
        plan = stage_plan("stable", train)
        batches = stage_batches(plan, train, drafter, None, sequences, [0, 1], K)
        with torch.no_grad():
            losses[name] = float(stage_loss(plan, train, drafter, None, embed, batches, position_weights(K, train.gamma), torch.device("cpu")))
    assert losses["double_ce"] == pytest.approx(2 * losses["ce"]) and losses["ce"] > 0
    with pytest.raises(DliteError, match="^stage stable: unknown loss 'tv': expected one of ce, kl, stable, double_ce$"):
        stage_plan("stable", load_config("micro", ["train.stable_loss=tv"]).train)
    with pytest.raises(DliteError, match="^stage stable-scratch: the loss kl distils a teacher, and this stage starts from none$"):
        stage_plan("stable-scratch", load_config("micro", ["train.stable_loss=kl"]).train)
