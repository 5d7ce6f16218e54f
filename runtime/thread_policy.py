"""The CPU thread policy: how many threads torch, inductor's kernels and rung's own kernels
run, so that a busy machine slows rung gracefully instead of collapsing it.

`apply_thread_policy` runs when a CPU engine starts: unless the user chose a count
(``RUNG_NUM_THREADS``, ``OMP_NUM_THREADS``, or ``torch.set_num_threads`` to other than
torch's default), torch runs on the cores that were free over a short sample, less
``RUNG_NUM_RESERVED_CORES`` (cores a user leaves to other work beside the engine, e.g.
`rung serve`'s HTTP process on a machine where its streams are many and its steps short;
vLLM's VLLM_CPU_NUM_OF_RESERVED_CPU). Compiled graphs are generated for that count (it is part
of their cache key).

OpenMP's wait policy is left as the user set it: on a busy machine the policy runs one
thread, where no OpenMP thread waits at all, and on a quiet one OpenMP's own long spin is
the fastest (a shorter spin, set before torch loads, lost every quiet measurement:
docs/performance.md). ``RUNG_THREAD_POLICY=off`` leaves the count to torch.
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)

POLICY_ENV = "RUNG_THREAD_POLICY"
NUM_THREADS_ENV = "RUNG_NUM_THREADS"
RESERVED_CORES_ENV = "RUNG_NUM_RESERVED_CORES"
_SAMPLE_S = 0.2


def policy_enabled() -> bool:
    return os.environ.get(POLICY_ENV, "auto").lower() != "off"


def _cpu_times(cpus: set[int]) -> tuple[float, float]:
    """(idle, total) jiffies summed over ``cpus``, from /proc/stat."""
    idle = total = 0.0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                continue
            values = [float(v) for v in fields[:8]]
            idle += values[3] + values[4]          # idle + iowait
            total += sum(values)
    return idle, total


def free_cores(sample_s: float = _SAMPLE_S) -> float | None:
    """Cores of this process's affinity that sat idle over ``sample_s`` seconds (None
    where /proc/stat cannot be read)."""
    cpus = os.sched_getaffinity(0)
    try:
        idle0, total0 = _cpu_times(cpus)
        time.sleep(sample_s)
        idle1, total1 = _cpu_times(cpus)
    except (OSError, ValueError):
        return None
    if total1 <= total0:
        return None
    return len(cpus) * (idle1 - idle0) / (total1 - total0)


def _user_threads(torch_threads: int, num_cores: int) -> tuple[int | None, str | None]:
    """(count, who chose it) when the user chose a thread count, else (None, None)."""
    raw = os.environ.get(NUM_THREADS_ENV)
    if raw is not None:
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"{NUM_THREADS_ENV}={raw!r} must be a positive integer")
        return int(raw), NUM_THREADS_ENV
    if os.environ.get("OMP_NUM_THREADS"):
        return torch_threads, "OMP_NUM_THREADS"
    if torch_threads != num_cores:
        return torch_threads, "torch.set_num_threads"
    return None, None


def _reserved_cores() -> int:
    raw = os.environ.get(RESERVED_CORES_ENV, "0")
    if not raw.isdigit():
        raise ValueError(f"{RESERVED_CORES_ENV}={raw!r} must be a non-negative integer")
    return int(raw)


def apply_thread_policy() -> int:
    """Set torch's thread count for a CPU engine; returns it."""
    import torch

    threads = torch.get_num_threads()
    if not policy_enabled():
        return threads
    num_cores = len(os.sched_getaffinity(0))
    chosen, by = _user_threads(threads, num_cores)
    if chosen is not None:
        torch.set_num_threads(chosen)
        logger.info("CPU threads: %d (%s)", chosen, by)
        return chosen
    free = free_cores()
    threads = num_cores if free is None else max(1, min(num_cores, round(free)))
    threads = max(1, threads - _reserved_cores())
    torch.set_num_threads(threads)
    logger.info("CPU threads: %d of %d cores (%s free at start-up, %d reserved; %s=N or "
                "%s=off overrides)", threads, num_cores,
                "?" if free is None else f"{free:.1f}", _reserved_cores(), NUM_THREADS_ENV,
                POLICY_ENV)
    return threads
