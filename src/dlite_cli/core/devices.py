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


class OtherLoad:
    """``with OtherLoad() as load: …`` → ``load.share``: the share of the machine's cores that processes other
    than this one kept busy meanwhile (0 idle, 1 every core), from /proc/stat less this process's own CPU time;
    None where /proc/stat is not there."""

    share: float | None = None
    SHORTEST = 0.5  # s: /proc/stat counts in ticks of 10 ms, so a shorter window is waited out (idle)

    @staticmethod
    def _busy() -> tuple[float, int] | None:
        """(seconds of CPU time all processes used since boot, the number of cores), or None."""
        try:
            lines = open("/proc/stat").read().splitlines()
        except OSError:
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in lines[0].split()[1:9])
        cores = sum(line.startswith("cpu") and line[3:4].isdigit() for line in lines)
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), cores

    def __enter__(self) -> "OtherLoad":
        self._start = time.perf_counter(), self._busy(), sum(os.times()[:2])
        return self

    def __exit__(self, *exc) -> None:
        started, busy_before, own_before = self._start
        time.sleep(max(0.0, self.SHORTEST - (time.perf_counter() - started)))  # a few clock ticks are no measure
        wall, busy, own = time.perf_counter(), self._busy(), sum(os.times()[:2])
        if busy is None or busy_before is None or wall <= started:
            return
        others = (busy[0] - busy_before[0]) - (own - own_before)
        self.share = round(min(1.0, max(0.0, others / ((wall - started) * busy[1]))), 3)


TORCH_EXTENSIONS = ("torchvision", "torchaudio", "torchcodec")  # vLLM's CPU build pulls them, built for another torch


def check_torch_extensions() -> None:
    """Refuse, in one sentence, torch extensions installed beside dlite that do not load with this torch: through
    transformers (which imports torchvision where it finds one) they break every model, vLLM's too, in a traceback
    far from the cause.  dlite and vLLM's text models use none of them."""
    import importlib
    import importlib.util
    from importlib import metadata

    broken = []
    for name in TORCH_EXTENSIONS:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception:  # an ABI mismatch shows as RuntimeError, OSError or ImportError, depending on the package
            broken.append(f"{name} {metadata.version(name)}")
    if broken:
        names = " ".join(entry.split()[0] for entry in broken)
        raise DliteError(f"{', '.join(broken)} {'is' if len(broken) == 1 else 'are'} installed but cannot load with torch "
                         f"{torch.__version__} (built for another torch); dlite needs none of them: pip uninstall -y {names}")
