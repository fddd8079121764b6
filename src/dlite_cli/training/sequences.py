"""A regen record's sequence and what the target computed over it, as training reads it.

For a regenerated sequence x_0..x_{T−1} (prompt then response) a no-grad target
pass gives, per position t:

    features   (T, S, H)  outputs of the S selected decoder layers (nothing else kept)
    top_probs  (T, k)     the k largest probabilities of p^T(· | x_≤t), the target's next-token distribution
    top_ids    (T, k)     their token ids (these two at the position before each response token; zeros elsewhere)

An anchor a (a response token) then yields: context = features[a−1] (the pivot),
the anchor token x_a, labels x_{a+1..a+K} and p^T_i = top-k at a+i−1.  A multi-turn
trace is one sequence with one response span per reply: its anchors and labels
stay inside a span, while the features before each are of the whole trace so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.files import atomic_path
from ..decoding.proposers.none import NoDrafter
from ..models.runner import TargetRunner


def spans_of(record: dict) -> list[list[int]]:
    """The ``[start, end)`` ranges of ``record["input_ids"]`` that are its responses: a trace's ``spans``, else the one
    after the prompt."""
    return record["spans"] if "spans" in record else [[record["prompt_len"], len(record["input_ids"])]]


@dataclass
class Sequence:
    """One regenerated sequence and what the target computed over it."""

    input_ids: torch.Tensor  # (T,) long
    prompt_len: int
    features: torch.Tensor  # (T, S, H): from a target pass on the target's device in its dtype; from the cache on the host in float16
    top_probs: torch.Tensor  # (T, k)
    top_ids: torch.Tensor  # (T, k) int32
    labels_from_target: bool = False  # the response is the source's original text: labels are the target's argmax
    spans: list[list[int]] = field(default_factory=list)  # [start, end) of each response (a trace's replies); empty: one, from prompt_len

    def responses(self) -> list[list[int]]:
        """The [start, end) ranges of the tokens the drafter learns to propose: the responses."""
        return self.spans or [[self.prompt_len, len(self.input_ids)]]

    def scored_positions(self) -> torch.Tensor:
        """The positions whose p^T training reads, the one before each response token: from the one before each
        response to the one before its last token → (n,)."""
        return torch.cat([torch.arange(max(start - 1, 0), end - 1) for start, end in self.responses()])


def scored_sequence(record: dict, features: torch.Tensor, top_k: int, logits_at) -> Sequence:
    """A regen record's Sequence from a target pass over it: its ``features`` (T, S, H), and p^T where training reads it,
    at the position before each response token (zeros elsewhere), as ``logits_at(positions (n,)) → (n, V)`` gives
    the target's logits there."""
    length = len(record["input_ids"])
    sequence = Sequence(torch.tensor(record["input_ids"]), record["prompt_len"], features, torch.zeros(length, top_k),
                        torch.zeros(length, top_k, dtype=torch.int32), record.get("labels") == "target", spans_of(record))
    read = sequence.scored_positions()
    probs, top = torch.softmax(logits_at(read).float(), dim=-1).topk(top_k, dim=-1)
    sequence.top_probs[read], sequence.top_ids[read] = probs.cpu(), top.int().cpu()
    return sequence


def runner_sequence(runner: TargetRunner, layer_ids: list[int], record: dict, features: torch.Tensor, top_k: int,
                    dtype: torch.dtype | None = None) -> Sequence:
    """A regen record's Sequence from the features (T, S', H) a runner captured over it (``runner.capture_layers``: at
    least ``layer_ids`` and id L, the final norm's output, through which p^T is read), with those of ``layer_ids`` on
    the host (in ``dtype``, else the runner's)."""
    final = runner.capture_layers.index(len(runner.layers))
    columns = [runner.capture_layers.index(i) for i in layer_ids]
    return scored_sequence(record, features[:, columns].to("cpu", dtype), top_k,
                           lambda read: runner.linears.lm_head(features[read.to(features.device), final][None])[0])


class FeatureRecorder(NoDrafter):
    """Plain decoding that keeps the target's features at every position of each request: the regen engine's proposer
    where training caches features, so that the sequences regen writes need no feature pass of their own.  Its
    runner captures the drafter's layers and id L.  A request's features, (T − 1, S', H) over its prompt and its
    output but the last token (the one no pass reads), are ``kept[request]`` once it ends, and the slot keeps them
    too, so that a next turn computes only its new tokens."""

    needs_all_features = True

    def __init__(self, runner: TargetRunner):
        self.runner, self.target_layers = runner, runner.capture_layers
        self.history: dict[int, list[torch.Tensor]] = {}  # slot → features of its positions before the pivot
        self.kept: dict = {}  # Request → (T − 1, S', H)

    def begin(self, row, prompt_features) -> None:
        self.history[row.slot] = [prompt_features[:-1]]

    def extend(self, row, features) -> None:
        self.history[row.slot].append(features)

    def end(self, row) -> None:
        features = torch.cat([*self.history.pop(row.slot), row.pivot[None]])
        self.kept[row] = features
        if len(features) == self.runner.length(row.slot):  # not a request that failed (its slot is emptied)
            self.runner.features[row.slot] = features


def write_sequences(path: Path, sequences: list[Sequence], metadata: dict[str, str] | None = None) -> None:
    """``sequences`` into one safetensors file at ``path`` (features and p^T in half precision), atomically."""
    from safetensors.torch import save_file

    tensors = {
        "input_ids": torch.cat([s.input_ids for s in sequences]).int(),
        "features": torch.cat([s.features for s in sequences]).half().cpu(),
        "top_probs": torch.cat([s.top_probs for s in sequences]).half(),
        "top_ids": torch.cat([s.top_ids for s in sequences]),
        "lengths": torch.tensor([len(s.input_ids) for s in sequences]),
        "prompt_lens": torch.tensor([s.prompt_len for s in sequences]),
        "spans": torch.tensor([span for s in sequences for span in s.responses()]).reshape(-1, 2),
        "span_counts": torch.tensor([len(s.responses()) for s in sequences]),
        "labels_from_target": torch.tensor([s.labels_from_target for s in sequences]),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata)


def sequences_metadata(path: Path) -> dict[str, str]:
    """The metadata :func:`write_sequences` wrote to ``path``, read without its tensors."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return f.metadata() or {}


def read_sequences(path: Path, columns: list[int] | None = None) -> tuple[list[Sequence], dict[str, str]]:
    """The Sequences :func:`write_sequences` wrote to ``path`` (features of the layer ``columns`` only, None: all), and
    its metadata."""
    from safetensors.torch import load_file

    shard = load_file(path)
    metadata = sequences_metadata(path)
    if columns is not None:
        shard["features"] = shard["features"][:, columns]
    starts = torch.cumsum(shard["lengths"], 0) - shard["lengths"]
    from_target = shard.get("labels_from_target", torch.zeros(len(starts), dtype=torch.bool)).tolist()
    # each sequence's response spans; a cache from before spans holds none: one response each, after the prompt
    spans = [s.tolist() for s in shard["spans"].split(shard["span_counts"].tolist())] if "spans" in shard else [[]] * len(starts)
    sequences = []
    for start, length, prompt_len, flag, responses in zip(starts.tolist(), shard["lengths"].tolist(), shard["prompt_lens"].tolist(),
                                                          from_target, spans):
        end = start + length
        sequences.append(Sequence(shard["input_ids"][start:end].long(), prompt_len, shard["features"][start:end], shard["top_probs"][start:end],
                                  shard["top_ids"][start:end], flag, responses))
    return sequences, metadata
