"""Decoding methods by name: the one grammar every command reads, the registry of proposers, and building one.

    [vllm:]DRAFTER[+PAIRING][:fixed]      or ar, ar:fastest (the bench's names for plain decoding: PLAIN, FASTEST_PLAIN)

    DRAFTER    a proposer that loads no checkpoint (:data:`PROPOSERS`: none, ngram, suffix), or a drafter checkpoint:
               dlite, history, parallel, scratch (a stage's export in the run directory), a directory or a hub id
    +PAIRING   a history-free checkpoint paired with a copying proposer (+ngram, +suffix): per row and round, the
               copy where it is expected to beat the drafter (proposers/hybrid.py)
    :fixed     all K proposed every round, as in the paper (otherwise only what is expected to pay: adaptive.py)
    vllm:      decoded in vLLM (vllm_engine), not dlite's engine

A name is checked (:func:`known_method`) before anything loads; a known drafter whose stage has not run is refused
when it is built.  Adding a proposer that loads no checkpoint is its own file in proposers/ and one line in
:data:`PROPOSERS`; every engine reads the registry (vLLM asks each proposer for its ``vllm_config``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.errors import DliteError
from ..models.model import Drafter
from ..models.release import load_drafter
from .checkpoints import STAGE_OF, is_checkpoint_name, resolve_drafter_path
from .proposers.base import Proposer, ProposerSetup
from .proposers.copying import LookupDrafter
from .proposers.dlite import DLiteAdapter
from .proposers.history import HistoryAdapter
from .proposers.hybrid import HybridDrafter
from .proposers.model import ModelDrafter, draft_dtype
from .proposers.ngram import NgramDrafter
from .proposers.none import NoDrafter
from .proposers.suffix import SuffixDrafter

# name → the proposer class (its ``build(setup)`` makes one) for proposers that load no checkpoint
PROPOSERS: dict[str, type[Proposer]] = {
    "none": NoDrafter,
    "ngram": NgramDrafter,
    "suffix": SuffixDrafter,
}
VLLM_PREFIX = "vllm:"
FIXED = ":fixed"
PLAIN = "ar"  # the bench's name for plain decoding (the drafter none)
# plain decoding at its fastest here (one token a pass, eager on a CPU, CUDA graphs on a GPU), measured beside PLAIN where
# the methods share passes K + 1 wide (a lower precision: see runner.pass_width): speedups are taken against the faster
# of the two, greedy texts compared with PLAIN's, which computes what the others do
FASTEST_PLAIN = "ar:fastest"


def pairings() -> list[str]:
    """The proposers a checkpoint may be paired with: those that copy."""
    return [name for name, cls in PROPOSERS.items() if issubclass(cls, LookupDrafter)]


@dataclass(frozen=True)
class Method:
    """A method name read by the grammar (:func:`parse_method`)."""

    name: str  # as written
    drafter: str  # a name in PROPOSERS, or a checkpoint's (a stage's drafter, a directory, a hub id)
    pairing: str = ""  # the copying proposer paired with the checkpoint, or ""
    adaptive: bool = True  # False: NAME:fixed
    in_vllm: bool = False  # vllm:NAME

    @property
    def engine(self) -> str:
        """The engine it decodes in, as tables name it: vLLM or dlite."""
        return "vLLM" if self.in_vllm else "dlite"

    @property
    def plain(self) -> str:
        """The plain decoding its speedup is taken against: its own engine's."""
        return VLLM_PREFIX + PLAIN if self.in_vllm else PLAIN

    @property
    def plain_decodings(self) -> tuple[str, ...]:
        """The plain decodings its speedup may be taken against: its engine's, and in dlite's its fastest too."""
        return (self.plain,) if self.in_vllm else (PLAIN, FASTEST_PLAIN)

    @property
    def is_plain(self) -> bool:
        return self.drafter == "none"

    @property
    def local(self) -> str:
        """Its name without ``vllm:``."""
        return self.name.removeprefix(VLLM_PREFIX)

    @property
    def drafter_option(self) -> str:
        """What ``--drafter`` takes for it (``ar`` → ``none``)."""
        return self.drafter + (f"+{self.pairing}" if self.pairing else "") + ("" if self.adaptive else FIXED)

    @property
    def has_checkpoint(self) -> bool:
        return self.drafter not in PROPOSERS

    @property
    def keeps_history(self) -> bool:
        """Whether it keeps a draft KV cache (the teacher, ``history``)."""
        return self.drafter == "history"

    @property
    def uses_suffix_trees(self) -> bool:
        """Whether it is suffix decoding or paired with it."""
        return "suffix" in (self.drafter, self.pairing)


