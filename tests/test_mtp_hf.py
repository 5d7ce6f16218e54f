"""The MTP proposer inside the engine vs HF: first-round drafts after prefill, and HF's
assisted generate, on the same saved weights (fp32 CPU)."""

import collections

import pytest
import torch
from helpers import MTP_PROMPT_LENS, hf_drafts, hf_gemma4_assistant, hf_gemma4_target

from rung.runtime import LLM, SamplingParams

NUM_TOKENS, NUM_DRAFTS = 12, 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    torch.manual_seed(0)
    target, assistant = hf_gemma4_target(), hf_gemma4_assistant()
    target_dir, assistant_dir = tmp_path_factory.mktemp("t"), tmp_path_factory.mktemp("a")
    target.save_pretrained(target_dir)
    assistant.save_pretrained(assistant_dir)
    return target, assistant, str(target_dir), str(assistant_dir)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in MTP_PROMPT_LENS]


def _llm(folders, graphs: bool) -> LLM:
    _, _, target_dir, assistant_dir = folders
    spec = {"method": "mtp", "model": assistant_dir, "num_speculative_tokens": NUM_DRAFTS}
    extra = ({"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4]}} if graphs
             else {"enforce_eager": True})
    return LLM(target_dir, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=96,
               max_num_batched_tokens=64, speculative_config=spec, **extra)


@pytest.mark.parametrize("graphs", [False, True])
def test_first_round_drafts_equal_hf_assistant(folders, graphs):
    hf_target, hf_assistant = folders[0], folders[1]
    llm = _llm(folders, graphs)
    engine = llm.engine
    for i, prompt in enumerate(_prompts()):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=NUM_TOKENS))
    engine.step()                                  # both prompts prefill in this one step
    for i, prompt in enumerate(_prompts()):
        want, _ = hf_drafts(hf_target, hf_assistant, torch.tensor(prompt), NUM_DRAFTS)
        assert engine.requests[f"p{i}"].spec_token_ids == want, f"prompt of {len(prompt)}"
    if graphs:
        assert list(engine.proposer.graph_replays) == ["FULL:2"]


@pytest.mark.parametrize("graphs", [False, True])
def test_drafts_after_every_verify_step_equal_hf_assistant(folders, graphs):
    """The drafter runs inside the target step, from a batch the device moved past each
    request's accepted drafts: after every step its drafts equal HF's drafter on the
    tokens the step committed. The test plants drafts the target accepts in part (0 to k
    of HF's own greedy continuation), so every accepted count is exercised."""
    hf_target, hf_assistant = folders[0], folders[1]
    engine = _llm(folders, graphs).engine
    greedy = {}
    for i, prompt in enumerate(_prompts()):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
        num_new = NUM_TOKENS + NUM_DRAFTS
        greedy[f"p{i}"] = hf_target.generate(
            torch.tensor([prompt]), max_new_tokens=num_new, min_new_tokens=num_new,
            do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    checked, step = collections.Counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        for req in engine.scheduler.running:
            if not req.spec_token_ids:
                continue
            want, _ = hf_drafts(hf_target, hf_assistant, torch.tensor(req.token_ids[:-1]),
                                NUM_DRAFTS)          # the last token is not in the KV yet
            assert req.spec_token_ids == want, f"after {req.num_output_tokens} tokens"
            checked[step] += 1
            follow = greedy[req.request_id][req.num_output_tokens:]
            num_right = (step + int(req.request_id[1:])) % (NUM_DRAFTS + 1)
            planted = follow[:num_right] + [3 if follow[num_right] != 3 else 4]
            req.set_drafts((planted + follow)[:len(req.spec_token_ids)])
    stats = engine.stats()["spec"]
    assert sum(checked.values()) >= 8 and all(stats["acceptance_per_position"]), stats
    if graphs:
        assert any(k.startswith("FULL") for k in engine.proposer.graph_replays)


def test_hf_assisted_generate_equals_rung(folders):
    hf_target, hf_assistant = folders[0], folders[1]
    hf_assistant.generation_config.num_assistant_tokens = NUM_DRAFTS
    hf_assistant.generation_config.num_assistant_tokens_schedule = "constant"
    outs = _llm(folders, graphs=True).generate(
        [{"prompt_token_ids": p} for p in _prompts()],
        SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS))
    for prompt, out in zip(_prompts(), outs):
        hf = hf_target.generate(torch.tensor([prompt]), assistant_model=hf_assistant,
                                max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS,
                                do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == hf[0, len(prompt):].tolist()
