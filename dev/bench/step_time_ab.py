"""Decode step time of two rung checkouts, interleaved A B A B, one torch thread each.

    git archive main | tar -x -C /tmp/rung-main     # any other checkout of rung
    python dev/bench/step_time_ab.py --old /tmp/rung-main --rounds 3

Each measurement runs in a fresh subprocess (so both versions see the same warm machine):
bench-llama, 64 requests of 16 prompt tokens, 48 new tokens, eager, and reports the median
time of one ``LLMEngine.step()`` once every request decodes. Workloads: sampled
(temperature 0.8, top-p 0.95) and the same under n-gram speculation (k = 3). Ratios are
new / old of the per-round medians.

    python dev/bench/step_time_ab.py --phases          (this checkout only)

splits the same decode steps into the host path (schedule, input prep and metadata, the
sampling batch, unpacking, commit and outputs, n-gram drafting) and the model and sampler
work a device runs, to size what overlapping step N+1's host work with step N could save.
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


def _worker(workload: str, num_reqs: int, max_tokens: int, phases: bool = False) -> dict:
    import torch

    from rung.runtime import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM("bench-llama", dtype="float32", enforce_eager=True, max_num_seqs=num_reqs,
              max_model_len=256, speculative_config=WORKLOADS[workload],
              debug_padding=False)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens,
                            ignore_eos=True, seed=None)
    engine = llm.engine
    timer = _PhaseTimer(engine) if phases else None
    for i in range(num_reqs):
        prompt = [3 + (5 * i + j % (4 + i % 3)) % 4000 for j in range(16)]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    times, tokens, per_step = [], 0, []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - start)
        tokens += len(outs)
        if timer is not None:
            per_step.append(timer.take())
    decode = times[2:-2]                  # NOTE: past the prefill, before the tail
    result = {"median_step_ms": 1e3 * statistics.median(decode), "steps": len(times),
              "rung": str(Path(__import__("rung.runtime").runtime.__file__).parent.parent)}
    if timer is not None:
        result["phases_ms"] = {name: 1e3 * statistics.median(s.get(name, 0.0)
                                                             for s in per_step[2:-2])
                               for name in timer.names}
    return result


class _PhaseTimer:
    """Wall time per phase of each step, by wrapping the engine's own methods (exclusive:
    time inside a nested wrapped call counts to the inner phase only)."""

    # phase -> what it wraps; "device" phases are the work a GPU would run
    HOST = ("schedule", "prepare", "metadata", "sampling_batch", "unpack", "commit",
            "propose")
    DEVICE = ("model", "logits", "sampler")

    def __init__(self, engine) -> None:
        from rung.runtime.worker import sampler

        runner = engine.runner
        self.names = self.HOST + self.DEVICE + ("other_host",)
        self._acc: dict[str, float] = {}
        self._stack: list[list] = []
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(runner.input_batch, "prepare", "prepare")   # rows, pads, metadata views
        self._wrap(runner, "forward_args", "metadata")           # every layer's metadata
        self._wrap(runner, "forward", "model")
        self._wrap(runner.model, "compute_logits", "logits")
        self._wrap(runner.sampler, "sample", "sampler")
        self._wrap(runner.host_copy, "fetch", "unpack")          # pack, copy, unpack
        self._wrap(engine, "_commit", "commit")
        self._wrap(engine, "_propose", "propose")
        self._wrap(engine, "step", "other_host")
        build = sampler.SamplingBatch.build
        self._wrap(sampler.SamplingBatch, "build", "sampling_batch", build)

    def _wrap(self, obj, attr: str, phase: str, fn=None) -> None:
        fn = fn if fn is not None else getattr(obj, attr)
        stack, acc = self._stack, self._acc

        def timed(*args, **kwargs):
            frame = [time.perf_counter(), 0.0]          # [start, time in nested phases]
            stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()
                spent = time.perf_counter() - frame[0]
                acc[phase] = acc.get(phase, 0.0) + spent - frame[1]
                if stack:
                    stack[-1][1] += spent

        if isinstance(obj, type):
            setattr(obj, attr, staticmethod(timed))
        else:
            object.__setattr__(obj, attr, timed)

    def take(self) -> dict[str, float]:
        out = dict(self._acc)
        self._acc.clear()
        return out


def _shim(root: Path) -> Path:
    """A folder holding ``rung`` -> root's packages, for PYTHONPATH (beats the editable)."""
    shim = Path(tempfile.mkdtemp(prefix="rung-shim-")) / "rung"
    shim.mkdir()
    for name in PACKAGES:
        if (root / name).exists():
            (shim / name).symlink_to(root / name)
    return shim.parent


def _print_phases(workload: str, result: dict) -> None:
    phases = result["phases_ms"]
    host = sum(phases[n] for n in _PhaseTimer.HOST + ("other_host",))
    device = sum(phases[n] for n in _PhaseTimer.DEVICE)
    print(f"{workload}: median step {result['median_step_ms']:.2f} ms; host path "
          f"{host:.2f} ms ({100 * host / (host + device):.0f}%), model + sampler "
          f"{device:.2f} ms (medians per phase)", flush=True)
    print("  " + ", ".join(f"{n} {v:.2f}" for n, v in phases.items()), flush=True)


def _run(pythonpath: str | None, workload: str, args: argparse.Namespace,
         extra: tuple[str, ...] | list[str] = ()) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", RUNG_GRAPH_BACKEND="emulated")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    # NOTE: this file by path, for both checkouts: the old one may not ship it
    cmd = [sys.executable, __file__, "--worker", workload,
           "--num-reqs", str(args.num_reqs), "--max-tokens", str(args.max_tokens), *extra]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, help="root of the other checkout (A)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-reqs", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--worker", choices=list(WORKLOADS))
    p.add_argument("--phases", action="store_true",
                   help="host path vs model work per decode step, this checkout only")
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.worker, args.num_reqs, args.max_tokens, args.phases)))
        return
    if args.phases:
        for workload in WORKLOADS:
            _print_phases(workload, _run(None, workload, args, ["--phases"]))
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
