"""FULL graphs of uniform decode / verify batches are captured, and replayed, with
decode-shaped metadata: max_query_len is the query length (1, or 1 + k), never the
padded token count. Other FULL graphs keep the token count as their bound."""

import pytest

from rung.core.graph_mode import CUDAGraphMode
from rung.runtime import LLM, SamplingParams
from rung.runtime.worker import model_runner

# NOTE: fp32 on a GPU too ("auto" is bf16 there): graph and eager tokens are compared
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 64,
          "dtype": "float32"}


def _max_query_lens(ctx) -> set[int]:
    return {getattr(m, "common", m).max_query_len for m in ctx.attn_metadata.values()}


def _capture_metadata(llm) -> list[tuple]:
    """(mode, tokens, rows, uniform, max_query_lens) of every captured graph's batch."""
    graphs = llm.engine.runner.graphs
    out = []
    for desc in graphs.dispatcher.capture_descriptors():
        _, _, ctx = llm.engine.runner.dummy_batch(desc)
        out.append((desc.mode, desc.num_tokens_padded, desc.num_reqs_padded,
                    desc.uniform_query_len, _max_query_lens(ctx)))
    return out


@pytest.mark.parametrize("spec, query_len", [(None, 1), ({"method": "ngram",
                                                          "num_speculative_tokens": 2}, 3)])
def test_full_uniform_graphs_capture_decode_shaped_metadata(spec, query_len):
    llm = LLM("tiny-llama", speculative_config=spec, **ENGINE,
              compilation_config={"cudagraph_mode": "full_and_piecewise",
                                  "cudagraph_capture_sizes": [3, 6, 12]})
    full = [c for c in _capture_metadata(llm) if c[0] == CUDAGraphMode.FULL]
    assert full, "no FULL graph captured"
    for _, tokens, rows, uniform, lens in full:
        assert uniform == query_len and rows * query_len == tokens
        assert lens == {query_len}, (tokens, lens)


def test_full_mode_keeps_mixed_graphs_apart_from_uniform_ones():
    llm = LLM("tiny-llama", **ENGINE, compilation_config={"cudagraph_mode": "full",
                                                          "cudagraph_capture_sizes": [2, 4]})
    full = {(tokens, rows, uniform): lens for mode, tokens, rows, uniform, lens
            in _capture_metadata(llm) if mode == CUDAGraphMode.FULL}
    assert full == {(4, 4, 1): {1}, (2, 2, 1): {1}, (4, 4, None): {4}, (2, 2, None): {2}}
    assert len(llm.engine.runner.graphs.full_graphs) == 4


def test_decode_replays_read_query_len_one(monkeypatch):
    llm = LLM("tiny-llama", **ENGINE, compilation_config={"cudagraph_mode": "full_decode_only",
                                                          "cudagraph_capture_sizes": [1, 2, 4]})
    seen = []
    build = model_runner.build_layer_metadata

    def spy(groups, commons, *args):
        seen.append((commons[0].desc.mode, {c.max_query_len for c in commons}))
        return build(groups, commons, *args)

    monkeypatch.setattr(model_runner, "build_layer_metadata", spy)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    eager = LLM("tiny-llama", enforce_eager=True, **ENGINE)
    prompts = ["one", "two prompts", "three"]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    replays = [lens for mode, lens in seen if mode == CUDAGraphMode.FULL]
    assert replays and all(lens == {1} for lens in replays)
