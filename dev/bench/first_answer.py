"""Time to the first chat answer: `LLM(model)` with its defaults vs `enforce_eager`.

Each run is a fresh process with empty RUNG_CACHE_DIR and TORCHINDUCTOR_CACHE_DIR (cold),
or with ``--warm`` a cache one untimed default run filled first (every graph built); the
variants alternate (A B A B ...). ``--busy N`` keeps N CPU-bound processes running beside
every timed run (a busy machine). Prints seconds from process start to the answer, CPU
seconds of the process, and the answer text (the two must agree).

    python dev/bench/first_answer.py --model smollm2-135m --rounds 2 [--warm] [--busy 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from typing import Iterator

_CHILD = r"""
import json, sys, time, resource
start = time.perf_counter()
from rung.runtime import LLM, SamplingParams
kwargs = json.loads(sys.argv[2])
llm = LLM(sys.argv[1], **kwargs)
built = time.perf_counter() - start
if len(sys.argv) > 3:                   # the warm-up run: every graph built into the cache
    llm.wait_for_graphs()
out = llm.chat([[{"role": "user", "content": "What is the capital of France?"}]],
               SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
answer_s = time.perf_counter() - start
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"llm_s": built, "answer_s": answer_s,
                  "cpu_s": usage.ru_utime + usage.ru_stime,
                  "graphs": llm.engine.stats()["graphs"],
                  "text": out[0].outputs[0].text}))
"""


def _run(model: str, kwargs: dict, warm: str | None = None, fill: bool = False) -> dict:
    """One fresh process; ``warm``: the cache folder to use (else an empty one)."""
    with tempfile.TemporaryDirectory() as rung_cache, \
            tempfile.TemporaryDirectory() as inductor_cache:
        env = {**os.environ, "RUNG_CACHE_DIR": warm or rung_cache,
               "TORCHINDUCTOR_CACHE_DIR": inductor_cache, "OMP_NUM_THREADS": "1"}
        env.pop("RUNG_GRAPH_BACKEND", None)
        done = subprocess.run([sys.executable, "-c", _CHILD, model, json.dumps(kwargs)]
                              + (["fill"] if fill else []),
                              env=env, capture_output=True, text=True, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def _busy(num_procs: int) -> Iterator[None]:
    """``num_procs`` CPU-bound processes running until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(num_procs)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warm", action="store_true",
                   help="every run on a cache a first untimed run filled")
    p.add_argument("--cache-dir", default=None,
                   help="with --warm: this cache folder, kept (filled by its first run)")
    p.add_argument("--busy", type=int, default=0, help="CPU-bound processes beside each run")
    args = p.parse_args()
    variants = {"eager": {"enforce_eager": True}, "default": {}}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as cache:
        warm = (args.cache_dir or cache) if args.warm else None
        if warm and not os.listdir(warm):           # NOTE: a kept folder is filled once
            _run(args.model, {}, warm, fill=True)
        for _ in range(args.rounds):
            for name, kwargs in variants.items():
                with _busy(args.busy):
                    r = _run(args.model, kwargs, warm)
                results[name].append(r)
                print(name, json.dumps(r), flush=True)
    for name, rs in results.items():
        print(f"{name}: answer {[round(r['answer_s'], 1) for r in rs]} s, "
              f"cpu {[round(r['cpu_s'], 1) for r in rs]} s")
    ratio = [d["answer_s"] / e["answer_s"] for d, e in zip(results["default"], results["eager"])]
    print(f"default / eager time to first answer: {[round(x, 2) for x in ratio]}; same text: "
          f"{all(d['text'] == e['text'] for d, e in zip(results['default'], results['eager']))}")


if __name__ == "__main__":
    main()
