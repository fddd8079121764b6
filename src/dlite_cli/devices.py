"""The device policy, in one place: where the target, the drafter and training run, and how that is named.

``target.device`` is ``auto`` (CUDA when available, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``.
Every stage resolves it here; a device that is not there is one sentence, not a traceback.
"""

from __future__ import annotations

import os
import platform
import statistics
import time

import torch

from .errors import DliteError


def resolve_device(setting: str) -> torch.device:
    """``target.device`` → the torch device to use (checked to exist)."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(setting)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise DliteError(f"target.device is {setting} but torch {torch.__version__} ({build}) sees no CUDA device; use --set target.device=cpu (or auto)")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DliteError(f"target.device is {setting} but this machine has {count} CUDA device(s): cuda:0 to cuda:{count - 1}")
    return device


def hardware(device: torch.device) -> str:
    """What a table row says the work ran on: the GPU's name, or the CPU's model, core count and the vector
    instructions PyTorch's kernels use there (``ATEN_CPU_CAPABILITY``, and oneDNN's ``ONEDNN_MAX_CPU_ISA``,
    cap them: then the same CPU does different work, at different speeds, as bfloat16 shows)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        name = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA")
    return f"{name} CPU, {os.cpu_count()} cores, {torch.backends.cpu.get_cpu_capability()}" + (f" (oneDNN ≤ {onednn})" if onednn else "")


def now(device: torch.device) -> float:
    """Wall time after the device has finished the work queued so far."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def median_ms(fn, repeats: int, device: torch.device, warmup: int = 2) -> float:
    """The median wall time of ``fn()`` in ms, after ``warmup`` calls (CUDA graphs are captured there)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = now(device)
        fn()
        times.append(1000 * (now(device) - start))
    return statistics.median(times)
