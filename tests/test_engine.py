"""Engine core behaviour through the public API: sampling, preemption, KV accounting, errors."""

import pytest

from rung.runtime import LLM, SamplingParams


def _llm(**kwargs):
    args = {"max_num_seqs": 4, "max_num_batched_tokens": 32, "max_model_len": 128,
            "enforce_eager": True}
    args.update(kwargs)
    return LLM("tiny-llama", **args)


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _all_free(llm):
    stats = llm.engine.stats()
    return stats["kv_free_blocks"] == stats["kv_total_blocks"]


@pytest.fixture(scope="module")
def llm():
    return _llm()


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7, max_tokens=12)
    alone = _tokens(llm.generate(["seeded prompt"], seeded))[0]
    again = _tokens(llm.generate(["seeded prompt"], seeded))[0]
    others = [SamplingParams(temperature=1.0, max_tokens=20),
              SamplingParams(temperature=0.5, seed=3, max_tokens=5), seeded,
              SamplingParams(temperature=0, max_tokens=9)]
    crowded = _tokens(llm.generate(["a long neighbour prompt " * 3, "b", "seeded prompt", "c"],
                                   others))[2]
    assert alone == again == crowded
    other_seed = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=8, max_tokens=12)
    assert _tokens(llm.generate(["seeded prompt"], other_seed))[0] != alone


def test_top_k_one_equals_greedy(llm):
    greedy = _tokens(llm.generate(["top k"], SamplingParams(temperature=0, max_tokens=10)))
    top1 = _tokens(llm.generate(["top k"], SamplingParams(temperature=1.5, top_k=1,
                                                          max_tokens=10)))
    assert greedy == top1


def test_preemption_finishes_everything_with_the_same_greedy_tokens():
    prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = _tokens(_llm().generate(prompts, params))
    tight_llm = _llm(num_gpu_blocks_override=12, block_size=8)
    tight = _tokens(tight_llm.generate(prompts, params))
    assert tight_llm.engine.stats()["preemptions"] > 0
    assert tight == roomy
    assert _all_free(tight_llm)


def test_stop_token_min_tokens_and_logprobs(llm):
    free = llm.generate(["stops"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    stop_at = free.token_ids[2]
    out = llm.generate(["stops"], SamplingParams(temperature=0, max_tokens=8,
                                                 stop_token_ids=[stop_at], logprobs=3))
    c = out[0].outputs[0]
    first = free.token_ids.index(stop_at)
    assert c.token_ids == free.token_ids[:first + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_at)
    assert all(len(d) >= 3 and c.token_ids[i] in d for i, d in enumerate(c.logprobs))
    held = llm.generate(["stops"], SamplingParams(temperature=0, max_tokens=8, min_tokens=8,
                                                  stop_token_ids=[stop_at]))[0].outputs[0]
    assert len(held.token_ids) == 8 and held.finish_reason == "length"


def test_step_api_abort_error_and_kv_accounting():
    llm = _llm(num_gpu_blocks_override=8, block_size=4)   # 32 token slots in all
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("ok-1", "hi", params)
    engine.add_request("doomed", {"prompt_token_ids": list(range(3, 3 + 40))}, params)
    engine.add_request("ok-2", "yo", params)
    engine.add_request("aborted", "abort me", params)
    finished = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
        steps += 1
        if steps == 2:
            engine.abort_request("aborted")
    assert finished["doomed"].finish_reason == "error"
    assert finished["ok-1"].finish_reason == finished["ok-2"].finish_reason == "length"
    assert len(finished["ok-1"].token_ids) == 6
    assert "aborted" not in finished and "aborted" not in engine.requests
    assert _all_free(llm)


@pytest.mark.parametrize("prompt, params, match", [
    ({"prompt_token_ids": list(range(3, 3 + 200))}, {}, "200 tokens.*max_model_len=128"),
    ("", {}, "empty"),
    ({"prompt_token_ids": [5, 512]}, {}, "512.*vocabulary \\[0, 512\\)"),
    ("x", {"temperature": -1.0}, "temperature=-1.0"),
    ("x", {"top_p": 0.0}, "top_p=0.0"),
    ("x", {"max_tokens": 0}, "max_tokens=0"),
    ("x", {"top_k": -5}, "top_k=-5"),
    ("x", {"min_tokens": 9, "max_tokens": 4}, "min_tokens=9"),
    ("x", {"stop_token_ids": [100000]}, "100000"),
])
def test_bad_request_fails_alone(llm, prompt, params, match):
    engine = llm.engine
    engine.add_request("good", "fine", SamplingParams(temperature=0, max_tokens=3))
    with pytest.raises(ValueError, match=match):
        engine.add_request("bad", prompt, SamplingParams(**params))
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["good"]
    assert len(done[0].outputs[0].token_ids) == 3
    assert _all_free(llm)


def test_bad_model_names(tmp_path):
    with pytest.raises(ValueError, match="no-such-model.*neither a built-in preset"):
        LLM("no-such-model")
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 8, '
                                          '"hidden_size": 8, "intermediate_size": 8, '
                                          '"num_hidden_layers": 1, "num_attention_heads": 1, '
                                          '"rms_norm_eps": 1e-6, "max_position_embeddings": 8}')
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(tmp_path), enforce_eager=True)
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(str(tmp_path / ".."), enforce_eager=True)


