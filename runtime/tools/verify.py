"""Graph replays held to eager: every captured size at every fill level, pads poisoned.

`rung verify` and the test suite (tests/test_graph_replay.py) both run `verify_engine`, so
the command a user runs on their own model and the suite's equivalence check cannot drift.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from typing import Any, Callable, Iterator

import torch

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.graph_mode import CUDAGraphMode
from rung.runtime.sampling_params import SamplingParams

# NOTE: replays run the same kernels as eager on the same fp32 inputs; only reduction
# order may differ, so logits are held to 1e-5 (looser for half precision).
TOLERANCES = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
MODES = ["full_and_piecewise", "piecewise", "full", "full_decode_only"]
MARKS = {"pass": "✓", "fail": "✗", "none": "·", "n/a": " "}

Steps = list[list[tuple[str, dict]]]   # per step: (request id, prompt) to add before it
_MAX_RAMP_PROMPT = 10                   # ramp prompts hold 2..10 tokens


@dataclasses.dataclass
class Trace:
    """What one drive of an engine produced, step by step."""

    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)  # [num_logits, V]
    drafts: list[dict[str, list[int]]] = dataclasses.field(default_factory=list)  # for next
    tokens: list[dict[str, list[int]]] = dataclasses.field(default_factory=list)  # outputs
    descs: list[BatchExecutionDescriptor] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Cell:
    """Every replay of ``num_reqs`` real requests padded to ``size`` tokens in ``mode``."""

    mode: str                     # runtime mode: FULL or PIECEWISE
    size: int
    num_reqs: int
    status: str = "none"          # "pass" | "fail" | "none" (never replayed) | "n/a"
    detail: str | None = None     # the first mismatch


def ramp(max_num_reqs: int) -> Steps:
    """Request i arrives at step 2i (a mixed step: i running + 1 prefill); every odd step
    runs the i + 1 requests alone (decode, or verify under spec decode). So every
    num_reqs 1..max runs once in a mixed batch and once in a uniform one."""
    prompt = lambda i: {"prompt_token_ids": [3 + (7 * i + j) % 500  # noqa: E731
                                             for j in range(2 + (5 * i) % 9)]}
    # NOTE: 2 + (5 * i) % 9 <= _MAX_RAMP_PROMPT
    return [arrivals for i in range(max_num_reqs)
            for arrivals in ([(f"verify-{i}", prompt(i))], [])]


def ramp_max_model_len(max_num_reqs: int, num_spec_tokens: int, block_size: int) -> int:
    """Positions the ramp's longest request can reach: its prompt, (1 + k) tokens per step
    (every draft accepted) and one more verify step of room, in whole KV blocks.

    NOTE: under FULL graphs attention is shaped by max_model_len, so the model's default
    (e.g. 2048) would make every replay attend over thousands of unused positions."""
    num_tokens = _MAX_RAMP_PROMPT + (2 * max_num_reqs + 1) * (1 + num_spec_tokens)
    return -(-num_tokens // block_size) * block_size


def drive(engine: Any, steps: Steps, trace: Trace | None = None) -> Trace:
    """Run exactly ``len(steps)`` greedy steps through the step API, then abort the rest."""
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    trace = trace if trace is not None else Trace()
    last: list[Any] = [None]             # the latest step's ModelRunnerOutput
    remove_listener = engine.add_step_listener(lambda result: last.__setitem__(0, result))
    try:
        for arrivals in steps:
            for rid, prompt in arrivals:
                engine.add_request(rid, prompt, params)
            outs = engine.step()
            trace.logits.append(last[0].logits.clone())
            trace.descs.append(last[0].desc)
            trace.tokens.append({o.request_id: o.outputs[0].token_ids for o in outs})
            trace.drafts.append({r.request_id: list(r.spec_token_ids)
                                 for r in engine.scheduler.running})
    finally:
        remove_listener()
        for rid in list(engine.requests):
            engine.abort_request(rid)
    return trace


def compare_step(got: Trace, want: Trace, step: int, tol: float) -> str | None:
    """How step ``step`` of two drives of the same steps differs, or None."""
    g, w = got.logits[step], want.logits[step]
    if g.shape != w.shape:
        return f"step {step}: logits {tuple(g.shape)}, eager {tuple(w.shape)}"
    w = w.to(g.device)
    # NOTE: a padded GEMM may pick another kernel (another summation order) than eager's
    # unpadded one, so the absolute tolerance follows the logits' scale.
    atol = tol * max(1.0, float(w.abs().max()) if w.numel() else 0.0)
    if not torch.allclose(g, w, atol=atol, rtol=tol):
        diff = float((g - w).abs().max())
        return f"step {step}: logits differ by {diff:.2e} (tolerance {atol:.1e})"
    if got.tokens[step] != want.tokens[step]:
        return f"step {step}: tokens differ"
    if got.drafts[step] != want.drafts[step]:
        return f"step {step}: drafts differ"
    return None


def guard_kv(engine: Any) -> Callable[[], None]:
    """Fail a step that writes a KV slot outside its real tokens' slots (null block aside).

    A step listener: it holds the KV cache to the copy taken after the previous step (a
    drafter between two steps writes no KV, so it is held to that too). Returns the
    function that removes it.
    """
    runner = engine.runner
    before = [_kv_copy(runner)]

    def check(out: Any) -> None:
        num_tokens = out.desc.num_tokens
        for group in runner.kv_groups:
            slots = torch.from_numpy(
                runner.input_batch.slot_mappings[group.group_id].np[:num_tokens].copy())
            for name in group.layer_names:
                cache = runner.kv_caches[name]
                changed = (cache != before[0][name]).flatten(3).any(-1).any(0).flatten()
                allowed = torch.zeros_like(changed)
                allowed[slots.to(changed.device)] = True
                allowed[:cache.shape[2]] = True        # the null block takes pad writes
                if bool((changed & ~allowed).any()):
                    raise AssertionError(f"{name}: KV written off the real tokens' slots")
        before[0] = _kv_copy(runner)

    return engine.add_step_listener(check)


def _kv_copy(runner: Any) -> dict[str, torch.Tensor]:
    return {name: cache.clone() for name, cache in runner.kv_caches.items()}


@contextlib.contextmanager
def pinned_size(runner: Any, size: int,
                dispatched: list[BatchExecutionDescriptor]) -> Iterator[None]:
    """Pad every graph batch that fits ``size`` to ``size`` (not to the smallest size that
    holds it), so one captured size replays at every fill level. Every descriptor handed
    out goes to ``dispatched`` (the last one names the step that failed, if one does).
    A descriptor hook of the runner: nothing of it is patched."""
    dispatcher = runner.graphs.dispatcher

    def pinned(desc: BatchExecutionDescriptor,
               num_tokens_across_dp: tuple[int, ...] | None) -> BatchExecutionDescriptor:
        desc = _pinned(desc, num_tokens_across_dp)
        dispatched.append(desc)
        return desc

    def _pinned(desc, num_tokens_across_dp):
        if (desc.mode == CUDAGraphMode.NONE or desc.num_tokens > size
                or num_tokens_across_dp is not None):     # data parallel sizes are agreed
            return desc
        rows = (desc.num_reqs if desc.mode == CUDAGraphMode.PIECEWISE
                else dispatcher.full_graph_rows(size, desc.uniform_query_len))
        if rows < desc.num_reqs:
            return desc
        return dataclasses.replace(desc, num_reqs_padded=rows, num_tokens_padded=size)

    remove = runner.add_descriptor_hook(pinned)
    try:
        yield
    finally:
        remove()


def max_reqs_at(engine: Any, size: int) -> int:
    """Most requests one batch of ``size`` tokens holds (each verifies 1 + k tokens)."""
    return min(size // (1 + engine.config.num_spec_tokens), engine.config.max_num_seqs)


def verify_engine(graph_engine: Any, eager_engine: Any,
                  progress: Callable[[int], None] | None = None,
                  want: Trace | None = None) -> list[Cell]:
    """Per ladder size, drive the same ramp of arrivals on both engines, every replay that
    fits pinned to the size, and hold each replayed step's logits, tokens and drafts to
    eager's. One cell per (runtime mode, size, num_reqs); a step that replayed at another
    size counts there. ``want``: eager's drive of the ramp, when the caller has it."""
    runner = graph_engine.runner
    dispatcher = runner.graphs.dispatcher
    sizes = list(dispatcher.sizes)
    tol = TOLERANCES.get(graph_engine.config.dtype, 1e-2)
    steps = ramp(graph_engine.config.max_num_seqs)
    want = want if want is not None else drive(eager_engine, steps)
    decode, mixed = dispatcher.mode.decode_mode(), dispatcher.mode.mixed_mode()
    num_cols = max_reqs_at(graph_engine, max(sizes, default=0))
    cells = {}
    for mode in dict.fromkeys(m for m in (decode, mixed) if m != CUDAGraphMode.NONE):
        only_mixed = mode != decode       # these graphs never run a uniform batch
        for s in sizes:
            for n in range(1, num_cols + 1):
                fits = _fits(graph_engine, s, n, only_mixed)
                cells[(mode.name, s, n)] = Cell(mode.name, s, n, "none" if fits else "n/a")
    for size in sizes:
        got, dispatched = Trace(), []
        # NOTE: past the ramp step where more requests run than ``size`` holds, nothing
        # can replay at this size: stop there (eager's prefix is the same steps).
        num_steps = 2 * max_reqs_at(graph_engine, size)
        with pinned_size(runner, size, dispatched):
            try:
                drive(graph_engine, steps[:num_steps], got)
            except (AssertionError, RuntimeError) as e:
                desc = dispatched[-1] if dispatched else None
                key = ((desc.mode.name, desc.num_tokens_padded, desc.num_reqs)
                       if desc is not None and desc.mode != CUDAGraphMode.NONE
                       else (next(iter(cells))[0], size, 1))
                _fail(cells, key, f"step {len(got.descs)}: {type(e).__name__}: {e}")
        for step, desc in enumerate(got.descs):
            cell = cells.get((desc.mode.name, desc.num_tokens_padded, desc.num_reqs))
            if cell is None:            # eager, or a batch no cell holds
                continue
            detail = compare_step(got, want, step, tol)
            if detail:
                _fail(cells, (cell.mode, cell.size, cell.num_reqs), detail)
            elif cell.status != "fail":
                cell.status = "pass"
        if progress is not None:
            progress(size)
    return list(cells.values())


