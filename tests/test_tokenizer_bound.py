"""`encode_within`: a prompt that fits is encoded as `encode` does; one far over the limit is
refused after a prefix of a few times the limit is encoded, whatever its size."""

import pytest

from rung.models.tokenizer import ByteTokenizer, TooManyTokens, encode_within


class _Counting(ByteTokenizer):
    def __init__(self) -> None:
        self.num_chars_encoded = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.num_chars_encoded += len(text)
        return super().encode(text, add_special_tokens)


@pytest.mark.parametrize("text", ["", "Hi", "x" * 255, "x" * 1000, "é" * 300])
def test_a_text_gets_the_ids_encode_gives(text):
    tok = ByteTokenizer()
    for special in (True, False):
        assert encode_within(tok, text, 256, special) == tok.encode(text, special)


def test_a_text_far_over_the_limit_costs_a_few_limits_not_its_size():
    tok = _Counting()
    with pytest.raises(TooManyTokens) as e:
        encode_within(tok, "hello world " * 600_000, 256)
    assert e.value.max_tokens == 256 and e.value.num_tokens > 256
    assert tok.num_chars_encoded <= 8 * 256 * 3, tok.num_chars_encoded
    assert "more than 256 tokens" in str(e.value)
