"""`rung bench latency`: decode step latency per graph mode and request count, against HF
transformers `generate` and the bare-matmul floor, on the same weights in one process.

Per (mode, num_reqs) cell, each measured round adds ``num_reqs`` prompts of ``input_len``
random tokens and decodes ``output_len`` tokens greedily (EOS ignored). Only steps in
which every request decodes one token are decode samples; the steps before the last
request's first token make up the time to first token.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from typing import Any, Callable

import torch
from tqdm import tqdm

from rung.bench.floor import MatmulFloor
from rung.bench.latency_plan import (
    LatencyPlan,
    engine_namespace,
    make_plan,
    require,
)
from rung.bench.report import environment, format_table, loadavg, plot_latency
from rung.bench.stats import percentiles_ms
from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.graph_mode import CUDAGraphMode
from rung.models.gguf import is_gguf
from rung.models.loader import resolve_model_path
from rung.runtime.api.llm import LLM
from rung.runtime.engine import LLMEngine
from rung.runtime.sampling_params import SamplingParams


# --- one rung cell ---------------------------------------------------------------------------
@dataclasses.dataclass
class RungRound:
    ttft_s: float
    step_s: list[float]              # decode steps only: every request decodes one token
    padding_waste: list[float]       # per decode step: padded tokens / real tokens - 1
    graph: str | None                # "MODE:num_tokens_padded" of the last decode step
    token_ids: list[list[int]]       # [num_reqs][output_len]


def _add_round(engine: LLMEngine, prompts: list[list[int]], output_len: int,
               tag: str) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    return ids


def rung_round(engine: LLMEngine, prompts: list[list[int]], output_len: int,
               tag: str) -> RungRound:
    """Run one batch to completion, timing every `engine.step()`."""
    ids = _add_round(engine, prompts, output_len, tag)
    num_reqs, started, done = len(ids), set(), {}
    rnd = RungRound(0.0, [], [], None, [])
    descs: list[BatchExecutionDescriptor] = []           # one per executed step
    remove_listener = engine.add_step_listener(lambda result: descs.append(result.desc))
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        all_started = len(started) == num_reqs
        t0 = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - t0
        desc = descs[-1]
        decode_len = 1 + engine.config.num_spec_tokens      # 1 + k under spec decode
        if all_started and desc.num_reqs == num_reqs and desc.uniform_query_len == decode_len:
            rnd.step_s.append(elapsed)
            rnd.padding_waste.append(desc.num_tokens_padded / desc.num_tokens - 1)
            rnd.graph = None if desc.mode == CUDAGraphMode.NONE else (
                f"{desc.mode.name}:{desc.num_tokens_padded}")
        for out in outputs:
            started.add(out.request_id)
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not all_started and len(started) == num_reqs:
            rnd.ttft_s = time.perf_counter() - start
    remove_listener()
    rnd.token_ids = [done[rid] for rid in ids]
    return rnd


def _capture_cost(engine: LLMEngine, graph: str | None) -> tuple[float | None, int | None]:
    """(seconds, bytes) of capturing the graph a cell's decode steps replayed."""
    graphs = engine.runner.graphs
    if graph is None or graphs is None:
        return None, None
    mode, size = graph.split(":")
    hits = [r for r in graphs.records if r.mode == mode and r.num_tokens_padded == int(size)]
    if not hits:
        return None, None
    return sum(r.seconds for r in hits), sum(r.nbytes for r in hits)


