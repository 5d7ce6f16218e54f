"""vLLM habits a user brings: honoured where rung can, refused (naming vLLM's own status)
where vLLM itself dropped the name."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from rung.runtime import LLM as RuntimeLLM
from rung.runtime import SamplingParams as RuntimeSamplingParams

ROOT = Path(__file__).resolve().parents[1]


def test_top_level_exports_as_vllm():
    # a fresh interpreter outside the repository: the installed package, not the cwd
    code = ("from rung import LLM, SamplingParams; import rung; "
            "print(LLM.__module__, SamplingParams.__module__, sorted(rung.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["rung.runtime.api.llm", "rung.runtime.sampling_params"]
    from rung import LLM, SamplingParams

    assert LLM is RuntimeLLM and SamplingParams is RuntimeSamplingParams


def test_import_rung_alone_stays_cheap():
    code = "import sys, rung; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd="/")
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def test_names_vllm_dropped_are_refused_with_vllms_status():
    from rung import SamplingParams

    with pytest.raises(ValueError, match=r"best_of=4 is unsupported: vLLM's V1 engine dropped"):
        SamplingParams(best_of=4, n=2)
    with pytest.raises(ValueError, match=r"use_beam_search=True is unsupported: vLLM removed"):
        SamplingParams(use_beam_search=True)
    # the no-op values a vLLM script may still pass
    assert SamplingParams(best_of=2, n=2, use_beam_search=False).n == 2


def test_swap_space_is_accepted_with_a_note(caplog):
    from rung import LLM, SamplingParams

    with caplog.at_level("INFO", logger="rung.runtime.api.llm"):
        llm = LLM("tiny-llama", enforce_eager=True, max_model_len=32, swap_space=4)
    assert "swap_space=4 GiB is not used" in caplog.text
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def _generate_help() -> str:
    from rung.cli.main import make_parser

    parser = make_parser()
    return parser._subparsers._group_actions[0].choices["generate"].format_help()


def test_quantization_help_lists_every_served_type():
    from rung.models.gguf import BLOCK_TYPES, INT4_TYPES

    help_text = " ".join(_generate_help().split())
    for type_name in set(BLOCK_TYPES) | set(INT4_TYPES):
        assert type_name in help_text


def test_mode_and_compile_backend_help_say_what_a_cpu_runs():
    help_text = " ".join(_generate_help().split())
    assert re.search(r"--mode MODE cudagraph mode: .* \(default: full_and_piecewise, which "
                     r"on CPU runs as full_decode_only", help_text)
    assert re.search(r"--compile-backend \{eager,inductor\} how PIECEWISE graph pieces are "
                     r"compiled\. CPU: the full decode graphs are inductor-compiled", help_text)


def test_no_per_layer_graphs_reaches_the_compilation_config(monkeypatch):
    """`--no-per-layer-graphs` asks for the whole-forward compile (per_layer_graphs=False);
    without it the config keeps the default (per-layer graphs)."""
    import argparse

    import rung.runtime.api.llm as llm_module
    from rung.cli.args import add_engine_args, build_llm

    seen = []
    monkeypatch.setattr(llm_module, "LLM", lambda *a, **kw: seen.append(kw))
    for argv in ([], ["--no-per-layer-graphs"]):
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        build_llm(parser.parse_args(argv))
    assert "per_layer_graphs" not in seen[0]["compilation_config"]
    assert seen[1]["compilation_config"]["per_layer_graphs"] is False
