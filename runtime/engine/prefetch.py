"""The background compile of compiled CPU graphs: ``start_prefetch`` runs
``python -m rung.runtime.engine.prefetch_worker --prefetch CONFIG`` in a subprocess that
builds the same engine with a minimal KV cache and compiles its graphs into the disk cache,
where the serving engine's GraphBuilder finds and binds them.

One compile per cache at a time: the subprocess holds a lock file in the cache folder
while it builds (a second one waits for it, then finds the artifacts built). A one-shot
command that exits first leaves it running (``detach``): the compile is bounded (one
ladder, at most PREFETCH_MAX_S) and the next run starts on graphs.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any

# NOTE: the artifact key holds no KV size: a KV cache of a few blocks compiles the same code
_PREFETCH_KV_BLOCKS = 4
PREFETCH_MAX_S = 3600      # a compile still running after this is stopped (SIGALRM)
LOCK_NAME = "prefetch.lock"


class SubprocessPrefetch:
    """A subprocess compiling an engine's graphs into the disk cache, at low priority."""

    def __init__(self, config: Any, lock_dir: Path) -> None:
        fd, self._config_path = tempfile.mkstemp(prefix="rung-prefetch-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(config, f)
        self._log = tempfile.TemporaryFile(mode="w+")
        # NOTE: one thread and niceness 10: on a small machine the compile takes the cycles
        # serving leaves, never the other way round. A session of its own: a Ctrl-C of the
        # command that started it does not reach it (``detach``).
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rung.runtime.engine.prefetch_worker", "--prefetch",
             self._config_path,
             "--lock", str(Path(lock_dir) / LOCK_NAME)],
            stdout=subprocess.DEVNULL, stderr=self._log, env=env, start_new_session=True,
            preexec_fn=(lambda: os.nice(10)) if hasattr(os, "nice") else None)
        self._finalizer = weakref.finalize(self, _stop, self.proc, self._config_path)

    def detach(self) -> int | None:
        """Let the compile outlive this process (a one-shot command about to exit): its
        pid, or None when it has already ended."""
        self._finalizer.detach()
        return self.proc.pid if self.proc.poll() is None else None

    def poll(self) -> int | None:
        return self.proc.poll()

    def describe_failure(self) -> str:
        self._log.seek(0)
        lines = [line for line in self._log.read().splitlines() if line.strip()]
        return " | ".join(lines[-3:]) or "no output"


def _stop(proc: subprocess.Popen, config_path: str) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        os.unlink(config_path)
    except OSError:
        pass


def start_prefetch(config: Any, max_model_len: int, compile_threads: int, cache_dir: Path
                   ) -> SubprocessPrefetch:
    """Compile ``config``'s graphs in a subprocess (same ladder, same cache dir
    ``cache_dir``, which holds its lock file).

    NOTE: the subprocess runs on one thread but generates the kernels (and keys them) for
    ``compile_threads``, the count of the engine that will replay them."""
    comp = dataclasses.replace(config.compilation, graph_startup="blocking",
                               graph_backend="compiled", compile_threads=compile_threads)
    build = dataclasses.replace(config, compilation=comp, max_model_len=max_model_len,
                                num_gpu_blocks_override=_PREFETCH_KV_BLOCKS,
                                debug_padding=False, enforce_eager=False)
    return SubprocessPrefetch(build, cache_dir)
