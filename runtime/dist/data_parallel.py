"""Data parallel over torch.distributed: ranks, the per-step sync, routing, the spawner.

Each rank is one process with its own engine, scheduler and KV cache, and its own share of
the requests. Every step the ranks agree, in one small all-gather, on each rank's real
token and request counts; all pad to the same token count (a ladder size when graphs are
on), which the descriptor records as ``num_tokens_across_dp``, so collectives inside the
model (expert-parallel MoE) see the same shapes on every rank. A rank with no work runs a
dummy batch while any rank has work; when every rank is idle, nobody steps.

Two ways to start the ranks:
- ``torchrun --nproc-per-node N script.py`` with ``LLM(..., data_parallel_size=N)``
  (RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT from the environment);
- `spawn_ranks` (what ``rung generate|bench --data-parallel-size N`` uses): N processes on
  this machine, rendezvous on a free port of 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

ROUTING_POLICIES = ("round_robin", "least_tokens")
# sync vector layout, one row per rank
_NUM_TOKENS, _NUM_REQS, _UNFINISHED, _FINISHED = range(4)


@dataclasses.dataclass(frozen=True)
class DPStep:
    """What every rank learned from one step's sync (the same on every rank)."""

    num_tokens: tuple[int, ...]      # real tokens scheduled, per rank
    num_reqs: tuple[int, ...]        # real requests scheduled, per rank
    any_unfinished: bool             # some rank still holds a request
    num_tokens_padded: int           # what every rank runs (a ladder size under graphs)
    num_draft_tokens_padded: int     # what every rank's draft step runs (one per request)
    num_finished: tuple[int, ...] = ()   # finished outputs each rank's step() returned so far

    @property
    def any_work(self) -> bool:
        return max(self.num_tokens) > 0

    @property
    def all_idle(self) -> bool:
        return not self.any_work and not self.any_unfinished

    def num_tokens_across_dp(self) -> tuple[int, ...]:
        return (self.num_tokens_padded,) * len(self.num_tokens)

    def num_draft_tokens_across_dp(self) -> tuple[int, ...]:
        return (self.num_draft_tokens_padded,) * len(self.num_tokens)


@dataclasses.dataclass
class DPStats:
    """Per-rank padding waste: tokens run for another rank's sake."""

    steps: int = 0
    dummy_steps: int = 0             # steps this rank ran with no request of its own
    num_tokens: int = 0              # real tokens this rank ran
    num_tokens_padded: int = 0       # tokens this rank ran, padding included

    def record(self, step: DPStep, rank: int) -> None:
        self.steps += 1
        self.dummy_steps += step.num_tokens[rank] == 0
        self.num_tokens += step.num_tokens[rank]
        self.num_tokens_padded += step.num_tokens_padded

    def as_dict(self) -> dict:
        waste = self.num_tokens_padded - self.num_tokens
        return {"steps": self.steps, "dummy_steps": self.dummy_steps,
                "num_tokens": self.num_tokens, "num_tokens_padded": self.num_tokens_padded,
                "padding_waste": waste / max(self.num_tokens_padded, 1)}


