"""rung vs HF transformers on the same random weights, one config per family that exercises
what the family declares differently (q/k/v biases, fused projections, partial rotary, a
sliding window shorter than the prompts): greedy tokens identical and logprobs within 1e-4,
eager and with graphs, padding debug mode on and off."""

import pytest
from helpers import (
    FAMILY_CONFIGS,
    assert_matches_hf,
    hf_family_model,
    random_prompts,
    run_greedy,
    save_hf_model,
)

from rung.runtime import LLM, SamplingParams

NUM_TOKENS = 24
VOCAB = 256
FAMILIES = sorted(FAMILY_CONFIGS)


@pytest.fixture(scope="module", params=FAMILIES)
def hf_folder(request, tmp_path_factory):
    model = hf_family_model(request.param, VOCAB)
    return model, save_hf_model(model, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_matches_hf(hf_folder, enforce_eager, debug_padding):
    model, folder = hf_folder
    prompts = random_prompts(VOCAB)
    graphs = {} if enforce_eager else {
        "compilation_config": {"cudagraph_capture_sizes": [4]}}
    llm, outs = run_greedy(folder, prompts, NUM_TOKENS, enforce_eager=enforce_eager,
                           **graphs)
    if not enforce_eager:
        assert llm.engine.stats()["graph_replays"], "no step replayed a graph"
    assert_matches_hf(model, outs, prompts, NUM_TOKENS)


def test_qwen2_use_sliding_window_rejected(tmp_path):
    model = hf_family_model("qwen2", VOCAB)
    model.config.use_sliding_window = True
    folder = save_hf_model(model, tmp_path)
    with pytest.raises(ValueError, match="use_sliding_window"):
        LLM(folder, dtype="float32", device="cpu", enforce_eager=True)


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-phi3"])
def test_preset_generates(preset):
    llm = LLM(preset, dtype="float32", device="cpu", max_model_len=128, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, logprobs=0)
    out = llm.generate("a preset of a family with random weights", params)[0].outputs[0]
    assert len(out.token_ids) == 8


def test_eos_outside_the_vocabulary_rejected(tmp_path):
    """HF's default Phi-3 EOS (32000) on a 256-token vocabulary: a clear error at start-up,
    not an IndexError in the sampler."""
    model = hf_family_model("phi3", VOCAB, eos_token_id=32000)
    folder = save_hf_model(model, tmp_path)
    with pytest.raises(ValueError, match="eos_token_id 32000, outside its vocabulary of 256"):
        LLM(folder, dtype="float32", device="cpu", enforce_eager=True)
