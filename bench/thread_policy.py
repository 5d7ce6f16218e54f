"""Does rung's default thread policy hold up on a busy machine? Decode tok/s of one greedy
request at the default policy against 1 and 2 torch threads with the policy off, beside 0,
1 and 2 busy processes (``python -c 'while True: pass'``), variants interleaved.

    python -m rung.bench.thread_policy --model smollm2-135m --rounds 2

Each run is a fresh interpreter (OpenMP reads its wait policy once, when torch loads), so a
variant's environment really is what that process ran with. Prints one JSON line per run
and a summary per condition: each variant's median tok/s and default / best(1, 2 threads).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# variant -> environment on top of the caller's (the policy env vars cleared first)
VARIANTS = {
    "default": {},
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
    "off_1thread": {"RUNG_THREAD_POLICY": "off", "OMP_NUM_THREADS": "1"},
    "off_2threads": {"RUNG_THREAD_POLICY": "off", "OMP_NUM_THREADS": "2"},
}
_CLEARED = ("RUNG_THREAD_POLICY", "RUNG_NUM_THREADS", "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
            "GOMP_SPINCOUNT", "RUNG_LOGGING_LEVEL")

_RUN = r"""
import json, sys, time
from rung import LLM, SamplingParams
import torch
llm = LLM(sys.argv[1], enforce_eager=True, max_model_len=512)
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[2]), ignore_eos=True)
llm.generate(["Warm up"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
start = time.perf_counter()
out = llm.generate(["The history of the city"], params, use_tqdm=False)[0].outputs[0]
elapsed = time.perf_counter() - start
print(json.dumps({"tok_s": len(out.token_ids) / elapsed, "threads": torch.get_num_threads()}))
"""


def run_variant(model: str, max_tokens: int, variant: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update(VARIANTS[variant], RUNG_LOGGING_LEVEL="WARNING")
    out = subprocess.run([sys.executable, "-c", _RUN, model, str(max_tokens)], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{variant}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--busy", default="0,1,2", help="busy-process counts to run beside")
    args = p.parse_args(argv)
    results: dict[int, dict[str, list[float]]] = {}
    for num_busy in [int(x) for x in args.busy.split(",")]:
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(num_busy)]
        try:
            runs = results.setdefault(num_busy, {v: [] for v in VARIANTS})
            for rnd in range(args.rounds):
                for variant in VARIANTS:       # NOTE: interleaved A B C D A B C D
                    r = run_variant(args.model, args.max_tokens, variant)
                    runs[variant].append(r["tok_s"])
                    print(json.dumps({"busy": num_busy, "round": rnd, "variant": variant,
                                      **r, "loadavg": _loadavg()}), flush=True)
        finally:
            for proc in busy:
                proc.kill()
                proc.wait()
    for num_busy, runs in results.items():
        med = {v: statistics.median(x) for v, x in runs.items()}
        best = max(med["off_1thread"], med["off_2threads"])
        print(json.dumps({"busy": num_busy, "median_tok_s": {k: round(v, 1)
                                                              for k, v in med.items()},
                          "default_over_best": round(med["default"] / best, 2),
                          "spin10k_over_best": round(med["spin10k"] / best, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
