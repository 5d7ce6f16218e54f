"""The host path a GPU needs: tensor-to-host conversions per engine step (each a device
sync on CUDA), and seeded sampled requests whose tokens depend on nothing but the seed."""

import json

import pytest
from helpers import conversions_in_steps

from rung.runtime import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
MTP = {"method": "mtp", "model": "tiny-gemma4-mtp", "num_speculative_tokens": 3}
SAMPLED = {"temperature": 0.8, "top_p": 0.9}
WORKLOADS = {"greedy": ("tiny-llama", None, {"temperature": 0}),
             "sampled": ("tiny-llama", None, SAMPLED),
             "ngram-greedy": ("tiny-llama", NGRAM, {"temperature": 0}),
             "ngram-sampled": ("tiny-llama", NGRAM, {**SAMPLED, "logprobs": 2}),
             "mtp-greedy": ("tiny-gemma4", MTP, {"temperature": 0}),
             "mtp-sampled": ("tiny-gemma4", MTP, SAMPLED),
             # the grammar's bitmask goes host -> device: still one conversion back
             "structured-sampled": ("tiny-llama", None,
                                    {**SAMPLED, "structured_outputs": {"regex": "[a-z ]+"}}),
             "structured-ngram": ("tiny-llama", NGRAM,
                                  {**SAMPLED, "structured_outputs": {"regex": "(ab|cd)+"}})}


def _prompts(num: int) -> list[list[int]]:
    return [[3 + (7 * i + j % (3 + i % 4)) % 400 for j in range(6 + 5 * (i % 3))]
            for i in range(num)]


def _add_all(params: SamplingParams):
    def add(engine) -> None:
        for i, prompt in enumerate(_prompts(6)):
            engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params)
    return add


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_at_most_one_host_conversion_per_step(workload, debug_padding):
    model, spec, sampling = WORKLOADS[workload]
    llm = LLM(model, dtype="float32", max_num_seqs=8, max_model_len=96, enforce_eager=True,
              speculative_config=spec)
    params = SamplingParams(max_tokens=10, ignore_eos=True, **sampling)
    per_step = conversions_in_steps(llm.engine, _add_all(params))
    assert max(per_step) <= 1, per_step
    if spec is not None:
        assert llm.engine.stats()["spec"]["num_drafts"] > 0


def test_one_host_conversion_per_step_under_graphs():
    """Emulated graph replays (poisoned pads in debug mode) add no conversion."""
    llm = LLM("tiny-llama", dtype="float32", max_num_seqs=8, max_model_len=96,
              speculative_config=NGRAM,
              compilation_config={"graph_backend": "emulated",
                                  "cudagraph_capture_sizes": [4, 8, 16, 32]})
    params = SamplingParams(max_tokens=10, ignore_eos=True, **SAMPLED)
    assert max(conversions_in_steps(llm.engine, _add_all(params))) <= 1
    assert any(k.startswith("FULL") for k in llm.engine.stats()["graph_replays"])


SEEDED = SamplingParams(temperature=1.0, seed=50, max_tokens=40, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 9, 5, 9, 5, 9, 17, 3, 5, 9, 5, 9, 22, 5, 9]}
NEIGHBOURS = [({"prompt_token_ids": _prompts(4)[i]},
               SamplingParams(temperature=0.9, seed=None if i % 2 else 60 + i,
                              max_tokens=30 + 4 * i, ignore_eos=True)) for i in range(3)]
SETTINGS = {"alone": ({}, False), "batched": ({}, True),
            "preempted": ({"num_gpu_blocks_override": 24, "block_size": 4}, True),
            "chunked": ({"max_num_batched_tokens": 9, "max_num_seqs": 4}, True)}


def _seeded_tokens(model: str, spec: dict | None, setting: str) -> tuple[list[int], dict]:
    engine_kwargs, with_neighbours = SETTINGS[setting]
    kwargs = {"max_num_seqs": 8, "max_model_len": 96, "block_size": 16, **engine_kwargs}
    llm = LLM(model, dtype="float32", enforce_eager=True, speculative_config=spec, **kwargs)
    prompts, params = [PROMPT], [SEEDED]
    if with_neighbours:
        prompts = [p for p, _ in NEIGHBOURS[:2]] + prompts + [NEIGHBOURS[2][0]]
        params = [s for _, s in NEIGHBOURS[:2]] + params + [NEIGHBOURS[2][1]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs[prompts.index(PROMPT)].outputs[0].token_ids, llm.engine.stats()


@pytest.mark.parametrize("model,spec", [("tiny-llama", {**NGRAM, "num_speculative_tokens": 2}),
                                        ("tiny-gemma4", {**MTP, "num_speculative_tokens": 2})],
                         ids=["ngram", "mtp"])
def test_a_seeded_request_gives_the_same_tokens_everywhere(model, spec):
    """Alone, batched, preempted and chunked, with and without speculation: keyed
    randomness makes verification exact, so every run gives the same 40 tokens."""
    want, _ = _seeded_tokens(model, None, "alone")
    for setting in SETTINGS:
        got, stats = _seeded_tokens(model, spec, setting)
        assert got == want, f"{setting} under {spec['method']}"
        assert stats["spec"]["num_drafts"] > 0
        if setting == "preempted":
            assert stats["preemptions"] > 0
    got, stats = _seeded_tokens(model, None, "preempted")
    assert got == want and stats["preemptions"] > 0


def test_the_bench_command_prints_the_table(tmp_path, capsys):
    """`python -m rung.bench.host_syncs` (gpu_check's host-syncs stage, on CPU here)."""
    from rung.bench import host_syncs

    out = tmp_path / "host_syncs.json"
    host_syncs.main(["--num-reqs", "2", "--max-tokens", "3", "--workloads",
                     "ngram-sampled", "--json", str(out)])
    assert "| ngram-sampled  |          1 |" in capsys.readouterr().out
    got = json.loads(out.read_text())["ngram-sampled"]
    assert max(got["conversions_per_step"]) == 1 and len(got["cuda_syncs_per_step"]) == 3
