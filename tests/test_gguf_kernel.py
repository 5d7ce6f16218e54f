"""rung's GGUF CPU kernel on every type it serves (kernels/gguf_cpu.py,
csrc/gguf_gemm.c, csrc/gguf_op.cpp): each type's block decode against the gguf package's
own dequantizer (an independent decoder), the kernel against the fp64 reference of its
formula on both ISA paths and any thread count, and a row's result independent of the
rows computed beside it (batch invariance)."""

import numpy as np
import pytest
import torch

from rung.kernels import gguf_cpu
from rung.kernels.gguf_cpu import (
    FILE_BLOCK,
    KERNEL_TYPES,
    dequantize_reference,
    gguf_gemm,
    gguf_gemm_reference,
)
from rung.models.gguf import block_weight

needs_kernel = pytest.mark.skipif(gguf_cpu.available() is not None,
                                  reason=f"rung's CPU kernel: {gguf_cpu.available()}")

# where each file block keeps its f16 fields (random bytes there could be inf / NaN)
_F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2),
               "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,),
               "Q2_K": (80, 82)}
NEW_TYPES = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K")


def raw_blocks(type_name: str, num_rows: int, num_cols: int, seed: int) -> np.ndarray:
    """Random raw data [num_rows, file bytes per row] of ``type_name`` as GGUF stores it:
    every value, scale and bit pattern random, the f16 fields finite."""
    rng = np.random.default_rng(seed)
    block_bytes, groups = FILE_BLOCK[type_name]
    num_blocks = num_rows * num_cols // (32 * groups)
    blocks = rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8)
    for i, start in enumerate(_F16_FIELDS[type_name]):
        value = rng.random(num_blocks) * 0.02 + 0.001
        if i == 1 and type_name in ("Q4_1", "Q5_1"):
            value = rng.standard_normal(num_blocks) * 0.05      # a signed minimum
        blocks[:, start:start + 2] = value.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(num_rows, -1)


def _cols(type_name: str) -> list[int]:
    """K values that reach every path: legacy types in chunks of 8 groups with a short
    last one (K = 320, 288: 10 and 9 groups) and a row under a chunk (96); K-quants one and
    three super-blocks."""
    return [256, 768] if type_name.endswith("_K") else [320, 288, 96]


@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_block_decode_matches_the_gguf_package(type_name):
    """rung's row layout decodes to the very values the gguf package's reference
    dequantizer reads from the same file bytes (bit for bit, in fp32)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    num_cols = _cols(type_name)[-1]
    data = raw_blocks(type_name, 12, num_cols, seed=1)
    weight = block_weight(data, type_name, (12, num_cols))
    assert weight.shape == (12, num_cols)
    want = dequantize(data, GGMLQuantizationType[type_name]).reshape(12, num_cols)
    torch.testing.assert_close(dequantize_reference(weight), torch.from_numpy(want),
                               atol=0, rtol=0)
    # resident bytes: the file's, but for the K-quants' unpacked 6-bit scales (4 bytes a
    # super-block of 256)
    unpacked = 4 * 12 * num_cols // 256 if type_name in ("Q4_K", "Q5_K", "Q3_K") else 0
    assert weight.rows.numel() == data.size + unpacked


@needs_kernel
@pytest.mark.parametrize("isa", ["avx2", None])
@pytest.mark.parametrize("type_name", NEW_TYPES)
def test_kernel_matches_its_reference(type_name, isa):
    """Every tile (1-4 activation rows; weight rows in fours, twos and ones) of every
    type on both ISA paths equals the fp64 reference of the kernel's formula (the exact
    decode times the int8-rounded activations). NOTE: tolerance 2e-6 of the output scale:
    fp32 accumulation in another order; a wrong bit, nibble half, scale or group order
    fails it by 100x."""
    gguf_cpu.set_isa(isa)
    try:
        for num_cols in _cols(type_name):
            weight = block_weight(raw_blocks(type_name, 23, num_cols, seed=num_cols),
                                  type_name, (23, num_cols))
            for num_rows in (1, 2, 3, 4, 5, 9):
                x = torch.randn(num_rows, num_cols,
                                generator=torch.Generator().manual_seed(num_rows)) * 3
                got, want = gguf_gemm(x, weight), gguf_gemm_reference(x, weight)
                assert got.shape == (num_rows, 23)
                torch.testing.assert_close(got, want, rtol=0,
                                           atol=2e-6 * want.abs().max().item())
    finally:
        gguf_cpu.set_isa(None)


@needs_kernel
@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_isa_paths_and_thread_counts_give_identical_bits(type_name):
    """The AVX-512 VNNI path (where the CPU has it) and the forced AVX2 path compute the
    same integer dots, and a thread split never reorders a row's sum: the outputs are
    bit-identical across paths and 1, 2, 3 threads, for decode and prefill shapes."""
    num_cols = _cols(type_name)[0]
    weight = block_weight(raw_blocks(type_name, 70, num_cols, seed=5), type_name,
                          (70, num_cols))
    threads = torch.get_num_threads()
    try:
        for num_rows in (1, 37):
            x = torch.randn(num_rows, num_cols, generator=torch.Generator().manual_seed(6))
            outs = []
            for isa in ("avx2", None):
                gguf_cpu.set_isa(isa)
                for n in (1, 2, 3):
                    torch.set_num_threads(n)
                    outs.append(gguf_gemm(x, weight))
            for out in outs[1:]:
                assert torch.equal(out, outs[0])
    finally:
        gguf_cpu.set_isa(None)
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_a_row_is_bit_identical_in_any_batch(type_name):
    """Batch invariance: each output row equals, bit for bit, that row computed alone
    (M = 1), whatever M (tiles of 1-4 rows, prefill tasks of 16) it was computed in."""
    num_cols = _cols(type_name)[0]
    weight = block_weight(raw_blocks(type_name, 45, num_cols, seed=7), type_name,
                          (45, num_cols))
    x = torch.randn(40, num_cols, generator=torch.Generator().manual_seed(8))
    alone = torch.cat([gguf_gemm(x[i:i + 1], weight) for i in range(40)])
    for num_rows in (2, 3, 5, 17, 40):
        assert torch.equal(gguf_gemm(x[:num_rows], weight), alone[:num_rows])
    assert torch.equal(gguf_gemm(x[3:40], weight), alone[3:40])


@pytest.mark.parametrize("type_name", KERNEL_TYPES)
def test_embedding_lookup_decodes_the_rows_the_dequantized_table_holds(type_name):
    """A quantized embedding's lookup (any ids, repeated, out of order; in the model's
    dtype) equals the rows of the table the gguf package dequantizes from the same file
    bytes, bit for bit; an id past the table is refused."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from rung.models.layers import QuantEmbedding

    num_rows, num_cols = 40, _cols(type_name)[0]
    data = raw_blocks(type_name, num_rows, num_cols, seed=3)
    table = torch.from_numpy(dequantize(data, GGMLQuantizationType[type_name])
                             .reshape(num_rows, num_cols))
    embedding = QuantEmbedding(num_rows, num_cols)
    embedding.load_quantized(block_weight(data, type_name, (num_rows, num_cols)), None)
    ids = torch.tensor([[7, 0, 39, 7], [3, 3, 12, 1]])
    assert torch.equal(embedding(ids), table[ids])
    assert torch.equal(embedding.to(torch.bfloat16)(ids), table[ids].bfloat16())
    with pytest.raises(ValueError, match="40 rows"):
        embedding(torch.tensor([2, 40]))


