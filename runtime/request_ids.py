"""Request ids rung makes for itself, in a namespace no user id can alias.

A user names a request with a ``str``. The samples of an ``n > 1`` request and the prompts
of ``LLM.generate`` get ids of their own types, which never compare equal to a ``str``: a
user's ``"0_a"`` and the first sample of ``"a"`` are two requests, whichever comes first.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GenerateId:
    """A prompt of ``LLM.generate``: the ``index``-th prompt that LLM ran."""

    index: int

    def __str__(self) -> str:
        return f"generate-{self.index}"


@dataclasses.dataclass(frozen=True)
class SampleId:
    """Sample ``index`` of the ``n > 1`` request ``parent``."""

    parent: RequestId
    index: int

    def __str__(self) -> str:
        return f"{self.parent}[sample {self.index}]"


RequestId = str | GenerateId | SampleId


def check_request_id(request_id: object) -> None:
    """A caller names a request with a str (``LLM.generate`` with a GenerateId); sample ids
    are the engine's own."""
    if isinstance(request_id, SampleId):
        raise ValueError(f"request_id {request_id!r} is the id of one sample of an n > 1 "
                         f"request: add or abort its parent {request_id.parent!r}")
    if not isinstance(request_id, (str, GenerateId)):
        raise ValueError(f"request_id {request_id!r} must be a str, got "
                         f"{type(request_id).__name__}")
