"""The tied lm_head on CPU (models/layers.py `lm_head_logits`): the tied weight's logits
for every row count, through rung's float32 GEMV on the embedding's own rows, or, where
that kernel cannot build, through BLAS and a W^T copy."""

import torch

from rung.models import layers
from rung.models.layers import MAX_ROWS_TRANSPOSED_HEAD
from rung.models.loader import load_model

ROW_COUNTS = (1, MAX_ROWS_TRANSPOSED_HEAD, MAX_ROWS_TRANSPOSED_HEAD + 1, 9, 16, 17, 40)


def _check_logits(model) -> None:
    for num_rows in ROW_COUNTS:
        hidden = torch.randn(num_rows, model.lm_head.in_features,
                             generator=torch.Generator().manual_seed(num_rows))
        want = torch.nn.functional.linear(hidden, model.model.embed_tokens.weight)
        torch.testing.assert_close(model.compute_logits(hidden), want, atol=1e-5, rtol=1e-5)


def test_tied_head_reads_the_embedding_rows_with_no_copy():
    model = load_model("tiny-qwen3", torch.float32, "cpu").model       # tied embeddings
    head = model.lm_head
    assert head.weight is model.model.embed_tokens.weight
    assert layers.is_f32_gemv(head)
    assert getattr(head, "weight_t", None) is None       # no second [vocab, hidden] table
    _check_logits(model)


def test_without_the_gemv_kernel_the_tied_head_gets_a_blas_copy(monkeypatch):
    monkeypatch.setattr(layers, "gguf_cpu_available", lambda: "no C compiler (test)")
    model = load_model("tiny-qwen3", torch.float32, "cpu").model
    head = model.lm_head
    assert not layers.is_f32_gemv(head)
    assert head.weight_t is not None
    _check_logits(model)


def test_untied_head_gets_no_copy():
    head = load_model("tiny-llama", torch.float32, "cpu").model.lm_head   # untied
    assert getattr(head, "weight_t", None) is None


def test_a_kernel_build_that_fails_leaves_the_model_on_blas(monkeypatch, caplog):
    def fail() -> None:
        raise RuntimeError("compiling rung's GGUF CPU kernel failed (test)")

    monkeypatch.setattr(layers, "load_kernel", fail)
    with caplog.at_level("WARNING", logger="rung.models.layers"):
        model = load_model("tiny-qwen3", torch.float32, "cpu").model
    assert not layers.is_f32_gemv(model.lm_head)
    assert "float32 linears run on BLAS: compiling rung's GGUF CPU kernel failed" in caplog.text
    _check_logits(model)
