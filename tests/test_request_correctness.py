"""What an adversarial user of the step API may do, and what the engine must still get right:
ids shaped like rung's own, prefix hashes under speculation, stop strings completed by the
last allowed token, params changed after add_request, bad seeds and values, and
`LLM.generate` next to requests it did not create. Every test runs in both debug modes."""

import math

import pytest

from rung.runtime import LLM, SamplingParams


def _llm(**kwargs) -> LLM:
    args = {"enforce_eager": True, "max_num_seqs": 4, "max_model_len": 128, "dtype": "float32"}
    return LLM("tiny-llama", **{**args, **kwargs})


def _greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def _drain(engine) -> dict:
    """Step until idle; every finished output by request id."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, f"{out.request_id!r} finished twice"
                done[out.request_id] = out
    return done


def _all_free(engine) -> bool:
    stats = engine.stats()
    return stats["kv_free_blocks"] == stats["kv_total_blocks"]


# --- 1. ids shaped like the samples of an n > 1 request --------------------------------------
@pytest.mark.parametrize("single_first", [True, False], ids=["single-first", "parent-first"])
def test_an_id_shaped_like_a_sample_id_is_its_own_request(debug_padding, single_first):
    engine = _llm().engine
    single = ("0_a", {"prompt_token_ids": [5, 6, 7, 8, 9]}, _greedy(12, ignore_eos=True))
    parent = ("a", {"prompt_token_ids": [30, 31, 32]}, _greedy(12, ignore_eos=True, n=2))
    for request in ([single, parent] if single_first else [parent, single]):
        engine.add_request(*request)
    done = _drain(engine)
    alone = _drain_one(single)
    assert sorted(done) == ["0_a", "a"]
    assert done["0_a"].outputs[0].token_ids == alone
    assert [c.index for c in done["a"].outputs] == [0, 1]
    assert done["a"].outputs[0].token_ids == done["a"].outputs[1].token_ids   # greedy
    assert _all_free(engine)


def _drain_one(request) -> list[int]:
    engine = _llm().engine
    engine.add_request(*request)
    return _drain(engine)[request[0]].outputs[0].token_ids


def test_aborting_an_id_shaped_like_a_sample_leaves_the_parent_running(debug_padding):
    engine = _llm().engine
    engine.add_request("b", {"prompt_token_ids": [40, 41, 42]}, _greedy(6, ignore_eos=True, n=2))
    engine.step()
    engine.abort_request("0_b")           # no request of that id: nothing to abort
    done = _drain(engine)
    assert list(done) == ["b"] and len(done["b"].outputs) == 2
    assert all(len(c.token_ids) == 6 for c in done["b"].outputs)
    engine.add_request("b", {"prompt_token_ids": [40]}, _greedy(1))    # "b" is free again
    assert list(_drain(engine)) == ["b"]
    assert _all_free(engine)


def test_a_request_id_must_be_a_string(debug_padding):
    engine = _llm().engine
    with pytest.raises(ValueError, match="request_id 7 .* str"):
        engine.add_request(7, "x", _greedy(1))
    assert not engine.has_unfinished_requests()


# --- 2. prefix-cache hashes under speculation ------------------------------------------------
def _second_request_hits(speculative: bool) -> int:
    spec = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    engine = _llm(block_size=4, max_num_seqs=2, **(spec if speculative else {})).engine
    prompt = [5, 6, 7, 8] * 6
    engine.add_request("first", {"prompt_token_ids": prompt}, _greedy(40, ignore_eos=True))
    output = _drain(engine)["first"].outputs[0].token_ids
    before = engine.stats()["prefix_cache"]["hit_tokens"]
    engine.add_request("second", {"prompt_token_ids": prompt + output + [9]}, _greedy(1))
    _drain(engine)
    if speculative:
        assert engine.stats()["spec"]["num_accepted_tokens"] > 0, "no draft was accepted"
    engine.kv.check_consistency()
    return engine.stats()["prefix_cache"]["hit_tokens"] - before


def test_prefix_cache_hits_do_not_depend_on_speculation(debug_padding):
    without = _second_request_hits(speculative=False)
    assert without == 60                  # 64 tokens computed by "first": 16 full blocks - 1
    assert _second_request_hits(speculative=True) == without


# --- 3. a stop string completed by the last allowed token ------------------------------------
STOP_PROMPT = {"prompt_token_ids": [1, 72, 105, 33]}


def _stop_case(llm) -> tuple[str, int]:
    """A one-character stop string first completed by output token k (k >= 1), and k + 1."""
    free = llm.generate(STOP_PROMPT, _greedy(8, ignore_eos=True), use_tqdm=False)[0]
    decode = llm.get_tokenizer().decode
    ids = free.outputs[0].token_ids
    for k in range(1, len(ids)):
        new = decode(ids[:k + 1])[len(decode(ids[:k])):]
        if len(new) == 1 and new.isprintable() and new not in decode(ids[:k]):
            return new, k + 1
    pytest.skip("greedy output completes no fresh one-character string")


def _final(outs) -> tuple:
    c = outs[0].outputs[0]
    return c.text, c.token_ids, c.finish_reason, c.stop_reason


@pytest.mark.parametrize("extra", [{}, {"stop_token_ids": "last"}, {"include": True}],
                         ids=["stop", "stop-and-stop-token", "include-stop"])
def test_a_stop_string_completed_by_the_last_allowed_token_stops(debug_padding, extra):
    llm = _llm()
    stop, num_tokens = _stop_case(llm)
    kwargs = {"stop": [stop], "include_stop_str_in_output": extra.get("include", False)}
    if "stop_token_ids" in extra:
        free = llm.generate(STOP_PROMPT, _greedy(8), use_tqdm=False)[0].outputs[0].token_ids
        kwargs["stop_token_ids"] = [free[num_tokens - 1]]
    roomy = _final(llm.generate(STOP_PROMPT, _greedy(num_tokens + 3, **kwargs), use_tqdm=False))
    at_limit = _final(llm.generate(STOP_PROMPT, _greedy(num_tokens, **kwargs), use_tqdm=False))
    assert roomy[2] == "stop" and at_limit == roomy
    at_model_len = _llm(max_model_len=len(STOP_PROMPT["prompt_token_ids"]) + num_tokens)
    unbounded = _greedy(None, **kwargs)
    assert _final(at_model_len.generate(STOP_PROMPT, unbounded, use_tqdm=False)) == roomy


def test_a_stop_string_at_the_limit_stops_a_delta_stream(debug_padding):
    from rung.runtime.sampling_params import RequestOutputKind

    llm = _llm()
    stop, num_tokens = _stop_case(llm)
    engine = llm.engine
    engine.add_request("s", STOP_PROMPT, _greedy(num_tokens, stop=[stop],
                                                 output_kind=RequestOutputKind.DELTA))
    text, last = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text
            last = out.outputs[0]
    roomy = llm.generate(STOP_PROMPT, _greedy(num_tokens + 3, stop=[stop]), use_tqdm=False)
    assert (text, last.finish_reason, last.stop_reason) == (
        roomy[0].outputs[0].text, "stop", stop)


# --- 4. params changed after add_request -----------------------------------------------------
def test_params_changed_after_add_request_leave_the_request_alone(debug_padding):
    engine = _llm().engine
    params = _greedy(4, ignore_eos=True)
    engine.add_request("p", "changed later", params)
    engine.add_request("q", "a neighbour", _greedy(6, ignore_eos=True))
    engine.step()
    params.max_tokens = 20
    params.logprobs = 10**6               # would be refused by add_request
    params.stop_token_ids.append(0)
    done = _drain(engine)
    assert len(done["p"].outputs[0].token_ids) == 4 and done["p"].outputs[0].logprobs is None
    assert len(done["q"].outputs[0].token_ids) == 6


# --- 5. an n > 1 request is queued whole or not at all ---------------------------------------
def test_a_seed_that_overflows_for_a_later_sample_queues_nothing(debug_padding):
    engine = _llm().engine
    with pytest.raises(ValueError, match=r"seed.*2\*\*64 - 1"):
        engine.add_request("par", "x", SamplingParams(n=2, seed=2**64 - 1, max_tokens=2))
    assert not engine.has_unfinished_requests()
    engine.add_request("par", "x", SamplingParams(n=2, seed=2**64 - 2, max_tokens=2))
    assert len(_drain(engine)["par"].outputs) == 2
    assert _all_free(engine)


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1])
def test_a_seed_outside_torchs_range_is_refused(seed):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)


# --- 6. non-finite values --------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [{"temperature": math.inf}, {"temperature": math.nan},
                                    {"top_p": math.nan}])
def test_non_finite_sampling_values_are_refused(kwargs):
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=f"{name}={value}.*finite"):
        SamplingParams(**kwargs, min_tokens=5)


# --- 7. LLM.generate next to requests it did not create --------------------------------------
def test_generate_leaves_requests_it_did_not_create_alone(debug_padding):
    llm = _llm()
    engine = llm.engine
    for rid in ("gen-0", "gen-1", "mine"):
        engine.add_request(rid, "added directly", _greedy(3, ignore_eos=True))
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], _greedy(2))
    outs = llm.generate(["fine", "also fine"], _greedy(2, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    done = _drain(engine)
    assert sorted(done) == ["gen-0", "gen-1", "mine"]
    assert all(len(o.outputs[0].token_ids) == 3 for o in done.values())
    assert _all_free(engine)


# --- 8. bad input types are ValueErrors naming the field -------------------------------------
@pytest.mark.parametrize("prompt, params, match", [
    ({"prompt_token_ids": None}, {}, "prompt_token_ids"),
    ({"prompt_token_ids": "abc"}, {}, "prompt_token_ids"),
    ("x", {"stop_token_ids": ["a"]}, "stop_token_ids"),
    ("x", {"stop": 5}, "stop"),
])
def test_bad_input_types_are_value_errors(prompt, params, match):
    engine = _llm().engine
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, SamplingParams(**params))
    assert not engine.has_unfinished_requests()


# --- 9. the engine's config is its own ------------------------------------------------------
def test_the_engine_keeps_its_own_copy_of_the_config():
    import torch

    from rung.runtime.config import EngineConfig
    from rung.runtime.engine import LLMEngine

    config = EngineConfig("tiny-llama", torch.float32, torch.device("cpu"), max_num_seqs=2,
                          max_model_len=32, enforce_eager=True, debug_padding=False)
    engine = LLMEngine(config)
    config.debug_padding, config.device = True, torch.device("meta")   # the caller's, later
    assert engine.config is not config and engine.runner.config is engine.config
    assert (engine.config.debug_padding, engine.config.device) == (False, torch.device("cpu"))
    engine.add_request("r", {"prompt_token_ids": [5, 6]}, _greedy(2))
    assert len(_drain(engine)["r"].outputs[0].token_ids) == 2


# --- 12. KV capacity per group, and which group ran out ------------------------------------
def test_kv_capacity_is_reported_per_group_and_names_the_group_that_ran_out(debug_padding):
    engine = LLM("tiny-gemma4", enforce_eager=True, max_model_len=128, dtype="float32",
                 num_gpu_blocks_override=4).engine      # 2 KV cache groups of 4 blocks
    stats = engine.stats()
    assert stats["kv_total_blocks"] == 4 == stats["kv_free_blocks"]
    assert [g["total_blocks"] for g in stats["kv_groups"]] == [4, 4]
    engine.add_request("long", {"prompt_token_ids": [5] * 100}, _greedy(1))
    engine.add_request("grows", {"prompt_token_ids": [5] * 60}, _greedy(20, ignore_eos=True))
    done = _drain(engine)
    long, grows = done["long"].outputs[0], done["grows"].outputs[0]
    assert long.finish_reason == grows.finish_reason == "error"
    assert "(full attention), which holds 4 blocks (64 tokens)" in long.error, long.error
    assert "can never run" in long.error
    # 60 + 4 tokens fill 64 slots; the 5th output token has no slot for its KV
    assert "65 tokens need 5 blocks" in grows.error and "after 5 output tokens" in grows.error
    assert "shorten the prompt" not in grows.error
    assert _all_free(engine)
