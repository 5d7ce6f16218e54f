"""`rung bench latency --shared-prefix N`: time to first token with and without prefix
caching, side by side in one process.

Every request is one system prompt of N random tokens plus a short suffix of its own; one
request arrives per engine step (a steady stream, so every request after the first finds
the system prompt's blocks cached). Two engines, prefix caching on and off, run rounds in
turn (on, off, on, off, ...), each round with a new system prompt so both start cold.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Any, Callable

import numpy as np
import torch

from rung.bench.stats import percentiles_ms
from rung.runtime.api.llm import LLM
from rung.runtime.engine import LLMEngine
from rung.runtime.sampling_params import SamplingParams

VARIANTS = ("prefix_caching", "no_prefix_caching")


def _workload(args: argparse.Namespace, vocab_size: int, round_index: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7000 + round_index)
    system = torch.randint(3, vocab_size, (args.shared_prefix,), generator=gen).tolist()
    suffixes = torch.randint(3, vocab_size, (args.prefix_requests, args.suffix_len),
                             generator=gen).tolist()
    return [system + s for s in suffixes]


def shared_prefix_round(engine: LLMEngine, prompts: list[list[int]], output_len: int,
                        tag: str) -> dict[str, Any]:
    """One request arrives per step; TTFT of each is add_request -> its first token."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    hits_before = engine.kv.prefix_stats.num_hit_tokens
    arrived: dict[str, float] = {}
    ttft: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, prompt = pending.pop(0)
            rid = f"{tag}-{i}"
            arrived[rid] = time.perf_counter()
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            ttft.setdefault(out.request_id, now - arrived[out.request_id])
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    num_hit = engine.kv.prefix_stats.num_hit_tokens - hits_before
    return {"ttft_s": [ttft[f"{tag}-{i}"] for i in range(len(prompts))],
            "prefill_tokens": sum(len(p) for p in prompts) - num_hit,
            "tokens": [tokens[f"{tag}-{i}"] for i in range(len(prompts))]}


def _check_args(args: argparse.Namespace) -> None:
    for flag, value, low in (("--shared-prefix", args.shared_prefix, 1),
                             ("--prefix-requests", args.prefix_requests, 1),
                             ("--suffix-len", args.suffix_len, 1),
                             ("--iters", args.iters, 1), ("--output-len", args.output_len, 1)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")


def run_shared_prefix(args: argparse.Namespace, build_llm: Callable[..., LLM]) -> int:
    """``build_llm(args)``: the CLI's engine builder (bench sits below the CLI)."""
    _check_args(args)
    ns = copy.copy(args)
    need = args.shared_prefix + args.suffix_len + args.output_len
    ns.max_model_len = max(args.max_model_len or 0, -(-need // args.block_size) * args.block_size)
    ns.max_num_seqs = max(args.max_num_seqs or 0, args.prefix_requests)
    engines = {}
    for variant in VARIANTS:
        ns.no_prefix_caching = variant == "no_prefix_caching"
        engines[variant] = build_llm(ns).engine
    vocab_size = engines[VARIANTS[0]].runner.vocab_size
    for i in range(args.warmup_iters):                 # untimed: first-step costs
        for variant, engine in engines.items():
            shared_prefix_round(engine, _workload(args, vocab_size, -1 - i)[:4], 2,
                                f"{variant}-w{i}")
    rounds: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for i in range(args.iters):                        # interleaved: on, off, on, off, ...
        prompts = _workload(args, vocab_size, i)
        for variant, engine in engines.items():
            rounds[variant].append(shared_prefix_round(engine, prompts, args.output_len,
                                                       f"{variant}-{i}"))
    report = _summary(args, rounds)
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _summary(args: argparse.Namespace, rounds: dict[str, list[dict]]) -> dict[str, Any]:
    rows = {}
    for variant, rs in rounds.items():
        rows[variant] = {"prefill_tokens_per_round": float(np.mean([r["prefill_tokens"]
                                                                   for r in rs])),
                         **percentiles_ms([t for r in rs for t in r["ttft_s"]], "ttft")}
    on, off = rows["prefix_caching"], rows["no_prefix_caching"]
    same = all(a["tokens"] == b["tokens"] for a, b in zip(rounds["prefix_caching"],
                                                          rounds["no_prefix_caching"]))
    return {"workload": {"shared_prefix": args.shared_prefix, "suffix_len": args.suffix_len,
                         "requests": args.prefix_requests, "output_len": args.output_len,
                         "rounds": args.iters, "model": args.model},
            "variants": rows,
            "prefill_tokens_reduction": 1 - on["prefill_tokens_per_round"]
            / off["prefill_tokens_per_round"],
            "ttft_p50_speedup": off["ttft_ms_p50"] / on["ttft_ms_p50"],
            "tokens_identical": same}


def _print(report: dict[str, Any]) -> None:
    w = report["workload"]
    print(f"shared prefix: {w['requests']} requests x ({w['shared_prefix']} shared + "
          f"{w['suffix_len']} own tokens), {w['output_len']} output tokens, one arrival per "
          f"step, {w['rounds']} interleaved rounds, model {w['model']}")
    print(f"{'variant':<20}{'prefill tokens':>16}{'TTFT p50 ms':>14}{'TTFT p90 ms':>14}")
    for variant, row in report["variants"].items():
        print(f"{variant:<20}{row['prefill_tokens_per_round']:>16.0f}"
              f"{row['ttft_ms_p50']:>14.2f}{row['ttft_ms_p90']:>14.2f}")
    print(f"prefill tokens computed: -{100 * report['prefill_tokens_reduction']:.1f}%  "
          f"TTFT p50: {report['ttft_p50_speedup']:.2f}x faster with prefix caching  "
          f"tokens identical: {report['tokens_identical']}")
