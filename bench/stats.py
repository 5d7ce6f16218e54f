"""Small timing helpers shared by the latency harness and its baselines."""

from __future__ import annotations

import numpy as np
import torch


def sync(device: torch.device) -> None:
    """Wait for queued device work, so a host timer covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentiles_ms(seconds: list[float], prefix: str) -> dict[str, float]:
    """{prefix_ms_p50, _p90, _p99, _mean} in milliseconds."""
    assert seconds, f"no samples for {prefix}"
    ms = np.asarray(seconds) * 1e3
    out = {f"{prefix}_ms_p{q}": float(np.percentile(ms, q)) for q in (50, 90, 99)}
    out[f"{prefix}_ms_mean"] = float(ms.mean())
    return out