def rung_record(engine: LLMEngine, plan: LatencyPlan, label: str, num_reqs: int,
                rounds: list[RungRound]) -> dict[str, Any]:
    """One cell's record from its measured rounds."""
    steps = [s for r in rounds for s in r.step_s]
    if not steps:
        raise RuntimeError(f"mode {label}, {num_reqs} requests: no step decoded every request "
                           "at once; raise --max-num-batched-tokens or lower --batch-sizes")
    wastes = [w for r in rounds for w in r.padding_waste]
    capture_s, capture_bytes = _capture_cost(engine, rounds[-1].graph)
    return {"mode": label, "num_reqs": num_reqs, "input_len": plan.input_len,
            "output_len": plan.output_len, "num_decode_steps": len(steps),
            **percentiles_ms(steps, "step"),
            "tokens_per_s": num_reqs * len(steps) / sum(steps),
            "ttft_ms": 1e3 * sorted(r.ttft_s for r in rounds)[len(rounds) // 2],
            "padding_waste": sum(wastes) / len(wastes), "graph": rounds[-1].graph,
            "capture_ms": None if capture_s is None else capture_s * 1e3,
            "capture_bytes": capture_bytes}


def floor_stats(floor: MatmulFloor, seconds: list[float]) -> dict[str, Any]:
    stats = percentiles_ms(seconds, "floor_step")
    return {"floor_matmuls": floor.num_matmuls,
            **{k: v for k, v in stats.items() if not k.endswith("_mean")}}


def _warmup_prompts(prompts: list[list[int]]) -> list[list[int]]:
    """Short prompts: a warm-up round exercises the decode batch, not a long prefill."""
    return [p[:8] for p in prompts]


def mode_summary(engine: LLMEngine, label: str, max_num_reqs: int) -> dict[str, Any]:
    graphs = engine.runner.graphs
    summary: dict[str, Any] = {"mode": label, "cudagraph_mode": "none", "num_graphs": 0,
                               "capture_s": 0.0, "capture_bytes": 0, "capture_sizes": [],
                               "ladder_padding_waste": 0.0}
    if engine.spec_stats is not None:
        summary["spec"] = engine.spec_stats.as_dict()
    if graphs is None:
        return summary
    summary.update(cudagraph_mode=graphs.mode.value, num_graphs=len(graphs.records),
                   capture_s=sum(r.seconds for r in graphs.records),
                   capture_bytes=graphs.pool_bytes,
                   capture_sizes=list(graphs.dispatcher.sizes),
                   ladder_padding_waste=ladder_padding_waste(
                       graphs.dispatcher.padded_size, max_num_reqs,
                       graphs.dispatcher.decode_query_len))
    return summary


def ladder_padding_waste(padded_size: Any, max_num_reqs: int, decode_len: int = 1) -> float:
    """Mean of padded / real - 1 over every decode batch of 1..max_num_reqs requests, each
    running ``decode_len`` tokens (1 + k under spec decode)."""
    wastes = [(padded_size(n * decode_len) or n * decode_len) / (n * decode_len) - 1
              for n in range(1, max_num_reqs + 1)]
    return sum(wastes) / len(wastes)


# --- baselines ---------------------------------------------------------------------------
def hf_stats(rounds: list[Any], num_reqs: int, rung_tokens: list[list[list[int]]],
             prefix: str = "hf") -> dict[str, Any]:
    """A baseline's stats under ``prefix`` ("hf" or "llamacpp")."""
    steps = [s for r in rounds for s in r.step_s]
    stats = percentiles_ms(steps, f"{prefix}_step")
    return {**{k: v for k, v in stats.items() if not k.endswith("_mean")},
            f"{prefix}_tokens_per_s": num_reqs * len(steps) / sum(steps),
            f"{prefix}_ttft_ms": 1e3 * sorted(r.ttft_s for r in rounds)[len(rounds) // 2],
            f"{prefix}_token_match": _token_match(rounds[-1].token_ids, rung_tokens)}


def _token_match(hf_tokens: list[list[int]], rung_tokens: list[list[list[int]]]) -> float:
    """Fraction of greedy tokens where every mode of rung agrees with HF."""
    total = agree = 0
    for mode_tokens in rung_tokens:
        for want, got in zip(hf_tokens, mode_tokens):
            total += len(want)
            agree += sum(a == b for a, b in zip(want, got))
    return agree / total if total else 1.0


def _prefill_stats(rung_s: list[float], baseline_s: list[float],
                   prefix: str) -> dict[str, Any]:
    """Median time to the first token of the prefill prompt, rung and the baseline."""
    def median_ms(values: list[float]) -> float:
        return 1e3 * sorted(values)[len(values) // 2]

    stats = {"prefill_ms": median_ms(rung_s)}
    if baseline_s:
        stats[f"{prefix}_prefill_ms"] = median_ms(baseline_s)
        stats[f"prefill_rung_over_{prefix}"] = stats["prefill_ms"] / median_ms(baseline_s)
    return stats


def _add_ratios(record: dict[str, Any]) -> None:
    hf, floor = record.get("hf_step_ms_p50"), record.get("floor_step_ms_p50")
    record["rung_over_hf"] = record["step_ms_p50"] / hf if hf else None
    lcpp = record.get("llamacpp_step_ms_p50")
    record["rung_over_llamacpp"] = record["step_ms_p50"] / lcpp if lcpp else None
    record["rung_over_floor"] = record["step_ms_p50"] / floor if floor else None


# --- the run ---------------------------------------------------------------------------------
class _Run:
    """One harness run: an engine per mode, then per request count one interleaved cell.

    NOTE: every measured round of a request count runs each mode, then HF, then the floor
    (A B C A B C ...), so each ratio compares timings taken under the same machine load.
    """

    def __init__(self, args: argparse.Namespace, plan: LatencyPlan,
                 build_llm: Callable[..., LLM]) -> None:
        self.args, self.plan, self.build_llm = args, plan, build_llm
        self.records: list[dict[str, Any]] = []
        self.modes: list[dict[str, Any]] = []
        self.engines: dict[str, LLMEngine] = {}
        self.hf: torch.nn.Module | None = None
        self.llamacpp: Any = None          # llamacpp_baseline.LlamaCppModel
        num_cells = len(plan.num_reqs_list) * (len(plan.modes) + (plan.baseline != "none"))
        self.bar = tqdm(total=num_cells, desc="bench latency", unit="cell", file=sys.stderr)

    @property
    def order(self) -> list[str]:
        """What one measured round runs, in order."""
        baseline = [] if self.plan.baseline == "none" else [self.plan.baseline]
        return self.plan.modes + baseline + ["floor"]

    def build(self) -> None:
        if self.plan.baseline == "llama.cpp":
            self._build_llamacpp()
        for label in self.plan.modes:
            self.bar.set_postfix_str(f"{label}: building engine")
            ns = engine_namespace(self.args, self.plan, label)
            progress = lambda r, label=label: self.bar.set_postfix_str(  # noqa: E731
                f"{label}: captured {r.mode}:{r.num_tokens_padded}")
            self.engines[label] = self.build_llm(ns, capture_progress=progress).engine
            self.modes.append(mode_summary(self.engines[label], label, self.plan.max_num_reqs))
        if self.plan.baseline == "hf":
            from rung.bench.hf_baseline import hf_model_from_gguf, hf_model_from_rung

            loaded = next(iter(self.engines.values())).loaded
            path = resolve_model_path(self.args.model)
            if is_gguf(path) and self.args.load_format != "dummy":
                self.bar.set_postfix_str("hf: loading the GGUF file")
                self.hf = hf_model_from_gguf(path, loaded.model)
            else:
                self.bar.set_postfix_str("hf: converting weights")
                self.hf = hf_model_from_rung(loaded.model, loaded.config)

    def _build_llamacpp(self) -> None:
        from rung.bench.llamacpp_baseline import LlamaCppModel, require_llama_cpp

        require_llama_cpp()
        path = resolve_model_path(self.args.model)
        require(is_gguf(path) and self.args.load_format != "dummy",
                 f"--baseline llama.cpp runs a GGUF file's own weights; {self.args.model!r} "
                 "is not a GGUF file (or --load-format dummy replaces its weights)")
        self.bar.set_postfix_str("llama.cpp: loading the GGUF file")
        ns = engine_namespace(self.args, self.plan, self.plan.modes[0])
        self.llamacpp = LlamaCppModel(path, self.plan.max_num_reqs, ns.max_model_len,
                                      torch.get_num_threads())

    def _baseline_round(self, prompts: list[list[int]], output_len: int) -> Any:
        from rung.bench.hf_baseline import hf_generate_round

        if self.hf is not None:
            return hf_generate_round(self.hf, prompts, output_len)
        if self.llamacpp is not None:
            return self.llamacpp.generate_round(prompts, output_len)
        return None

    def run_cell(self, num_reqs: int) -> None:

        plan = self.plan
        first = next(iter(self.engines.values()))
        prompts = plan.prompts(num_reqs, first.runner.vocab_size)
        floor = MatmulFloor(first.runner.model, num_reqs)
        self.bar.set_postfix_str(f"{num_reqs} requests: warm-up")
        for i in range(plan.warmup_iters):
            for label, engine in self.engines.items():
                rung_round(engine, _warmup_prompts(prompts), min(plan.output_len, 4),
                           f"{label}-{num_reqs}-w{i}")
            self._baseline_round(_warmup_prompts(prompts), min(plan.output_len, 4))
        rounds: dict[str, list[RungRound]] = {label: [] for label in self.engines}
        prefill_s: dict[str, list[float]] = {label: [] for label in self.engines}
        hf_rounds, floor_s, baseline_prefill_s = [], [], []
        long_prompt = plan.prefill_prompt(first.runner.vocab_size) if plan.prefill_len else None
        for i in range(plan.iters):
            self.bar.set_postfix_str(f"{num_reqs} requests: round {i + 1}/{plan.iters}")
            for label, engine in self.engines.items():
                rounds[label].append(rung_round(engine, prompts, plan.output_len,
                                                f"{label}-{num_reqs}-{i}"))
            baseline_round = self._baseline_round(prompts, plan.output_len)
            if baseline_round is not None:
                hf_rounds.append(baseline_round)
            floor_s += floor.time_steps(plan.output_len - 1)
            if long_prompt is not None and num_reqs == plan.num_reqs_list[0]:
                # NOTE: interleaved like the decode rounds: every mode, then the baseline
                for label, engine in self.engines.items():
                    prefill_s[label].append(rung_round(
                        engine, [long_prompt], 1, f"{label}-prefill-{i}").ttft_s)
                baseline_prefill = self._baseline_round([long_prompt], 1)
                if baseline_prefill is not None:
                    baseline_prefill_s.append(baseline_prefill.ttft_s)
        shared = floor_stats(floor, floor_s)
        if hf_rounds:
            tokens = [r[-1].token_ids for r in rounds.values()]
            prefix = "hf" if self.hf is not None else "llamacpp"
            shared.update(hf_stats(hf_rounds, num_reqs, tokens, prefix))
            self.bar.update(1)
        for label, engine in self.engines.items():
            record = rung_record(engine, plan, label, num_reqs, rounds[label])
            record.update(shared, interleaved_with=self.order)
            if prefill_s[label]:
                record.update(_prefill_stats(prefill_s[label], baseline_prefill_s,
                                             "hf" if self.hf is not None else "llamacpp"))
            _add_ratios(record)
            self.records.append(record)
            self.bar.update(1)


def run_latency(args: argparse.Namespace, build_llm: Callable[..., LLM]) -> int:
    """``build_llm(args)``: the CLI's engine builder (bench sits below the CLI)."""
    plan = make_plan(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    env = environment(args)
    run = _Run(args, plan, build_llm)
    try:
        run.build()
        for num_reqs in plan.num_reqs_list:
            run.run_cell(num_reqs)
            gc.collect()
    except (ValueError, RuntimeError, ImportError) as e:
        if not run.records:
            raise
        # NOTE: the cells already measured are reported, not thrown away
        print(f"error: {e}; reporting the {len(run.records)} cells measured so far",
              file=sys.stderr)
    finally:
        run.bar.close()
    modes = {label: i for i, label in enumerate(plan.modes)}
    run.records.sort(key=lambda r: (modes[r["mode"]], r["num_reqs"]))
    env["interleaving"] = {"unit": "round", "order": run.order, "rounds_per_cell": plan.iters,
                           "note": "each measured round runs every entry of order once, in "
                                   "order; the floor times as many steps as a round decodes"}
    _report(args, plan, env, run)
    return 0


def _report(args: argparse.Namespace, plan: LatencyPlan, env: dict[str, Any],
            run: _Run) -> None:
    env["loadavg_end"] = loadavg()
    print(f"model {args.model}: input {plan.input_len}, output {plan.output_len}, "
          f"{plan.iters} rounds per cell, {env['device']}, {env['num_threads']} threads")
    print(format_table(run.records, run.modes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "plan": dataclasses.asdict(plan), "modes": run.modes,
                       "records": run.records}, f, indent=2)
    if args.plot:
        plot_latency(run.records, args.plot, f"{args.model}: decode step latency")
