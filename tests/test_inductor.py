"""The piecewise pieces compiled with inductor give the eager pieces' tokens (slow)."""

import pytest
import torch._inductor.compile_fx as inductor

from rung.graphs.piecewise import is_attention_node
from rung.runtime import LLM, SamplingParams


@pytest.mark.slow
def test_inductor_pieces_match_eager(monkeypatch):
    calls = []
    compile_fx = inductor.compile_fx
    monkeypatch.setattr(inductor, "compile_fx",
                        lambda gm, inputs, **kw: calls.append(gm) or compile_fx(gm, inputs, **kw))
    args = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 64}
    prompts = ["inductor", "pieces", "match"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    compiled = LLM("tiny-llama", compilation_config={"backend": "inductor",
                                                     "cudagraph_capture_sizes": [1, 2, 4]},
                   **args)
    # tiny-llama's 2 attention layers split each traced forward into 3 pieces, each
    # compiled through inductor's entry point (dynamo traces size 1 apart from the rest)
    assert calls and len(calls) % 3 == 0
    assert not any(is_attention_node(n) for gm in calls for n in gm.graph.nodes)
    eager = LLM("tiny-llama", enforce_eager=True, **args)
    got = [o.outputs[0].token_ids for o in compiled.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
