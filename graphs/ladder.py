"""The capture-size ladder: padded token counts a graph is captured for."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# NOTE: vLLM's default cap. Batches above the largest captured size run without a graph,
# so a huge max_num_seqs costs eager steps, never minutes of capture and gigabytes of graphs.
DEFAULT_MAX_CAPTURE_SIZE = 512


def default_ladder(max_size: int, short: bool = False) -> list[int]:
    """[1, 2, 4] + every 8 up to 256 + every 16 up to max; max always included.

    ``short`` (the CPU default, where every size costs a compile or a forward at start-up
    and a replay saves no launch overhead): powers of two up to max, and max.
    """
    if short:
        sizes = [1 << i for i in range(max_size.bit_length())]
    else:
        sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_size + 1, 16))
    return sorted({s for s in sizes if s <= max_size} | {max_size})


def capture_sizes(user_sizes: list[int] | None, max_num_seqs: int, num_spec_tokens: int,
                  max_num_batched_tokens: int,
                  max_capture_size: int | None = None, short: bool = False) -> list[int]:
    """Validated ladder, sizes rounded up to multiples of ``1 + num_spec_tokens``.

    ``max_capture_size`` caps the ladder (None: DEFAULT_MAX_CAPTURE_SIZE for the default
    ladder, no cap for sizes the user lists).
    NOTE: the largest size is always in the ladder (failure class 5).
    """
    step = 1 + num_spec_tokens
    schedulable = min(max_num_seqs * step, max_num_batched_tokens)
    cap = max_capture_size
    if cap is None and user_sizes is None:
        cap = DEFAULT_MAX_CAPTURE_SIZE
    max_size = schedulable if cap is None else min(schedulable, cap)
    max_size -= max_size % step
    if user_sizes is None:
        sizes = default_ladder(max(max_size, 1), short)
        if schedulable > max_size and cap is not None:
            logger.warning("batches of up to %d tokens (max_num_seqs=%d x %d tokens per "
                           "decode step) exceed max_cudagraph_capture_size=%d: graphs are "
                           "captured up to %d tokens, larger batches run eagerly",
                           schedulable, max_num_seqs, step, cap, max(max_size, step))
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
        bound = (f"max_cudagraph_capture_size={cap}" if cap is not None and cap < schedulable
                 else f"the largest batch this config schedules, {limit} tokens (max_num_seqs="
                      f"{max_num_seqs} x {step}, max_num_batched_tokens={max_num_batched_tokens})")
        logger.warning("cudagraph capture sizes %s (rounded to multiples of %d) exceed %s; %s",
                       dropped, step, bound, f"capturing {kept}" if kept else
                       "NO graph is captured: every step runs eagerly")
    if step > 1 and user_sizes is None:
        logger.info("speculative decoding verifies %d tokens per request: capture sizes are "
                    "multiples of %d, up to %d", step, step, limit)
    elif step > 1 and sorted(set(user_sizes)) != kept:
        logger.info("speculative decoding verifies %d tokens per request: capture sizes %s "
                    "become %s (multiples of %d)", step, sorted(set(user_sizes)), kept, step)
    return kept


def draft_capture_sizes(user_sizes: list[int] | None, max_num_seqs: int,
                        max_capture_size: int | None = None, short: bool = False) -> list[int]:
    """Request counts a draft step (one query per request) is captured for."""
    cap = max_capture_size
    if cap is None:
        cap = DEFAULT_MAX_CAPTURE_SIZE if user_sizes is None else max_num_seqs
    largest = min(max_num_seqs, cap)
    sizes = default_ladder(largest, short) if user_sizes is None else user_sizes
    return sorted({s for s in sizes if 1 <= s <= largest})
