"""Per-layer vs whole-forward compiled CPU graphs: compile seconds, and decode step time
at 1 and 8 requests, interleaved A B A B in one process, one torch thread.

    OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \\
        python dev/bench/per_layer_replay.py --model smollm2-135m

"per_layer": one artifact per decoder layer kind, called once per layer
(``compilation_config.per_layer_graphs``, the default); "whole": the whole forward in one artifact.
Both use a symbolic batch for the size-8 graph. Ratios are per_layer / whole of the
per-round medians, of wall time and of the stepping thread's CPU time (the steadier figure
on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _engine(model: str, sizes: list[int], per_layer: bool, max_num_seqs: int):
    from rung.runtime import LLM

    start = time.perf_counter()
    # NOTE: per_layer_graphs goes through the config: the engine sets GraphManager.per_layer
    # from it after building the manager (patching the manager's __init__ measured
    # per-layer against per-layer)
    llm = LLM(model, max_num_seqs=max_num_seqs, max_model_len=256, debug_padding=False,
              compilation_config={"cudagraph_mode": "full_decode_only",
                                  "cudagraph_capture_sizes": sizes,
                                  "graph_backend": "compiled", "cache_dir": "",
                                  "graph_startup": "blocking", "per_layer_graphs": per_layer})
    llm.startup_s = time.perf_counter() - start
    return llm


def _decode_ms(llm, num_reqs: int, num_steps: int) -> tuple[float, float]:
    """Median decode step (wall ms, this thread's CPU ms). NOTE: with one torch thread a
    step runs on this thread alone; its CPU time leaves out the waits for a core that a
    shared machine adds to the wall time."""
    from rung.runtime import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 2, ignore_eos=True)
    for i in range(num_reqs):
        engine.add_request(f"r{time.perf_counter_ns()}-{i}",
                           {"prompt_token_ids": [1, 5 + i, 9, 200]}, params)
    engine.step()                                          # prefill
    wall, cpu = [], []
    for _ in range(num_steps):
        start, start_cpu = time.perf_counter(), time.thread_time()
        engine.step()
        wall.append((time.perf_counter() - start) * 1e3)
        cpu.append((time.thread_time() - start_cpu) * 1e3)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engines = {name: _engine(args.model, [1, 8], name == "per_layer", 8)
               for name in ("per_layer", "whole")}
    report = {"startup_s": {n: e.startup_s for n, e in engines.items()},
              "records": {n: [(r.num_tokens_padded, r.compile_s, r.load_s)
                              for r in e.engine.runner.graphs.records]
                          for n, e in engines.items()}}
    for num_reqs in (1, 8):
        times = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, llm in engines.items():              # interleaved: A B A B ...
                times[name].append(_decode_ms(llm, num_reqs, args.steps))
        for i, clock in enumerate(("", "cpu_")):
            report[f"decode_{clock}ms_{num_reqs}"] = {
                n: statistics.median(t[i] for t in ts) for n, ts in times.items()}
            report[f"per_layer_over_whole_{clock}{num_reqs}"] = statistics.median(
                a[i] / b[i] for a, b in zip(times["per_layer"], times["whole"]))
    report["replays"] = {n: e.engine.stats()["graph_replays"] for n, e in engines.items()}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
