"""Precision chosen by measuring the work it governs, on the machine that does it.

Four settings may be ``auto``; each is decided by timing its own work both ways:

    target.dtype (batched)    regen and the feature pass: a pass of one token for each of a batch of rows
    target.dtype (decoding)   generate, bench, serve: a decode step plus the widest verify at batch 1, on the
                              decode path and pass width the engine would use with that dtype
    train.mixed_precision     one training step of the stage with bfloat16 autocast and one in float32
    decode.draft_dtype        one draft round at batch 1 in float32 and in bfloat16

On a GPU ``auto`` is bfloat16 for all four, unmeasured.  On a CPU the answer depends on the CPU: with AMX or
AVX-512 BF16 bfloat16 is often the faster, with AVX2 alone it is several times slower at batched work while a
single decode step may still be quicker.  So on a CPU without bfloat16 instructions the compute-bound work (a
batched pass, a training step: 4-16× the slower in bfloat16 on a 2-core AVX2 EPYC, and timing a bfloat16 training
step there took minutes) is float32 unmeasured; the decode step and the draft round are still measured.

A single timing decides nothing (:func:`measure`): each option is run once untimed (oneDNN builds its
primitives, the allocator grows), then the options are timed in ROUNDS interleaved rounds (A B, B A, A B, …)
and compared by their medians (:func:`verdict`).  Unless the medians part by MARGIN or more and the rounds
agree, the conventional choice stands: float32 on a CPU.  While the options are timed, the share of the
cores other processes keep busy is measured too (:class:`devices.OtherLoad`).  A decision is remembered in
the dlite cache with its rounds, spread and load, printed as one line, and recorded in the manifest of the
stage that asked for it (:func:`made`); one taken on a busy machine, or on a thin margin the first time,
is measured again next time.  ``dlite precision`` lists what is remembered and ``--forget`` clears it.  An
explicit value in a config or ``--set`` is never measured.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .devices import OtherLoad, hardware

GPU_CHOICE = "bfloat16"
CPU_CHOICE = "float32"
ROUNDS = 5  # interleaved timings of each option, after one untimed run of each
MARGIN = 0.10  # the slower median must be this much above the faster for the faster to be chosen
CLEAR_RATIO = 5.0  # two rounds that both part the options by more than this end the timing early
BUSY = 0.25  # other processes keeping more than this share of the cores busy: measured again next time


@dataclass
class Decision:
    setting: str  # e.g. "target.dtype (batched)"
    choice: str
    ms: dict[str, float]  # option → median ms of the timed work ({} on a GPU: not measured)
    work: str  # what was timed
    hardware: str
    rounds: list[dict[str, float]] = field(default_factory=list)  # each round's ms per option
    reason: str = ""  # why ``choice``, in words
    decisive: bool = False  # the medians parted by MARGIN and the rounds agreed
    load: float | None = None  # share of the cores other processes kept busy while timing (None: unknown)
    measured_at: str = ""  # UTC, ISO 8601
    settled: bool = False  # not measured again: decisive, or thin twice, on a machine that was not busy

    @property
    def spread(self) -> float:
        """The largest (max − min) / median of an option's rounds."""
        return max(((max(r[o] for r in self.rounds) - min(r[o] for r in self.rounds)) / self.ms[o] for o in self.ms),
                   default=0.0)

    def line(self, remembered: str = "") -> str:
        if not self.ms:
            return f"{self.setting} auto: {self.choice} on {self.hardware} ({self.reason}: not measured)"
        timings = ", ".join(f"{ms:.1f} ms in {option}" for option, ms in self.ms.items())
        load = "" if self.load is None else f", other processes busy on {self.load:.0%} of the cores"
        again = "" if self.settled else "; measured again next time"
        where = f" (remembered in {remembered}{again})" if remembered else ""
        return (f"{self.setting} auto: {self.work} takes {timings} on {self.hardware} (medians of {len(self.rounds)} "
                f"interleaved rounds, spread {self.spread:.0%}{load}); using {self.choice}: {self.reason}{where}")


