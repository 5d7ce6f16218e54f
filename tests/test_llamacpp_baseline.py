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
