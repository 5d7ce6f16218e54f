"""`rung warmup`: capture every graph on the ladder, then print one row per graph.

Also the background compile of compiled CPU graphs: ``start_prefetch`` runs
``python -m rung.runtime.warmup --prefetch CONFIG`` in a subprocess that builds the same
engine with a minimal KV cache and compiles its graphs into the disk cache, where the
serving engine's GraphBuilder finds and binds them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any, Callable

from rung.core.graph_mode import CUDAGraphMode
from rung.graphs.manager import TARGET


def served_ranges(sizes: list[int]) -> dict[int, str]:
    """Capture size -> the real token counts it serves: [1, 2, 4, 8] -> {4: '3-4', 8: '5-8'}."""
    out, low = {}, 1
    for size in sizes:
        out[size] = str(size) if low == size else f"{low}-{size}"
        low = size + 1
    return out


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _row(mode: str, tokens: str, reqs: str, serves: str, record: dict) -> str:
    nodes = record.get("num_kernel_nodes")
    # compile_s / load_s: compiled CPU graphs only (compiled now, or loaded from disk)
    return (f"{mode:<10} {tokens:>7} {reqs:>5} {serves:>9} {record['seconds'] * 1e3:>11.1f} "
            f"{record['nbytes'] / 1024:>11.1f} {'-' if nodes is None else nodes:>12} "
            f"{_seconds(record.get('compile_s')):>9} {_seconds(record.get('load_s')):>6}")


def _table(records: list[dict], draft_records: list[dict], sizes: list[int],
           draft_sizes: list[int]) -> str:
    """PIECEWISE graphs depend on the token count alone (reqs '-'); FULL graphs on both;
    DRAFT rows are the drafter's graphs, one query per request."""
    head = (f"{'mode':<10} {'tokens':>7} {'reqs':>5} {'serves':>9} {'capture_ms':>11} "
            f"{'memory_kib':>11} {'kernel_nodes':>12} {'compile_s':>9} {'load_s':>6}")
    rows = [head, "-" * len(head)]
    serves = served_ranges(sizes)
    # NOTE: graphs go live smallest first; the table lists each mode largest first
    modes = list(dict.fromkeys(r["mode"] for r in records))
    for r in sorted(records, key=lambda r: (modes.index(r["mode"]), -r["num_tokens_padded"])):
        size = r["num_tokens_padded"]
        reqs = "-" if r["mode"] == CUDAGraphMode.PIECEWISE.name else str(r["num_reqs_padded"])
        rows.append(_row(r["mode"], str(size), reqs, serves.get(size, "?"), r))
    draft_serves = served_ranges(draft_sizes)
    for r in draft_records:
        size = r["num_reqs_padded"]
        rows.append(_row(r["mode"], str(size), str(size),
                         draft_serves.get(size, "?") + " reqs", r))
    return "\n".join(rows)


def _artifact_lines(records: list[dict]) -> list[str]:
    """Compiled CPU graphs: one line per artifact (sizes traced symbolic share one) and
    the total compile and load time."""
    by_artifact: dict[str, list[dict]] = {}
    for r in records:
        if r.get("artifact"):
            by_artifact.setdefault(r["artifact"], []).append(r)
    lines = []
    for key, rs in by_artifact.items():
        compile_s = sum(r["compile_s"] or 0.0 for r in rs)
        load_s = sum(r["load_s"] or 0.0 for r in rs)
        how = f"compiled in {compile_s:.1f} s" if compile_s else "loaded"
        lines.append(f"artifact {key[:12]}: sizes {sorted(r['num_tokens_padded'] for r in rs)}, "
                     f"{how}, bound/loaded in {load_s:.1f} s")
    if by_artifact:
        total_compile = sum(r["compile_s"] or 0.0 for r in records)
        total_load = sum(r["load_s"] or 0.0 for r in records)
        lines.append(f"{len(by_artifact)} artifacts for {sum(map(len, by_artifact.values()))} "
                     f"graphs: compile {total_compile:.1f} s in all, load/bind "
                     f"{total_load:.1f} s in all")
    return lines


def run_warmup(args: argparse.Namespace, build_llm: Callable) -> int:
    """Errors a user can cause raise ValueError; the CLI turns them into one line."""
    if args.enforce_eager:
        raise ValueError("warmup captures graphs; drop --enforce-eager")
    start = time.perf_counter()
    llm = build_llm(args)
    graphs = llm.engine.runner.graphs
    proposer = llm.engine.proposer
    draft = [dict(vars(r)) for r in graphs.records if r.graph != TARGET]
    draft_sizes = list(getattr(getattr(proposer, "dispatcher", None), "sizes", []))
    records = [dict(vars(r)) for r in graphs.records if r.graph == TARGET]
    report: dict[str, Any] = {
        "model": args.model, "mode": graphs.mode.name,
        "capture_backend": graphs.capture_backend.name,
        "capture_sizes": graphs.dispatcher.sizes, "trace_seconds": graphs.trace_seconds,
        "graphs": records, "draft_capture_sizes": draft_sizes, "draft_graphs": draft,
        "pool_bytes": graphs.pool_bytes}
    elapsed = time.perf_counter() - start
    if not records and not draft:
        why = ("cudagraph mode NONE" if graphs.mode == CUDAGraphMode.NONE
               else "capture sizes above what this config can schedule")
        print(f"model {args.model}: 0 graphs, mode {graphs.mode.name}: no graph captured: "
              f"every step will run eagerly ({why}; {elapsed:.1f} s start-up)")
    else:
        print(f"model {args.model}: {len(records)} graphs"
              f"{f' + {len(draft)} draft graphs' if draft else ''}, mode {graphs.mode.name}, "
              f"backend {graphs.capture_backend.name}, {elapsed:.1f} s total, of which "
              f"one-time tracing {graphs.trace_seconds:.1f} s (not in any row)")
        print(_table(records, draft, graphs.dispatcher.sizes, draft_sizes))
        for line in _artifact_lines(records):
            print(line)
        print(f"capture pool holds {graphs.pool_bytes / 2**20:.1f} MiB")
        note = getattr(graphs.capture_backend, "kernel_nodes_note", None)
        if note and all(r.get("num_kernel_nodes") is None for r in records + draft):
            print(f"kernel_nodes '-': {note}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


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
            [sys.executable, "-m", "rung.runtime.warmup", "--prefetch", self._config_path],
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


def start_prefetch(config: Any, max_model_len: int) -> SubprocessPrefetch:
    """Compile ``config``'s graphs in a subprocess (same ladder, same cache dir)."""
    comp = dataclasses.replace(config.compilation, graph_startup="blocking",
                               graph_backend="compiled")
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
