"""The background compile's subprocess (started by `prefetch.SubprocessPrefetch`): builds
the engine of a pickled EngineConfig, whose start-up compiles its graphs into the disk cache,
holding the cache's lock file while it does.

    python -m rung.runtime.engine.prefetch_worker --prefetch CONFIG --lock LOCK
"""

from __future__ import annotations

import argparse
import fcntl
import os
import pickle
import signal
import sys
from pathlib import Path

from rung.runtime.engine.llm_engine import LLMEngine
from rung.runtime.engine.prefetch import PREFETCH_MAX_S


def prefetch_main(config_path: str, lock_path: str) -> int:
    signal.alarm(PREFETCH_MAX_S)            # NOTE: bounded, detached or not
    with open(config_path, "rb") as f:
        config = pickle.load(f)
    os.unlink(config_path)                  # NOTE: read: a detached compile leaves none
    Path(lock_path).parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        # NOTE: waits for another compile of this cache; then finds its artifacts built
        fcntl.flock(lock, fcntl.LOCK_EX)
        LLMEngine(config)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="compile an engine's graphs into the cache")
    parser.add_argument("--prefetch", required=True, help="pickled EngineConfig")
    parser.add_argument("--lock", required=True, help="lock file: one compile per cache")
    args = parser.parse_args()
    sys.exit(prefetch_main(args.prefetch, args.lock))
