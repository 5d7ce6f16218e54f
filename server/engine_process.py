"""The engine in a process of its own: the child that owns it, and the server's transport
to it.

The HTTP process and the engine then share no interpreter lock: the event loop frames
answers while the engine steps. One duplex pipe (a socketpair, pickled tuples) carries
the commands and events of rung.server.engine_loop; each step's outputs for every request
are one message. A writer thread sends commands, so the event loop never pickles a prompt
nor waits on a full pipe; the event loop's own selector wakes on events (no thread hop
between a step and its answers).

The child is spawned (a fresh interpreter: no state forked from the server), builds the
engine with the ``make_engine`` it is given, reports ready with the `EngineInfo` the
server prepares requests with, then runs `EngineCore`. Its engine takes the thread count
rung.runtime.thread_policy gives any CPU engine (the cores free at start-up, while the
HTTP process waits for it); no core is set aside for the HTTP process, whose work per step
is small beside a step's (RUNG_NUM_RESERVED_CORES=1 sets one aside). It ignores SIGINT
and SIGTERM (the server drains, then stops it) and ends with its parent: on the pipe's end
of file between steps, or at once by the kernel's parent-death signal (Linux). When the
child dies, the event loop sees the pipe close and reports ``("dead", why)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from rung.server.engine_loop import Command, EngineCore, EngineInfo, Event, engine_info

if TYPE_CHECKING:
    from rung.runtime import LLMEngine

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class EngineStartError(RuntimeError):
    """The engine process failed before it was ready (its own error is the message)."""


class EngineProcess:
    """Spawns the engine's process and carries commands and events to and from it."""

    def __init__(self, make_engine: Callable[[], LLMEngine]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_engine_main, args=(child_conn, make_engine),
                                   name="rung-engine", daemon=False)
        self.process.start()
        child_conn.close()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._stopping = False
        self.info: EngineInfo | None = None

    def wait_ready(self) -> EngineInfo:
        """Block until the child reports ready; EngineStartError if it fails or dies."""
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError):
            self.process.join(5)
            raise EngineStartError(f"the engine process exited with code "
                                   f"{self.process.exitcode} before it was ready") from None
        if kind != "ready":
            self.process.join(5)
            raise EngineStartError(f"the engine process failed to start: {payload}")
        self.info = payload
        return payload

    def start(self, loop: asyncio.AbstractEventLoop, on_event: Callable[[Event], None]
              ) -> None:
        """Start carrying; ``on_event`` is called on ``loop``."""
        self._loop, self._on_event = loop, on_event
        loop.add_reader(self._conn.fileno(), self._read)
        self._writer = threading.Thread(target=self._write, name="rung-engine-writer",
                                        daemon=True)
        self._writer.start()

    def send(self, command: Command) -> None:
        self._commands.put(command)

    def stop(self, timeout_s: float) -> None:
        """Ask the child to stop; kill it if it has not within ``timeout_s``."""
        self._stopping = True
        if self.process.is_alive():
            if self._writer is None:        # never started (a failed or cut start-up)
                with contextlib.suppress(OSError, ValueError):
                    self._conn.send(("stop",))
            else:
                self._commands.put(("stop",))
            self.process.join(timeout_s)
        if self.process.is_alive():
            logger.warning("the engine process did not stop within %.1f s: killing it",
                           timeout_s)
            self.process.kill()
            self.process.join(5)
        self._commands.put(None)

    def _read(self) -> None:
        """On the event loop: every event that has arrived. NOTE: the child writes each
        event whole, so a readable pipe holds at least the start of one that is coming
        at once; none is larger than one step's outputs."""
        try:
            while self._conn.poll(0):
                self._on_event(self._conn.recv())
        except (EOFError, OSError):
            self._loop.remove_reader(self._conn.fileno())
            if not self._stopping:
                future = self._loop.run_in_executor(None, self.process.join, 2.0)
                future.add_done_callback(lambda _: self._on_event(("dead", self._why())))

    def _why(self) -> str:
        code = self.process.exitcode
        how = (f"killed by signal {-code}" if code is not None and code < 0
               else f"exit code {code}")
        return f"the engine process died ({how})"

    def _write(self) -> None:
        while (command := self._commands.get()) is not None:
            try:
                self._conn.send(command)
            except (OSError, ValueError):
                return              # the child is gone: `_read` reports it


# --- the child ---------------------------------------------------------------------------------
def _engine_main(conn: Connection, make_engine: Callable[[], LLMEngine]) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        engine = make_engine()
        info = engine_info(engine, own_grammars=False)
    except BaseException as e:      # noqa: BLE001 - the server prints it and exits
        if os.environ.get("RUNG_DEBUG", "0") == "1":
            traceback.print_exc()
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    conn.send(("ready", info))

    def receive(timeout: float | None) -> Command | None:
        try:
            if not conn.poll(timeout):
                return None
            return conn.recv()
        except (EOFError, OSError):
            return ("stop",)        # the server is gone

    def emit(event: Event) -> None:
        try:
            conn.send(event)
        except (OSError, ValueError):
            pass                    # the server is gone: the next receive stops

    EngineCore(engine, emit).run(receive)


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies, even by SIGKILL."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:   # it died before the call
        os._exit(1)
