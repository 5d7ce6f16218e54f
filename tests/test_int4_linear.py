"""Quantized linear layers (kernels/gguf_cpu.py, kernels/int4.py, models/layers.py
`QuantLinear`) held to their references: rung's CPU kernel against
`gguf_gemm_reference`, torch's int4 kernel against the bf16-rounded weight, GGUF Q4_0 /
Q4_1 / Q8_0 blocks against rung's numpy dequantizer, and the SmolLM2 Q4_1 file served
quantized."""

import numpy as np
import pytest
import torch

from rung.kernels import gguf_cpu
from rung.kernels.gguf_cpu import (
    GROUP_SIZE,
    GGUFBlockWeight,
    dequantize_reference,
    gguf_gemm,
    gguf_gemm_reference,
)
from rung.models.gguf import block_weight, dequantize_numpy
from rung.models.layers import QuantLinear

needs_kernel = pytest.mark.skipif(gguf_cpu.available() is not None,
                                  reason=f"rung's CPU kernel: {gguf_cpu.available()}")


def _random_blocks(num_rows: int, num_cols: int, type_name: str, seed: int) -> GGUFBlockWeight:
    data = _gguf_blocks(type_name, num_rows, num_cols, seed)
    return block_weight(data, type_name, (num_rows, num_cols))


def _gguf_blocks(type_name: str, num_rows: int, num_cols: int, seed: int) -> np.ndarray:
    """Random raw Q4_0 / Q4_1 / Q8_0 data [num_rows, bytes per row] as GGUF stores it."""
    rng = np.random.default_rng(seed)
    num_blocks = num_rows * num_cols // 32
    d = (rng.random(num_blocks) * 0.02 + 0.001).astype(np.float16).view(np.uint8)
    parts = [d.reshape(-1, 2)]
    if type_name == "Q4_1":
        parts.append((rng.standard_normal(num_blocks) * 0.05).astype(np.float16)
                     .view(np.uint8).reshape(-1, 2))
    width = 32 if type_name == "Q8_0" else 16
    parts.append(rng.integers(0, 256, (num_blocks, width), dtype=np.uint8))
    return np.concatenate(parts, axis=1).reshape(num_rows, -1)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_load_losslessly(type_name):
    """A block weight stands for the very fp32 values rung's dequantizer reads from the
    same bytes (f16 scales widen exactly; scale * q is exact in fp32)."""
    data = _gguf_blocks(type_name, 32, 96, seed=1)
    weight = block_weight(data, type_name, (32, 96))
    assert weight.shape == (32, 96) and weight.bits == (8 if type_name == "Q8_0" else 4)
    want = dequantize_numpy(data, type_name).reshape(32, 96)
    torch.testing.assert_close(dequantize_reference(weight), torch.from_numpy(want),
                               atol=0, rtol=0)


@needs_kernel
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("num_cols", [320, 288, 96])
def test_cpu_kernel_matches_its_reference(type_name, num_rows, num_cols):
    """Every tile of the kernel (1-4 activation rows, weight rows in fours and a tail of
    two; 4-bit blocks in pairs, 8 a chunk: K = 320 is 10 blocks, a chunk and a pair read
    with the last 8 blocks' scales; K = 288 is 9, the last block alone; K = 96 is a row
    under a chunk) equals the fp64 reference of the same formula. NOTE:
    tolerance 2e-6 of the output scale: fp32 accumulation over K in another order; a
    wrong nibble or pair order, a dropped group or the sign trick of 8-bit weights fails
    it by 100x."""
    weight = _random_blocks(70, num_cols, type_name, seed=num_rows)
    x = torch.randn(num_rows, num_cols, generator=torch.Generator().manual_seed(num_rows)) * 3
    got, want = gguf_gemm(x, weight), gguf_gemm_reference(x, weight)
    assert got.shape == (num_rows, 70) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-6 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0"])
def test_reference_is_the_dequantized_matmul_up_to_activation_rounding(type_name):
    """The int8 rounding of activations (llama.cpp's Q8 scheme) is the one approximation:
    each x moves by at most max|x| / 254 of its group, so an output moves by at most that
    times sum|w| of a row (the weights are exact); here the bound holds and the error is
    under 1% of the output scale."""
    weight = _random_blocks(48, 256, type_name, seed=3)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4))
    w = dequantize_reference(weight).double()                          # [48, 256]
    exact = x.double() @ w.t()
    got = gguf_gemm_reference(x, weight).double()
    group_max = x.double().reshape(4, -1, GROUP_SIZE).abs().amax(-1)     # [4, G]
    bound = (group_max.repeat_interleave(GROUP_SIZE, 1) / 254) @ w.abs().t()
    assert ((got - exact).abs() <= bound * (1 + 1e-6) + 1e-9).all()
    assert (got - exact).abs().max() < 1e-2 * exact.abs().max()


