"""The capture-size ladder: padded token counts a graph is captured for."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def default_ladder(max_size: int) -> list[int]:
    """[1, 2, 4] + every 8 up to 256 + every 16 up to max; max always included."""
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_size + 1, 16))
    return sorted({s for s in sizes if s <= max_size} | {max_size})


def capture_sizes(user_sizes: list[int] | None, max_num_seqs: int, num_spec_tokens: int,
                  max_num_batched_tokens: int) -> list[int]:
    """Validated ladder, sizes rounded up to multiples of ``1 + num_spec_tokens``.

    NOTE: the largest size is always in the ladder (failure class 5).
    """
    step = 1 + num_spec_tokens
    max_size = min(max_num_seqs * step, max_num_batched_tokens)
    max_size -= max_size % step
    if user_sizes is None:
        sizes = default_ladder(max_size)
    else:
        sizes = list(user_sizes)
        for s in sizes:
            if not isinstance(s, int) or isinstance(s, bool) or s < 1:
                raise ValueError(f"cudagraph capture size {s!r} must be a positive integer")
            if s > max_num_batched_tokens:
                raise ValueError(f"cudagraph capture size {s} exceeds max_num_batched_tokens="
                                 f"{max_num_batched_tokens}")
    rounded = {-(-s // step) * step for s in sizes}
    limit = max(max_size, step)
    kept = sorted(s for s in rounded if s <= limit)
    if user_sizes is not None and len(kept) < len(rounded):
        dropped = sorted(s for s in rounded if s > limit)
        logger.warning("cudagraph capture sizes %s (rounded to multiples of %d) exceed the "
                       "largest batch this config schedules, %d tokens (max_num_seqs=%d x %d, "
                       "max_num_batched_tokens=%d); %s", dropped, step, limit, max_num_seqs,
                       step, max_num_batched_tokens,
                       f"capturing {kept}" if kept else "NO graph is captured: every step "
                       "runs eagerly")
    return kept


def draft_capture_sizes(user_sizes: list[int] | None, max_num_seqs: int) -> list[int]:
    """Request counts a draft step (one query per request) is captured for."""
    sizes = default_ladder(max_num_seqs) if user_sizes is None else user_sizes
    return sorted({s for s in sizes if 1 <= s <= max_num_seqs})
