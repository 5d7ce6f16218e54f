"""A benchmark's server subprocess on loopback: the free port it listens on, waiting until
its /health answers, and stopping it (SIGTERM, then SIGKILL after a grace period). Shared by
`rung serve` and llama.cpp's `llama-server` in `rung bench serve`."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable


def free_port() -> int:
    """A loopback port no one listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float, name: str,
                 detail: Callable[[], str] = lambda: "") -> None:
    """Return once ``http://127.0.0.1:port/health`` answers 200; a RuntimeError naming
    ``name`` (and ``detail()``, e.g. its log) if ``proc`` exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}{detail()}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
            return
        except (urllib.error.URLError, ConnectionError):    # not listening, or 503 loading
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start in {timeout_s:.0f} s{detail()}"
                                   ) from None
            time.sleep(0.2)


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM ``proc``, then SIGKILL it if it has not exited within ``grace_s``."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
