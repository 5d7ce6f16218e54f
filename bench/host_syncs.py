"""Tensor-to-host conversions per engine step: on a GPU each one is a device sync.

    python -m rung.bench.host_syncs                 (every workload, one table)
    python -m rung.bench.host_syncs --debug-padding --num-reqs 16 --max-tokens 24

Counts every call of ``tolist``, ``item``, ``cpu``, ``numpy``, ``int()``, ``float()`` and
``bool()`` on a ``torch.Tensor`` while ``LLMEngine.step()`` runs, per step; prints the worst
step and the mean of each workload (tiny-llama, emulated graphs; MTP rows: tiny-gemma4 and
its assistant). On CPU none of them syncs, so this is the count a GPU would pay, measured
where the suite runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import os
import warnings
from collections.abc import Iterator

import torch

# NOTE: int()/float()/bool() reach a tensor through these dunders
CONVERSIONS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__")
# debug_padding's value checks read device metadata on purpose (debug mode adds checks, and
# may sync to make them): counted apart, in ``debug_counts``
DEBUG_CHECKS = (("rung.core.attention_metadata", "_validate_values"),)


class ConversionCounter:
    """Counts tensor-to-host conversions while ``counting()`` is active (by method name);
    those made inside a debug-mode check (DEBUG_CHECKS) go to ``debug_counts``."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.debug_counts: collections.Counter = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @contextlib.contextmanager
    def counting(self) -> Iterator[ConversionCounter]:
        originals = {name: getattr(torch.Tensor, name) for name in CONVERSIONS}
        depth = [0]          # a conversion made inside another one is not a second sync
        in_debug = [0]

        def wrap(name: str, fn):
            def counted(*args, **kwargs):
                if depth[0] == 0:
                    (self.debug_counts if in_debug[0] else self.counts)[name] += 1
                depth[0] += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    depth[0] -= 1
            return counted

        def wrap_check(fn):
            def checked(*args, **kwargs):
                in_debug[0] += 1
                try:
                    return fn(*args, **kwargs)
                finally:
                    in_debug[0] -= 1
            return checked

        checks = [(importlib.import_module(m), f) for m, f in DEBUG_CHECKS]
        check_fns = [getattr(module, f) for module, f in checks]
        for name, fn in originals.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        for (module, f), fn in zip(checks, check_fns):
            setattr(module, f, wrap_check(fn))
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(torch.Tensor, name, fn)
            for (module, f), fn in zip(checks, check_fns):
                setattr(module, f, fn)


def conversions_per_step(engine, add_requests, cuda_syncs: bool = False
                         ) -> list[collections.Counter]:
    """Run ``engine`` to completion after ``add_requests(engine)``; one Counter per step
    (debug-mode checks left out). ``cuda_syncs``: also count, under key ``CUDA_SYNC``, the
    synchronising CUDA operations ``torch.cuda.set_sync_debug_mode("warn")`` reports."""
    add_requests(engine)
    steps = []
    if cuda_syncs:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        while engine.has_unfinished_requests():
            counter = ConversionCounter()
            with warnings.catch_warnings(record=True) as caught, counter.counting():
                warnings.simplefilter("always")
                engine.step()
            syncs = sum("synchroniz" in str(w.message) for w in caught)
            if cuda_syncs:
                counter.counts[CUDA_SYNC] = syncs
            steps.append(counter.counts)
    finally:
        if cuda_syncs:
            torch.cuda.set_sync_debug_mode("default")
    return steps


CUDA_SYNC = "cuda_sync"


# --- the workloads ---------------------------------------------------------------------------
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
MTP = {"method": "mtp", "model": "tiny-gemma4-mtp", "num_speculative_tokens": 3}
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.8, "top_p": 0.9}
WORKLOADS = {                  # name -> (model, speculative_config, sampling params)
    "greedy": ("tiny-llama", None, GREEDY),
    "sampled": ("tiny-llama", None, SAMPLED),          # temperature 0.8, top-p 0.9
    "ngram-greedy": ("tiny-llama", NGRAM, GREEDY),     # k = 3
    "ngram-sampled": ("tiny-llama", NGRAM, SAMPLED),
    "mtp-greedy": ("tiny-gemma4", MTP, GREEDY),        # k = 3
    "mtp-sampled": ("tiny-gemma4", MTP, SAMPLED),
}


def workload_prompts(num_reqs: int) -> list[list[int]]:
    """Prompts with repeats in them, so n-gram lookup finds drafts."""
    return [[3 + (7 * i + j % (3 + i % 5)) % 400 for j in range(8 + 3 * (i % 6))]
            for i in range(num_reqs)]


def measure(name: str, num_reqs: int, max_tokens: int, debug_padding: bool,
            graph_backend: str = "emulated", device: str = "cpu") -> list[collections.Counter]:
    from rung.runtime.api.llm import LLM
    from rung.runtime.sampling_params import SamplingParams

    model, spec, sampling = WORKLOADS[name]
    graphs = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16]}
    if device == "cpu":
        graphs["graph_backend"] = graph_backend
    llm = LLM(model, dtype="float32", device=device, max_num_seqs=num_reqs,
              max_model_len=128, speculative_config=spec, debug_padding=debug_padding,
              compilation_config=graphs)
    llm.wait_for_graphs()     # NOTE: the compiled backend builds its graphs in a subprocess
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=None, **sampling)

    def add(engine) -> None:
        for i, prompt in enumerate(workload_prompts(num_reqs)):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)

    return conversions_per_step(llm.engine, add, cuda_syncs=device != "cpu")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-reqs", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--debug-padding", action="store_true")
    p.add_argument("--graph-backend", default="emulated", choices=["emulated", "compiled"],
                   help="CPU graphs (CUDA runs CUDA graphs)")
    p.add_argument("--device", default="cpu",
                   help="cpu, or cuda: also count syncs under set_sync_debug_mode('warn')")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help="comma-separated subset of: " + ", ".join(WORKLOADS))
    p.add_argument("--json", help="write the per-workload results here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    os.environ.setdefault("RUNG_GRAPH_BACKEND", args.graph_backend)
    graphs = "CUDA" if args.device != "cpu" else args.graph_backend
    print(f"{args.num_reqs} requests, {args.max_tokens} tokens each, {graphs} graphs on "
          f"{args.device}, debug_padding={args.debug_padding}")
    print(f"| {'workload':<14} | worst step | mean per step | CUDA syncs worst / mean | "
          "steps | by kind (all steps) |")
    print(f"|{'-' * 16}|------------|---------------|-------------------------|-------|"
          "---------------------|")
    results = {}
    for name in args.workloads.split(","):
        steps = measure(name, args.num_reqs, args.max_tokens, args.debug_padding,
                        args.graph_backend, args.device)
        syncs = [s.pop(CUDA_SYNC, 0) for s in steps]
        totals = [sum(s.values()) for s in steps]
        kinds = sum(steps, collections.Counter())
        sync_cell = (f"{max(syncs)} / {sum(syncs) / len(syncs):.2f}" if args.device != "cpu"
                     else "-")
        print(f"| {name:<14} | {max(totals):>10} | {sum(totals) / len(totals):>13.2f} | "
              f"{sync_cell:>23} | {len(steps):>5} | {dict(kinds)} |", flush=True)
        results[name] = {"conversions_per_step": totals, "cuda_syncs_per_step": syncs,
                         "by_kind": dict(kinds)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
