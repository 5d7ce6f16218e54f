"""Gemma 3 on the hybrid KV-group machinery: sliding-window blocks freed as the window
moves, n-gram speculation lossless, `rung verify` passing with both layer kinds as graphs.
(HF parity of the family is in test_hf_families.py.)"""

import pytest

from rung.cli.main import main
from rung.runtime import LLM, SamplingParams

WINDOW, BLOCK_SIZE = 16, 16          # tiny-gemma3's window; rung's default block size
ENGINE = dict(dtype="float32", device="cpu", max_model_len=256, max_num_seqs=2)


def test_prompt_past_the_window_frees_sliding_blocks():
    llm = LLM("tiny-gemma3", enforce_eager=True, block_size=BLOCK_SIZE, **ENGINE)
    engine = llm.engine
    assert [g["sliding_window"] for g in engine.stats()["kv_groups"]] == [WINDOW, None]
    prompt_len = 100
    engine.add_request("long", {"prompt_token_ids": list(range(3, 3 + prompt_len))},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held.append(engine.stats()["kv_blocks_held_per_group"])
    sliding, full = held[-2]                      # the last step before the request ended
    assert full == -(-(prompt_len + 7) // BLOCK_SIZE)          # every position's block
    # the window reaches back WINDOW - 1 keys: at most 2 blocks live, the rest are freed
    assert 0 < sliding <= 2, held
    stats = engine.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]


def test_ngram_speculation_is_lossless():
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 10}, {"prompt_token_ids": list(range(3, 40))}]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM("tiny-gemma3", enforce_eager=True,
                                                 **ENGINE).generate(prompts, params)]
    llm = LLM("tiny-gemma3", speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              compilation_config={"cudagraph_capture_sizes": [2, 8]}, **ENGINE)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    stats = llm.engine.stats()
    assert stats["spec"]["num_drafts"] > 0 and stats["graph_replays"], stats


def test_verify_passes(capsys):
    assert main(["verify", "--model", "tiny-gemma3", "--max-num-seqs", "2",
                 "--mode", "full"]) == 0
    assert "PASS: all" in capsys.readouterr().out


@pytest.mark.slow
def test_compiled_graphs_one_artifact_per_layer_kind(monkeypatch):
    """Compiled CPU graphs of tiny-gemma3 give eager's greedy tokens, its 6 layers served
    by one artifact per layer kind (sliding, full)."""
    import rung.graphs.cpu_compiled.artifacts as compiled_graphs

    monkeypatch.setattr(compiled_graphs, "INDUCTOR_OPTIONS", {})
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM("tiny-gemma3", enforce_eager=True,
                                                 **ENGINE).generate(prompts, params)]
    llm = LLM("tiny-gemma3", compilation_config={
        "cudagraph_mode": "full_decode_only", "cudagraph_capture_sizes": [2],
        "graph_backend": "compiled", "graph_startup": "blocking"}, **ENGINE)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    backend = llm.engine.runner.graphs.capture_backend
    assert backend.name == "compiled" and llm.engine.stats()["graph_replays"]
    # two layer artifacts (sliding, full) and the epilogue's
    assert len(set(backend.direct_calls)) == 3, backend.direct_calls