_made: dict[str, Decision] = {}  # (setting, key) → the decision this process made or recalled
_asked: list[str] = []  # every (setting, key) asked for in this process, in order


def fastest(ms: dict[str, float]) -> str:
    """The option whose work took the least time (the first named on a tie)."""
    return min(ms, key=ms.get)


def _clear(rounds: list[dict[str, float]]) -> bool:
    """Whether every round parts the options by more than CLEAR_RATIO, the same one ahead each time."""
    return len({fastest(r) for r in rounds}) == 1 and all(max(r.values()) > CLEAR_RATIO * min(r.values()) for r in rounds)


def measure(options: dict[str, Callable[[], float]], rounds: int = ROUNDS) -> list[dict[str, float]]:
    """Each option run once untimed, then ``rounds`` rounds of one timing each (ms), in alternating order
    (A B, B A, …) so that a load that comes and goes, or a machine that speeds up, favours neither.  Two
    rounds that part the options by more than CLEAR_RATIO the same way end it early (a bfloat16-autocast
    training step without native bfloat16 is 20× the slower, some 30 s a step)."""
    for run in options.values():
        run()
    timed: list[dict[str, float]] = []
    for index in range(rounds):
        order = list(options) if index % 2 == 0 else list(reversed(options))
        timed.append({name: round(options[name](), 2) for name in order})
        if len(timed) == 2 and _clear(timed):
            break
    return [{name: r[name] for name in options} for r in timed]


def verdict(rounds: list[dict[str, float]], conventional: str) -> tuple[dict[str, float], str, str, bool]:
    """Rounds of timings → (median ms per option, the choice, why, decisive).  The fastest median is chosen
    when it is MARGIN or more ahead and the fastest in all rounds but at most one; otherwise ``conventional``."""
    medians = {name: round(statistics.median(r[name] for r in rounds), 2) for name in rounds[0]}
    best = fastest(medians)
    wins = sum(fastest(r) == best for r in rounds)
    margin = min(ms for name, ms in medians.items() if name != best) / max(medians[best], 1e-9) - 1
    if wins < len(rounds) - 1:
        return medians, conventional, f"the conventional choice: the rounds disagree ({best} the faster in {wins} of {len(rounds)})", False
    if margin < MARGIN:
        return medians, conventional, f"the conventional choice: the medians are within {MARGIN:.0%} ({margin:.1%})", False
    return medians, best, f"{margin:.0%} faster, in {wins} of {len(rounds)} rounds", True


def records_dir() -> Path:
    from .files import cache_dir

    return cache_dir() / "precision"


def _recall(record: Path) -> Decision | None:
    """The decision remembered in ``record``, or None (none, or one from a dlite that kept no rounds)."""
    try:
        data = json.loads(record.read_text())
        return Decision(**data) if data.get("rounds") or not data.get("ms") else None
    except (OSError, ValueError, TypeError):
        return None


def decide(setting: str, key: dict, options: dict[str, Callable[[], float]], work: str, device: torch.device,
           log=print, gpu_choice: str = GPU_CHOICE, cpu_choice: str = CPU_CHOICE, compute_bound: bool = False) -> str:
    """``setting`` auto → the option of ``options`` (name → a function timing the work once, in ms) that is
    clearly the fastest here (:func:`verdict`), else ``cpu_choice``; remembered per machine and ``key`` (what
    else the timing depends on) until a measurement on a quiet machine settles it.  ``compute_bound`` work is
    ``cpu_choice`` unmeasured on a CPU without bfloat16 instructions."""
    from .files import atomic_write_json  # artifacts records this module's decisions in manifests

    machine, ident = hardware(device), json.dumps([setting, key], sort_keys=True)
    if device.type == "cuda":
        decision, remembered = Decision(setting, gpu_choice, {}, work, machine, reason="a GPU", settled=True), ""
    elif compute_bound and not bf16_instructions():
        reason = "a CPU without bfloat16 instructions"
        decision, remembered = Decision(setting, cpu_choice, {}, work, machine, reason=reason, settled=True), ""
    else:
        digest = hashlib.sha256(f"{ident}{machine}".encode()).hexdigest()[:16]
        record = records_dir() / f"{setting.split()[0]}-{digest}.json"
        decision = _made.get(ident) or _recall(record)
        if decision is None or not decision.settled and ident not in _made:
            decision = _measured(setting, options, work, machine, cpu_choice, decision)
            atomic_write_json(record, dataclasses.asdict(decision))
        remembered = str(record)
    if ident not in _made:
        log(decision.line(remembered))
    _made[ident] = decision
    _asked.append(ident)
    return decision.choice