def parse_method(name: str) -> Method:
    """``name`` read by the grammar (see the module's docstring), unchecked: :func:`known_method` checks it."""
    rest = name.removeprefix(VLLM_PREFIX)
    rest = "none" if rest in (PLAIN, FASTEST_PLAIN) else rest
    adaptive = not rest.endswith(FIXED)
    rest = rest.removesuffix(FIXED)
    drafter, pairing = rest, ""
    for candidate in pairings():
        if rest.endswith(f"+{candidate}"):
            drafter, pairing = rest.removesuffix(f"+{candidate}"), candidate
    return Method(name, drafter, pairing, adaptive, name.startswith(VLLM_PREFIX))


def known_method(name: str) -> Method:
    """``name`` read by the grammar, refused in one sentence where its drafter is none the grammar knows, or a pairing
    pairs something that is not a checkpoint."""
    method = parse_method(name)
    if method.has_checkpoint and not is_checkpoint_name(method.drafter):
        words = ", ".join([*PROPOSERS, *STAGE_OF])
        where = "" if method.drafter == name else f" in {name!r}"
        raise DliteError(f"unknown drafter {method.drafter!r}{where}: expected [vllm:]DRAFTER[+{'|+'.join(pairings())}][:fixed] with DRAFTER one of "
                         f"{words}, a drafter directory or a hub id (or {PLAIN} for plain decoding)")
    if method.pairing and not method.has_checkpoint:
        raise DliteError(f"{name}: +{method.pairing} pairs a drafter checkpoint ({', '.join(STAGE_OF)}, a directory or a hub id), not {method.drafter}")
    return method


def known_drafter(name: str) -> Method:
    """``--drafter``'s ``name`` (generate, serve), checked as :func:`known_method` does; ``vllm:`` is the bench's, refused."""
    method = known_method(name)
    if method.in_vllm:
        raise DliteError(f"--drafter {name}: {VLLM_PREFIX} names an engine in the bench's methods; here pass --engine vllm --drafter {method.local}")
    return method


def checkpoint_of(method: Method, run_dir: Path) -> Path | None:
    """The checkpoint directory ``method`` drafts with, or None for a proposer that loads none."""
    return resolve_drafter_path(method.drafter, run_dir) if method.has_checkpoint else None


def load_proposer(method: Method, directory: Path | None, setup: ProposerSetup) -> Proposer:
    """The proposer ``method`` names, built with ``setup``: from :data:`PROPOSERS`, or the drafter in ``directory`` (its
    checkpoint: :func:`checkpoint_of`), paired where the method says, on the target's device."""
    if not method.has_checkpoint:
        return PROPOSERS[method.drafter].build(setup)
    model = checkpoint_proposer(directory, method.drafter if method.drafter in STAGE_OF else directory.name, setup)
    if method.pairing and isinstance(model, HistoryAdapter):
        raise DliteError(f"{method.name}: {method.pairing} pairs with a history-free drafter, and {directory} keeps a draft history (W ≠ 0)")
    return paired(model, method.pairing, setup) if method.pairing else model


def checkpoint_proposer(directory: Path, label: str, setup: ProposerSetup) -> ModelDrafter:
    """The checkpoint in ``directory`` as a proposer named ``label`` (:func:`model_proposer`), run in ``setup.dtype``
    (auto: proposers/model.draft_dtype) on the target's device."""
    target = setup.target_model
    drafter = load_drafter(directory, target.config).eval().to(next(target.parameters()).device)
    embed = target.get_input_embeddings()
    drafter.to(dtype=getattr(torch, draft_dtype(setup.dtype, drafter, embed, setup.log)))
    return model_proposer(drafter, embed, label, setup)


def model_proposer(drafter: Drafter, embed, label: str, setup: ProposerSetup) -> ModelDrafter:
    """``drafter`` (on its device, in its dtype; ``embed`` the target's input embedding) as a proposer named ``label``:
    DLiteAdapter where it keeps no history (W = 0), HistoryAdapter otherwise (its KV cache up to ``setup.capacity``)."""
    if drafter.spec.history_window != 0:
        return HistoryAdapter(drafter, embed, label, setup.capacity)
    return DLiteAdapter(drafter, embed, label, graphs=setup.path == "graphs")


def paired(model: DLiteAdapter, pairing: str, setup: ProposerSetup) -> HybridDrafter:
    """``model`` paired with the copying proposer ``pairing``, which proposes up to the model's K."""
    copying = PROPOSERS[pairing].build(dataclasses.replace(setup, draft_tokens=model.draft_tokens))
    return HybridDrafter(model, copying, model.drafter.spec.vocab_size)

