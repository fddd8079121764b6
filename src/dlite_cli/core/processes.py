"""Processes dlite starts: a child that dies with its parent, and a server run until it answers ``/health``.

    die_with_parent(signal, pid)   in a child: the kernel signals it when its parent dies, even by kill -9 (Linux)
    free_port()                    a loopback port nothing listens on
    started(argv, log, port)       a server process, yielded once healthy as Server(url, process), stopped on the way out

``dlite run`` has its stages' processes die with it, vLLM's engine processes die with the server or bench that
started them, and ``dlite sessions`` and the tests start servers with :func:`started`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from .errors import DliteError

PR_SET_PDEATHSIG = 1  # linux/prctl.h
START_TIMEOUT_S = 600  # a server that answers no /health by then has failed (vLLM compiles at start-up)


def die_with_parent(signal_number: int, parent: int) -> None:
    """In a child process of ``parent`` (its pid): be sent ``signal_number`` when the parent dies, however it dies
    (Linux's PR_SET_PDEATHSIG; elsewhere nothing); where it died before this call, exit at once."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal_number)
    if os.getppid() != parent:
        os._exit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server(NamedTuple):
    url: str  # http://127.0.0.1:PORT
    process: subprocess.Popen


@contextmanager
def started(argv: list[str], log_path: Path, port: int, env: dict[str, str] | None = None, cwd: Path | None = None,
            timeout_s: float = START_TIMEOUT_S) -> Iterator[Server]:
    """Run the server ``argv`` listening on ``port`` (its output to ``log_path``; ``env`` added to this process's
    environment) until it answers /health → a Server; terminated (killed after a minute) on the way out.  A server
    that stops or does not answer within ``timeout_s`` is refused in one sentence naming its log."""
    import httpx

    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        deadline = time.time() + timeout_s
        while True:
            if process.poll() is not None:
                tail = [line for line in log_path.read_text().splitlines() if line.strip()][-1:] or ["no output"]
                raise DliteError(f"the server stopped at start-up ({tail[0].strip()}); its log: {log_path}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.time() > deadline:
                raise DliteError(f"the server did not answer within {timeout_s:.0f} s; its log: {log_path}")
            time.sleep(0.3)
        yield Server(url, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
