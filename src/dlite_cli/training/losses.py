"""Training losses over draft positions (paper App. A.1), each weighted by w_i = exp(−(i−1)/γ).

Shapes: B anchors, K draft positions, V vocabulary.  ``valid`` (B, K) marks
positions that have a label (an anchor near the end of a sequence has fewer
than K).  Every loss is Σ_i w_i · loss_i summed over positions and averaged over
anchors.  The target distribution p^T is stored sparsely as its top-k
(probabilities and ids): the TV term is then exact for the truncated p^T, and
differs from the full one by at most the dropped mass 1 − Σ top-k (which
:func:`dropped_mass` reports).

A stage trains with the loss its config names (``train.teacher_loss``, ``train.warmup_loss``, ``train.stable_loss``)
from :data:`LOSSES`.  Adding a loss is its function here, one line in :data:`LOSSES`, and the config naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.config import TrainConfig


def position_weights(k: int, gamma: float) -> torch.Tensor:
    """w_i = exp(−(i−1)/γ), i = 1..K → (K,)."""
    return torch.exp(-torch.arange(k, dtype=torch.float32) / gamma)


def _weighted_mean(per_position: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """per_position (B, K) → Σ_i w_i · loss_i over valid positions, averaged over anchors."""
    return (per_position * valid * weights.to(per_position.device)).sum(-1).mean()


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """logits (B, K, V), labels (B, K) → weighted CE; a label < 0 (none, or outside the drafter's
    vocabulary) adds nothing."""
    per_position = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().clamp(min=0), reduction="none")
    return _weighted_mean(per_position.view(labels.shape), valid & (labels >= 0), weights)


def forward_kl(teacher_logits: torch.Tensor, logits: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """KL(p^H ‖ q) with p^H = softmax(teacher_logits), q = softmax(logits); both (B, K, V)."""
    log_p = F.log_softmax(teacher_logits.float(), dim=-1)
    log_q = F.log_softmax(logits.float(), dim=-1)
    per_position = (log_p.exp() * (log_p - log_q)).sum(-1)
    return _weighted_mean(per_position, valid, weights)


def total_variation(
    logits: torch.Tensor, target_probs: torch.Tensor, target_ids: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """‖p^T − q‖₁ with p^T given by its top-k: target_probs, target_ids (B, K, k); logits (B, K, V).

    Outside the top-k p^T is taken as 0, so the term there is the mass q puts outside it.  An id < 0
    is a token the drafter cannot propose (outside its vocabulary): q is 0 there.
    """
    q = F.softmax(logits.float(), dim=-1)
    q_top = q.gather(-1, target_ids.long().clamp(min=0)) * (target_ids >= 0)
    inside = (target_probs.float() - q_top).abs().sum(-1)
    outside = (1 - q_top.sum(-1)).clamp(min=0)
    return _weighted_mean(inside + outside, valid, weights)


def stable_loss(logits, labels, target_probs, target_ids, valid, weights, lambda_ce: float, lambda_tv: float):
    """Stage 2: λ_CE · CE(q, y) + λ_TV · ‖p^T − q‖₁."""
    ce = cross_entropy(logits, labels, valid, weights)
    tv = total_variation(logits, target_probs, target_ids, valid, weights)
    return lambda_ce * ce + lambda_tv * tv


def dropped_mass(target_probs: torch.Tensor) -> torch.Tensor:
    """1 − Σ top-k p^T per position: the bound on how far the sparse TV is from the full one."""
    return 1 - target_probs.float().sum(-1)


@dataclass
class LossInputs:
    """What a stage's loss may read, for B anchors × K draft positions (V: the drafter's vocabulary)."""

    logits: torch.Tensor  # (B, K, V) the drafter's
    labels: torch.Tensor  # (B, K) the regenerated tokens in the drafter's vocabulary; < 0: none, or outside it
    valid: torch.Tensor  # (B, K) bool: the position has a label
    weights: torch.Tensor  # (K,) w_i
    target_probs: torch.Tensor  # (B, K, k) p^T as its top-k
    target_ids: torch.Tensor  # (B, K, k) their ids in the drafter's vocabulary (< 0: outside it)
    teacher_logits: torch.Tensor | None  # (B, K, V) the frozen teacher's, for a loss that distils it; else None
    train: TrainConfig  # the loss's weights (lambda_ce, lambda_tv)


@dataclass(frozen=True)
class Loss:
    compute: Callable[[LossInputs], torch.Tensor]  # → the scalar loss
    needs_teacher: bool = False  # it reads teacher_logits: the stage's ``init_from`` drafter, kept frozen


LOSSES: dict[str, Loss] = {
    "ce": Loss(lambda x: cross_entropy(x.logits, x.labels, x.valid, x.weights)),
    "kl": Loss(lambda x: forward_kl(x.teacher_logits, x.logits, x.valid, x.weights), needs_teacher=True),
    "stable": Loss(lambda x: stable_loss(x.logits, x.labels, x.target_probs, x.target_ids, x.valid, x.weights, x.train.lambda_ce,
                                         x.train.lambda_tv)),
}