def test_capture_check_takes_an_int8_rounding_flip_and_refuses_a_wrong_row():
    """Compiled graphs' capture check (graphs/cpu_compiled/artifacts.py): an artifact
    whose input rounds one activation a step apart from eager's (inductor's fused norm
    differs from eager in the last bit) still goes live; a wrong row (another request's)
    does not."""
    from rung.graphs.cpu_compiled.artifacts import reproduces_eager

    weight = block_weight(raw_blocks("Q8_0", 256, 512, seed=3), "Q8_0", (256, 512))
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(0))
    x[:, 0] = 12.7                  # each row's first group: max 12.7, one step 0.1
    x[:, 1] = 0.25 + 1e-5           # eager rounds it to 3 steps ...
    nudged = x.clone()
    nudged[:, 1] = 0.25 - 1e-5      # ... the artifact, a hair below, to 2
    want, got = gguf_gemm(x, weight), gguf_gemm(nudged, weight)
    assert not torch.allclose(got, want, rtol=1e-3, atol=1e-4)     # past elementwise
    assert reproduces_eager(got, want, rounded=True)
    assert not reproduces_eager(got, want, rounded=False)          # float layers: as before
    wrong = got.clone()
    wrong[1] = want[2]
    assert not reproduces_eager(wrong, want, rounded=True)


@pytest.mark.parametrize("shape", [(1, 7, 5), (3, 13, 64), (4, 960, 576), (16, 130, 33),
                                   (17, 50, 64)])
def test_f32_linear_matches_fp64_and_is_the_same_bits_in_any_batch(shape):
    """rung::f32_linear (a CPU model's float32 linears): x @ w^T within fp32 rounding of
    the fp64 product, a row's bits the same alone or among up to 16 rows, on either ISA
    and any thread count."""
    from rung.kernels.gguf_cpu import f32_linear

    num_rows, num_out, num_in = shape
    gen = torch.Generator().manual_seed(num_out)
    x = torch.randn(num_rows, num_in, generator=gen)
    w = torch.randn(num_out, num_in, generator=gen)
    want = (x.double() @ w.double().t()).float()
    outs = []
    threads = torch.get_num_threads()
    try:
        for isa, num_threads in (("avx2", 1), (None, 1), (None, 3)):
            gguf_cpu.set_isa(isa)
            torch.set_num_threads(num_threads)
            outs.append(f32_linear(x, w))
            torch.testing.assert_close(outs[-1], want, rtol=1e-5, atol=1e-4)
    finally:
        gguf_cpu.set_isa(None)
        torch.set_num_threads(threads)
    if num_rows <= 16:                       # the GEMV's rows; more are BLAS's GEMM
        assert all(torch.equal(out, outs[0]) for out in outs)
        alone = torch.cat([f32_linear(x[i:i + 1], w) for i in range(num_rows)])
        assert torch.equal(alone, outs[0])
