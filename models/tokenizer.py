"""Tokenizers: a byte-level one for presets, HF `tokenizers` for local folders and GGUF."""

from __future__ import annotations

import os


class ByteTokenizer:
    """UTF-8 bytes offset past three specials: 0 pad, 1 bos, 2 eos."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    _OFFSET = 3
    vocab_size = 256 + _OFFSET

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        bos = [self.bos_token_id] if add_special_tokens else []
        return bos + [b + self._OFFSET for b in text.encode("utf-8")]

    def id_to_token(self, token_id: int | None) -> str | None:
        return None if token_id is None else {0: "<pad>", 1: "<s>", 2: "</s>"}.get(token_id)

    _SPECIALS = {0: "<pad>", 1: "<s>", 2: "</s>"}

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        if not skip_special_tokens:
            return _join_special(self, token_ids, spaces_between_special_tokens,
                                 self._SPECIALS)
        data = bytes(t - self._OFFSET for t in token_ids
                     if self._OFFSET <= t < self._OFFSET + 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer` (from a folder's `tokenizer.json` or built from a GGUF
    vocabulary) with the model's special ids and chat template."""

    def __init__(self, tokenizer, eos_token_id: int | None, bos_token_id: int | None,
                 add_bos_token: bool = False, chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token    # NOTE: a tokenizer.json adds its own BOS
        self.chat_template = chat_template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            return self._tok.decode(token_ids, skip_special_tokens=True)
        specials = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()
                    if t.special}
        return _join_special(self, token_ids, spaces_between_special_tokens, specials)

    def id_to_token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._tok.id_to_token(token_id)


def _join_special(tokenizer, token_ids: list[int], spaces: bool,
                  specials: dict[int, str]) -> str:
    """Text with special tokens kept: runs of ordinary tokens decoded as a whole, each
    special token as its own text, joined by a space when ``spaces`` (vLLM's
    ``spaces_between_special_tokens``)."""
    pieces, run = [], []
    for t in token_ids:
        if t in specials:
            if run:
                pieces.append(tokenizer.decode(run))
                run = []
            pieces.append(specials[t])
        else:
            run.append(t)
    if run:
        pieces.append(tokenizer.decode(run))
    return (" " if spaces else "").join(pieces)


# a text over the limit is counted in prefixes of this many characters per allowed token,
# doubling: a prompt that fits has fewer characters per token than this and is encoded once
_FIRST_PREFIX_CHARS_PER_TOKEN = 8
# NOTE: BPE encodes a prefix as it encodes the whole text except near the cut, where a
# word cut in two may take a few tokens more: a prefix over the limit by more than this
# is a text over it
_CUT_MARGIN_TOKENS = 64


class TooManyTokens(ValueError):
    """A text has more than ``max_tokens`` tokens: its first ``num_chars`` characters
    alone have ``num_tokens``."""

    def __init__(self, num_tokens: int, num_chars: int, max_tokens: int) -> None:
        super().__init__(f"more than {max_tokens} tokens: its first {num_chars} characters "
                         f"alone have {num_tokens}")
        self.num_tokens, self.num_chars, self.max_tokens = num_tokens, num_chars, max_tokens


def encode_within(tokenizer, text: str, max_tokens: int, add_special_tokens: bool = True
                  ) -> list[int]:
    """``tokenizer.encode(text)``, or TooManyTokens once a prefix of ``text`` has more than
    ``max_tokens`` tokens: a text far over the limit costs the encoding of a few times
    ``max_tokens`` tokens, not of the whole text (a 7.2 MB prompt is 1.2M tokens, seconds
    and most of a GB inside the tokenizer)."""
    num_chars = _FIRST_PREFIX_CHARS_PER_TOKEN * max_tokens
    while num_chars < len(text):
        num_tokens = len(tokenizer.encode(text[:num_chars],
                                          add_special_tokens=add_special_tokens))
        if num_tokens > max_tokens + _CUT_MARGIN_TOKENS:
            raise TooManyTokens(num_tokens, num_chars, max_tokens)
        num_chars *= 2
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def load_tokenizer(folder: str, cfg: dict):
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        return None
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    from rung.models.chat_template import load_chat_template

    return HFTokenizer(path, eos, cfg.get("bos_token_id"),
                       chat_template=load_chat_template(folder))
