"""Which of rung's functions one greedy decode step calls, traced with ``sys.setprofile``.

    python -m rung.bench.trace_step [--model tiny-llama] [--num-reqs 4]

Builds an engine with compiled FULL graphs (on CPU an inductor-compiled artifact), runs
the requests past their prompts and a few decode steps, then traces one more
``LLMEngine.step()``: a uniform decode batch that replays a FULL graph, in production mode
(``debug_padding`` off: debug mode adds checks). Prints every rung
function the step calls (properties count: they are calls; comprehensions and generator
expressions do not), in the order first called; then every file entry in order (a call
from another file: the file, the function entered, the file it came from); then the
files, how often each was entered and how often the walk came back to a file it had left.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from rung.core.graph_mode import CUDAGraphMode
from rung.runtime import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("core", "kernels", "models", "graphs", "runtime")
_NOT_FUNCTIONS = ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>")


@dataclasses.dataclass
class StepTrace:
    functions: list[str]         # "file:qualname", in the order first called
    files: list[str]             # in the order first entered
    file_visits: list[str]       # the file of every call that entered another file
    # (file entered, function entered, file it was called from) of every such call
    entries: list[tuple[str, str, str | None]] = dataclasses.field(default_factory=list)


def _library_file(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.parts and rel.parts[0] in LIBRARY else None


def trace_calls(fn) -> StepTrace:
    """Call ``fn()`` under a profiler that records rung's own Python calls."""
    functions: dict[str, None] = {}
    files: dict[str, None] = {}
    visits: list[str] = []
    entries: list[tuple[str, str, str | None]] = []
    stack: list[str | None] = []

    def profile(frame, event, arg) -> None:
        if event == "call":
            code = frame.f_code
            rel = _library_file(code.co_filename)
            stack.append(rel)
            if rel is None or code.co_name in _NOT_FUNCTIONS:
                return
            functions.setdefault(f"{rel}:{code.co_qualname}", None)
            files.setdefault(rel, None)
            caller = next((f for f in reversed(stack[:-1]) if f is not None), None)
            if caller != rel:
                visits.append(rel)
                entries.append((rel, code.co_qualname, caller))
        elif event == "return" and stack:
            stack.pop()

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return StepTrace(list(functions), list(files), visits, entries)


def decode_step_trace(model: str, num_reqs: int) -> StepTrace:
    # NOTE: production mode (debug_padding off, the default): debug mode adds checks
    llm = LLM(model, max_num_seqs=num_reqs, max_model_len=128, debug_padding=False,
              compilation_config={"cudagraph_mode": "full_and_piecewise",
                                  "cudagraph_capture_sizes": [1, 2, 4, 8],
                                  "graph_backend": "compiled"})
    llm.wait_for_graphs()               # every graph live before the traced step
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    for i in range(num_reqs):
        engine.add_request(f"trace-{i}", {"prompt_token_ids": [3 + i, 5, 7, 11]}, params)
    descs = []
    remove = engine.add_step_listener(lambda result: descs.append(result.desc))
    for _ in range(4):                  # the prefill, then decode steps that warm the graph
        engine.step()
    trace = trace_calls(engine.step)
    remove()
    desc = descs[-1]
    if desc.mode != CUDAGraphMode.FULL or desc.uniform_query_len != 1:
        raise RuntimeError(f"the traced step ran {desc}, not a FULL decode replay")
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return trace


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--num-reqs", type=int, default=4)
    args = parser.parse_args(argv)
    trace = decode_step_trace(args.model, args.num_reqs)
    for i, name in enumerate(trace.functions, start=1):
        print(f"{i:>3} {name}")
    print("file entries, in order:")
    for i, (rel, function, caller) in enumerate(trace.entries, start=1):
        print(f"{i:>3} {rel}:{function}  <- {caller or 'the caller'}")
    returns = len(trace.file_visits) - len(trace.files)
    print(f"{len(trace.functions)} functions in {len(trace.files)} files; "
          f"{len(trace.file_visits)} file entries ({returns} back to a file already left); "
          "debug_padding off")
    for f in trace.files:
        print(f"  {f}: entered {trace.file_visits.count(f)}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
