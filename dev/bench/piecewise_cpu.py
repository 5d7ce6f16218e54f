"""Does a PIECEWISE graph buy anything on CPU? Prefill time of the same mixed batches,
eager vs PIECEWISE (pieces between attention ops, as compiled CPU graphs capture them),
interleaved A B A B, one torch thread.

    OMP_NUM_THREADS=1 python dev/bench/piecewise_cpu.py --model smollm2-135m

On CPU a PIECEWISE "graph" replays its FX pieces as torch ops (``compilation_config``
``backend="eager"``, the default) and copies their outputs into static buffers: it saves
only the Python of the modules between attention ops. Its price is a dynamo trace of the
whole model at start-up (tens of seconds for SmolLM2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _engine(model: str, piecewise: bool, sizes: list[int]):
    from rung.runtime import LLM

    comp = ({"cudagraph_mode": "piecewise", "cudagraph_capture_sizes": sizes,
             "graph_backend": "emulated", "graph_startup": "blocking"} if piecewise else None)
    return LLM(model, enforce_eager=not piecewise, compilation_config=comp, max_num_seqs=64,
               max_model_len=256, debug_padding=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=12)
    parser.add_argument("--num-prompts", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from rung.runtime import SamplingParams

    num_tokens = args.prompt_len * args.num_prompts
    size = 1 << (num_tokens - 1).bit_length()
    start = time.perf_counter()
    piecewise = _engine(args.model, True, [size])
    setup_s = time.perf_counter() - start
    eager = _engine(args.model, False, [size])
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1 + (7 * i + j) % 300 for j in range(args.prompt_len)]}
               for i in range(args.num_prompts)]
    times: dict[str, list[float]] = {"eager": [], "piecewise": []}
    outputs = {}
    for _ in range(args.rounds):
        for name, llm in (("eager", eager), ("piecewise", piecewise)):
            start = time.perf_counter()
            for _ in range(5):
                outs = llm.generate(prompts, params, use_tqdm=False)
            times[name].append((time.perf_counter() - start) / 5 * 1e3)
            outputs[name] = [o.outputs[0].token_ids for o in outs]
    replays = piecewise.engine.stats()["graph_replays"]
    ratios = [p / e for p, e in zip(times["piecewise"], times["eager"])]
    print(json.dumps({"model": args.model, "num_tokens": num_tokens, "padded": size,
                      "eager_ms": statistics.median(times["eager"]),
                      "piecewise_ms": statistics.median(times["piecewise"]),
                      "piecewise_over_eager": statistics.median(ratios),
                      "piecewise_setup_s": setup_s, "replays": replays,
                      "same_tokens": outputs["eager"] == outputs["piecewise"]}, indent=1))


if __name__ == "__main__":
    main()
