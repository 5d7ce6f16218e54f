"""CUDA graph modes: how much of a forward pass a captured graph covers."""

from __future__ import annotations

import enum


class CUDAGraphMode(enum.Enum):
    """User-facing graph mode (vLLM's vocabulary).

    NONE, PIECEWISE and FULL are runtime modes: the mode one batch actually runs in.
    FULL_DECODE_ONLY and FULL_AND_PIECEWISE are policies: FULL for uniform decode
    batches, and NONE or PIECEWISE respectively for mixed batches.
    """

    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @classmethod
    def parse(cls, value: str | CUDAGraphMode) -> CUDAGraphMode:
        if isinstance(value, CUDAGraphMode):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown cudagraph mode {value!r}; expected one of {names}") from None

    def decode_mode(self) -> CUDAGraphMode:
        """Runtime mode for uniform (decode / spec-verify) batches."""
        if self in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY,
                    CUDAGraphMode.FULL_AND_PIECEWISE):
            return CUDAGraphMode.FULL
        return self

    def mixed_mode(self) -> CUDAGraphMode:
        """Runtime mode for mixed prefill + decode batches."""
        if self in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE):
            return CUDAGraphMode.PIECEWISE
        if self == CUDAGraphMode.FULL:
            return CUDAGraphMode.FULL
        return CUDAGraphMode.NONE

    def has_full(self) -> bool:
        return self.decode_mode() == CUDAGraphMode.FULL or self.mixed_mode() == CUDAGraphMode.FULL

    def has_piecewise(self) -> bool:
        return self.mixed_mode() == CUDAGraphMode.PIECEWISE or self == CUDAGraphMode.PIECEWISE


class GraphSupport(enum.IntEnum):
    """How much graph capture an attention backend supports, weakest first."""

    NEVER = 0            # attention must run eagerly: PIECEWISE at most
    UNIFORM_BATCH = 1    # FULL capture for uniform-query-length batches only
    ALWAYS = 2           # FULL capture for any batch
