"""Gemma 4 + its MTP assistant: lossless speculation under graphs and partial batches."""

import pytest

from rung.core import attention_metadata
from rung.runtime import LLM, SamplingParams
from rung.runtime.spec.mtp import DraftBatch
from rung.runtime.worker.input_batch import InputBatch

ENGINE = {"max_model_len": 160, "max_num_seqs": 8, "max_num_batched_tokens": 64,
          "dtype": "float32"}
MODES = {"none": {"enforce_eager": True},
         "piecewise": {"compilation_config": {"cudagraph_mode": "piecewise",
                                              "cudagraph_capture_sizes": [1, 2, 4, 8]}},
         "full_and_piecewise": {"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8]}}}


def _prompts(num: int, seed: int = 0) -> list[dict]:
    return [{"prompt_token_ids": [3 + (13 * i + 7 * j + seed) % 500
                                  for j in range(1 + (11 * i + seed) % 40)]}
            for i in range(num)]


def _mtp(k: int) -> dict:
    return {"method": "mtp", "model": "tiny-gemma4-mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def reference():
    prompts = _prompts(6)
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True)
              for i in range(6)]
    llm = LLM("tiny-gemma4", enforce_eager=True, **ENGINE)
    return prompts, params, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("k", [1, 3, 5])
def test_mtp_speculation_is_lossless(k, mode, reference):
    prompts, params, want = reference
    llm = LLM("tiny-gemma4", speculative_config=_mtp(k), **ENGINE, **MODES[mode])
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    stats = llm.engine.stats()
    assert stats["spec"]["num_drafts"] > 0
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_drafter_layers_get_their_own_attention_groups():
    llm = LLM("tiny-gemma4", speculative_config=_mtp(2), enforce_eager=True, **ENGINE)
    proposer = llm.engine.proposer
    target_keys = {(g.kv_group_id, g.key.num_heads_q) for g in llm.engine.runner.attn_groups}
    draft_keys = {(g.kv_group_id, g.key.num_heads_q) for g in proposer.attn_groups}
    assert {h for _, h in target_keys} == {8} and {h for _, h in draft_keys} == {4}
    assert {gid for gid, _ in draft_keys} == {0, 1}        # reads both KV cache groups


def test_staggered_waves_under_graphs_match_eager_without_speculation(monkeypatch):
    """32 requests in 4 waves of 8 through the step API, partial batches throughout;
    validate() runs on every target and draft step's metadata, for every KV group."""
    checked = {"target": 0, "draft": 0}

    prompts = _prompts(32, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=4 + (7 * i) % 13, ignore_eos=True)
              for i in range(32)]

    def run(llm) -> dict:
        engine, done, step = llm.engine, {}, 0
        waves = {0: range(0, 8), 3: range(8, 16), 7: range(16, 24), 12: range(24, 32)}
        while len(done) < 32:
            for i in waves.get(step, []):
                engine.add_request(f"w{i}", prompts[i], params[i])
            done.update({o.request_id: o.outputs[0].token_ids
                         for o in engine.step() if o.finished})
            step += 1
            assert step < 2000
        return done

    want = run(LLM("tiny-gemma4", enforce_eager=True, **ENGINE))
    import rung.runtime.worker.attention_groups as attention_groups

    real_build = attention_groups.build_layer_metadata
    def counting_build(kind):
        def build(groups, commons, check_values):
            for common in commons:
                attention_metadata.validate(common, check_values=True)
                checked[kind] += 1
            return real_build(groups, commons, check_values)
        return build
    monkeypatch.setattr("rung.runtime.worker.model_runner.build_layer_metadata",
                        counting_build("target"))
    monkeypatch.setattr("rung.runtime.spec.mtp.build_layer_metadata", counting_build("draft"))
    llm = LLM("tiny-gemma4", speculative_config=_mtp(3), **ENGINE,
              compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]})
    got = run(llm)
    assert len(got) == 32 and got == want
    assert checked["target"] > 0 and checked["draft"] > 0
    stats = llm.engine.stats()
    assert any(k.startswith("FULL") for k in stats["graph_replays"])
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_draft_replays_poison_the_draft_batch(monkeypatch):
    """Failure class 4 on the draft path: an emulated draft replay garbles the pad rows of the
    DRAFT batch (a draft descriptor: one query per request), never the target's buffers."""
    poisoned = []
    for cls, kind in ((DraftBatch, "draft"), (InputBatch, "target")):
        def spy(self, desc, *args, _real=cls.poison_pads, _kind=kind):
            poisoned.append((_kind, desc))
            return _real(self, desc, *args)
        monkeypatch.setattr(cls, "poison_pads", spy)
    llm = LLM("tiny-gemma4", speculative_config=_mtp(2), debug_padding=True, **ENGINE,
              compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]})
    prompts, params = _prompts(3), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM("tiny-gemma4", enforce_eager=True, **ENGINE).generate(prompts, params)
    target_steps = []
    llm.engine.add_step_listener(lambda result: target_steps.append(result.desc))
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    draft = [d for kind, d in poisoned if kind == "draft"]
    assert any(d.num_reqs < d.num_reqs_padded for d in draft), "no padded draft replay"
    assert all(d.num_tokens == d.num_reqs and d.uniform_query_len == 1 for d in draft)
    target = [d for kind, d in poisoned if kind == "target"]
    assert target and all(d in target_steps for d in target), (
        "a draft replay poisoned the target's input batch")