def test_generate_rejects_a_bad_prompt_without_running_the_others(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    assert _all_free(llm)


def _reuse_id_run(new_id):
    """"y" runs long; "x" finishes; once "y" has grown, a new request arrives as ``new_id``."""
    engine = _llm(block_size=4, dtype="float32").engine
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
    engine.add_request("y", {"prompt_token_ids": list(range(10, 17))}, greedy(40))
    engine.add_request("x", {"prompt_token_ids": list(range(20, 27))}, greedy(1))
    done, step = {}, 0
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        step += 1
        if step == 4:
            engine.add_request(new_id, {"prompt_token_ids": list(range(30, 35))}, greedy(10))
    return done["y"], done[new_id]


def test_a_reused_request_id_gets_its_own_blocks(debug_padding):
    # NOTE: the old "x" held blocks [3, 4]; "y" took 3 when "x" freed it. A block-table row
    # cached by request id would hand the new "x" those stale ids.
    assert _reuse_id_run("x") == _reuse_id_run("x2")



def _resident_mib(tensors) -> float:
    """Resident MiB of the memory mappings that hold ``tensors`` (/proc/self/smaps)."""
    starts = {t.data_ptr() for t in tensors}
    found, total, inside = set(), 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = any(lo <= p < hi for p in starts) and (lo, hi) not in found
                if inside:
                    found.add((lo, hi))
            elif inside and head == "Rss:":
                total += int(line.split()[1])
    return total / 1024


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/smaps"), reason="Linux only")
def test_a_large_kv_cache_is_not_resident_until_requests_write_it():
    """A start-up with a long max_model_len must not write (and pay for) the whole KV cache
    up front: its memory becomes resident as requests fill blocks, and reads as zeros."""
    llm = _llm(max_num_seqs=128, max_num_batched_tokens=128, max_model_len=2048)
    caches = list(llm.engine.runner.kv_caches.values())
    total_mib = sum(c.numel() * c.element_size() for c in caches) / 2**20
    assert total_mib >= 64
    assert _resident_mib(caches) < total_mib / 8
    assert not caches[0][:, -4:].any()
    prompt, greedy = ["fill a few blocks"], SamplingParams(temperature=0, max_tokens=8)
    tokens = llm.generate(prompt, greedy)[0].outputs[0].token_ids
    assert tokens == _llm().generate(prompt, greedy)[0].outputs[0].token_ids
    assert _resident_mib(caches) < total_mib / 8
    assert _all_free(llm)