@pytest.mark.parametrize("kernel", ["rung", "torch_int4"])
def test_quant_linear_runs_fused_shards(kernel):
    """A fused layer (two shards, like gate/up) equals its reference on each kernel: rung's
    formula (tolerance as above), or bf16 x @ the bf16-rounded weight for torch's kernel
    (NOTE: it returns bf16, a relative step of 2^-8: 1.6e-2 of the scale bounds that and
    its order of summation; a wrong zero convention fails it by 10x)."""
    if kernel == "rung" and gguf_cpu.available() is not None:
        pytest.skip(gguf_cpu.available())
    shards = [_random_blocks(32, 256, "Q4_1", seed=2), _random_blocks(16, 256, "Q4_1", seed=3)]
    layer = QuantLinear(256, [32, 16])
    for i, shard in enumerate(shards):
        layer.load_quantized(shard, i)
    layer.pack(torch.device("cpu"), kernel)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    stacked = gguf_cpu.stack_rows(shards)
    if kernel == "rung":
        got, want = layer(x), gguf_gemm_reference(x, stacked)
        torch.testing.assert_close(got, want, atol=2e-6 * want.abs().max().item(), rtol=0)
        return
    # NOTE: torch's kernel reads scale and zero = offset + 8 scale in bf16
    scale = stacked.scale().bfloat16().float()
    zero = (stacked.offset() + 8 * stacked.scale()).bfloat16().float()
    weight = ((stacked.values().float() - 8).reshape(48, -1, GROUP_SIZE) * scale[..., None]
              + zero[..., None]).reshape(48, 256)
    want = x.bfloat16().float() @ weight.t()
    got = layer(x.bfloat16())
    assert got.dtype == torch.bfloat16 and got.shape == (3, 48)
    torch.testing.assert_close(got.float(), want, atol=1.6e-2 * want.abs().max().item(),
                               rtol=0)


def test_quant_linear_refuses_missing_shards_and_torch_int4_other_dtypes():
    layer = QuantLinear(64, [16, 16])
    layer.load_quantized(_random_blocks(16, 64, "Q4_0", seed=5), 0)
    with pytest.raises(ValueError, match=r"lacks checkpoint shards \[1\]"):
        layer.pack(torch.device("cpu"))
    layer.load_quantized(_random_blocks(16, 64, "Q4_0", seed=6), 1)
    layer.pack(torch.device("cpu"), "torch_int4")
    with pytest.raises(ValueError, match="bfloat16 activations, got torch.float32"):
        layer(torch.randn(2, 64))
    head = QuantLinear(64, [16])
    head.load_quantized(_random_blocks(16, 64, "Q8_0", seed=7), None)
    with pytest.raises(ValueError, match="cannot run 8-bit blocks"):
        head.pack(torch.device("cpu"), "torch_int4")


@needs_kernel
@pytest.mark.slow
def test_cpu_kernel_runs_inside_an_inductor_graph():
    """Compiled graphs call the custom op rung::gguf_gemm: same numbers as eager."""
    layer = QuantLinear(128, [32])
    layer.load_quantized(_random_blocks(32, 128, "Q4_1", seed=7), None)
    layer.pack(torch.device("cpu"))
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(8))
    compiled = torch.compile(lambda t: layer(t.relu()) * 2, backend="inductor",
                             fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x.relu()) * 2, atol=0, rtol=0)


def test_quantization_gguf_needs_a_gguf_file():
    from rung.models.loader import load_model

    with pytest.raises(ValueError, match="serves GGUF files"):
        load_model("tiny-llama", torch.float32, "cpu", quantization="gguf")


def test_torch_int4_kernel_refuses_a_dtype_it_cannot_run(monkeypatch):
    from rung.models import loader

    monkeypatch.setattr(loader, "quant_kernel", lambda device: "torch_int4")
    with pytest.raises(ValueError, match="dtype torch.float32 cannot run it"):
        loader.check_quantization("gguf", torch.float32, torch.device("cpu"))


