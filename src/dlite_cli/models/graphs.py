"""Fixed-shape passes replayed as CUDA graphs: one launch for a whole forward instead of hundreds.

A decode step of a small model at batch 1 is a few hundred small kernels; launched one by one from
Python they cost more than the memory traffic they do (launch-bound).  A CUDA graph records them once
and replays them with one call.  A graph fixes its shapes and the addresses it reads and writes, so
each shape (``key``) gets its own, its inputs are copied into buffers it owns, and its outputs are
its own tensors, overwritten by its next replay.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # batch sizes a fixed-shape pass is padded to


@dataclass
class CaptureLedger:
    """Every graph captured in this process and the seconds the captures took (warm-up included, on a
    synchronised clock): timed regions take them out, as if each graph had been captured before the clock started."""

    count: int = 0
    seconds: float = 0.0


CAPTURES = CaptureLedger()


def bucket_for(rows: int, limit: int) -> int:
    """The smallest bucket that holds ``rows`` rows, or ``limit`` (the most rows there are) if none is smaller."""
    return next((b for b in BUCKETS if rows <= b <= limit), limit)


class CudaGraphs:
    """``run(key, fn, *inputs)`` = ``fn(*inputs)``, captured once per key and replayed when ``enabled``.

    ``fn`` must be a fixed-shape computation of its tensor inputs (no host reads); everything else it
    touches (weights, a KV cache) must stay at the same address while the graph lives — call
    :meth:`clear` when it moves.  The graphs share one memory pool, so that each key does not keep its
    own intermediates: returned tensors are valid until the next ``run``, of any key.  Each graph is
    captured on its inputs' device, whichever device is current (a server's worker thread, ``cuda:1``).
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.captured: dict = {}  # key → (input buffers, graph, outputs)
        self.pool = None  # the graphs' shared memory pool, made at the first capture

    @torch.no_grad()
    def run(self, key, fn, *inputs: torch.Tensor):
        if not self.enabled:
            return fn(*inputs)
        if key not in self.captured:
            self.captured[key] = self._capture(fn, inputs)
        buffers, graph, outputs = self.captured[key]
        for buffer, value in zip(buffers, inputs):
            buffer.copy_(value, non_blocking=True)
        graph.replay()
        return outputs

    def clear(self) -> None:
        self.captured.clear()
        self.pool = None

    def _capture(self, fn, inputs):
        buffers = [x.clone() for x in inputs]
        torch.cuda.synchronize(buffers[0].device)
        start = time.perf_counter()
        with torch.cuda.device(buffers[0].device):
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up outside the graph: lazy initialisation, kernel choice
                for _ in range(2):
                    fn(*buffers)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = fn(*buffers)
        torch.cuda.synchronize(buffers[0].device)
        CAPTURES.count += 1
        CAPTURES.seconds += time.perf_counter() - start
        return buffers, graph, outputs
