"""One-shot commands converge to graphs: the background compile a `rung generate` started
goes on after it exits (one per cache at a time), so the next run starts warm."""

import fcntl
import gc
import os
import signal
import time

import pytest

from rung.cli.main import main
from rung.runtime import LLM
from rung.runtime.engine.prefetch import LOCK_NAME, start_prefetch

KWARGS = dict(max_num_seqs=4, max_model_len=64, num_gpu_blocks_override=32)


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == 0


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.fixture
def held_lock(tmp_path):
    """The cache's compile lock, held as by another compile of the same cache."""
    with open(tmp_path / LOCK_NAME, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield tmp_path


def test_a_detached_compile_outlives_its_engine_and_waits_for_the_cache_lock(held_lock):
    config = LLM("tiny-llama", enforce_eager=True, **KWARGS).engine.config
    kept = start_prefetch(config, 64, 1, held_lock)
    ended = start_prefetch(config, 64, 1, held_lock)
    kept_pid, ended_pid = kept.detach(), ended.proc.pid
    assert kept_pid == kept.proc.pid
    try:
        time.sleep(2)
        # one compile per cache: both wait for the lock another compile holds
        assert _alive(kept_pid) and _alive(ended_pid)
        assert not list(held_lock.glob("*/meta.json"))
        del kept, ended                     # the engine that started them is gone
        gc.collect()
        assert _wait_gone(ended_pid, 30)    # not detached: stopped with its engine
        time.sleep(1)
        assert _alive(kept_pid)             # detached: still waiting to compile
    finally:
        for pid in (kept_pid, ended_pid):
            if _alive(pid):
                os.kill(pid, signal.SIGTERM)
                _wait_gone(pid, 30)


@pytest.mark.slow
def test_generate_leaves_its_compile_running_and_the_next_run_is_warm(tmp_path, capsys,
                                                                      monkeypatch):
    monkeypatch.setenv("RUNG_GRAPH_BACKEND", "compiled")
    monkeypatch.setenv("RUNG_CACHE_DIR", str(tmp_path))
    argv = ["generate", "--model", "tiny-llama", "--prompt-token-ids", "1,72,105",
            "--max-tokens", "4", "--max-model-len", "64", "--max-num-seqs", "4",
            "--capture-sizes", "1,2,4", "--mode", "full_decode_only"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "compile goes on in the background (pid " in out, out
    pid = int(out.split("(pid ")[1].split(",")[0])
    gc.collect()
    assert _wait_gone(pid, 1500)            # the compile finished after generate returned
    warm = LLM("tiny-llama", compilation_config={"graph_startup": "background",
                                                 "graph_backend": "compiled",
                                                 "cudagraph_mode": "full_decode_only",
                                                 "cudagraph_capture_sizes": [1, 2, 4],
                                                 "cache_dir": str(tmp_path)}, **KWARGS)
    assert warm.engine.graph_builder.prefetch is None        # nothing left to compile
    assert warm.wait_for_graphs(timeout=300)
