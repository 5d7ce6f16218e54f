"""What batch-invariant mode costs: the time of a decode-heavy generate (short prompts, 48
greedy tokens each) with ``batch_invariant`` off and on, at 1 and 8 requests, the two
engines interleaved A B A B in one process, eager, one torch thread.

    python dev/bench/batch_invariant_cost.py --model smollm2-135m --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--num-reqs", default="1,8")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    from rung.runtime import LLM, SamplingParams

    engines = {mode: LLM(args.model, enforce_eager=True, max_model_len=256,
                         batch_invariant=mode == "invariant")
               for mode in ("default", "invariant")}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for num_reqs in [int(x) for x in args.num_reqs.split(",")]:
        prompts = [f"Story {i}: once upon a time" for i in range(num_reqs)]
        times: dict[str, list[float]] = {m: [] for m in engines}
        for _ in range(args.rounds):
            for mode, llm in engines.items():           # NOTE: interleaved
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                times[mode].append((time.perf_counter() - start) / args.max_tokens)
        med = {m: statistics.median(t) for m, t in times.items()}
        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
        print(json.dumps({"num_reqs": num_reqs, "ms_per_step": {m: round(1e3 * v, 1)
                                                                 for m, v in med.items()},
                          "invariant_over_default": round(med["invariant"] / med["default"], 2),
                          "loadavg": load}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
