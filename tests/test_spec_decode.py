"""Speculative decoding: lossless verification, n-gram drafts, the stochastic accept rule."""

import logging

import pytest

from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.graph_mode import CUDAGraphMode
from rung.runtime import LLM, SamplingParams
from rung.runtime.sched.request import Request
from rung.runtime.spec.ngram import NgramProposer

PROMPTS = ["abcabcabcabcabc", "hello hello hello hello", "xyz", "one two one two one"]
MODES = {"none": {"enforce_eager": True},
         "piecewise": {"compilation_config": {"cudagraph_mode": "piecewise",
                                              "cudagraph_capture_sizes": [4, 8, 16]}},
         "full_and_piecewise": {"compilation_config": {"cudagraph_capture_sizes": [4, 8, 16]}}}
ENGINE = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 64,
          "dtype": "float32"}


@pytest.fixture(scope="module")
def greedy_reference():
    params = [SamplingParams(temperature=0, max_tokens=10 + 4 * i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    llm = LLM("tiny-llama", enforce_eager=True, **ENGINE)
    return params, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("mode", list(MODES))
def test_ngram_speculation_is_lossless(mode, greedy_reference):
    params, want = greedy_reference
    llm = LLM("tiny-llama", speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              **ENGINE, **MODES[mode])
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert got == want
    spec = llm.engine.stats()["spec"]
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] == 3 * spec["num_drafts"]
    assert 0 < spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert len(spec["acceptance_per_position"]) == 3
    if mode == "full_and_piecewise":
        replays = llm.engine.stats()["graph_replays"]
        assert any(k.startswith("FULL:") for k in replays), replays
    stats = llm.engine.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_ngram_proposer_finds_the_latest_longest_match():
    proposer = NgramProposer(3, 1, 3)
    assert proposer.propose_one([5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]) == [9, 2, 6]
    assert proposer.propose_one([1, 2, 3, 4]) == [4, 4, 4]          # no match: filler
    assert proposer.propose_one([4, 1, 2, 4]) == [1, 2, 4]


def _request(temperature: float) -> Request:
    return Request("r", None, [1, 2], SamplingParams(temperature=temperature, max_tokens=50),
                   None, 0)


def test_drafting_descriptor_ignores_graph_and_data_parallel_padding():
    desc = BatchExecutionDescriptor(CUDAGraphMode.FULL, 3, 4, 12, 16, 4,
                                    num_tokens_across_dp=(16, 16))
    drafting = desc.for_drafting()
    assert (drafting.num_reqs, drafting.num_reqs_padded) == (3, 3)
    assert (drafting.num_tokens, drafting.num_tokens_padded) == (3, 3)
    assert drafting.num_tokens_across_dp is None


def test_a_draft_step_refuses_a_padded_descriptor():
    """Failure class 3: the target step's own descriptor (4 query tokens a request, one
    padded row) is not a draft step's; the proposer raises instead of drafting pad rows."""
    reqs = [_request(0.0) for _ in range(3)]
    target = BatchExecutionDescriptor(CUDAGraphMode.FULL, 3, 4, 12, 16, 4)
    with pytest.raises(RuntimeError, match="one query per real request"):
        NgramProposer(3, 1, 3).propose(target, reqs)
    assert NgramProposer(3, 1, 3).propose(target.for_drafting(), reqs) == [[2, 2, 2]] * 3


@pytest.mark.parametrize("spec, match", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "prompt_lookup_min=0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5,
      "prompt_lookup_max": 3}, "prompt_lookup_min=5"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "'medusa'"),
    ({"method": "mtp", "num_speculative_tokens": 2}, "needs a draft 'model'"),
])
def test_bad_speculative_config(spec, match):
    with pytest.raises(ValueError, match=match):
        LLM("tiny-llama", speculative_config=spec, enforce_eager=True)


def test_min_tokens_holds_stop_tokens_back_under_speculation():
    base = LLM("tiny-llama", enforce_eager=True, **ENGINE)
    free = base.generate(["abcabcabcabc"], SamplingParams(temperature=0, max_tokens=12))
    stop = free[0].outputs[0].token_ids[1]
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, stop_token_ids=[stop])
    want = base.generate(["abcabcabcabc"], params)[0].outputs[0]
    spec = LLM("tiny-llama", speculative_config={"method": "ngram", "num_speculative_tokens": 3},
               enforce_eager=True, **ENGINE)
    got = spec.generate(["abcabcabcabc"], params)[0].outputs[0]
    assert got.token_ids == want.token_ids and len(got.token_ids) >= 6
    assert stop not in got.token_ids[:6]


@pytest.mark.parametrize("num_reqs", [1, 2])
def test_drafts_give_way_under_kv_pressure(num_reqs, debug_padding):
    # Each request ends at exactly 32 tokens = 8 blocks of 4: the pool holds every request's
    # own tokens, never its drafts on top. Speculation must not change how anything ends.
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6 + i]} for i in range(num_reqs)]
    params = SamplingParams(temperature=0, max_tokens=22, ignore_eos=True)
    engine = {"max_num_seqs": 2, "max_model_len": 64, "block_size": 4, "enforce_eager": True,
              "num_gpu_blocks_override": 8 * num_reqs}

    def run(spec):
        llm = LLM("tiny-llama", speculative_config=spec, **engine)
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        return [(o.token_ids, o.finish_reason) for o in outs], llm.engine.stats()

    want, _ = run(None)
    got, stats = run({"method": "ngram", "num_speculative_tokens": 3})
    assert got == want and all(reason == "length" for _, reason in got)
    assert stats["preemptions"] == 0 and stats["spec"]["num_drafts"] > 0
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


@pytest.mark.parametrize("num_spec, budget, sizes", [(1, 1, [1]), (5, 4, None)])
@pytest.mark.parametrize("eager", [True, False])
def test_token_budget_below_one_verify_step_is_raised(num_spec, budget, sizes, eager, caplog):
    # a budget below 1 + k used to pass validation, then crash in graph capture
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM("tiny-llama", enforce_eager=True, max_num_seqs=1, max_model_len=64,
               max_num_batched_tokens=budget).generate("abcabcabc", params)
    mode = {"enforce_eager": True} if eager else {
        "compilation_config": {"cudagraph_capture_sizes": sizes}}
    with caplog.at_level(logging.WARNING, logger="rung.runtime.config"):
        llm = LLM("tiny-llama", max_num_seqs=1, max_model_len=64, max_num_batched_tokens=budget,
                  speculative_config={"method": "ngram", "num_speculative_tokens": num_spec},
                  **mode)
    assert f"max_num_batched_tokens={budget} is below 1 + num_speculative_tokens=" \
           f"{1 + num_spec}" in caplog.text
    got = llm.generate("abcabcabc", params)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert llm.engine.stats()["spec"]["num_drafts"] > 0
