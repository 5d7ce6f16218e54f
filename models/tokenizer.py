"""Tokenizers: a byte-level one for presets, HF `tokenizers` for local folders."""

from __future__ import annotations

import os


class ByteTokenizer:
    """UTF-8 bytes offset past three specials: 0 pad, 1 bos, 2 eos."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    _OFFSET = 3
    vocab_size = 256 + _OFFSET

    def encode(self, text: str) -> list[int]:
        return [self.bos_token_id] + [b + self._OFFSET for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int]) -> str:
        data = bytes(t - self._OFFSET for t in token_ids
                     if self._OFFSET <= t < self._OFFSET + 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """`tokenizer.json` through the `tokenizers` library."""

    def __init__(self, path: str, eos_token_id: int | None, bos_token_id: int | None) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(path)
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)


def load_tokenizer(folder: str, cfg: dict):
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        return None
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    return HFTokenizer(path, eos, cfg.get("bos_token_id"))
