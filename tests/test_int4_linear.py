"""int4 weight-only linear layers (kernels/int4.py, models/layers.py `Int4Linear`) held to
the fp32 reference: the kernel against `int4_reference`, GGUF Q4_0 / Q4_1 blocks against
rung's numpy dequantizer, and the SmolLM2 Q4_1 file served quantized."""

import numpy as np
import pytest
import torch

from rung.kernels.int4 import GROUP_SIZE, Int4Weight, int4_reference
from rung.models.gguf import dequantize_numpy, int4_weight
from rung.models.layers import Int4Linear


def _random_int4(num_rows: int, num_cols: int, seed: int) -> Int4Weight:
    gen = torch.Generator().manual_seed(seed)
    groups = (num_rows, num_cols // GROUP_SIZE)
    return Int4Weight(torch.randint(0, 16, (num_rows, num_cols), generator=gen,
                                    dtype=torch.uint8),
                      torch.rand(groups, generator=gen) * 0.02 + 0.001,
                      torch.randn(groups, generator=gen) * 0.05)


def _bf16_rounded(weight: Int4Weight) -> Int4Weight:
    """The kernel reads scales and zeros in bf16: the oracle rounds them the same way."""
    return Int4Weight(weight.q, weight.scale.bfloat16().float(), weight.zero.bfloat16().float())


def _gguf_blocks(type_name: str, num_rows: int, num_cols: int, seed: int) -> np.ndarray:
    """Random raw Q4_0 / Q4_1 data [num_rows, bytes per row] as a GGUF reader yields it."""
    rng = np.random.default_rng(seed)
    num_blocks = num_rows * num_cols // 32
    d = (rng.random(num_blocks) * 0.02 + 0.001).astype(np.float16).view(np.uint8)
    nibbles = rng.integers(0, 256, (num_blocks, 16), dtype=np.uint8)
    parts = [d.reshape(-1, 2)]
    if type_name == "Q4_1":
        parts.append((rng.standard_normal(num_blocks) * 0.05).astype(np.float16)
                     .view(np.uint8).reshape(-1, 2))
    return np.concatenate(parts + [nibbles], axis=1).reshape(num_rows, -1)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_map_onto_int4_groups_losslessly(type_name):
    """zero = m + 8 d (Q4_1) and 0 (Q4_0): the int4 weight stands for the very fp32 values
    rung's dequantizer reads from the same bytes."""
    data = _gguf_blocks(type_name, 32, 96, seed=1)
    weight = int4_weight(data, type_name, (32, 96))
    want = dequantize_numpy(data, type_name).reshape(32, 96)
    torch.testing.assert_close(int4_reference(weight), torch.from_numpy(want),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("num_rows", [1, 3, 8])
def test_int4_linear_matches_the_dequantized_matmul(num_rows):
    """A fused layer (two shards, like gate/up) equals bf16 x @ the fp32 reference weight.

    NOTE: tolerance: the kernel returns bf16 (a relative step of 2^-8), and its
    accumulation order differs from the fp32 matmul's; 1.6e-2 of the output's scale bounds
    both with margin over K = 256, and a wrong zero convention (an error of 8 * scale per
    weight) or a swapped group layout fails it by 10x or more."""
    shards = [_random_int4(32, 256, seed=2), _random_int4(16, 256, seed=3)]
    layer = Int4Linear(256, [32, 16])
    for i, shard in enumerate(shards):
        layer.load_int4(shard, i)
    layer.pack(torch.device("cpu"))
    x = torch.randn(num_rows, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    weight = torch.cat([int4_reference(_bf16_rounded(s)) for s in shards])      # [48, 256]
    want = x.float() @ weight.t()
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (num_rows, 48)
    scale = want.abs().max().item()
    torch.testing.assert_close(got.float(), want, atol=1.6e-2 * scale, rtol=0)


def test_int4_linear_refuses_other_activation_dtypes_and_missing_shards():
    layer = Int4Linear(64, [16, 16])
    layer.load_int4(_random_int4(16, 64, seed=5), 0)
    with pytest.raises(ValueError, match=r"lacks checkpoint shards \[1\]"):
        layer.pack(torch.device("cpu"))
    layer.load_int4(_random_int4(16, 64, seed=6), 1)
    layer.pack(torch.device("cpu"))
    with pytest.raises(ValueError, match="bfloat16 activations, got torch.float32"):
        layer(torch.randn(2, 64))


@pytest.mark.slow
def test_int4_linear_runs_inside_an_inductor_graph():
    layer = Int4Linear(128, [32])
    layer.load_int4(_random_int4(32, 128, seed=7), None)
    layer.pack(torch.device("cpu"))
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(8)).bfloat16()
    compiled = torch.compile(layer, backend="inductor", fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), atol=0, rtol=0)


def test_quantization_gguf_refuses_a_dtype_the_kernel_cannot_run():
    from rung.models.loader import load_model

    with pytest.raises(ValueError, match="dtype torch.float32 cannot run it"):
        load_model("tiny-llama", torch.float32, "cpu", quantization="gguf")
    with pytest.raises(ValueError, match="serves GGUF files"):
        load_model("tiny-llama", torch.bfloat16, "cpu", quantization="gguf")


def test_smollm2_q4_1_served_int4_generates_the_fp32_text():
    """The shipped Q4_1 file loads with its Q4_1 layers int4 (no fp32 copy of them) and
    greedily writes what the dequantized fp32 model writes, on a prompt whose every token
    wins by a margin larger than the int4 + bf16 error."""
    from rung.models.loader import resolve_model_path
    from rung.runtime import LLM, SamplingParams

    try:
        resolve_model_path("smollm2-135m")
    except ValueError as e:
        pytest.skip(f"SmolLM2 weights not installed ({e})")
    conversation = [[{"role": "user", "content": "What is 7 times 8?"}]]
    params = SamplingParams(temperature=0, max_tokens=12)
    texts = []
    for quantization in ("gguf", None):
        llm = LLM("smollm2-135m", device="cpu", max_model_len=96, max_num_seqs=1,
                  enforce_eager=True, quantization=quantization)
        model = llm.engine.loaded.model
        if quantization:
            layer = model.model.layers[0]
            assert isinstance(layer.mlp.gate_up_proj, Int4Linear)
            assert isinstance(layer.self_attn.qkv_proj, Int4Linear)
            # only the embedding (Q8_0) and the norms stay floating-point parameters
            assert sum(p.numel() for p in model.parameters()) < 30_000_000
        texts.append(llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text)
    assert texts[0] == texts[1]
