"""The piecewise pieces compiled with inductor give the eager pieces' tokens (slow)."""

import pytest

from rung.runtime import LLM, SamplingParams


@pytest.mark.slow
def test_inductor_pieces_match_eager():
    args = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 64}
    prompts = ["inductor", "pieces", "match"]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    compiled = LLM("tiny-llama", compilation_config={"backend": "inductor",
                                                     "cudagraph_capture_sizes": [1, 2, 4]},
                   **args)
    eager = LLM("tiny-llama", enforce_eager=True, **args)
    got = [o.outputs[0].token_ids for o in compiled.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
