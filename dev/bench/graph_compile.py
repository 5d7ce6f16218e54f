"""What a compiled CPU graph costs and what it gives: static vs symbolic batch, and serving
while a compile runs.

1. Compile: one static artifact per size vs one artifact with a symbolic batch dimension
   (``GraphManager.symbolic_batch``), each ladder size then bound to it. Wall and CPU
   seconds per artifact, from a cold rung cache (inductor's own cache: set
   TORCHINDUCTOR_CACHE_DIR to an empty folder for cold figures).
2. Replay: the static and the symbolic artifact of the same size, interleaved (A B A B),
   and the static size-1 artifact.
3. Serving during a compile: eager decode step times alone, then while a thread runs an
   inductor compile (GIL contention on a small machine).

    OMP_NUM_THREADS=1 TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \\
        python dev/bench/graph_compile.py --model smollm2-135m --size 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch


def _engine(model: str, sizes: list[int], symbolic: bool | None, **kw):
    from rung.runtime import LLM

    comp = {"cudagraph_mode": "full_decode_only", "cudagraph_capture_sizes": sizes,
            "graph_backend": "compiled", "cache_dir": "", "graph_startup": "blocking"}
    if symbolic is None:
        return LLM(model, enforce_eager=True, **kw)
    import rung.graphs.manager as manager

    old = manager.GraphManager.__init__

    def init(self, *args, **kwargs):
        old(self, *args, **kwargs)
        self.symbolic_batch = symbolic

    manager.GraphManager.__init__ = init
    try:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        llm = LLM(model, compilation_config=comp, **kw)
        llm.startup = (time.perf_counter() - wall0, time.process_time() - cpu0)
    finally:
        manager.GraphManager.__init__ = old
    return llm


def _graph(llm, size: int):
    return next(g for g in llm.engine.runner.graphs.full_graphs.values()
                if g.outputs.shape[0] == size)


def _replay_ms(graphs: dict[str, object], rounds: int, reps: int) -> dict[str, float]:
    times = {name: [] for name in graphs}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, graph in graphs.items():          # interleaved: A B A B ...
                start = time.perf_counter()
                for _ in range(reps):
                    graph._run()
                times[name].append((time.perf_counter() - start) / reps * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _step_ms(llm, num_steps: int) -> list[float]:
    from rung.runtime import SamplingParams

    engine = llm.engine
    rid = f"r{time.perf_counter_ns()}"
    engine.add_request(rid, {"prompt_token_ids": [1, 5, 9, 200]},
                       SamplingParams(temperature=0.0, max_tokens=num_steps + 1,
                                      ignore_eos=True))
    engine.step()                                          # prefill
    out = []
    for _ in range(num_steps):
        start = time.perf_counter()
        engine.step()
        out.append((time.perf_counter() - start) * 1e3)
    while engine.has_unfinished_requests():
        engine.step()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--size", type=int, default=8)
    p.add_argument("--compile-model", default="tiny-llama",
                   help="what the background thread compiles in part 3")
    p.add_argument("--json", default=None)
    p.add_argument("--only-serving", action="store_true", help="part 3 alone")
    args = p.parse_args()
    torch.set_num_threads(1)
    kw = dict(max_num_seqs=args.size, max_model_len=256)
    report = {}
    if not args.only_serving:
        _compile_and_replay(args, kw, report)
    _serving_during_compile(args, kw, report)
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


def _compile_and_replay(args: argparse.Namespace, kw: dict, report: dict) -> None:
    static = _engine(args.model, [1, args.size], symbolic=False, **kw)
    symbolic = _engine(args.model, [1, 2, 4, args.size], symbolic=True, **kw)
    for name, llm in (("static", static), ("symbolic", symbolic)):
        report[f"{name}_startup_wall_cpu_s"] = llm.startup
        report[f"{name}_records"] = [
            (r.num_tokens_padded, r.compile_s, r.load_s) for r in llm.engine.runner.graphs.records]
    report["replay_ms"] = _replay_ms({"static_1": _graph(static, 1),
                                      f"static_{args.size}": _graph(static, args.size),
                                      f"symbolic_{args.size}": _graph(symbolic, args.size),
                                      "symbolic_2": _graph(symbolic, 2)}, rounds=15, reps=20)


def _serving_during_compile(args: argparse.Namespace, kw: dict, report: dict) -> None:
    eager = _engine(args.model, [], symbolic=None, **kw)
    _step_ms(eager, 5)
    alone = _step_ms(eager, 40)
    done = threading.Event()
    compile_s = []

    def compile_in_thread():
        start = time.perf_counter()
        _engine(args.compile_model, [2], symbolic=False, max_num_seqs=2, max_model_len=64)
        compile_s.append(time.perf_counter() - start)
        done.set()

    thread = threading.Thread(target=compile_in_thread, daemon=True)
    thread.start()
    during = []
    while not done.is_set():
        during += _step_ms(eager, 10)
    thread.join()
    after = _step_ms(eager, 40)
    report["eager_step_ms"] = {"alone": statistics.median(alone),
                               "during_thread_compile": statistics.median(during),
                               "during_p90": sorted(during)[int(len(during) * 0.9)],
                               "after": statistics.median(after),
                               "thread_compile_s": compile_s[0] if compile_s else None}


if __name__ == "__main__":
    main()
