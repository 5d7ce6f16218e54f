"""Decoding through the eager -> graph switch of a background start, step by step.

    python -m rung.bench.live_switch [--model tiny-llama] [--device auto] [--num-reqs 4]

``LLM(...)`` with ``graph_startup="background"`` serves eagerly from its first step while
the builder makes one graph live per step, on the serving thread between steps (on CUDA
this is where a size is captured; on CPU a worker thread loads, binds and checks each
graph meanwhile, and the step only swaps it in).
This harness keeps ``--num-reqs`` greedy requests decoding until every graph is live, times
every ``LLMEngine.step()`` (device synchronised), and prints:
- each step in which a graph went live: its time, and which sizes;
- the median eager step and the median graph step around it, the worst stall (a step
  that made a graph live, less the median eager step), and the worst decode step of the
  switch-over (every step up to the last one a graph went live in);
- whether every request's tokens equal an ``enforce_eager`` engine's on the same prompts.

Exit status 1 when the tokens differ or a graph did not go live within ``--timeout``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from rung.bench.stats import sync
from rung.runtime import LLM, SamplingParams

PROMPT_SETS = 4     # wave w decodes prompt set w % PROMPT_SETS


def _prompts(num_reqs: int, wave: int) -> list[dict]:
    return [{"prompt_token_ids": [1, 7 + wave % PROMPT_SETS, 30 + 11 * i, 5 + i]}
            for i in range(num_reqs)]


def _eager_tokens(args: argparse.Namespace, waves: int, params: SamplingParams
                  ) -> list[list[list[int]]]:
    llm = LLM(args.model, enforce_eager=True, **_engine_kwargs(args))
    return [[o.outputs[0].token_ids
             for o in llm.generate(_prompts(args.num_reqs, w), params, use_tqdm=False)]
            for w in range(min(waves, PROMPT_SETS))]


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(device=args.device, dtype=args.dtype, max_num_seqs=args.num_reqs,
                max_model_len=args.max_tokens + 16)


def _wave(llm: LLM, prompts: list[dict], params: SamplingParams, wave: int,
          steps: list[dict]) -> list[list[int]]:
    """Decode one wave of requests to the end; append a row per step to ``steps``."""
    engine = llm.engine
    ids = [f"w{wave}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    modes: list[str] = []
    remove = engine.add_step_listener(
        lambda out: modes.append(f"{out.desc.mode.name}:{out.desc.num_reqs_padded}"))
    tokens: dict[str, list[int]] = {}
    device = llm.engine.runner.device
    try:
        while engine.has_unfinished_requests():
            live = set(engine.stats()["graphs"]["live"])
            modes.clear()
            sync(device)
            start = time.perf_counter()
            outs = engine.step()
            sync(device)
            step_s = time.perf_counter() - start
            went_live = sorted(set(engine.stats()["graphs"]["live"]) - live)
            steps.append({"wave": wave, "ms": step_s * 1e3, "ran": modes[0] if modes else "-",
                          "went_live": went_live})
            for out in outs:
                if out.finished:
                    tokens[out.request_id] = out.outputs[0].token_ids
    finally:
        remove()
    return [tokens[rid] for rid in ids]


def _summary(steps: list[dict]) -> dict:
    # NOTE: a step's own time; prefill steps (the first of each wave) are left out of
    # the medians, which compare decode steps only
    decode = [s for s in steps if s["ran"] != "-" and not s["went_live"]
              and s is not _first_of_wave(steps, s)]
    eager = [s["ms"] for s in decode if s["ran"].startswith("NONE")]
    graph = [s["ms"] for s in decode if not s["ran"].startswith("NONE")]
    switches = [s for s in steps if s["went_live"]]
    eager_ms = statistics.median(eager) if eager else None
    # the switch-over: every decode step up to the one the last graph went live in (a
    # graph built off the serving thread takes cycles from the steps it overlaps too)
    last = steps.index(switches[-1]) if switches else -1
    over = [s["ms"] for s in steps[:last + 1] if s["ran"] != "-"
            and s is not _first_of_wave(steps, s)]
    return {"eager_step_ms_p50": eager_ms,
            "graph_step_ms_p50": statistics.median(graph) if graph else None,
            "switch_steps": [{"ms": s["ms"], "went_live": s["went_live"]} for s in switches],
            "worst_stall_ms": (max(s["ms"] for s in switches) - eager_ms
                               if switches and eager_ms is not None else None),
            "worst_switchover_step_ms": max(over) if over else None}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _first_of_wave(steps: list[dict], step: dict) -> dict:
    return next(s for s in steps if s["wave"] == step["wave"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-reqs", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds for every graph to go live")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    llm = LLM(args.model, compilation_config={"graph_startup": "background"},
              **_engine_kwargs(args))
    started, steps, got = time.perf_counter(), [], []
    while not llm.engine.stats()["graphs"]["done"]:
        if time.perf_counter() - started > args.timeout:
            break
        got.append(_wave(llm, _prompts(args.num_reqs, len(got)), params, len(got), steps))
    got.append(_wave(llm, _prompts(args.num_reqs, len(got)), params, len(got), steps))
    want = _eager_tokens(args, len(got), params)
    graphs = llm.engine.stats()["graphs"]
    same = all(tokens == want[w % PROMPT_SETS] for w, tokens in enumerate(got))
    report = {"model": args.model, "device": str(llm.engine.runner.device),
              "waves": len(got), "steps": len(steps), "live": graphs["live"],
              "pending": graphs["pending"], "tokens_match_eager": same,
              **_summary(steps),
              "step_log": [[round(s["ms"], 2), s["ran"], s["went_live"]] for s in steps]}
    for s in report["switch_steps"]:
        print(f"step {s['ms']:9.1f} ms  went live: {', '.join(s['went_live'])}")
    print("eager step p50 {}, graph step p50 {}, worst stall {}, worst decode step of the "
          "switch-over {}".format(*(_ms(report[k]) for k in (
              "eager_step_ms_p50", "graph_step_ms_p50", "worst_stall_ms",
              "worst_switchover_step_ms"))))
    print(f"{len(graphs['live'])} graphs live, {len(graphs['pending'])} pending; tokens "
          f"{'match' if report['tokens_match_eager'] else 'DIFFER from'} enforce_eager "
          f"over {len(got)} waves of {args.num_reqs} requests")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["tokens_match_eager"] and not graphs["pending"] else 1


if __name__ == "__main__":
    sys.exit(main())
