"""Memory plans: the peak bytes a stage will hold on its device, known from the config before anything loads.

A plan runs the stage's own code on tensors without storage (torch's FakeTensorMode: shapes, dtypes and
strides, no data) and counts the bytes of every storage alive, as the device's allocator would see them:

    training   the target's weights; with ``train.features: online`` its no-grad feature pass over a
               micro-batch; the drafter (and warmup's frozen teacher); then an optimizer step of up to two
               micro-batches of ``train.micro_batch`` sequences of ``train.max_length`` tokens under the
               stage's autocast (the second holding the first's gradients), with the optimizer's state it
               makes counted as held through every later step
    decoding   the target's and the drafters' weights, traced the same way, and, per slot holding
               ``tokens`` positions, the target's KV cache and a history drafter's draft KV (counted), with
               the widest pass's logits (and, on the graphs path, their copy in the graph pool)

The trace runs the CPU's kernels (a CPU build of torch cannot make even fake CUDA tensors); for attention
they keep what CUDA's fused kernels keep (the output and its log-sum-exp), and AdamW is traced with CUDA's
default multi-tensor step where the plan is for a GPU.  Not counted: the allocator's caching and
fragmentation, CUDA's context and kernels' workspaces, tensors a GPU run keeps on the host (the feature
cache, the held-out sequences).  So a plan fits when it needs at most ``HEADROOM`` of what the device has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass

import torch

from .errors import DliteError

HEADROOM = 0.9  # the share of the device's memory a plan may fill
MIN_CONTEXT = 1024  # the fewest positions per row an engine is sized down to before it refuses
GB = 1e9


def size(nbytes: float) -> str:
    """Bytes as a reader takes them in: 3.8 MB, 43.1 GB."""
    return f"{nbytes / GB:.1f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.1f} MB"


@dataclass
class MemoryPlan:
    """What a stage holds at its peak on one device (bytes), and the setting it was planned at."""

    stage: str
    setting: str  # e.g. "micro-batch 4 × 4096 tokens", "16 slots × 40960 tokens"
    parts: dict[str, int]  # what the peak is made of (each phase's peak above the parts before it)
    peak: int

    def fits(self, capacity: int) -> bool:
        return self.peak <= HEADROOM * capacity

    def describe(self) -> str:
        return f"{self.stage} at {self.setting} needs {size(self.peak)}"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the bytes of every tensor storage alive that it has seen (made by an op run inside it, or
    ``add``ed), and their peak; a storage is counted once however many views share it, and uncounted when freed."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self._phase_peak = 0
        self._seen: set[int] = set()

    def add(self, tensors) -> None:
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if id(storage) in self._seen:
                continue
            self._seen.add(id(storage))
            self.live += storage.nbytes()
            self.peak, self._phase_peak = max(self.peak, self.live), max(self._phase_peak, self.live)
            weakref.finalize(storage, self._freed, id(storage), storage.nbytes())

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self._seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.prim.device.default:  # the commonest call by far (AdamW's grouping asks every tensor)
            return out
        self.add(t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out

    @contextlib.contextmanager
    def phase(self, parts: dict[str, int], name: str):
        """Record as ``parts[name]`` how far the peak inside rises above what was alive before it."""
        before = self._phase_peak = self.live
        with self:
            yield
        parts[name] = self._phase_peak - before


def fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def module_bytes(*modules) -> LiveBytes:
    """A counter holding the parameters and buffers of ``modules``."""
    counter = LiveBytes()
    for module in modules:
        counter.add([*module.parameters(), *module.buffers()])
    return counter


# ---------------------------------------------------------------- sizes and fitting


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values one position costs in a KV cache."""
    return 2 * layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def planned_dtype(setting: str, device_type: str) -> torch.dtype:
    """A precision setting's dtype in a plan: auto is bfloat16 on a GPU, and float32 (the larger) on a CPU,
    where it is decided by timing."""
    if setting == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return getattr(torch, setting)


def device_memory(device: torch.device) -> int:
    """Bytes free for this process: the GPU's free memory, or the CPU's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemAvailable"))


def most_that_fit(peak_of, capacity: int) -> int:
    """The largest n (rows, or positions a row) with ``peak_of(n)`` bytes within ``capacity``, for a decoding plan
    (linear in both), or 0 where not even one fits."""
    one, two = peak_of(1), peak_of(2)
    return max(0, int((HEADROOM * capacity - one) // (two - one)) + 1) if HEADROOM * capacity >= one else 0


def checked(plan: MemoryPlan, capacity: int, advice, log=print) -> MemoryPlan:
    """``plan``, said in one line, if it fits ``capacity`` bytes; else refused with ``advice()`` (what fits, worked
    out only then)."""
    if not plan.fits(capacity):
        refuse(plan, capacity, advice())
    log(f"{plan.stage} plans {size(plan.peak)} of the {size(capacity)} free ({plan.setting})")
    return plan


def refuse(plan: MemoryPlan, capacity: int, advice: str) -> None:
    """Raise the one-sentence refusal of a plan that does not fit ``capacity`` bytes."""
    raise DliteError(f"{plan.describe()} ({', '.join(f'{k} {size(v)}' for k, v in plan.parts.items())}), more than "
                     f"{HEADROOM:.0%} of the {size(capacity)} this device has free: {advice}")
