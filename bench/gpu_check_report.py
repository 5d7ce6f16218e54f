"""Helpers of bench/gpu_check.sh, run as a plain script (rung may not be importable yet).

    python bench/gpu_check_report.py versions OUT/versions.json
    python bench/gpu_check_report.py same-versions OUT/versions.json
    python bench/gpu_check_report.py summary OUT
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import re
import sys
from pathlib import Path

STAGE_VERDICTS = {"0": "PASS", "124": "TIMEOUT", "137": "KILLED", "skipped": "SKIPPED"}


def _module_version(name: str) -> str | None:
    try:
        module = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return None
    return str(getattr(module, "__version__", "unknown"))


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def collect_versions() -> dict:
    info = {"python": platform.python_version(), "torch": _module_version("torch"),
            "triton": _module_version("triton"), "flash_attn": _module_version("flash_attn"),
            "transformers": _dist_version("transformers"),
            "cuda_bindings": _dist_version("cuda-bindings", "cuda-python"),
            "cuda": None, "gpu": None}
    if info["torch"] is not None:
        import torch

        info["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    return info


def cmd_versions(path: str) -> int:
    info = collect_versions()
    Path(path).write_text(json.dumps(info, indent=2))
    for key, value in info.items():
        print(f"{key:<14} {value if value is not None else 'MISSING'}")
    if info["flash_attn"] is None:
        print("flash-attn is not installed: FLASH_ATTN tests skip (reason in the kernels "
              "stage's -rs lines); capture and latency use the TRITON backend")
    if info["cuda_bindings"] is None:
        print("cuda-bindings is not installed: kernel-node counts will read '-'")
    missing = [k for k in ("torch", "triton") if info[k] is None]
    if missing:
        print(f"error: {', '.join(missing)} not importable; nothing can run")
        return 1
    if info["gpu"] is None and os.environ.get("DRY_RUN") != "1":
        print("error: torch sees no CUDA device")
        return 1
    return 0


def cmd_same_versions(path: str) -> int:
    """After the install: torch/triton untouched, and rung importable."""
    before = json.loads(Path(path).read_text())
    now = {k: _module_version(k) for k in ("torch", "triton")}
    changed = {k: (before[k], v) for k, v in now.items() if before[k] != v}
    if changed:
        print(f"error: the install changed {changed}")
        return 1
    import rung.runtime.engine  # noqa: F401 - the import is the check

    print(f"rung imports from {Path(sys.modules['rung.runtime'].__file__).parent.parent}; "
          f"torch {now['torch']} and triton {now['triton']} untouched")
    return 0


# --- summary ---------------------------------------------------------------------------------
def read_stages(out: Path) -> list[dict]:
    stages = []
    for line in (out / "stages.tsv").read_text().splitlines():
        name, rc, seconds, limit = line.split("\t")
        verdict = STAGE_VERDICTS.get(rc, f"FAIL rc={rc}")
        stage = {"stage": name, "verdict": verdict, "seconds": int(seconds),
                 "limit_s": int(limit), "log": f"{name}.log",
                 "pytest": _pytest_counts(out / f"{name}.log")}
        devices = _load(out / f"{name}.devices.json")
        if devices is not None:
            # NOTE: a test that passed without touching the GPU is no GPU pass
            stage["gpu_passed"] = len(devices["gpu"])
            stage["cpu_only_passed"] = devices["cpu_only"]
            stage["pytest"] = (f"{stage['pytest'] or ''}: {len(devices['gpu'])} on the GPU, "
                               f"{len(devices['cpu_only'])} CPU-only").lstrip(": ")
            if verdict == "PASS" and not devices["gpu"]:
                stage["verdict"] = "NO GPU TEST"
        stages.append(stage)
    return stages


def _pytest_counts(log: Path) -> str | None:
    """pytest's final '3 passed, 2 skipped in 1.2s' line, if the stage ran pytest."""
    if not log.exists():
        return None
    lines = [ln for ln in log.read_text(errors="replace").splitlines()
             if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    return lines[-1].strip("= ") if lines else None


def _capture_rows(warmup: dict) -> list[str]:
    rows = [f"{'mode':<10} {'tokens':>6} {'reqs':>5} {'ms':>8} {'MiB':>8} {'nodes':>6}"]
    for g in warmup["graphs"]:
        nodes = "-" if g["num_kernel_nodes"] is None else g["num_kernel_nodes"]
        rows.append(f"{g['mode']:<10} {g['num_tokens_padded']:>6} {g['num_reqs_padded']:>5} "
                    f"{g['seconds'] * 1e3:>8.1f} {g['nbytes'] / 2**20:>8.2f} {nodes:>6}")
    total_s = sum(g["seconds"] for g in warmup["graphs"])
    total_mib = warmup.get("pool_bytes", sum(g["nbytes"] for g in warmup["graphs"])) / 2**20
    rows.append(f"{len(warmup['graphs'])} graphs in {total_s:.2f} s (target < 5 s), "
                f"pool {total_mib:.1f} MiB")
    return rows


def _latency_rows(latency: dict) -> list[str]:
    rows = [f"{'mode':<10} {'reqs':>5} {'p50_ms':>8} {'p90_ms':>8} {'tok/s':>9} graph"]
    p50 = {}
    for r in latency["records"]:
        p50[(r["mode"], r["num_reqs"])] = r["step_ms_p50"]
        rows.append(f"{r['mode']:<10} {r['num_reqs']:>5} {r['step_ms_p50']:>8.3f} "
                    f"{r['step_ms_p90']:>8.3f} {r['tokens_per_s']:>9.0f} {r['graph']}")
    if ("none", 1) in p50 and ("full", 1) in p50:
        rows.append(f"FULL vs eager decode at 1 request: "
                    f"{p50[('none', 1)] / p50[('full', 1)]:.2f}x (target >= 2x)")
    return rows


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms"


def _switch_rows(switch: dict) -> list[str]:
    rows = [f"step {s['ms']:9.1f} ms  went live: {', '.join(s['went_live'])}"
            for s in switch["switch_steps"]]
    rows.append("eager step p50 {}, graph step p50 {}, worst stall {}".format(
        *(_ms(switch[k]) for k in ("eager_step_ms_p50", "graph_step_ms_p50", "worst_stall_ms"))))
    rows.append(f"{len(switch['live'])} live, {len(switch['pending'])} pending; tokens "
                f"{'match' if switch['tokens_match_eager'] else 'DIFFER from'} enforce_eager")
    return rows


def _sync_rows(host_syncs: dict) -> list[str]:
    rows = [f"{'workload':<16} {'steps':>5} {'conv worst':>10} {'conv mean':>9} "
            f"{'sync worst':>10} {'sync mean':>9}"]
    for name, r in host_syncs.items():
        conv, syncs = r["conversions_per_step"], r["cuda_syncs_per_step"]
        n = max(len(conv), 1)
        rows.append(f"{name:<16} {len(conv):>5} {max(conv, default=0):>10} "
                    f"{sum(conv) / n:>9.2f} {max(syncs, default=0):>10} "
                    f"{sum(syncs) / n:>9.2f}")
    return rows


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def cmd_summary(out_dir: str) -> int:
    out = Path(out_dir)
    stages = read_stages(out)
    print("\n===== gpu_check summary")
    print(f"{'stage':<12} {'verdict':<12} {'secs':>5} {'limit':>5}  pytest")
    for s in stages:
        print(f"{s['stage']:<12} {s['verdict']:<12} {s['seconds']:>5} {s['limit_s']:>5}  "
              f"{s['pytest'] or ''}")
    print(f"total {sum(s['seconds'] for s in stages)} s")
    versions, warmup, switch, syncs, latency = (
        _load(out / n) for n in ("versions.json", "warmup.json", "live_switch.json",
                                 "host_syncs.json", "latency.json"))
    if versions and versions.get("flash_attn") is None:
        print("flash-attn: not installed, so its tests skip (reasons in kernels.log)")
    for title, data, rows in (("capture", warmup, _capture_rows),
                              ("capture between steps (background start)", switch,
                               _switch_rows),
                              ("host syncs per step", syncs, _sync_rows),
                              ("latency (bf16)", latency, _latency_rows)):
        if data is not None:
            print(f"\n----- {title}")
            print("\n".join(rows(data)))
    report = {"stages": stages, "versions": versions, "warmup": warmup,
              "live_switch": switch, "host_syncs": syncs, "latency": latency}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"\nJSON: {out / 'gpu_check.json'}")
    return 0 if all(s["verdict"] in ("PASS", "SKIPPED") for s in stages) else 1


def main(argv: list[str]) -> int:
    commands = {"versions": cmd_versions, "same-versions": cmd_same_versions,
                "summary": cmd_summary}
    if len(argv) != 2 or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