def test_smollm2_q4_1_served_quantized_generates_the_fp32_text():
    """The shipped Q4_1 file loads with its Q4_1 layers and its tied Q8_0 head in their
    blocks (no fp32 copy of them) and greedily writes what the dequantized fp32 model
    writes, on a prompt whose every token wins by a margin larger than the quantized
    kernel's error."""
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
            assert isinstance(layer.mlp.gate_up_proj, QuantLinear)
            assert isinstance(layer.self_attn.qkv_proj, QuantLinear)
            if gguf_cpu.available() is None:
                assert isinstance(model.lm_head, QuantLinear)
                assert model.lm_head.type_name == "Q8_0"
            # only the embedding (for its gather) and the norms stay float parameters
            assert sum(p.numel() for p in model.parameters()) < 30_000_000
        texts.append(llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text)
    assert texts[0] == texts[1]


def test_smollm2_q4_1_compiled_graphs_go_live_with_the_eager_text():
    """Compiled FULL graphs of the quantized model pass their capture check and replay
    eager's greedy text: the check compares each layer on eager's input, where the last
    hidden states of a model with int8-rounded activations differ by compounded rounding
    flips (the whole-stack comparison refused every size)."""
    from rung.models.loader import resolve_model_path
    from rung.runtime import LLM, SamplingParams

    try:
        resolve_model_path("smollm2-135m")
    except ValueError as e:
        pytest.skip(f"SmolLM2 weights not installed ({e})")
    if gguf_cpu.available() is not None:
        pytest.skip(f"rung's GGUF CPU kernel is not available: {gguf_cpu.available()}")
    conversation = [[{"role": "user", "content": "What is 7 times 8?"}]]
    params = SamplingParams(temperature=0, max_tokens=12)
    texts = []
    for eager in (True, False):
        llm = LLM("smollm2-135m", device="cpu", max_model_len=96, max_num_seqs=1,
                  quantization="gguf", enforce_eager=eager,
                  compilation_config={"cudagraph_mode": "full_decode_only",
                                      "cudagraph_capture_sizes": [1],
                                      "graph_backend": "compiled",
                                      "graph_startup": "blocking"})
        texts.append(llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text)
        if not eager:
            assert llm.engine.stats()["graph_replays"]["FULL:1"] >= 10
    assert texts[0] == texts[1]


def test_default_smollm2_runs_its_file_types_and_answers_the_readme_question():
    """`LLM("smollm2-135m")` with no quantization argument serves the file's Q4_1 layers
    and Q8_0 head in their blocks (no fp32 copy of them) and answers README's first
    question as README shows, as the dequantized fp32 model (quantization=None) does."""
    from rung.models.loader import resolve_model_path
    from rung.runtime import LLM, SamplingParams

    try:
        resolve_model_path("smollm2-135m")
    except ValueError as e:
        pytest.skip(f"SmolLM2 weights not installed ({e})")
    if gguf_cpu.available() is not None:
        pytest.skip(f"rung's GGUF CPU kernel is not available: {gguf_cpu.available()}")
    conversation = [[{"role": "user", "content": "What is the capital of Japan?"}]]
    params = SamplingParams(temperature=0, max_tokens=16)
    texts = []
    for kwargs in ({}, {"quantization": None}):
        llm = LLM("smollm2-135m", device="cpu", max_model_len=96, max_num_seqs=1,
                  enforce_eager=True, **kwargs)
        model = llm.engine.loaded.model
        quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
        assert len(quantized) == (121 if not kwargs else 0)
        texts.append(llm.chat(conversation, params, use_tqdm=False)[0].outputs[0].text)
    assert texts == ["The capital of Japan is Tokyo."] * 2


def test_default_smollm2_holds_its_file_bytes_and_no_float_table():
    """The default load of SmolLM2's Q4_1 file keeps at most 1.1x the file's tensor bytes
    resident (each storage counted once): the tied Q8_0 embedding is served from the head's
    blocks, no float [vocab, hidden] table."""
    from rung.bench.gguf_memory import file_tensor_bytes, resident_bytes
    from rung.models.loader import load_model, resolve_model_path

    try:
        path = resolve_model_path("smollm2-135m")
    except ValueError as e:
        pytest.skip(f"SmolLM2 weights not installed ({e})")
    if gguf_cpu.available() is not None:
        pytest.skip(f"rung's GGUF CPU kernel is not available: {gguf_cpu.available()}")
    loaded = load_model("smollm2-135m")
    rows, floats, largest = resident_bytes(loaded.model)
    assert rows + floats <= 1.1 * file_tensor_bytes(path)
    table = loaded.config["vocab_size"] * loaded.config["hidden_size"] * 4
    assert largest < table / 16
