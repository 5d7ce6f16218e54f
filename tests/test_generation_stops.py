"""A model's other end-of-generation ids stop requests, as in vLLM.

Chat models end a turn on their own token besides the tokenizer's EOS (HF:
generation_config.json lists them under eos_token_id; GGUF: tokenizer.ggml.eot_token_id).
A request stops on any of them unless it sets ignore_eos, and the caller's SamplingParams
are left unchanged.
"""

from __future__ import annotations

import json

import pytest

from rung.runtime import LLM, SamplingParams

pytest.importorskip("transformers")
from test_gguf import _hf_model, write_gguf  # noqa: E402

PROMPT = {"prompt_token_ids": [5, 9, 14, 22, 7]}
ENGINE = {"enforce_eager": True, "max_model_len": 64, "max_num_seqs": 4}


def _free_run(model: str) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return LLM(model, **ENGINE).generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids


def _stop_token(tokens: list[int]) -> tuple[int, int]:
    """A token of the free run (not its first) -> (token, index of its first appearance)."""
    for index, token in enumerate(tokens[2:], start=2):
        if token not in tokens[:index]:
            return token, index
    pytest.skip(f"greedy run {tokens} repeats one token: no fresh stop candidate")


def _check_stops_at(model: str, tokens: list[int], stop: int, index: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=12)
    out = LLM(model, **ENGINE).generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:index + 1] and out.finish_reason == "stop"
    assert params.stop_token_ids == []            # the caller's params are untouched
    ignored = LLM(model, **ENGINE).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"


def test_hf_generation_config_eos_list_stops(tmp_path):
    folder = tmp_path / "llama"
    _hf_model("llama").save_pretrained(folder)
    tokens = _free_run(str(folder))
    stop, index = _stop_token(tokens)
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = [config.get("eos_token_id", 2), stop]
    (folder / "generation_config.json").write_text(json.dumps(config))
    _check_stops_at(str(folder), tokens, stop, index)


def test_gguf_end_of_turn_id_stops(tmp_path):
    tokens = _free_run(write_gguf(tmp_path / "plain.gguf"))
    stop, index = _stop_token(tokens)
    _check_stops_at(write_gguf(tmp_path / "eot.gguf", eot_token_id=stop), tokens, stop, index)
