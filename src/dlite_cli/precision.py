"""Precision chosen by measuring the work it governs, on the machine that does it.

Four settings may be ``auto``; each is decided by timing its own work both ways:

    target.dtype (batched)    regen and the feature pass: a pass of one token for each of a batch of rows
    target.dtype (decoding)   generate, bench, serve: a decode step plus the widest verify at batch 1, on the
                              decode path and pass width the engine would use with that dtype
    train.mixed_precision     one training step of the stage with bfloat16 autocast and one in float32
    decode.draft_dtype        one draft round at batch 1 in float32 and in bfloat16

On a GPU ``auto`` is bfloat16 for all four, unmeasured.  On a CPU the answer depends on the CPU: with AMX or
AVX-512 BF16 bfloat16 is often the faster, with AVX2 alone it is several times slower at batched work while a
single decode step may still be quicker.  A decision is measured once per machine (and per shape that
matters), remembered in the dlite cache, printed as one line with both timings, and recorded in the manifest
of the stage that asked for it (:func:`made`).  Each option is timed twice, in mirrored order, and keeps its best
(:func:`measure`), so that a passing load (just after an install: a bfloat16 pass once timed 498 ms, 155 ms
minutes later) does not decide for the machine; a first round that parts them by more than 5x is not repeated.
An explicit value in a config or ``--set`` is never measured.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Callable

import torch

from .devices import hardware

GPU_CHOICE = "bfloat16"
CLEAR_RATIO = 5.0  # the largest passing load seen here slowed one timing 3.2x (498 vs 155 ms)


@dataclass
class Decision:
    setting: str  # e.g. "target.dtype (batched)"
    choice: str
    ms: dict[str, float]  # option → ms of the timed work ({} on a GPU: not measured)
    work: str  # what was timed
    hardware: str

    def line(self, remembered: str = "") -> str:
        if not self.ms:
            return f"{self.setting} auto: {self.choice} on {self.hardware} (a GPU: not measured)"
        timings = ", ".join(f"{ms:.1f} ms in {option}" for option, ms in self.ms.items())
        where = f" (remembered in {remembered})" if remembered else ""
        return f"{self.setting} auto: {self.work} takes {timings} on {self.hardware}; using {self.choice}{where}"


_made: dict[str, Decision] = {}  # (setting, key) → the decision this process made or recalled
_asked: list[str] = []  # every (setting, key) asked for in this process, in order


def fastest(ms: dict[str, float]) -> str:
    """The option whose work took the least time (the first named on a tie): the whole rule, by construction
    whatever the CPU, since the timings come from the machine itself."""
    return min(ms, key=ms.get)


def measure(options: dict[str, Callable[[], float]]) -> dict[str, float]:
    """Each option's best of two timings, taken in the order A B B A: a load that comes and goes, or a machine
    that speeds up or slows down while it is measured, then favours neither option.  Where the first round already
    parts them by more than CLEAR_RATIO (bfloat16 autocast without native bfloat16: a training step 10x slower, some
    30 s), no passing load seen here could reverse it, and the second round is not timed."""
    ms: dict[str, float] = {}
    for name in options:
        ms[name] = round(options[name](), 2)
    if max(ms.values()) <= CLEAR_RATIO * min(ms.values()):
        for name in reversed(options):
            ms[name] = round(min(options[name](), ms[name]), 2)
    return ms


def decide(setting: str, key: dict, options: dict[str, Callable[[], float]], work: str, device: torch.device,
           log=print, gpu_choice: str = GPU_CHOICE) -> str:
    """``setting`` auto → the option of ``options`` (name → a function timing the work in ms) that is fastest
    here, measured once per machine and ``key`` (what else the timing depends on) and then remembered."""
    from .artifacts import atomic_write_json  # artifacts records this module's decisions in manifests
    from .wheels import cache_dir

    machine, ident = hardware(device), json.dumps([setting, key], sort_keys=True)
    if device.type == "cuda":
        decision, remembered = Decision(setting, gpu_choice, {}, work, machine), ""
    else:
        digest = hashlib.sha256(f"{ident}{machine}".encode()).hexdigest()[:16]
        record = cache_dir() / "precision" / f"{setting.split()[0]}-{digest}.json"
        if record.is_file():
            decision = Decision(**json.loads(record.read_text()))
        else:
            ms = measure(options)
            decision = Decision(setting, fastest(ms), ms, work, machine)
            atomic_write_json(record, dataclasses.asdict(decision))
        remembered = str(record)
    if ident not in _made:
        log(decision.line(remembered))
    _made[ident] = decision
    _asked.append(ident)
    return decision.choice


def mark() -> int:
    """Where this process's decisions stand now: :func:`made` since then is what a stage begun now used."""
    return len(_asked)


def made(since: int = 0) -> list[dict]:
    """The decisions asked for since ``since`` (a :func:`mark`), each once, for a stage's manifest."""
    return [dataclasses.asdict(_made[ident]) for ident in dict.fromkeys(_asked[since:])]
