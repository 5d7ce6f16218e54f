"""`rung warmup`: capture every graph on the ladder, then print one row per graph."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable

from tqdm import tqdm


def _table(records: list[dict]) -> str:
    head = f"{'mode':<10} {'tokens':>7} {'reqs':>5} {'capture_ms':>11} {'memory_kib':>11} " \
           f"{'kernel_nodes':>12}"
    rows = [head, "-" * len(head)]
    for r in records:
        nodes = "-" if r["num_kernel_nodes"] is None else str(r["num_kernel_nodes"])
        rows.append(f"{r['mode']:<10} {r['num_tokens_padded']:>7} {r['num_reqs_padded']:>5} "
                    f"{r['seconds'] * 1e3:>11.1f} {r['nbytes'] / 1024:>11.1f} {nodes:>12}")
    return "\n".join(rows)


def run_warmup(args: argparse.Namespace, build_llm: Callable) -> int:
    if args.enforce_eager:
        print("error: warmup captures graphs; drop --enforce-eager", file=sys.stderr)
        return 2
    start = time.perf_counter()
    bar = tqdm(desc="capturing", unit="graph", file=sys.stderr)
    progress = lambda r: bar.update(1) or bar.set_postfix_str(  # noqa: E731
        f"{r.mode}:{r.num_tokens_padded}")
    try:
        llm = build_llm(args, capture_progress=progress)
    except ValueError as e:
        bar.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, AssertionError) as e:
        bar.close()
        print(f"error: graph capture failed: {e}", file=sys.stderr)
        return 1
    bar.close()
    graphs = llm.engine.runner.graphs
    records = [dict(vars(r)) for r in graphs.records]
    print(f"model {args.model}: {len(records)} graphs, mode {graphs.mode.name}, "
          f"backend {graphs.capture_backend.name}, {time.perf_counter() - start:.1f} s total")
    print(_table(records))
    if not records:
        print("no graph captured: every step will run eagerly (capture sizes above what this "
              "config can schedule, or an eager-only mode)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "mode": graphs.mode.name,
                       "capture_backend": graphs.capture_backend.name,
                       "capture_sizes": graphs.dispatcher.sizes, "graphs": records}, f, indent=2)
    return 0
