"""The background compile of compiled CPU graphs: ``start_prefetch`` runs
``python -m rung.runtime.engine.prefetch --prefetch CONFIG`` in a subprocess that builds the
same engine with a minimal KV cache and compiles its graphs into the disk cache, where the
serving engine's GraphBuilder finds and binds them.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
import weakref
from typing import Any

# NOTE: the artifact key holds no KV size: a KV cache of a few blocks compiles the same code
_PREFETCH_KV_BLOCKS = 4


class SubprocessPrefetch:
    """A subprocess compiling an engine's graphs into the disk cache, at low priority."""

    def __init__(self, config: Any) -> None:
        fd, self._config_path = tempfile.mkstemp(prefix="rung-prefetch-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(config, f)
        self._log = tempfile.TemporaryFile(mode="w+")
        # NOTE: one thread and niceness 10: on a small machine the compile takes the cycles
        # serving leaves, never the other way round
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rung.runtime.engine.prefetch", "--prefetch", self._config_path],
            stdout=subprocess.DEVNULL, stderr=self._log, env=env,
            preexec_fn=(lambda: os.nice(10)) if hasattr(os, "nice") else None)
        self._finalizer = weakref.finalize(self, _stop, self.proc, self._config_path)

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


def start_prefetch(config: Any, max_model_len: int, compile_threads: int
                   ) -> SubprocessPrefetch:
    """Compile ``config``'s graphs in a subprocess (same ladder, same cache dir).

    NOTE: the subprocess runs on one thread but generates the kernels (and keys them) for
    ``compile_threads``, the count of the engine that will replay them."""
    comp = dataclasses.replace(config.compilation, graph_startup="blocking",
                               graph_backend="compiled", compile_threads=compile_threads)
    build = dataclasses.replace(config, compilation=comp, max_model_len=max_model_len,
                                num_gpu_blocks_override=_PREFETCH_KV_BLOCKS,
                                debug_padding=False, enforce_eager=False)
    return SubprocessPrefetch(build)


def _prefetch_main(config_path: str) -> int:
    from rung.runtime.engine import LLMEngine

    with open(config_path, "rb") as f:
        config = pickle.load(f)
    LLMEngine(config)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="compile an engine's graphs into the cache")
    parser.add_argument("--prefetch", required=True, help="pickled EngineConfig")
    sys.exit(_prefetch_main(parser.parse_args().prefetch))
