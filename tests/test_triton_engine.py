"""Backend choice: the engine on Triton (interpreted on CPU) gives the torch backend's
tokens; `auto` skips a backend that rejects the config."""

import logging

import torch

from rung.core.kv_cache_spec import KVCacheSpec
from rung.kernels import selector
from rung.kernels.torch_backend import TorchBackend
from rung.runtime import LLM, SamplingParams

# NOTE: fp32 on a GPU too ("auto" is bf16 there): random-weight bf16 logits have near
# ties that two attention backends may break differently
ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 64,
          "dtype": "float32", "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4]}}


def test_triton_backend_matches_torch_with_graphs_on():
    prompts = ["a", "hello there", "the third prompt is longer than a block", "four"]
    params = [SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True)
              for i in range(4)]
    triton_llm = LLM("tiny-llama", attention_backend="triton", **ENGINE)
    torch_llm = LLM("tiny-llama", attention_backend="torch", **ENGINE)
    assert triton_llm.engine.runner.backend.name == "TRITON"
    for batch in (slice(0, 1), slice(0, 4)):    # a lone 2-token prefill runs PIECEWISE
        got = [o.outputs[0].token_ids for o in triton_llm.generate(prompts[batch],
                                                                   params[batch])]
        want = [o.outputs[0].token_ids for o in torch_llm.generate(prompts[batch],
                                                                   params[batch])]
        assert got == want
    replays = triton_llm.engine.stats()["graph_replays"]
    assert any(k.startswith("FULL") for k in replays) and any(
        k.startswith("PIECEWISE") for k in replays), replays


class _PickyBackend(TorchBackend):
    """Available everywhere, but refuses the default page size, as flash-attn 2 does."""

    name = "PICKY"

    @classmethod
    def validate_layer(cls, layer, kv_spec) -> None:
        if kv_spec.block_size % 256:
            raise ValueError(f"block_size {kv_spec.block_size} is not a multiple of 256")


def test_auto_skips_a_backend_that_rejects_the_config(monkeypatch, caplog):
    accepted = []

    def accepts(backend):
        accepted.append(backend.name)
        backend.validate_layer(None, KVCacheSpec(16, 1, 8, torch.float32))

    monkeypatch.setattr(selector, "_known", lambda: {"FLASH_ATTN": _PickyBackend,
                                                     "TORCH": TorchBackend})
    with caplog.at_level(logging.INFO, logger="rung.kernels.selector"):
        chosen = selector.select_backend("auto", torch.device("cuda"), accepts)
    assert chosen is TorchBackend and accepted == ["PICKY", "TORCH"]
    assert ("attention backend FLASH_ATTN skipped: block_size 16 is not a multiple of 256"
            in caplog.text)
    assert "attention backend TRITON skipped: not installed" in caplog.text
