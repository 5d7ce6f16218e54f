"""Host overhead of one decode step, without the model forward (pytest-benchmark).

    python -m pytest bench/bench_host_overhead.py --benchmark-only -o addopts='' \
        -p no:cacheprovider

Built from the real engine pieces on bench-llama (8 layers) in decode steady state: every
request is past its prompt and decodes one token per step, dispatched on the default
ladder under FULL_DECODE_ONLY (padded FULL descriptors, as a graph replay would see them).

- ``test_host_prepare``: Scheduler.schedule (with block ids) + dispatch +
  InputBatch.prepare (rows, pads, metadata views) + every layer's attention metadata: the
  work between two forwards.
- ``test_host_engine_step``: a whole ``LLMEngine.step()`` with the model replaced by
  preallocated zeros (no forward, no lm_head): adds sampling and output bookkeeping.
"""

from __future__ import annotations

import pytest
import torch

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.graph_mode import CUDAGraphMode
from rung.graphs.capture import ForwardOutput
from rung.graphs.dispatcher import Dispatcher
from rung.graphs.ladder import capture_sizes
from rung.runtime.api.llm import LLM
from rung.runtime.engine import LLMEngine
from rung.runtime.sampling_params import SamplingParams

MODEL = "bench-llama"
NUM_REQS = [1, 4, 16, 64, 256]
PROMPT_LEN = 16
ROUNDS, WARMUP_ROUNDS = 200, 20          # engine-step rounds: each adds one token
MAX_MODEL_LEN = 256                      # >= PROMPT_LEN + WARMUP_ROUNDS + ROUNDS + 1
BLOCK_SIZE = 16


class _NoForward:
    """Stands in for the model: preallocated zeros, so a step costs host work only."""

    def __init__(self, max_num_tokens: int, hidden_size: int, vocab_size: int) -> None:
        self.hidden = torch.zeros(max_num_tokens, hidden_size)   # [max_num_tokens, hidden]
        self.logits = torch.zeros(max_num_tokens, vocab_size)    # [max_num_tokens, vocab]

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.hidden[:input_ids.shape[0]]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits[:hidden.shape[0]]


class _DispatchOnly:
    """The graph manager with no captured graph: the runner dispatches through its
    dispatcher, and `run` calls the model."""

    def __init__(self, dispatcher: Dispatcher, model: _NoForward) -> None:
        self.dispatcher = dispatcher
        self.model = model

    def run(self, desc: BatchExecutionDescriptor, ids: torch.Tensor, positions: torch.Tensor,
            ctx: object, rows: torch.Tensor) -> ForwardOutput:
        return ForwardOutput(self.model(ids, positions), None)


def decode_engine(num_reqs: int) -> LLMEngine:
    """An engine with ``num_reqs`` requests past their prompts, decoding one token a step."""
    max_num_seqs = max(NUM_REQS)
    num_blocks = num_reqs * (MAX_MODEL_LEN // BLOCK_SIZE)
    engine = LLM(MODEL, device="cpu", max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN,
                 max_num_batched_tokens=max(2048, max_num_seqs * PROMPT_LEN),
                 block_size=BLOCK_SIZE, enforce_eager=True,
                 num_gpu_blocks_override=num_blocks).engine
    runner = engine.runner
    stub = _NoForward(runner.input_batch.max_num_tokens, engine.loaded.config["hidden_size"],
                      runner.vocab_size)
    runner.model = stub
    sizes = capture_sizes(None, max_num_seqs, 0, engine.config.max_num_batched_tokens)
    dispatcher = Dispatcher(CUDAGraphMode.FULL_DECODE_ONLY, sizes, max_num_seqs)
    for key in dispatcher.capture_descriptors():
        dispatcher.go_live(key)
    runner.use_graphs(_DispatchOnly(dispatcher, stub))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_MODEL_LEN, ignore_eos=True)
    for i in range(num_reqs):
        engine.add_request(f"r{i}", {"prompt_token_ids": [3 + i % 100] * PROMPT_LEN}, params)
    descs = []
    remove_listener = engine.add_step_listener(lambda result: descs.append(result.desc))
    engine.step()                                    # prefill: every prompt in one step
    engine.step()                                    # first decode step
    remove_listener()
    assert descs[-1].uniform_query_len == 1, "not in decode steady state"
    return engine


def host_prepare(engine: LLMEngine) -> BatchExecutionDescriptor:
    """Everything between two forwards but sampling; leaves the requests where they are."""
    sched = engine.scheduler.schedule()
    runner = engine.runner
    desc = runner.dispatcher.dispatch(sched.num_reqs, sched.num_tokens,
                                      sched.uniform_query_len)
    inputs = runner.input_batch.prepare(sched, sched.block_ids, desc, runner.max_model_len)
    runner.forward_args(desc, inputs)
    return desc


@pytest.fixture(scope="module", params=NUM_REQS, ids=lambda n: f"reqs{n}")
def engine(request) -> LLMEngine:
    torch.set_num_threads(1)
    return decode_engine(request.param)


def test_host_prepare(benchmark, engine):
    num_reqs = len(engine.scheduler.running)
    desc = benchmark(host_prepare, engine)
    assert desc.num_reqs == num_reqs and desc.uniform_query_len == 1
    assert desc.mode == CUDAGraphMode.FULL


def test_host_engine_step(benchmark, engine):
    num_reqs = len(engine.scheduler.running)
    descs = []
    remove_listener = engine.add_step_listener(lambda result: descs.append(result.desc))
    outputs = benchmark.pedantic(engine.step, rounds=ROUNDS, warmup_rounds=WARMUP_ROUNDS)
    remove_listener()
    assert len(outputs) == num_reqs
    assert descs[-1].uniform_query_len == 1
