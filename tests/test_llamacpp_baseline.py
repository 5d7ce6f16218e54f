"""`rung bench latency --baseline llama.cpp` (bench/llamacpp_baseline.py): clear errors
without llama-cpp-python or without a GGUF file; with both, llama.cpp's batched greedy
decode gives each request what it gives that request alone."""

import sys
import types

import pytest

from rung.cli.main import main

TINY = ["bench", "latency", "--model", "tiny-llama", "--input-len", "8", "--output-len", "4",
        "--iters", "1", "--batch-sizes", "1", "--modes", "none", "--baseline", "llama.cpp"]


def test_missing_llama_cpp_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)        # import raises ImportError
    assert main(TINY) == 2
    assert "needs llama-cpp-python: pip install 'rung[llamacpp]'" in capsys.readouterr().err


def test_a_model_that_is_not_a_gguf_file_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    assert main(TINY) == 2
    assert "runs a GGUF file's own weights; 'tiny-llama' is not" in capsys.readouterr().err


def test_batched_llama_cpp_decode_matches_one_request_at_a_time():
    pytest.importorskip("llama_cpp")
    from rung.bench.llamacpp_baseline import LlamaCppModel
    from rung.models.loader import resolve_model_path

    try:
        path = resolve_model_path("smollm2-135m")
    except ValueError as e:
        pytest.skip(f"SmolLM2 weights not installed ({e})")
    model = LlamaCppModel(path, max_num_reqs=2, max_model_len=32, num_threads=1)
    prompts = [[1, 504, 3575, 282, 4649, 314], [1, 2068, 1117, 314, 216, 37, 1414]]
    together = model.generate_round(prompts, 6)
    assert len(together.step_s) == 5
    alone = [model.generate_round([p], 6).token_ids[0] for p in prompts]
    assert together.token_ids == alone


@pytest.mark.slow       # loads SmolLM2 in rung and in llama.cpp
def test_bench_reports_prefill_beside_decode_at_two_threads(tmp_path):
    """`rung bench latency --baseline llama.cpp` times one prompt's prefill (to its first
    token) for rung and llama.cpp beside the decode step, at the --threads asked for."""
    import json

    pytest.importorskip("llama_cpp")
    from rung.models.loader import resolve_model_path

    try:
        resolve_model_path("smollm2-135m")
    except ValueError as e:
        pytest.skip(f"SmolLM2 weights not installed ({e})")
    out = tmp_path / "b.json"
    assert main(["bench", "latency", "--model", "smollm2-135m", "--baseline", "llama.cpp",
                 "--modes", "none", "--batch-sizes", "1", "--input-len", "8",
                 "--output-len", "3", "--iters", "1", "--warmup-iters", "0",
                 "--prefill-len", "40", "--threads", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    [record] = report["records"]
    assert report["env"]["num_threads"] == 2
    assert record["prefill_ms"] > 0 and record["llamacpp_prefill_ms"] > 0
    assert record["prefill_rung_over_llamacpp"] == pytest.approx(
        record["prefill_ms"] / record["llamacpp_prefill_ms"])


def test_prefill_longer_than_the_batch_is_a_clear_error(capsys):
    assert main([*TINY, "--prefill-len", "600", "--max-num-batched-tokens", "512"]) == 2
    assert "--max-num-batched-tokens 512 is below --prefill-len 600" in capsys.readouterr().err