def _fits(engine: Any, size: int, num_reqs: int, only_mixed: bool) -> bool:
    """Whether a batch of ``num_reqs`` requests can run padded to ``size`` tokens: all
    decoding (1 + k tokens each), or, for graphs of mixed batches only, one of them
    prefilling 2 tokens instead."""
    if only_mixed:
        return (num_reqs - 1) * (1 + engine.config.num_spec_tokens) + 2 <= size
    return num_reqs <= max_reqs_at(engine, size)


def _fail(cells: dict[tuple[str, int, int], Cell], key: tuple[str, int, int],
          detail: str) -> None:
    cell = cells.setdefault(key, Cell(*key))
    if cell.status != "fail":
        cell.status, cell.detail = "fail", detail


# --- the `rung verify` command ----------------------------------------------------------
@dataclasses.dataclass
class ModeReport:
    config_mode: str          # the configured cudagraph mode, e.g. full_and_piecewise
    sizes: list[int]
    cells: list[Cell]


def matrix(report: ModeReport, mode: str) -> str:
    """Rows: ladder sizes; columns: num_reqs; one mark per cell (see MARKS)."""
    by_key = {(c.size, c.num_reqs): c for c in report.cells if c.mode == mode}
    num_cols = max((n for _, n in by_key), default=0)
    width = max(len(str(num_cols)), 1)
    head = f"{'size':>6} | " + " ".join(f"{n:>{width}}" for n in range(1, num_cols + 1))
    rows = [f"{report.config_mode}, {mode} replays (columns: num_reqs):", head,
            "-" * len(head)]
    for size in report.sizes:
        marks = [MARKS[by_key[(size, n)].status] if (size, n) in by_key else " "
                 for n in range(1, num_cols + 1)]
        rows.append(f"{size:>6} | " + " ".join(f"{m:>{width}}" for m in marks))
    return "\n".join(rows)


