"""What the latency harness prints and writes: environment, table, plot."""

from __future__ import annotations

import argparse
import os
import platform
from typing import Any

import numpy as np
import torch

_COLUMNS = [  # (header, record key, format spec, scale)
    ("mode", "mode", "<9", None), ("reqs", "num_reqs", ">4", None),
    ("p50_ms", "step_ms_p50", ">7.2f", None), ("p90_ms", "step_ms_p90", ">7.2f", None),
    ("p99_ms", "step_ms_p99", ">7.2f", None), ("tok/s", "tokens_per_s", ">7.0f", None),
    ("ttft_ms", "ttft_ms", ">8.1f", None), ("pad%", "padding_waste", ">5.1%", None),
    ("graph", "graph", ">10", None), ("cap_ms", "capture_ms", ">7.0f", None),
    ("cap_KiB", "capture_bytes", ">8.0f", 1 / 1024),
    ("hf_p50", "hf_step_ms_p50", ">7.2f", None), ("rung/hf", "rung_over_hf", ">7.2f", None),
    ("lcpp_p50", "llamacpp_step_ms_p50", ">8.2f", None),
    ("rung/lcpp", "rung_over_llamacpp", ">9.2f", None),
    ("prefill_ms", "prefill_ms", ">10.1f", None),
    ("lcpp_prefill", "llamacpp_prefill_ms", ">12.1f", None),
    ("prefill/lcpp", "prefill_rung_over_llamacpp", ">12.2f", None),
    ("floor_p50", "floor_step_ms_p50", ">9.2f", None),
    ("rung/floor", "rung_over_floor", ">10.2f", None),
]


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """Everything a reader needs to compare two runs."""
    cuda = torch.cuda.is_available() and args.device in ("auto", "cuda")
    env: dict[str, Any] = {
        "torch": torch.__version__, "numpy": np.__version__,
        "python": platform.python_version(), "platform": platform.platform(),
        "device": "cuda" if cuda else "cpu",
        "device_name": torch.cuda.get_device_name() if cuda else _cpu_model(),
        "cpu_model": _cpu_model(), "cpu_count": os.cpu_count(),
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "loadavg_start": loadavg(), "model": args.model, "dtype": args.dtype,
        "compile_backend": args.compile_backend, "attention_backend": args.attention_backend,
    }
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def _width(spec: str) -> int:
    return int("".join(c for c in spec.split(".")[0] if c.isdigit()))


def _cell(value: Any, spec: str, scale: float | None) -> str:
    if value is None:
        return f"{'-':>{_width(spec)}}"
    return format(value * scale if scale else value, spec)


def format_table(records: list[dict[str, Any]], modes: list[dict[str, Any]]) -> str:
    """One row per (mode, num_reqs) cell, then one capture line per mode."""
    head = " ".join(format(h, spec[0] + str(max(_width(spec), len(h))))
                    for h, _, spec, _ in _COLUMNS)
    lines = [head, "-" * len(head)]
    for r in records:
        cells = [_cell(r.get(key), spec, scale) for _, key, spec, scale in _COLUMNS]
        lines.append(" ".join(c.rjust(max(_width(spec), len(h))) if spec[0] == ">" else
                              c.ljust(max(_width(spec), len(h)))
                              for c, (h, _, spec, _) in zip(cells, _COLUMNS)))
    for m in modes:
        lines.append(f"{m['mode']}: cudagraph_mode {m['cudagraph_mode']}, {m['num_graphs']} "
                     f"graphs captured in {m['capture_s']:.1f} s, "
                     f"{m['capture_bytes'] / 2**20:.1f} MiB; ladder padding waste over "
                     f"1..max requests {m['ladder_padding_waste']:.1%}")
        if "spec" in m:
            lines.append(f"{m['mode']}: speculative acceptance rate "
                         f"{m['spec']['acceptance_rate']:.2f}, mean tokens per step "
                         f"{m['spec']['mean_tokens_per_step']:.2f}")
    return "\n".join(lines)


def plot_latency(records: list[dict[str, Any]], path: str, title: str) -> None:
    """p50 decode step latency vs requests: one line per mode, HF and floor dashed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'rung[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in records):
        rows = [r for r in records if r["mode"] == mode]
        ax.plot([r["num_reqs"] for r in rows], [r["step_ms_p50"] for r in rows], "o-",
                label=f"rung {mode}")
    first = [r for r in records if r["mode"] == records[0]["mode"]]
    for key, label in (("hf_step_ms_p50", "HF generate"), ("floor_step_ms_p50", "matmul floor")):
        if first and first[0].get(key) is not None:
            ax.plot([r["num_reqs"] for r in first], [r[key] for r in first], "--", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("requests decoding (num_reqs)")
    ax.set_ylabel("decode step p50 (ms)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
