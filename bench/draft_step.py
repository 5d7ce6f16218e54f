"""MTP draft step time: compiled CPU draft graphs vs emulated ones (a replay re-runs the
eager rounds), interleaved A B A B in one process, one torch thread.

    OMP_NUM_THREADS=1 python -m rung.bench.draft_step --model tiny-gemma4 \\
        --drafter tiny-gemma4-mtp

"compiled": one inductor artifact of one greedy round, called k times per draft step (what
the compiled backend builds); "whole": the k rounds unrolled into ONE artifact (the
alternative, built here through the same backend); "emulated": the eager rounds. Every
engine serves the same greedy requests; what is timed is the draft hook inside each target
step (``MtpProposer.draft``: fill, advance, replay), by the number of requests drafting.
Ratios are of the per-size medians, wall time and the thread's CPU time.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import tempfile
import time
from typing import Any

import torch


def _engine(model: str, drafter: str, k: int, max_num_seqs: int, backend: str,
            cache_dir: str) -> Any:
    from rung.runtime import LLM

    start = time.perf_counter()
    llm = LLM(model, max_num_seqs=max_num_seqs, max_model_len=256, debug_padding=False,
              speculative_config={"method": "mtp", "model": drafter,
                                  "num_speculative_tokens": k},
              compilation_config={"cudagraph_mode": "full_decode_only",
                                  "graph_backend": backend, "cache_dir": cache_dir,
                                  "graph_startup": "blocking"})
    llm.startup_s = time.perf_counter() - start
    return llm


def _whole_rounds(llm: Any) -> float:
    """Replace each compiled draft graph by one artifact of the k unrolled rounds; the
    seconds its compile took."""
    from rung.core.forward_context import forward_context
    from rung.graphs.cpu_compiled.artifacts import compile_key, symbolic_dims
    from rung.graphs.cpu_compiled.draft_rounds import DRAFT_BATCHED, draft_tensors

    proposer, graphs = llm.engine.proposer, llm.engine.runner.graphs
    backend, start = graphs.capture_backend, time.perf_counter()
    with torch.inference_mode():
        for desc in proposer.captured:              # two rows or more first
            proposer.batch.fill([], proposer._target_block_tables(), desc)
            ctx = proposer._context(desc)
            inputs = proposer.batch.graph_inputs(desc)
            with forward_context(ctx):
                named = draft_tensors(inputs, ctx, graphs.named_tensors([]),
                                      {"draft.": proposer.drafter})
                symbolic = max(d.num_reqs_padded for d in proposer.captured) >= 2
                dynamic = symbolic_dims(named, ctx, symbolic, DRAFT_BATCHED)
                graph_key = {**compile_key(desc, ctx, symbolic), "whole_rounds":
                             proposer.num_spec_tokens}
                graphs.full_graphs[("draft", desc)] = backend.capture_model(
                    proposer._draft_rounds, inputs, named, dynamic, graph_key)
    return time.perf_counter() - start


def _time_drafts(llm: Any, times: dict) -> None:
    proposer = llm.engine.proposer
    draft = proposer.draft

    def timed(desc, *args, **kwargs):
        start, start_cpu = time.perf_counter(), time.thread_time()
        out = draft(desc, *args, **kwargs)
        times[desc.num_reqs].append(((time.perf_counter() - start) * 1e3,
                                     (time.thread_time() - start_cpu) * 1e3))
        return out

    proposer.draft = timed


def _serve(llm: Any, num_reqs: int, max_tokens: int) -> list[list[int]]:
    from rung.runtime import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 5 + i, 9, 200, 17 + i]} for i in range(num_reqs)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-gemma4")
    parser.add_argument("--drafter", default="tiny-gemma4-mtp")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--num-reqs", default="1,4")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-whole", action="store_true", help="skip the unrolled variant")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    num_reqs = [int(n) for n in args.num_reqs.split(",")]
    cache = tempfile.mkdtemp(prefix="rung-draft-step-")
    k, most = args.num_speculative_tokens, max(num_reqs)
    variants = {"emulated": _engine(args.model, args.drafter, k, most, "emulated", ""),
                "compiled": _engine(args.model, args.drafter, k, most, "compiled", cache)}
    compile_s = {"compiled": sum(r.compile_s or 0.0 for r in
                                 variants["compiled"].engine.runner.graphs.records
                                 if r.graph == "draft")}
    if not args.no_whole:
        variants["whole"] = _engine(args.model, args.drafter, k, most, "compiled", cache)
        compile_s["whole"] = _whole_rounds(variants["whole"])
    times = {name: collections.defaultdict(list) for name in variants}
    for name, llm in variants.items():
        _time_drafts(llm, times[name])
    tokens = {}
    for _ in range(args.rounds):                  # A B C A B C ...
        for n in num_reqs:
            for name, llm in variants.items():
                tokens[(name, n)] = _serve(llm, n, args.max_tokens)
    # NOTE: greedy tokens are the target's whatever the drafts; the acceptance counts
    # are the drafts' own
    same = (all(tokens[(name, n)] == tokens[("emulated", n)] for name, n in tokens)
            and len({json.dumps(llm.engine.stats()["spec"]) for llm in variants.values()}) == 1)
    report: dict[str, Any] = {"model": args.model, "drafter": args.drafter, "k": k,
                              "tokens_and_acceptance_identical": same,
                              "draft_compile_s": compile_s, "median_ms": {}}
    print(f"{args.model} + {args.drafter}, k={k}, one torch thread; tokens and "
          f"acceptance identical across variants: {same}; draft artifact compile s: "
          + ", ".join(f"{n} {s:.1f}" for n, s in compile_s.items()))
    for rows in sorted(times["emulated"]):
        med = {name: (statistics.median(w for w, _ in t[rows]),
                      statistics.median(c for _, c in t[rows])) for name, t in times.items()}
        report["median_ms"][rows] = med
        base = med["emulated"]
        print(f"{rows} drafting requests ({len(times['emulated'][rows])} steps each): " + "; ".join(
            f"{name} {w:.3f} ms wall ({w / base[0]:.2f}x), {c:.3f} ms cpu ({c / base[1]:.2f}x)"
            for name, (w, c) in med.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