def bf16_instructions() -> bool:
    """Whether this CPU computes in bfloat16 natively (x86 AVX-512 BF16 or AMX, Arm's BF16), as oneDNN may use it
    (``ONEDNN_MAX_CPU_ISA`` can forbid it); True where /proc/cpuinfo cannot tell (not Linux)."""
    import os

    try:
        flags = {word for line in open("/proc/cpuinfo") if line.startswith(("flags", "Features")) for word in line.split()}
    except OSError:
        return True
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}) and (capped == "ALL" or "BF16" in capped or "AMX" in capped)


def _measured(setting, options, work, machine, cpu_choice, before: Decision | None) -> Decision:
    """A new decision from timing ``options``; ``before``, the one it replaces, settles a second thin one."""
    with OtherLoad() as load:
        rounds = measure(options)
    medians, choice, reason, decisive = verdict(rounds, cpu_choice)
    quiet = load.share is None or load.share < BUSY
    thin_before = before is not None and not before.decisive and (before.load is None or before.load < BUSY)
    if not quiet:
        reason += f" (measured while other processes kept {load.share:.0%} of the cores busy)"
    return Decision(setting, choice, medians, work, machine, rounds, reason, decisive, load.share,
                    time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), quiet and (decisive or thin_before))


def remembered() -> list[tuple[Path, Decision | None]]:
    """Every decision record in the cache, with what it holds (None: unreadable or from an older dlite)."""
    return [(record, _recall(record)) for record in sorted(records_dir().glob("*.json"))]


def forget() -> int:
    """Delete every remembered decision (each is measured again when next needed) → how many there were."""
    records = list(records_dir().glob("*.json"))
    for record in records:
        record.unlink()
    return len(records)


def mark() -> int:
    """Where this process's decisions stand now: :func:`made` since then is what a stage begun now used."""
    return len(_asked)


def made(since: int = 0) -> list[dict]:
    """The decisions asked for since ``since`` (a :func:`mark`), each once, for a stage's manifest."""
    return [dataclasses.asdict(_made[ident]) for ident in dict.fromkeys(_asked[since:])]


def decisions_table():
    """``dlite precision``: a rich table of the decisions remembered, each option's median, the rounds, their
    spread, the load while timing, and whether it is measured again."""
    from rich.table import Table

    table = Table(title=f"precision decisions remembered in {records_dir()}")
    for column in ("setting", "work", "choice", "median ms", "rounds", "spread", "load", "measured", "again"):
        table.add_column(column, overflow="fold")
    for record, decision in remembered():
        if decision is None:
            table.add_row(record.stem, "(from an older dlite: measured again when next needed)", *[""] * 6, "yes")
            continue
        medians = ", ".join(f"{option} {ms:.1f}" for option, ms in decision.ms.items())
        load = "" if decision.load is None else f"{decision.load:.0%}"
        table.add_row(decision.setting, decision.work, decision.choice, medians, str(len(decision.rounds)),
                      f"{decision.spread:.0%}", load, decision.measured_at, "no" if decision.settled else "yes")
    return table