def run_verify(args: argparse.Namespace, build_llm: Callable,
               num_spec_tokens: int = 0) -> int:
    """One eager engine and one graph engine per configured mode; print the matrices.
    ``num_spec_tokens``: the k the engine flags ask for (sizes the ramp's max_model_len)."""
    from tqdm import tqdm

    start = time.perf_counter()
    if args.dtype == "auto":
        args.dtype = "float32"             # the 1e-5 tolerance is an fp32 one
    args.debug_padding = True              # poisoned pads: a read of padding shows up
    if args.max_model_len is None:         # what the ramp reaches, not the model's maximum
        args.max_model_len = _ramp_model_len(args, num_spec_tokens)
    modes = MODES if args.mode == "all" else [args.mode or MODES[0]]
    eager = build_llm(_with(args, enforce_eager=True, mode=None)).engine
    want = drive(eager, ramp(eager.config.max_num_seqs))     # every mode is held to it
    reports = []
    for mode in modes:
        engine = build_llm(_with(args, enforce_eager=False, mode=mode)).engine
        if args.guard_kv:
            guard_kv(engine)
        sizes = list(engine.runner.graphs.dispatcher.sizes)
        with tqdm(total=len(sizes), desc=f"verify {mode}", unit="size",
                  file=sys.stderr) as bar:
            cells = verify_engine(engine, eager, lambda size, bar=bar: bar.update(1), want)
        reports.append(ModeReport(mode, sizes, cells))
    _print_reports(reports)
    cells = [c for r in reports for c in r.cells]
    failed = [c for c in cells if c.status == "fail"]
    checked = sum(c.status in ("pass", "fail") for c in cells)
    unreplayed = sum(c.status == "none" for c in cells)
    seconds = time.perf_counter() - start
    spec = f", speculative k={eager.config.num_spec_tokens}" if eager.config.speculative else ""
    verdict = (f"FAIL: {len(failed)} of {checked} cells differ from eager" if failed else
               f"PASS: all {checked} cells match eager")
    print(f"{verdict}; {unreplayed} never replayed (model {args.model}{spec}, "
          f"max_model_len {eager.max_model_len}, modes {', '.join(modes)}, {seconds:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "verdict": "fail" if failed else "pass",
                       "num_spec_tokens": eager.config.num_spec_tokens,
                       "max_model_len": eager.max_model_len, "seconds": seconds,
                       "modes": [{"mode": r.config_mode, "sizes": r.sizes,
                                  "cells": [dataclasses.asdict(c) for c in r.cells]}
                                 for r in reports]}, f, indent=2)
    return 1 if failed else 0


def _ramp_model_len(args: argparse.Namespace, num_spec_tokens: int) -> int | None:
    """The ramp's max_model_len for the CLI's engine flags (None: the model's own maximum
    is shorter anyway)."""
    from rung.models.loader import peek_model

    need = ramp_max_model_len(args.max_num_seqs, num_spec_tokens, args.block_size)
    model_max = int(peek_model(args.model)[0].get("max_position_embeddings", 2048))
    return need if need < model_max else None


def _print_reports(reports: list[ModeReport]) -> None:
    for report in reports:
        for mode in dict.fromkeys(c.mode for c in report.cells):
            print(matrix(report, mode))
        for c in report.cells:
            if c.status == "fail":
                print(f"  ✗ {c.mode} size {c.size}, {c.num_reqs} requests: {c.detail}")
    print("legend: ✓ replays match eager   ✗ mismatch   · possible, but no batch of the "
          "ramp replayed there")


def _with(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})