def test_drafter_that_does_not_fit_the_target_is_rejected():
    # tiny-llama is no Gemma 4 model: the assistant reads a Gemma 4 target's KV and hidden
    with pytest.raises(ValueError, match="requires a Gemma 4 target; model 'tiny-llama'"):
        LLM("tiny-llama", speculative_config=_mtp(2), enforce_eager=True, **ENGINE)
    with pytest.raises(ValueError, match="not an MTP drafter"):
        LLM("tiny-gemma4", speculative_config={"method": "mtp", "model": "tiny-llama",
                                               "num_speculative_tokens": 2},
            enforce_eager=True, **ENGINE)


def test_draft_graphs_are_captured_under_the_descriptors_a_draft_step_replays():
    """Every draft step a request count can dispatch finds a graph captured under that very
    descriptor (padded sizes and query length), not one that matches by accident."""
    llm = LLM("tiny-gemma4", speculative_config=_mtp(1), max_model_len=32, max_num_seqs=2,
              dtype="float32", compilation_config={"cudagraph_mode": "full_decode_only",
                                                   "cudagraph_capture_sizes": [2, 4]})
    proposer = llm.engine.proposer

    def shape(d):
        return (d.mode, d.num_reqs_padded, d.num_tokens_padded, d.uniform_query_len)

    captured = {shape(d) for d in proposer.captured}
    replayed = {shape(proposer.dispatcher.dispatch(n, n, 1)) for n in range(1, 3)}
    assert replayed and replayed <= captured, (replayed, captured)
    assert len(llm.engine.runner.graphs.records) > len(proposer.captured) > 0



def test_mtp_with_logprobs_and_prompt_logprobs_in_the_same_copy():
    """Tokens, logprobs, prompt logprobs and the drafts share the step's one packed copy:
    with all of them asked, MTP gives what the target alone gives."""
    prompts = _prompts(3, seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    want = LLM("tiny-gemma4", enforce_eager=True, **ENGINE).generate(prompts, params)
    llm = LLM("tiny-gemma4", speculative_config=_mtp(3), enforce_eager=True, **ENGINE)
    got = llm.generate(prompts, params)
    assert llm.engine.stats()["spec"]["num_accepted_tokens"] > 0
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for got_lps, want_lps in zip(g.outputs[0].logprobs + g.prompt_logprobs[1:],
                                     w.outputs[0].logprobs + w.prompt_logprobs[1:]):
            assert got_lps.keys() == want_lps.keys()
            for token, lp in want_lps.items():
                assert abs(got_lps[token].logprob - lp.logprob) < 1e-4
