"""The tied lm_head's W^T copy (models/layers.py `lm_head_logits`): same logits as the
tied weight for every row count, and made only where it is meant to be."""

import torch

from rung.models.layers import MAX_ROWS_TRANSPOSED_HEAD
from rung.models.loader import load_model


def test_tied_head_copy_gives_the_tied_weights_logits():
    loaded = load_model("tiny-qwen3", torch.float32, "cpu")      # tied embeddings
    model = loaded.model
    head = model.lm_head
    assert head.weight is model.model.embed_tokens.weight
    assert head.weight_t.shape == (head.in_features, head.out_features)
    for num_rows in (1, MAX_ROWS_TRANSPOSED_HEAD, MAX_ROWS_TRANSPOSED_HEAD + 1, 9):
        hidden = torch.randn(num_rows, head.in_features, generator=torch.Generator()
                             .manual_seed(num_rows))
        want = torch.nn.functional.linear(hidden, model.model.embed_tokens.weight)
        torch.testing.assert_close(model.compute_logits(hidden), want, atol=1e-5, rtol=1e-5)


def test_untied_head_gets_no_copy():
    head = load_model("tiny-llama", torch.float32, "cpu").model.lm_head   # untied
    assert getattr(head, "weight_t", None) is None
