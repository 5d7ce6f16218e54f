"""The CPU thread policy: torch's threads from the cores free at start-up unless the user
chose (rung.runtime.thread_policy). Its tok/s on a busy machine:
``python -m rung.bench.thread_policy`` (docs/performance.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rung.runtime import thread_policy


def _fresh(code: str, **env: str) -> dict:
    """Run ``code`` in a fresh interpreter (OpenMP not loaded yet); its last line is JSON."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS",
                          "RUNG_NUM_THREADS", "RUNG_THREAD_POLICY",
                          "RUNG_NUM_RESERVED_CORES")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**clean, **env}, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_THREADS = """
import json, os, rung, torch
from rung.runtime import thread_policy as tp
cores = len(os.sched_getaffinity(0))
seen = {}
for name, free, env in [("busy", 0.3, {}), ("quiet", float(cores), {}),
                        ("half", cores / 2, {}), ("chosen", 0.3, {"RUNG_NUM_THREADS": "2"}),
                        ("omp", float(cores), {"OMP_NUM_THREADS": "1"}),
                        ("off", 0.3, {"RUNG_THREAD_POLICY": "off"}),
                        ("reserved", float(cores), {"RUNG_NUM_RESERVED_CORES": "1"}),
                        ("reserved_busy", 0.3, {"RUNG_NUM_RESERVED_CORES": "1"}),
                        ("reserved_chosen", 0.3, {"RUNG_NUM_RESERVED_CORES": "1",
                                                  "RUNG_NUM_THREADS": "2"})]:
    torch.set_num_threads(cores)    # torch's own default: no application choice
    tp.free_cores = lambda: free
    os.environ.update(env)
    if name == "omp":
        torch.set_num_threads(1)    # what OMP_NUM_THREADS=1 at start-up gives
    tp.apply_thread_policy()
    seen[name] = torch.get_num_threads()
    for key in env:
        del os.environ[key]
print(json.dumps([seen, cores]))
"""


def test_threads_follow_the_free_cores_unless_the_user_chose():
    seen, cores = _fresh(_THREADS)
    assert seen["busy"] == 1              # every core busy: one thread, never zero
    assert seen["quiet"] == cores
    assert seen["half"] == max(1, round(cores / 2))
    assert seen["chosen"] == 2            # RUNG_NUM_THREADS, whatever is free
    assert seen["omp"] == 1
    assert seen["off"] == cores
    # a core left to another process (rung serve's HTTP process), never below one thread,
    # and never over the user's own count
    assert seen["reserved"] == max(1, cores - 1)
    assert seen["reserved_busy"] == 1
    assert seen["reserved_chosen"] == 2


def test_an_application_thread_count_is_left_alone(monkeypatch, caplog):
    import torch

    monkeypatch.setattr(thread_policy, "free_cores", lambda: 0.0)
    threads = torch.get_num_threads()       # the suite's 1 (conftest): the application's
    with caplog.at_level("INFO", logger="rung.runtime.thread_policy"):
        assert thread_policy.apply_thread_policy() == threads
    assert torch.get_num_threads() == threads
    monkeypatch.setenv("RUNG_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="RUNG_NUM_THREADS='two' must be a positive integer"):
        thread_policy.apply_thread_policy()


def test_free_cores_measures_this_machine():
    free = thread_policy.free_cores(0.05)
    assert free is not None and 0 <= free <= len(os.sched_getaffinity(0)) + 1e-6
