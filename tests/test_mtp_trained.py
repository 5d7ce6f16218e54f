"""The shipped `tiny-gemma4-mtp` drafter: trained on its target, accepted, and lossless.

The weights come from `python -m rung.bench.train_mtp` (self-distillation on tiny-gemma4's
own continuations). These tests hold the drafter to the numbers a user sees: drafts accepted
at least half the time at k = 3 on prompts it never trained on, with greedy tokens identical
to the target alone; and they check that the training forward is the runtime's forward.
"""

from __future__ import annotations

import os

import pytest
import torch

from rung.bench import train_mtp
from rung.models.loader import WEIGHT_SEED, WEIGHTS_DIR, load_model
from rung.runtime import LLM, SamplingParams

ENGINE = {"max_model_len": 256, "max_num_seqs": 8, "dtype": "float32"}
FOLDER = os.path.join(WEIGHTS_DIR, "tiny-gemma4-mtp")


def _held_out_prompts(num: int) -> list[dict]:
    # NOTE: a seed the training script never uses for data (it uses --seed and --seed + 1)
    gen = torch.Generator().manual_seed(12345)
    lens = torch.randint(1, 48, (num,), generator=gen).tolist()
    return [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=gen).tolist()}
            for n in lens]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_trained_drafter_is_accepted_and_lossless(graphs):
    prompts = _held_out_prompts(8)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    modes = ({"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8]}} if graphs
             else {"enforce_eager": True})
    want = LLM("tiny-gemma4", enforce_eager=True, **ENGINE).generate(prompts, params)
    spec = {"method": "mtp", "model": "tiny-gemma4-mtp", "num_speculative_tokens": 3}
    llm = LLM("tiny-gemma4", speculative_config=spec, **ENGINE, **modes)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = llm.engine.stats()
    assert stats["spec"]["acceptance_rate"] >= 0.5, stats["spec"]
    assert stats["spec"]["mean_tokens_per_step"] > 2.0, stats["spec"]
    if graphs:
        assert any(k.startswith("FULL") for k in llm.engine.proposer.graph_replays)


def test_shipped_drafter_is_trained_not_random():
    loaded = load_model("tiny-gemma4-mtp")
    assert not loaded.random_weights
    random = load_model("tiny-gemma4-mtp", load_format="dummy")
    assert random.random_weights
    assert not torch.equal(loaded.model.pre_projection.weight, random.model.pre_projection.weight)


def test_shipped_folder_is_an_hf_checkpoint():
    """HF's Gemma4AssistantForCausalLM loads the folder with no missing or unexpected key, and
    its weights are rung's (the exporter's q/gate/up split and the tied head are right)."""
    transformers = pytest.importorskip("transformers")
    hf, info = transformers.Gemma4AssistantForCausalLM.from_pretrained(
        FOLDER, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    rung = train_mtp.hf_state_dict(load_model("tiny-gemma4-mtp").model)
    hf_state = hf.state_dict()
    for name, tensor in rung.items():
        assert torch.equal(hf_state[name], tensor), name


def test_dense_training_forward_is_the_engine_forward():
    """The training script's dense target pass predicts every token the engine generated
    greedily: the data the drafter learns from is the runtime's own."""
    sequences, prompt_lens = train_mtp.make_sequences(6, 40, 0.0, seed=3)
    target = train_mtp.build("tiny-gemma4", WEIGHT_SEED).requires_grad_(False)
    data = train_mtp.run_target(target, sequences)
    assert train_mtp._agreement(sequences, prompt_lens, data.greedy) == 1.0


def test_rounds_count_only_on_the_targets_greedy_chain():
    #            p: 0  1  2  3  4
    x = torch.tensor([[5, 6, 7, 9, 9]])
    greedy = torch.tensor([[6, 7, 8, 9, 4]])    # x[3] = 9 != greedy[2] = 8: the chain breaks
    rounds = train_mtp.round_targets(x, greedy, 3)
    inputs, label, counted = rounds[0]
    assert inputs.tolist() == x.tolist() and label.tolist() == greedy.tolist()
    assert counted.tolist() == [[False, True, True, True, True]]
    inputs, label, counted = rounds[1]          # reads greedy[p], predicts greedy[p + 1]
    assert inputs[0, :4].tolist() == [6, 7, 8, 9] and label[0, :4].tolist() == [7, 8, 9, 4]
    # p=1: x[2] = 7 == greedy[1]; p=2: x[3] = 9 != greedy[2]; p=3: x[4] = 9 == greedy[3]
    assert counted.tolist() == [[False, True, False, True, False]]
    _, label, counted = rounds[2]
    # p=1 needs x[2], x[3] on the chain (x[3] is not); p=2 stops too; p >= 3 runs off the end
    assert counted.tolist() == [[False, False, False, False, False]]
