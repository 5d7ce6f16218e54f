"""No Triton kernel variant is compiled after warm-up: a serving run with prefill chunks,
decode batches of every size and batches above the ladder keeps the compile counter in
`stats()` at 0. Under the interpreter the counter counts specialization keys."""

import pytest
import torch

from rung.kernels.triton.paged_attention import _paged_attention_kernel, paged_attention
from rung.kernels.triton.variants import KERNEL_VARIANTS, specialization_key
from rung.runtime import LLM, SamplingParams

ENGINE = {"max_num_seqs": 6, "max_num_batched_tokens": 24, "max_model_len": 96,
          "attention_backend": "triton"}


def _serve(llm) -> None:
    prompts = ["a", "hello there", "a prompt long enough to need more than one chunk",
               "four", "five five", "six"]
    params = [SamplingParams(temperature=0, max_tokens=2 + 2 * i, ignore_eos=True)
              for i in range(len(prompts))]
    for batch in (slice(0, 1), slice(0, 3), slice(0, 6)):
        llm.generate(prompts[batch], params[batch])


@pytest.mark.parametrize("engine_args", [
    {"compilation_config": {"cudagraph_mode": "full_and_piecewise",
                            "cudagraph_capture_sizes": [1, 2, 4]}},
    {"enforce_eager": True},
], ids=["graphs", "eager"])
def test_serving_compiles_nothing_after_warmup(engine_args):
    llm = LLM("tiny-llama", **ENGINE, **engine_args)
    _serve(llm)
    stats = llm.engine.stats()
    assert stats["eager_steps"] > 0 or stats["graph_replays"]
    assert stats["triton_compiles_after_warmup"] == 0


def test_the_counter_sees_a_new_variant():
    llm = LLM("tiny-llama", **ENGINE, enforce_eager=True)
    before = llm.engine.stats()["triton_compiles_after_warmup"]
    device = llm.engine.runner.device
    query = torch.randn(3, 4, 32, device=device)    # head_dim 32: no layer of the model
    cache = torch.zeros(2, 4, 16, 2, 32, device=device)
    ints = lambda values: torch.tensor(values, dtype=torch.int32, device=device)
    paged_attention(query, cache, torch.empty_like(query), ints([0, 3]), ints([3]), ints([[1]]),
                    3, 0.1)
    assert llm.engine.stats()["triton_compiles_after_warmup"] == before + 1


def test_count_arguments_are_not_specialised():
    qsl = torch.zeros(9, dtype=torch.int32)

    def key(num_tokens_padded: int, num_reqs_padded: int):
        args = (qsl,) * 19 + (1.0, 0.0, 0, num_tokens_padded, num_reqs_padded,
                              num_tokens_padded + num_reqs_padded, 16)
        return specialization_key(_paged_attention_kernel, args, {"BLOCK_Q": 16})

    assert key(1, 1) == key(17, 3) == key(32, 16)
    names = _paged_attention_kernel.arg_names
    assert names[19:25] == ["scale", "softcap", "sliding_window", "num_tokens_padded",
                            "num_reqs_padded", "num_q_tiles"]
    assert KERNEL_VARIANTS.kernels["paged_attention"] is _paged_attention_kernel
