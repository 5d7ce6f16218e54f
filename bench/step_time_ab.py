"""Decode step time of two rung checkouts, interleaved A B A B, one torch thread each.

    git archive main | tar -x -C /tmp/rung-main     # any other checkout of rung
    python -m rung.bench.step_time_ab --old /tmp/rung-main --rounds 3

Each measurement runs in a fresh subprocess (so both versions see the same warm machine):
bench-llama, 64 requests of 16 prompt tokens, 48 new tokens, eager, and reports the median
time of one ``LLMEngine.step()`` once every request decodes. Workloads: sampled
(temperature 0.8, top-p 0.95) and the same under n-gram speculation (k = 3). Ratios are
new / old of the per-round medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOADS = {"sampled": None, "ngram-sampled": {"method": "ngram", "num_speculative_tokens": 3}}
PACKAGES = ("core", "runtime", "graphs", "kernels", "models", "bench")


def _worker(workload: str, num_reqs: int, max_tokens: int) -> dict:
    import torch

    from rung.runtime import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM("bench-llama", dtype="float32", enforce_eager=True, max_num_seqs=num_reqs,
              max_model_len=256, speculative_config=WORKLOADS[workload],
              debug_padding=False)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens,
                            ignore_eos=True, seed=None)
    engine = llm.engine
    for i in range(num_reqs):
        prompt = [3 + (5 * i + j % (4 + i % 3)) % 4000 for j in range(16)]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    times, tokens = [], 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - start)
        tokens += len(outs)
    decode = times[2:-2]                  # NOTE: past the prefill, before the tail
    return {"median_step_ms": 1e3 * statistics.median(decode), "steps": len(times),
            "rung": str(Path(__import__("rung.runtime").runtime.__file__).parent.parent)}


def _shim(root: Path) -> Path:
    """A folder holding ``rung`` -> root's packages, for PYTHONPATH (beats the editable)."""
    shim = Path(tempfile.mkdtemp(prefix="rung-shim-")) / "rung"
    shim.mkdir()
    for name in PACKAGES:
        if (root / name).exists():
            (shim / name).symlink_to(root / name)
    return shim.parent


def _run(pythonpath: str | None, workload: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", RUNG_GRAPH_BACKEND="emulated")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-m", "rung.bench.step_time_ab", "--worker", workload,
           "--num-reqs", str(args.num_reqs), "--max-tokens", str(args.max_tokens)]
    if pythonpath:      # the old checkout may not ship this module: run this file by path
        cmd[1:3] = [__file__]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, help="root of the other checkout (A)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-reqs", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--worker", choices=list(WORKLOADS))
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.worker, args.num_reqs, args.max_tokens)))
        return
    old = str(_shim(args.old.resolve()))
    for workload in WORKLOADS:
        pairs = []
        for r in range(args.rounds):
            a = _run(old, workload, args)
            b = _run(None, workload, args)
            pairs.append((a["median_step_ms"], b["median_step_ms"]))
            print(f"{workload} round {r}: old {a['median_step_ms']:.2f} ms ({a['rung']}), "
                  f"new {b['median_step_ms']:.2f} ms ({b['rung']})", flush=True)
        olds, news = zip(*pairs)
        print(f"| {workload} | old {statistics.median(olds):.2f} ms | new "
              f"{statistics.median(news):.2f} ms | new/old "
              f"{statistics.median(n / o for o, n in pairs):.3f} |", flush=True)


if __name__ == "__main__":
    main()
