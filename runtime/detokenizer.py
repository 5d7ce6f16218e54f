"""Incremental detokenization: a request's output text grows by deltas, and stop strings are
searched only where the new characters could complete one.

Decoding the whole output after every token costs O(n) per token, O(n^2) per request; here
each token costs one decode of a short window, and the final text is the full decode.
"""

from __future__ import annotations

from collections.abc import Callable

# What a decoder writes for bytes that are not (yet) a whole UTF-8 character.
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """The output text of one request, grown by deltas as its tokens arrive (vLLM's scheme).

    Two offsets into the output ids, both at token boundaries where the text so far is
    whole characters:
      read_offset    tokens before it are in ``text``;
      prefix_offset  the window each update decodes starts here (<= read_offset), so
                     decoders that look at the previous piece (SentencePiece's leading
                     space) see it.
    An update decodes ``ids[prefix_offset:]`` and emits what it adds to
    ``ids[prefix_offset:read_offset]``'s text. A window ending in U+FFFD (e.g. the first
    byte of a 3-byte character from a byte-level BPE piece) is held back until a later
    token completes it; ``finish`` emits whatever is still held, as a full decode would.

    NOTE: the request's ``token_ids`` list is read in place (prompt + output, appended to).
    """

    def __init__(self, decode: Callable[[list[int]], str], token_ids: list[int],
                 num_prompt_tokens: int, stop_buffer_length: int = 0) -> None:
        self._decode = decode
        self._token_ids = token_ids           # the request's prompt + output ids
        self._start = num_prompt_tokens       # output id i is token_ids[start + i]
        # streamed text holds back this many trailing characters: they may begin a stop
        # string that is not to be shown (vLLM's stop buffer)
        self.stop_buffer_length = stop_buffer_length
        self.text = ""                        # whole characters of output ids [0, read)
        self.num_tokens = 0                   # output ids taken so far
        self.finished = False                 # finish() or truncate() ran: text is final
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text: str | None = ""    # decode(output ids [prefix, read)), or None
                                              # until an update needs it

    def update(self, num_tokens: int) -> int:
        """Take the output ids up to ``num_tokens``; the number of characters added."""
        if self.finished or num_tokens <= self.num_tokens:
            return 0
        self.num_tokens = num_tokens
        window = self._window(num_tokens)
        if window.endswith(REPLACEMENT_CHAR) or len(window) <= len(self._prefix()):
            return 0                          # an incomplete character, or nothing new
        return self._emit(window, num_tokens)

    def finish(self) -> str:
        """The request is done: emit what is held back (U+FFFD for an incomplete character,
        as a full decode writes it). Returns the final text."""
        if not self.finished:
            if self._read_offset < self.num_tokens:
                self._emit(self._window(self.num_tokens), self.num_tokens)
            self.finished = True
        return self.text

    def truncate(self, text_end: int) -> None:
        """A stop string was found: the text ends at ``text_end`` and takes no more tokens."""
        self.text = self.text[:text_end]
        self.finished = True

    def text_at(self, num_tokens: int, final: bool) -> str:
        """The text of an output that holds the first ``num_tokens`` output ids (``final``:
        the request had finished then)."""
        if num_tokens < self.num_tokens or (self.finished and not final):
            # NOTE: read after later steps moved this detokenizer on: replay the snapshot
            replay = IncrementalDetokenizer(self._decode, self._token_ids, self._start,
                                            self.stop_buffer_length)
            return replay.text_at(num_tokens, final)
        self.update(num_tokens)
        if final:
            self.finish()
        return self.streamed_text()

    def streamed_text(self) -> str:
        """The text a stream may show now: all of it once finished, else all but the stop
        buffer."""
        if self.finished or not self.stop_buffer_length:
            return self.text
        return self.text[:max(len(self.text) - self.stop_buffer_length, 0)]

    def _window(self, num_tokens: int) -> str:
        start = self._start
        return self._decode(self._token_ids[start + self._prefix_offset:start + num_tokens])

    def _prefix(self) -> str:
        if self._prefix_text is None:
            start = self._start
            self._prefix_text = self._decode(
                self._token_ids[start + self._prefix_offset:start + self._read_offset])
        return self._prefix_text

    def _emit(self, window: str, num_tokens: int) -> int:
        # NOTE: the window starts with the prefix's text: decoding starts at a boundary
        # where the text so far was whole characters
        delta = window[len(self._prefix()):]
        self._prefix_offset, self._read_offset = self._read_offset, num_tokens
        self._prefix_text = None          # NOTE: a finished output never needs it
        self.text += delta
        return len(delta)


def find_stop_string(text: str, num_new_chars: int, stops: list[str],
                     include_stop_str_in_output: bool) -> tuple[str, int] | None:
    """The stop string that occurs first among those ending in the last ``num_new_chars``
    characters of ``text``, and where the output text then ends; None if none does.

    Only ``len(stop) - 1`` old characters before the new ones are searched per stop string:
    an earlier occurrence would have ended the output at an earlier token.
    """
    if not num_new_chars:
        return None
    hits = []
    for stop in stops:
        index = text.find(stop, max(len(text) - num_new_chars - len(stop) + 1, 0))
        if index >= 0:
            hits.append((index, stop))
    if not hits:
        return None
    index, stop = min(hits)
    return stop, index + (len(stop) if include_stop_str_in_output else 0)
