"""`rung` command line: generate, warmup, verify, bench, serve.

Every subcommand is added by one ``_add_*`` function; errors a user can cause become one
``error: ...`` line on stderr (exit 2 for bad input, 1 for a failure), Ctrl-C exits quietly
with 130, and ``RUNG_DEBUG=1`` shows the traceback instead.

NOTE: cli/ imports only the standard library (and itself) at the top, so `rung --help` and a
Ctrl-C during start-up never wait for (or trace back through) torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Callable

from rung.cli.args import (
    VERSION,
    HelpFormatter,
    add_engine_args,
    build_llm,
    check_output_path,
    importable,
    speculative_config,
)
from rung.cli.generate import add_generate
from rung.cli.serve import add_bench_serve, add_serve


# --- warmup ----------------------------------------------------------------------------------
def _add_warmup(sub: Any) -> None:
    warm = sub.add_parser("warmup", help="capture every graph on the ladder and report",
                          formatter_class=HelpFormatter)
    add_engine_args(warm)
    warm.add_argument("--json", default=None, help="also write the capture table as JSON here")
    warm.set_defaults(func=cmd_warmup)


def cmd_warmup(args: argparse.Namespace) -> int:
    args.graph_startup = args.graph_startup or "blocking"   # measures live graphs
    from rung.runtime.tools.warmup import run_warmup

    check_output_path(args.json, "--json")
    return run_warmup(args, build_llm)


# --- verify ----------------------------------------------------------------------------------
def _add_verify(sub: Any) -> None:
    verify = sub.add_parser("verify", help="replay every graph at every fill level with "
                            "poisoned pads; compare logits, tokens and drafts to eager",
                            formatter_class=HelpFormatter)
    add_engine_args(verify)
    verify.add_argument("--json", default=None, help="also write every cell's result here")
    verify.add_argument("--guard-kv", action="store_true",
                        help="also fail a step that writes KV outside its real tokens' slots "
                        "(clones the KV cache every step: slower)")
    verify.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    args.graph_startup = args.graph_startup or "blocking"   # measures live graphs
    if args.data_parallel_size > 1:
        raise ValueError("verify runs one process: drop --data-parallel-size "
                         f"{args.data_parallel_size}")
    if args.enforce_eager or args.mode == "none":
        raise ValueError("verify compares graph replays to eager: drop --enforce-eager and "
                         "--mode none")
    check_output_path(args.json, "--json")
    from rung.runtime.tools.verify import run_verify

    spec = speculative_config(args)
    return run_verify(args, build_llm, spec["num_speculative_tokens"] if spec else 0)


# --- bench -----------------------------------------------------------------------------------
def _add_bench(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks", formatter_class=HelpFormatter)
    bench_sub = bench.add_subparsers(dest="bench_command", required=True,
                                     help="the benchmark to run")
    latency = bench_sub.add_parser("latency", help="decode latency vs HF and the matmul floor",
                                   formatter_class=HelpFormatter)
    add_engine_args(latency)
    from rung.bench.latency_plan import add_latency_args, add_prefix_args

    add_latency_args(latency)
    add_prefix_args(latency)
    latency.set_defaults(func=cmd_bench)
    add_bench_serve(bench_sub)


def cmd_bench(args: argparse.Namespace) -> int:
    args.graph_startup = args.graph_startup or "blocking"   # measures live graphs
    if args.baseline == "hf" and not importable("transformers"):
        raise ValueError("--baseline hf needs transformers: pip install 'rung[test]'")
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot")
    if getattr(args, "shared_prefix", None) is not None:
        from rung.bench.prefix import run_shared_prefix

        return run_shared_prefix(args, build_llm)
    if args.data_parallel_size > 1:
        from rung.bench.dp_latency import run_dp_latency

        return run_dp_latency(args, build_llm)
    from rung.bench.latency import run_latency

    return run_latency(args, build_llm)


# --- entry point -----------------------------------------------------------------------------
SUBCOMMANDS: list[Callable[[Any], None]] = [add_generate, _add_warmup, _add_verify,
                                              _add_bench, add_serve]


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rung", description="CUDA-graph-first LLM runtime",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"rung {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True, help="what to run")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    debug = os.environ.get("RUNG_DEBUG", "0") == "1"
    try:
        args = make_parser().parse_args(argv)
        from tqdm.contrib.logging import logging_redirect_tqdm

        from rung.runtime.log import configure_logging

        configure_logging()
        # NOTE: log lines go through tqdm.write, so they never land in a progress bar's line
        with logging_redirect_tqdm([logging.getLogger("rung")]):
            return args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        if debug:
            raise
        hint = "" if isinstance(e, ValueError) else " (RUNG_DEBUG=1 shows the traceback)"
        print(f"error: {e}{hint}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1


if __name__ == "__main__":
    sys.exit(main())