class DataParallelGroup:
    """This process's place among the data-parallel ranks."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.stats = DPStats()

    # --- start-up ---------------------------------------------------------------------------
    def check_same_config(self, fingerprint: dict[str, Any]) -> None:
        """RuntimeError on EVERY rank if the ranks disagree on any field (never a hang)."""
        everyone: list[dict | None] = [None] * self.world_size
        dist.all_gather_object(everyone, fingerprint)
        diffs = [key for key in sorted(fingerprint)
                 if any(other.get(key) != fingerprint[key] for other in everyone)]
        if diffs:
            detail = "; ".join(f"{key}: " + ", ".join(f"rank {r}={cfg.get(key)!r}"
                                                      for r, cfg in enumerate(everyone))
                               for key in diffs)
            raise RuntimeError(f"data-parallel ranks disagree on {', '.join(diffs)} ({detail}); "
                               "every rank must run the same model, ladder and spec config")

    def check_same_requests(self, key: Any) -> None:
        """RuntimeError on every rank unless every rank passed an equal ``key``."""
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, key)
        if any(k != everyone[0] for k in everyone):
            raise RuntimeError("LLM.generate under data parallel needs the same prompts and "
                               "sampling params on every rank (each rank runs its share)")

    # --- one step ------------------------------------------------------------------------
    def sync(self, num_reqs: int, num_tokens: int, has_unfinished: bool,
             padded_size: Callable[[int], int | None],
             draft_padded_size: Callable[[int], int | None] | None,
             num_finished: int = 0) -> DPStep:
        """One all-gather of (tokens, requests, unfinished, finished so far) per rank -> the
        padded sizes (and every rank's progress, for one progress bar).

        ``padded_size(n)``: the graph size n tokens pad to (None: above the ladder or no
        graphs), from the dispatcher, which every rank shares (checked at start-up).
        """
        mine = torch.tensor([num_tokens, num_reqs, int(has_unfinished), num_finished],
                            dtype=torch.int64)
        rows = torch.empty(self.world_size, len(mine), dtype=torch.int64)
        dist.all_gather(list(rows.unbind(0)), mine)
        table = rows.tolist()
        tokens = tuple(r[_NUM_TOKENS] for r in table)
        reqs = tuple(r[_NUM_REQS] for r in table)
        max_tokens, max_reqs = max(tokens), max(reqs)
        step = DPStep(tokens, reqs, any(r[_UNFINISHED] for r in table),
                      padded_size(max_tokens) or max_tokens,
                      (draft_padded_size(max_reqs) if draft_padded_size else None) or max_reqs,
                      tuple(r[_FINISHED] for r in table))
        if step.any_work:
            self.stats.record(step, self.rank)
        return step

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out


def init_data_parallel(world_size: int, device: torch.device, timeout_s: float
                       ) -> tuple[DataParallelGroup, torch.device]:
    """Join (or reuse) the default process group: gloo on CPU, NCCL on CUDA.

    Collectives time out after ``timeout_s``, so a dead rank makes the others fail.
    Returns the group and this rank's device (cuda:LOCAL_RANK on CUDA).
    """
    if not dist.is_initialized():
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
                   if k not in os.environ]
        if missing:
            raise ValueError(f"data_parallel_size={world_size} needs torch.distributed ranks: "
                             f"run under torchrun (environment lacks {', '.join(missing)}) or "
                             "use `rung generate --data-parallel-size N`, which spawns them")
        env_world = int(os.environ["WORLD_SIZE"])
        if env_world != world_size:
            raise ValueError(f"data_parallel_size={world_size} but WORLD_SIZE={env_world}")
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                rank=int(os.environ["RANK"]), world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    elif dist.get_world_size() != world_size:
        raise ValueError(f"data_parallel_size={world_size} but the process group has "
                         f"{dist.get_world_size()} ranks")
    group = DataParallelGroup(dist.get_rank(), world_size)
    logger.info("data parallel rank %d of %d (%s)", group.rank, world_size, dist.get_backend())
    return group, device


# --- routing --------------------------------------------------------------------------------
def route_requests(num_prompt_tokens: Sequence[int], world_size: int,
                   policy: str = "round_robin") -> list[int]:
    """The rank of each request; deterministic, so every rank computes the same answer.

    ``round_robin``: request i -> rank i % world_size. ``least_tokens``: each request to the
    rank with the fewest prompt tokens so far (ties: the lowest rank).
    """
    if policy == "round_robin":
        return [i % world_size for i in range(len(num_prompt_tokens))]
    if policy == "least_tokens":
        load = [0] * world_size
        ranks = []
        for n in num_prompt_tokens:
            rank = min(range(world_size), key=lambda r: (load[r], r))
            load[rank] += n
            ranks.append(rank)
        return ranks
    raise ValueError(f"data-parallel routing policy {policy!r} not in {ROUTING_POLICIES}")


# --- the built-in spawner --------------------------------------------------------------------
def free_port() -> int:
    """A free TCP port on 127.0.0.1 (only loopback: ranks never listen on the network)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, fn: Callable[..., Any], args: tuple,
               results: Any) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    try:
        results.put((rank, True, fn(rank, *args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (),
                timeout_s: float = 600.0) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``world_size`` fresh processes; their results by rank.

    ``fn`` must be importable (a module-level function). RuntimeError if a rank fails,
    dies or runs past ``timeout_s``; every rank is ended before this returns or raises.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, results),
                         daemon=True) for r in range(world_size)]
    with _main_not_rerun(fn):
        for p in procs:
            p.start()
    try:
        out = _collect(procs, results, world_size, timeout_s)
    except BaseException:
        _end(procs, grace_s=0)
        raise
    # NOTE: a rank that reported is still leaving its process group; ended by terminate()
    # it would skip its finalizers and leak its semaphores (tqdm's lock, one per rank)
    _end(procs, grace_s=30)
    results.close()
    results.join_thread()
    return out


def _end(procs: list, grace_s: float) -> None:
    """Join every rank, waiting up to ``grace_s`` for it to exit; terminate, then kill,
    what is left."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 0))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


@contextlib.contextmanager
def _main_not_rerun(fn: Callable[..., Any]) -> Iterator[None]:
    """Spawned ranks import ``fn``'s module, never re-run the launching script.

    NOTE: a console script (`rung`) has no ``if __name__ == "__main__"`` guard, so a rank
    that re-ran it would spawn ranks of its own; multiprocessing skips the main module
    when it has neither ``__spec__`` nor ``__file__``.
    """
    main = sys.modules.get("__main__")
    if main is None or fn.__module__ == "__main__":
        yield
        return
    saved_file, saved_spec = main.__dict__.pop("__file__", None), main.__spec__
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = saved_spec
        if saved_file is not None:
            main.__file__ = saved_file


def _collect(procs: list, results: Any, world_size: int, timeout_s: float) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}
    while len(out) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"data-parallel ranks {sorted(set(range(world_size)) - set(out))}"
                               f" did not finish within {timeout_s:.0f} s")
        try:
            rank, ok, value = results.get(timeout=min(left, 1.0))
        except queue.Empty:
            dead = [i for i, p in enumerate(procs)
                    if i not in out and not p.is_alive() and p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"data-parallel rank {dead[0]} died with exit code "
                                   f"{procs[dead[0]].exitcode}") from None
            continue
        if not ok:
            raise RuntimeError(f"data-parallel rank {rank} failed: {value}")
        out[rank] = value
    return [out[r] for r in range(world_size)]
