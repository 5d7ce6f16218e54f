"""Structured outputs in the embedded API: the output follows the grammar (JSON schema,
regex, choice, Lark), greedy and sampled, n > 1, in a batch with free requests, under
preemption and emulated graphs; a compiling grammar blocks nobody; bad specs are refused."""

import concurrent.futures
import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from rung.runtime import LLM, SamplingParams
from rung.runtime.structured import StructuredOutputsParams, apply_bitmask
from rung.runtime.worker.sampler import Sampler, SamplingBatch

# bounded everywhere, so a random-weight model closes the object within max_tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                 "maxItems": 3},
        "owner": {"type": "object",
                  "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                 "ok": {"type": "boolean"}},
                  "required": ["id", "ok"], "additionalProperties": False},
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", enforce_eager=True, max_num_seqs=8, max_model_len=256)


def _json(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=200, structured_outputs={"json": SCHEMA}, **kw)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7},
                                      {"temperature": 0.8, "top_p": 0.9, "top_k": 40}])
def test_json_schema_outputs_validate(llm, sampling):
    outs = llm.generate(["a", "bb", "ccc"], _json(**sampling))
    for out in outs:
        (c,) = out.outputs
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_n2_samples_each_follow_the_schema_and_differ(llm):
    (out,) = llm.generate(["x"], _json(temperature=1.0, seed=11, n=2))
    texts = [c.text for c in out.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert texts[0] != texts[1]


def test_seeded_constrained_sampling_is_reproducible(llm):
    params = _json(temperature=1.0, seed=5)
    alone = llm.generate(["q"], params)[0].outputs[0].text
    crowd = llm.generate(["q", "zz", "y"], [params, SamplingParams(temperature=1.0,
                                                                   max_tokens=30),
                                            _json(temperature=0)])
    assert crowd[0].outputs[0].text == alone


def test_regex_choice_and_lark_grammar(llm):
    regex = r"[a-c]{2,4}-[0-9]{3}"
    outs = llm.generate(["p", "q", "r"], [
        SamplingParams(temperature=1.0, seed=1, max_tokens=30,
                       structured_outputs={"regex": regex}),
        SamplingParams(temperature=1.0, seed=2, max_tokens=30,
                       structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
        SamplingParams(temperature=0, max_tokens=30,
                       structured_outputs={"grammar": 'start: "(" NUM ")"\nNUM: /[0-9]{1,2}/'}),
    ])
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(regex, texts[0]), texts[0]
    assert texts[1] in ("yes", "no")
    assert re.fullmatch(r"\([0-9]{1,2}\)", texts[2]), texts[2]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_free_requests_in_a_constrained_batch_are_untouched(llm):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["hello there"], free)[0].outputs[0].token_ids
    mixed = llm.generate(["hello there", "hello there"],
                         [free, SamplingParams(temperature=0, max_tokens=12,
                                               structured_outputs={"regex": "[0-9]+"})])
    assert mixed[0].outputs[0].token_ids == alone
    assert re.fullmatch("[0-9]+", mixed[1].outputs[0].text)


def test_bitmask_is_applied_per_row_in_one_batched_pass():
    """Row 0 may take only tokens 5 and 40; row 1 is free: each row's argmax respects its
    own mask, with no loop over requests."""
    vocab = 70
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, 5], logits[0, 40], logits[0, 3] = 1.0, 2.0, 9.0
    mask = np.zeros((2, (vocab + 31) // 32), dtype=np.int32)
    mask[0, 0] = 1 << 5
    mask[0, 1] = 1 << (40 - 32)
    mask[1] = -1
    batch = SamplingBatch(2, np.arange(2), np.arange(2), 0, torch.empty(2, 0),
                          torch.zeros(2, 1, dtype=torch.int64), [None, None],
                          bitmask=torch.from_numpy(mask))
    tokens = Sampler()(logits, batch)
    assert tokens.tolist() == [40, int(logits[1].argmax())]
    masked = apply_bitmask(logits, batch.bitmask)
    assert torch.isfinite(masked[0]).nonzero().flatten().tolist() == [5, 40]
    assert torch.equal(masked[1], logits[1])


def test_survives_preemption(llm):
    """A KV cache too small for every request at once preempts some: a preempted request
    keeps its matcher state; its seeded output is the one it gets with room to spare."""
    tight = LLM("tiny-llama", enforce_eager=True, max_num_seqs=4, max_model_len=256,
                num_gpu_blocks_override=24)
    prompts = ["a" * 40, "b" * 40, "c" * 40, "d" * 40]
    params = _json(temperature=1.0, seed=3)
    outs = [o.outputs[0].text for o in tight.generate(prompts, params)]
    assert tight.engine.stats()["preemptions"] > 0
    assert outs == [o.outputs[0].text for o in llm.generate(prompts, params)]
    for text in outs:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_under_emulated_graphs():
    llm = LLM("tiny-llama", dtype="float32", max_num_seqs=4, max_model_len=256,
              compilation_config={"graph_backend": "emulated",
                                  "cudagraph_capture_sizes": [1, 2, 4]})
    outs = llm.generate(["a", "b", "c"], _json(temperature=1.0, seed=9))
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert any(k.startswith("FULL") for k in llm.engine.stats()["graph_replays"])


def test_a_compiling_grammar_blocks_no_other_request(llm):
    engine = llm.engine
    pending = concurrent.futures.Future()
    real_submit = engine.grammars.submit
    engine.grammars.submit = lambda spec: pending
    try:
        engine.add_request("slow", "s", SamplingParams(
            temperature=0, max_tokens=8, structured_outputs={"regex": "[0-9]{3}"}))
        engine.add_request("free", "f", SamplingParams(temperature=0, max_tokens=4,
                                                       ignore_eos=True))
        done = {}
        for _ in range(10):
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        assert "free" in done and "slow" not in done
        pending.set_result(real_submit(StructuredOutputsParams(regex="[0-9]{3}")).result())
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        assert re.fullmatch("[0-9]{3}", done["slow"].outputs[0].text)
    finally:
        engine.grammars.submit = real_submit


def test_the_same_spec_compiles_once(llm):
    compiler = llm.engine.grammars
    a = compiler.submit(StructuredOutputsParams(json={"type": "object", "x-k": 1}))
    b = compiler.submit(StructuredOutputsParams(json=json.dumps({"x-k": 1, "type": "object"})))
    assert a is b
    for i in range(compiler.max_cached):
        compiler.submit(StructuredOutputsParams(regex=f"x{i}"))
    assert compiler.submit(StructuredOutputsParams(json={"type": "object", "x-k": 1})) is not a


def test_invalid_specs_are_refused(llm):
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError, match="choice"):
        SamplingParams(structured_outputs={"choice": []})
    with pytest.raises(ValueError, match="not valid JSON"):
        SamplingParams(structured_outputs={"json": "{oops"})
    with pytest.raises(ValueError, match="structured_outputs.regex is invalid"):
        llm.engine.grammars.compile(StructuredOutputsParams(regex="a(b"))
    (out,) = llm.generate(["x"], SamplingParams(structured_outputs={"regex": "a(b"}))
    assert out.outputs[0].finish_reason == "error"


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "mtp", "model": "tiny-gemma4-mtp", "num_speculative_tokens": 3}])
def test_speculation_is_lossless_under_a_grammar(spec):
    """Drafts are verified against rows masked with the matcher advanced along them: the
    seeded output is token for token the one without speculation, and drafts were
    accepted (repetitive prompts feed the n-gram drafter)."""
    model = "tiny-llama" if spec["method"] == "ngram" else "tiny-gemma4"
    args = {"enforce_eager": True, "max_num_seqs": 4, "max_model_len": 256}
    prompts = ['{"a": 1, "a": 1, "a": 1, ', "abab abab abab", "x"]
    params = [_json(temperature=0), _json(temperature=1.0, seed=4),
              SamplingParams(temperature=0, max_tokens=30,
                             structured_outputs={"regex": "(ab ){3,9}"})]
    plain = LLM(model, **args).generate(prompts, params)
    fast = LLM(model, speculative_config=spec, **args)
    drafted = fast.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    assert fast.engine.stats()["spec"]["num_accepted_tokens"] > 0
    for out in drafted[:2]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
