"""`rung bench latency --data-parallel-size N`: decode step latency and padding waste per
data-parallel rank.

Each cell routes ``num_reqs`` requests round-robin over the ranks (so an odd count leaves
one rank a request short, and 1 request leaves every other rank idle) and decodes them;
every rank reports its step latency and the share of the tokens it ran that were padding
for another rank's sake (`DPStats`). Ranks come from torchrun when RANK is set, else from
the built-in spawner.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, Callable

from rung.bench.latency_plan import engine_namespace, make_plan
from rung.bench.stats import percentiles_ms
from rung.runtime.api.llm import LLM
from rung.runtime.dist.data_parallel import DPStats, route_requests, spawn_ranks
from rung.runtime.sampling_params import SamplingParams

_COLUMNS = ("mode", "num_reqs", "rank", "rank_num_reqs", "steps", "dummy_steps",
            "step_ms_p50", "padding_waste")


def _round(llm: Any, prompts: list[list[int]], output_len: int, tag: str) -> list[float]:
    """This rank's share of one batch, decoded to completion; the time of every step."""
    engine, dp = llm.engine, llm.engine.dp
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i, rank in enumerate(route_requests([len(p) for p in prompts], dp.world_size)):
        if rank == dp.rank:
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompts[i]}, params)
    steps = []
    engine.all_ranks_idle = False
    while not engine.all_ranks_idle:
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return steps[:-1]             # the last step only found every rank idle


def bench_rank(rank: int | None, args: argparse.Namespace,
               build_llm: Callable[..., LLM]) -> list[dict[str, Any]]:
    """One rank's records, one per (mode, request count). ``build_llm(args)``: the CLI's
    engine builder (bench sits below the CLI)."""
    plan = make_plan(args)
    records = []
    for label in plan.modes:
        llm = build_llm(engine_namespace(args, plan, label))
        dp = llm.engine.dp
        for num_reqs in plan.num_reqs_list:
            prompts = plan.prompts(num_reqs, llm.engine.runner.vocab_size)
            for i in range(plan.warmup_iters):
                _round(llm, [p[:8] for p in prompts], min(plan.output_len, 4),
                       f"{label}-{num_reqs}-w{i}")
            dp.stats, steps = DPStats(), []
            for i in range(plan.iters):
                steps += _round(llm, prompts, plan.output_len, f"{label}-{num_reqs}-{i}")
            stats = dp.stats.as_dict()
            mine = route_requests([0] * num_reqs, dp.world_size).count(dp.rank)
            records.append({"mode": label, "num_reqs": num_reqs, "rank": dp.rank,
                            "rank_num_reqs": mine, "steps": stats["steps"],
                            "dummy_steps": stats["dummy_steps"],
                            **percentiles_ms(steps, "step"),
                            "padding_waste": stats["padding_waste"]})
    return records


def format_dp_table(records: list[dict[str, Any]]) -> str:
    rows = [list(_COLUMNS)]
    for r in sorted(records, key=lambda r: (r["mode"], r["num_reqs"], r["rank"])):
        rows.append([r["mode"], str(r["num_reqs"]), str(r["rank"]), str(r["rank_num_reqs"]),
                     str(r["steps"]), str(r["dummy_steps"]), f"{r['step_ms_p50']:.2f}",
                     f"{100 * r['padding_waste']:.1f}%"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows)


def run_dp_latency(args: argparse.Namespace, build_llm: Callable[..., LLM]) -> int:
    if "RANK" in os.environ:          # under torchrun: this process is one rank
        records = bench_rank(None, args, build_llm)
        print(format_dp_table(records))
        return 0
    per_rank = spawn_ranks(bench_rank, args.data_parallel_size, (args, build_llm),
                           timeout_s=args.data_parallel_timeout_s * 30)
    print(f"model {args.model}: data parallel {args.data_parallel_size} ranks, input "
          f"{args.input_len}, output {args.output_len}; padding_waste = share of the "
          "tokens a rank ran that were padding for another rank")
    print(format_dp_table([r for records in per_rank for r in records]))
    return 0
