"""``history``: a drafter checkpoint that keeps a draft KV cache over the history (W ≠ 0: the teacher, a sliding window)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...models.model import FULL_HISTORY, Drafter, History
from .dlite import DLiteAdapter


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
