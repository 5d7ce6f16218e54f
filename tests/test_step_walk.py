"""The decode step walks forward (docs/ARCHITECTURE.md, "One engine step, as data"): one
greedy decode step of several requests through a compiled FULL graph enters each of the
library's files once, so a reader follows it top to bottom (``python -m
rung.bench.trace_step`` prints the same listing)."""

import pytest

from rung.bench.trace_step import decode_step_trace


@pytest.mark.slow
def test_a_decode_step_of_four_requests_enters_each_file_once():
    trace = decode_step_trace("tiny-llama", num_reqs=4)
    again = sorted({f for f in trace.files if trace.file_visits.count(f) > 1})
    assert not again, [entry for entry in trace.entries if entry[0] in again]
    # the step's own parts are all on the walk: commit and outputs once for all requests
    for part in ("runtime/sched/request.py:commit_step",
                 "runtime/engine/output_processor.py:make_outputs",
                 "runtime/worker/step_output.py:HostCopy.fetch",
                 "runtime/worker/input_batch.py:InputBatch.prepare"):
        assert part in trace.functions
