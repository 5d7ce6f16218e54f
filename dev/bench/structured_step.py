"""Decode step time with a grammar active vs without, interleaved A B A B in one process.

    python dev/bench/structured_step.py --model smollm2-135m --rounds 4

Each round runs ``num_reqs`` requests (greedy, 48 new tokens, eager) twice: free, then each
constrained to a JSON schema (or the reverse on odd rounds), and takes the median time of
one ``LLMEngine.step()`` once every request decodes. The grammar's cost is the mask
computation on the host (llguidance, per constrained request) plus its host-to-device copy
and the batched mask on the device. Reports the per-round ratios grammar / free.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rung.runtime import LLM, SamplingParams

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "tags": {"type": "array",
                                                            "items": {"type": "string"}},
                         "age": {"type": "integer"}},
          "required": ["name", "tags", "age"]}


def _median_decode_step(llm: LLM, num_reqs: int, params: SamplingParams, tag: str) -> float:
    engine = llm.engine
    for i in range(num_reqs):
        engine.add_request(f"{tag}-{i}", f"Write record number {i} as JSON:", params)
    times = []
    while engine.has_unfinished_requests():
        decoding = all(r.num_output_tokens > 0 for r in engine.requests.values()) and \
            len(engine.requests) == num_reqs
        t = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-reqs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(args.model, dtype="float32", enforce_eager=True, max_model_len=256,
              max_num_seqs=args.num_reqs, enable_prefix_caching=False)
    free = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                 structured_outputs={"json": SCHEMA})
    _median_decode_step(llm, args.num_reqs, constrained, "warm")       # compile + warm up
    ratios = []
    for r in range(args.rounds):
        order = [("free", free), ("grammar", constrained)]
        got = {name: _median_decode_step(llm, args.num_reqs, p, f"{r}-{name}")
               for name, p in (order if r % 2 == 0 else order[::-1])}
        ratios.append(got["grammar"] / got["free"])
        print(f"round {r}: free {got['free'] * 1e3:.2f} ms, grammar "
              f"{got['grammar'] * 1e3:.2f} ms, ratio {ratios[-1]:.3f}", flush=True)
    print(f"median ratio grammar / free at {args.num_reqs} requests: "
          f"{statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
