"""A request's own chat template, rendered in a child process that is killed at its deadline.

A request template is code from the client: even in Jinja's sandbox it can loop for long or
build a huge string in one C call (a thread cannot be interrupted there). So it renders in a
child Python process of its own (jinja2 only; its address space capped), one render at a
time, and a render past its deadline kills the child; the next render starts a fresh one.
Its CPU time is not the server's: the event loop and the engine thread keep their GIL.
Protocol: one JSON line per request on the child's stdin, one JSON line per answer on its
stdout.
"""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import threading
import time
from typing import Any

CHILD_MEMORY_BYTES = 1 << 30        # the child's address-space cap


class TemplateTimeout(Exception):
    """The template did not render within its deadline (the child was killed)."""


class TemplateRenderer:
    """Renders request templates in the child; thread-safe (renders queue on a lock)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None

    def render(self, template: str, messages: list[dict[str, Any]],
               add_generation_prompt: bool, bos_token: str | None,
               eos_token: str | None) -> str:
        """The prompt text; ValueError for a template that fails, TemplateTimeout for
        one that takes longer than ``timeout_s`` (the wait for the lock included)."""
        deadline = time.monotonic() + self.timeout_s
        if not self._lock.acquire(timeout=self.timeout_s):
            raise TemplateTimeout
        try:
            child = self._start()
            line = json.dumps([template, messages, add_generation_prompt, bos_token,
                               eos_token]) + "\n"
            child.stdin.write(line.encode())
            child.stdin.flush()
            answer = _read_line(child.stdout, deadline)
            if answer is None:
                self._kill()
                raise TemplateTimeout
            ok, value = json.loads(answer)
            if not ok:
                raise ValueError(value)
            return value
        except (BrokenPipeError, EOFError, json.JSONDecodeError):
            self._kill()            # it died (out of memory): the template's fault
            raise ValueError("the chat template exhausted the renderer's memory "
                             f"({CHILD_MEMORY_BYTES >> 20} MiB)") from None
        finally:
            self._lock.release()

    def close(self) -> None:
        with self._lock:
            self._kill()

    def _start(self) -> subprocess.Popen:
        if self._child is None or self._child.poll() is not None:
            self._child = subprocess.Popen([sys.executable, "-m", __name__],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=subprocess.DEVNULL)
        return self._child

    def _kill(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._child.wait()
            self._child = None


def _read_line(stream, deadline: float) -> bytes | None:
    """One line from ``stream`` (a pipe), or None at the deadline; EOFError when the
    child died."""
    fd, data = stream.fileno(), b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _child_main() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))
    from rung.runtime import render_chat

    for line in sys.stdin.buffer:
        template, messages, add_generation_prompt, bos, eos = json.loads(line)
        try:
            answer = [True, render_chat(template, messages, add_generation_prompt, bos, eos)]
        except Exception as e:      # noqa: BLE001 - every failure is the template's
            answer = [False, f"{type(e).__name__}: {e}"]
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _child_main()
