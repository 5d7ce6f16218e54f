"""`rung bench latency` end to end on tiny-llama: JSON schema, baselines, bad arguments."""

import importlib.util
import json

import pytest

from rung.cli.main import main

RECORD_KEYS = {"mode", "num_reqs", "step_ms_p50", "step_ms_p90", "step_ms_p99",
               "tokens_per_s", "ttft_ms", "padding_waste", "hf_step_ms_p50",
               "floor_step_ms_p50", "rung_over_hf", "rung_over_floor", "capture_ms",
               "capture_bytes", "hf_token_match"}
TINY = ["bench", "latency", "--model", "tiny-llama", "--input-len", "8", "--output-len", "4",
        "--iters", "2"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "latency.json"
    rc = main(TINY + ["--batch-sizes", "1,2", "--modes", "none,full", "--baseline", "hf",
                      "--json", str(path)])
    assert rc == 0
    with open(path) as f:
        return json.load(f)


def test_json_has_env_and_one_record_per_cell(report):
    env = report["env"]
    assert {"torch", "device", "num_threads", "cpu_model", "transformers"} <= set(env)
    cells = [(r["mode"], r["num_reqs"]) for r in report["records"]]
    assert cells == [("none", 1), ("none", 2), ("full", 1), ("full", 2)]
    for record in report["records"]:
        assert RECORD_KEYS <= set(record), RECORD_KEYS - set(record)


def test_numbers_are_positive_and_ratios_present(report):
    for r in report["records"]:
        assert r["num_decode_steps"] == 2 * (4 - 1)      # iters x (output_len - 1)
        assert 0 < r["step_ms_p50"] <= r["step_ms_p90"] <= r["step_ms_p99"]
        for key in ("tokens_per_s", "ttft_ms", "hf_step_ms_p50", "floor_step_ms_p50",
                    "rung_over_hf", "rung_over_floor"):
            assert r[key] > 0, (key, r[key])
        assert r["padding_waste"] == 0.0                  # 1 and 2 are on the ladder
        assert r["hf_token_match"] == 1.0                 # same weights, same greedy tokens


def test_full_mode_replays_captured_graphs(report):
    full = [r for r in report["records"] if r["mode"] == "full"]
    assert [r["graph"] for r in full] == ["FULL:1", "FULL:2"]
    # NOTE: graphs share one pool, so a graph that reuses freed blocks adds 0 bytes; the
    # pool as a whole holds something.
    assert all(r["capture_ms"] > 0 and r["capture_bytes"] >= 0 for r in full)
    eager = [r for r in report["records"] if r["mode"] == "none"]
    assert all(r["graph"] is None and r["capture_ms"] is None for r in eager)
    modes = {m["mode"]: m for m in report["modes"]}
    assert modes["full"]["cudagraph_mode"] == "full_decode_only"
    assert modes["full"]["num_graphs"] == 2
    assert modes["full"]["capture_bytes"] > 0 and modes["none"]["capture_bytes"] == 0


@pytest.mark.parametrize("extra, message", [
    (["--batch-sizes", "0"], "--batch-sizes must be positive integers"),
    (["--batch-sizes", "1,x"], "--batch-sizes must be comma-separated integers"),
    (["--modes", "none,warp"], "unknown cudagraph mode 'warp'"),
    (["--output-len", "1"], "--output-len must be >= 2"),
    (["--batch-sizes", "8", "--max-num-seqs", "4"], "--max-num-seqs 4 is below"),
    (["--mode", "full"], "takes --modes"),
])
def test_bad_arguments_exit_nonzero_with_a_clear_error(capsys, extra, message):
    assert main(TINY + extra) == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_fails_before_measuring(capsys, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert main(TINY + ["--plot", "latency.png"]) == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
