"""The one exception of a broken contract."""

from __future__ import annotations


class ContractError(RuntimeError):
    """A batch whose counts, pads or shapes break the descriptor contract: a bug in rung (or
    in code driving its internals), never a user error. Raised, not asserted, so the checks
    hold under ``python -O``."""
