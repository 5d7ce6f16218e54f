"""Batch-invariant mode (``LLM(batch_invariant=True)``): the same request gives the same
logits, so the same greedy and seeded tokens, alone or inside any batch, with chunked
prefill on or off, eagerly or through graphs (kernels/batch_invariant.py)."""

from __future__ import annotations

import random

import pytest

from rung.runtime import LLM, SamplingParams

MODEL = "tiny-llama"
TARGET = {"prompt_token_ids": [5, 17, 99, 3, 250, 41, 7, 18, 64, 2, 11, 90, 33]}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(temperature=0.9, seed=20, max_tokens=12, ignore_eos=True, logprobs=3)


def _llm(eager: bool, chunked: bool, invariant: bool = True) -> LLM:
    # chunked: a 32-token step budget splits a long prompt over several steps
    return LLM(MODEL, max_num_seqs=32, max_model_len=128, enforce_eager=eager,
               max_num_batched_tokens=32 if chunked else 2048, batch_invariant=invariant,
               compilation_config=None if eager else {"graph_backend": "emulated",
                                                      "cudagraph_capture_sizes": [1, 8, 32]})


def _target_outputs(llm: LLM, num_companions: int, rng: random.Random) -> list:
    """The greedy and the seeded target's (tokens, logprobs), in a batch of companions."""
    companions = [{"prompt_token_ids": [rng.randrange(256) for _ in range(rng.randint(1, 60))]}
                  for _ in range(num_companions)]
    params = [SamplingParams(temperature=rng.choice([0, 0.8]), max_tokens=rng.randint(1, 16),
                             ignore_eos=True) for _ in companions]
    prompts = companions + [TARGET, TARGET]
    params = params + [GREEDY, SEEDED]
    order = list(range(len(prompts)))
    rng.shuffle(order)                   # the targets anywhere in the batch
    outs = llm.generate([prompts[i] for i in order], [params[i] for i in order],
                        use_tqdm=False)
    by_index = {i: out for i, out in zip(order, outs)}
    return [_seen(by_index[len(prompts) - 2]), _seen(by_index[len(prompts) - 1])]


def _seen(out) -> tuple:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items()))
                                     for d in c.logprobs)


@pytest.fixture(scope="module")
def alone() -> list:
    llm = LLM(MODEL, max_num_seqs=32, max_model_len=128, enforce_eager=True,
              batch_invariant=True)
    return [_seen(llm.generate([TARGET], p, use_tqdm=False)[0]) for p in (GREEDY, SEEDED)]


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "whole"])
def test_a_request_gets_the_same_logits_in_any_batch(alone, eager, chunked):
    llm = _llm(eager, chunked)
    rng = random.Random(f"{eager}{chunked}")
    for num_companions in (0, 1, 3, 7, 15, 30):
        greedy, seeded = _target_outputs(llm, num_companions, rng)
        # NOTE: logprobs compared exactly: the same logits, not merely the same argmax
        assert greedy == alone[0], (num_companions, greedy, alone[0])
        assert seeded == alone[1], (num_companions, seeded, alone[1])


def test_without_the_mode_batches_change_the_logits(alone):
    """The mode is what holds the logits: without it, a batch rounds them differently
    (the test above would fail)."""
    llm = _llm(eager=True, chunked=False, invariant=False)
    rng = random.Random(0)
    seen = [_target_outputs(llm, n, rng)[0][1] for n in (7, 30)]
    assert any(s != alone[0][1] for s in seen)


def test_compiled_cpu_graphs_fall_back_to_eager_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="rung.runtime.engine"):
        llm = LLM(MODEL, max_model_len=64, batch_invariant=True,
                  compilation_config={"graph_backend": "compiled"})
    assert "compiled CPU graphs are not batch-invariant; every step runs eagerly" in caplog.text
    assert llm.engine.config.enforce_eager and llm.engine.graph_startup is None
