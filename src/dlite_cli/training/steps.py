"""One training step of a stage: what it trains, its anchors and batches, and its loss (paper App. A.1)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..core.config import TrainConfig
from ..core.errors import DliteError
from ..models.model import FULL_HISTORY, DrafterSpec
from .losses import LOSSES, LossInputs
from .sequences import Sequence, spans_of


@dataclass
class StagePlan:
    name: str
    history_window: int
    loss: str  # a name in losses.LOSSES
    epochs: int
    init_from: str | None  # stage whose export initialises the drafter (warmup: also the frozen teacher)
    sequential_head: bool = True  # False: the pure-parallel ablation, whatever drafter.sequential_head says

    @property
    def needs_teacher(self) -> bool:
        """Whether its loss distils a frozen teacher (warmup's forward KL): ``init_from``'s drafter, kept frozen."""
        return LOSSES[self.loss].needs_teacher

    def drafter_spec(self, spec: DrafterSpec) -> DrafterSpec:
        """The drafter this stage trains, from the drafter config's ``spec``: the stage's history window, and no
        sequential head in the pure-parallel ablation."""
        return dataclasses.replace(spec, history_window=self.history_window, sequential_head=spec.sequential_head and self.sequential_head)


def stage_plan(name: str, train: TrainConfig) -> StagePlan:
    """The training stage ``name`` under ``train``; a loss the config names that :data:`losses.LOSSES` lacks, or one that
    distils a teacher in a stage with none, is refused in one sentence."""
    # the single-stage runs get the epochs of the stage-2 drafter they are compared with
    single = train.stable_epochs if train.stable_init == "scratch" else train.warmup_epochs + train.stable_epochs
    stable = train.stable_loss
    plans = {
        # teacher_window: −1 = full (the paper's teacher); 128 / 512 / 0 give the history ablations
        "train-teacher": StagePlan("train-teacher", train.teacher_window, train.teacher_loss, train.teacher_epochs, None),
        "warmup": StagePlan("warmup", 0, train.warmup_loss, train.warmup_epochs, "train-teacher"),
        "stable": StagePlan("stable", 0, stable, train.stable_epochs, "warmup" if train.stable_init == "warmup" else None),
        "stable-scratch": StagePlan("stable-scratch", 0, stable, single, None),
        "stable-parallel": StagePlan("stable-parallel", 0, stable, single, None, sequential_head=False),
    }
    plan = plans[name]
    if plan.loss not in LOSSES:
        raise DliteError(f"stage {name}: unknown loss {plan.loss!r}: expected one of {', '.join(LOSSES)}")
    if plan.needs_teacher and plan.init_from is None:
        raise DliteError(f"stage {name}: the loss {plan.loss} distils a teacher, and this stage starts from none")
    return plan


def valid_anchors(sequence: Sequence) -> torch.Tensor:
    """Response positions a with a pivot a−1 and at least one label a+1 in the same response → (n,)."""
    return torch.cat([torch.arange(max(start, 1), end - 1) for start, end in sequence.responses()])


def response_ends(sequence: Sequence, anchors: torch.Tensor) -> torch.Tensor:
    """(B,) the end of the response each anchor lies in: its labels stop there (a trace's next turn is not the target's)."""
    starts, ends = torch.tensor(sequence.responses()).T.contiguous()
    return ends[torch.searchsorted(starts, anchors, right=True) - 1]


def sample_anchors(sequence: Sequence, count: int, seed: int) -> torch.Tensor:
    """``count`` anchors (or all, if fewer), chosen with a generator seeded by ``seed``, sorted."""
    candidates = valid_anchors(sequence)
    if len(candidates) <= count:
        return candidates
    generator = torch.Generator().manual_seed(seed)
    return candidates[torch.randperm(len(candidates), generator=generator)[:count]].sort().values


@dataclass
class AnchorBatch:
    """B anchors of one sequence (W ≠ 0) or of several (W = 0)."""

    context: torch.Tensor  # (B, S, H) target states at the pivots
    tokens: torch.Tensor  # (B, G) the anchor group: G − 1 tokens before each anchor, then the anchor
    labels: torch.Tensor  # (B, K) regenerated tokens x_{a+1..a+K}
    valid: torch.Tensor  # (B, K) bool: the label exists
    top_probs: torch.Tensor  # (B, K, k) p^T_i = p^T(· | x_≤a+i−1)
    top_ids: torch.Tensor  # (B, K, k)
    history: dict  # W ≠ 0: Drafter.history's arguments (features (1, T, S·H), mask (B, T), anchors (B,)); else empty

    def to(self, device) -> AnchorBatch:
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self) if f.name != "history"}
        return AnchorBatch(**moved, history={k: v.to(device) for k, v in self.history.items()})

    @property
    def anchor(self) -> torch.Tensor:
        """(B,)"""
        return self.tokens[:, -1]

    @property
    def previous(self) -> torch.Tensor:
        """Teacher-forced inputs of the sequential head: [anchor, y_1..y_{K−1}] (B, K)."""
        return torch.cat([self.anchor[:, None], self.labels[:, :-1].clamp(min=0)], dim=1)

    @property
    def target_greedy(self) -> torch.Tensor:
        """The target's own argmax at each draft position (B, K): what greedy verification accepts."""
        return self.top_ids[..., 0].long()


def anchor_batch(sequence: Sequence, anchors: torch.Tensor, k: int, window: int, group: int = 1) -> AnchorBatch:
    length = len(sequence.input_ids)
    offsets = torch.arange(k)
    label_positions = anchors[:, None] + 1 + offsets  # (B, K)
    valid = label_positions < response_ends(sequence, anchors)[:, None]
    p_positions = (anchors[:, None] + offsets).clamp(max=length - 1)
    if sequence.labels_from_target:
        # The text is not the target's: label i is the target's argmax after x_≤a+i−1, which is the
        # target's own continuation only while the text x_a+1..x_a+i−1 followed its argmax too.
        greedy = sequence.top_ids[:, 0].long()  # (T,) argmax after each position
        follows = torch.cat([sequence.input_ids[1:] == greedy[:-1], torch.zeros(1, dtype=torch.bool)])  # x_t+1 = argmax after t
        chain = torch.cat([torch.ones(len(anchors), 1, dtype=torch.bool), follows[p_positions[:, :-1]]], dim=1).long().cumprod(dim=1).bool()
        valid &= chain
        labels = torch.where(valid, greedy[p_positions], -100)
    else:
        labels = torch.where(valid, sequence.input_ids[label_positions.clamp(max=length - 1)], -100)
    history = {}
    if window != 0:
        span = int(anchors.max()) - 1  # positions 0 .. a−2 lie before every pivot
        positions = torch.arange(span)
        relative = positions[None] - anchors[:, None]  # (B, T), negative
        visible = relative <= -2
        if window != FULL_HISTORY:
            visible &= relative >= -1 - window
        history = {"features": sequence.features[:span].float().flatten(1)[None], "mask": visible, "anchors": anchors}
    return AnchorBatch(
        context=sequence.features[anchors - 1].float(),
        tokens=sequence.input_ids[(anchors[:, None] + torch.arange(1 - group, 1)).clamp(min=0)],
        labels=labels,
        valid=valid,
        top_probs=sequence.top_probs[p_positions].float(),
        top_ids=sequence.top_ids[p_positions],
        history=history,
    )


def concat_batches(batches: list[AnchorBatch]) -> AnchorBatch:
    """W = 0 anchors are independent: several sequences' anchors form one batch."""
    fields = ("context", "tokens", "labels", "valid", "top_probs", "top_ids")
    return AnchorBatch(**{f: torch.cat([getattr(b, f) for b in batches]) for f in fields}, history={})


def frequent_tokens(items: list, count: int, vocab_size: int) -> torch.Tensor:
    """The ``count`` most frequent token ids of the responses of ``items`` (Sequences or regen records),
    most frequent first: the draft vocabulary."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for item in items:
        ids, spans = (item.input_ids, item.responses()) if isinstance(item, Sequence) else (torch.tensor(item["input_ids"]), spans_of(item))
        for start, end in spans:
            counts += torch.bincount(ids[start:end].long(), minlength=vocab_size)
    return counts.sort(descending=True, stable=True).indices[:count]


def stage_batches(plan: StagePlan, train: TrainConfig, drafter, teacher, sequences: list[Sequence], seeds: list[int], k: int) -> list[AnchorBatch]:
    """The anchor batches of a stage's loss, on the sequences' device: ``train.anchors_per_sample`` anchors of each
    sequence (drawn with its seed), one batch per sequence where the loss reads a history (W ≠ 0), else one of all."""
    # warmup's student has no history, but its teacher reads the full history of each anchor
    window = teacher.spec.history_window if teacher is not None else plan.history_window
    group = getattr(drafter, "module", drafter).spec.anchor_group  # unwrapped from DDP
    batches = [anchor_batch(s, sample_anchors(s, train.anchors_per_sample, seed), k, window, group) for s, seed in zip(sequences, seeds)]
    return batches if window != 0 else [concat_batches(batches)]


def stage_loss(plan: StagePlan, train: TrainConfig, drafter, teacher, embed, batches: list[AnchorBatch], weights: torch.Tensor,
               device) -> torch.Tensor:
    """The stage's mean loss over the anchors of ``batches`` (:func:`stage_batches`), on ``device``; ``embed`` is
    the target's input embedding, ``teacher`` warmup's frozen teacher."""
    total = sum(len(b.anchor) for b in batches)
    return sum(batch_loss(plan, train, drafter, teacher, embed, b.to(device), weights) * (len(b.anchor) / total) for b in batches)


def batch_loss(plan: StagePlan, train: TrainConfig, drafter, teacher, embed, batch: AnchorBatch, weights: torch.Tensor) -> torch.Tensor:
    """The stage's loss on one batch; labels and p^T's ids are taken into the drafter's vocabulary."""
    own_history = batch.history if plan.history_window != 0 else {}
    logits = drafter(batch.context, batch.tokens, embed, batch.previous, **own_history)
    vocabulary = getattr(drafter, "module", drafter)  # unwrapped from DDP
    labels = torch.where(batch.labels >= 0, vocabulary.to_draft(batch.labels.clamp(min=0)), -1)
    teacher_logits = None
    if plan.needs_teacher:
        with torch.no_grad():
            teacher_logits = teacher(batch.context, batch.tokens, embed, batch.previous, **batch.history)
    inputs = LossInputs(logits, labels, batch.valid, weights, batch.top_probs, vocabulary.to_draft(batch.top_ids), teacher_logits, train)
    return LOSSES[plan.loss].compute(inputs)


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}  # train.mixed_precision → the autocast dtype


def synthetic_sequences(spec: DrafterSpec, train: TrainConfig) -> list[Sequence]:
    """``train.micro_batch`` random sequences of ``train.max_length`` tokens, with features (T, S, H) and p^T:
    what a training step is timed on (its time does not depend on the values)."""
    S, H, T, V = len(spec.target_layer_ids), spec.hidden_size, train.max_length, spec.vocab_size
    return [Sequence(torch.randint(V, (T,)), T // 4, torch.randn(T, S, H).half(), torch.rand(T, train.target_top_k).half(),
                     torch.randint(V, (T, train.target_top_k), dtype=torch.int32)) for _ in range(train.micro_batch)]
