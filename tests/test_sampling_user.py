"""What a vLLM user expects of SamplingParams and outputs: `stop` strings, `n`, `.text` in
the repr, decoded tokens in logprobs, a reason for finish_reason "error", a progress bar."""

import pytest

from rung.runtime import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", enforce_eager=True, max_num_seqs=4, max_model_len=128)


def _greedy_text(llm, max_tokens=48):
    return llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=max_tokens,
                                                    ignore_eos=True), use_tqdm=False)[0]


def _ascii_stop(text: str) -> tuple[str, int]:
    """A 2-character printable stop string past the first few characters, and where it
    first occurs."""
    for i in range(3, len(text) - 1):
        stop = text[i:i + 2]
        if stop.isascii() and stop.isprintable():
            return stop, text.find(stop)
    pytest.skip("greedy output holds no printable ASCII pair")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_and_trims_the_text(llm, include):
    full = _greedy_text(llm).outputs[0].text
    stop, index = _ascii_stop(full)
    out = llm.generate("Once upon", SamplingParams(
        temperature=0, max_tokens=48, ignore_eos=True, stop=[stop, "\x00never"],
        include_stop_str_in_output=include), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:index + (len(stop) if include else 0)]
    assert len(out.token_ids) < 48


def test_stop_string_not_matched_before_min_tokens(llm):
    full = _greedy_text(llm, 8).outputs[0].text
    stop, _ = _ascii_stop(full + "!!")
    out = llm.generate("Once upon", SamplingParams(
        temperature=0, max_tokens=8, min_tokens=8, ignore_eos=True, stop=stop),
        use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8


def test_n_samples_are_one_output_and_match_seeded_single_requests(llm):
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=11, n=3, ignore_eos=True)
    outs = llm.generate(["Hello", "Hi"], params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [3, 3]
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    for i, completion in enumerate(outs[0].outputs):
        single = llm.generate("Hello", SamplingParams(temperature=1.0, max_tokens=6,
                                                      seed=11 + i, ignore_eos=True),
                              use_tqdm=False)[0].outputs[0]
        assert completion.token_ids == single.token_ids
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests


def test_n_samples_abort_together(llm):
    engine = llm.engine
    engine.add_request("p", "Hello", SamplingParams(n=2, max_tokens=4))
    engine.abort_request("p")
    assert not engine.has_unfinished_requests() and not engine.requests


def test_repr_shows_text_and_logprobs_carry_decoded_tokens(llm):
    out = llm.generate("Hey", SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                             ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert f"text={out.text!r}" in repr(out)
    tok = llm.get_tokenizer()
    for token, step in zip(out.token_ids, out.logprobs):
        assert step[token].decoded_token == tok.decode([token])
        assert all(lp.decoded_token is not None for lp in step.values())


def test_prompt_that_can_never_fit_says_why():
    llm = LLM("tiny-llama", enforce_eager=True, max_num_seqs=2, max_model_len=128,
              num_gpu_blocks_override=2)
    out = llm.generate({"prompt_token_ids": list(range(3, 60))}, SamplingParams(max_tokens=2),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error"
    assert "57 tokens" in out.error and "can never run" in out.error
    assert "error=" in repr(out)


def test_generate_progress_bar_on_by_default(llm, capsys):
    llm.generate("Hi", SamplingParams(max_tokens=2))
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, match", [
    ({"n": 0}, "n=0"), ({"stop": [""]}, "stop"), ({"seed": "abc"}, "seed='abc'"),
    ({"temperature": "hot"}, "temperature='hot'"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty=0.0 .* > 0"),
    ({"presence_penalty": 2.5}, r"presence_penalty=2.5 .* in \[-2, 2\]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty=nan"),
    ({"min_p": 1.5}, r"min_p=1.5 .* in \[0, 1\]"),
    ({"prompt_logprobs": -1}, "prompt_logprobs=-1"),
    ({"prompt_logprobs": 1.5}, "prompt_logprobs=1.5")])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    ({"seed": "abc"}, "seed='abc' must be an integer"),
    ({"max_model_len": 0}, "max_model_len=0 must be a positive integer"),
    ({"max_model_len": -5}, "max_model_len=-5"),
    ({"device": "tpu"}, "device 'tpu' is not one of"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 100}},
     "from 1 to 16"),
    ({"compilation_config": {"max_cudagraph_capture_size": 0}}, "max_cudagraph_capture_size"),
    ({"compilation_config": {"compile_threads": 0}}, "compile_threads=0 must be a positive"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size=2 is unsupported"),
    ({"trust_remote_code": True}, "trust_remote_code=True is unsupported"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization=1.5 must be a number in \(0, 1\]")])
def test_bad_engine_args_fail_before_loading(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM("tiny-llama", enforce_eager=True, **kwargs)


def test_default_ladder_is_capped():
    from rung.graphs.ladder import capture_sizes

    assert capture_sizes(None, 100000, 0, 100000)[-1] == 512
    assert capture_sizes(None, 100000, 0, 100000, max_capture_size=64)[-1] == 64
    assert capture_sizes(None, 100000, 0, 100000, short=True) == [1 << i for i in range(10)]
    assert capture_sizes(None, 12, 0, 8192, short=True) == [1, 2, 4, 8, 12]


def test_cpu_kv_cache_follows_max_num_seqs_and_max_model_len(monkeypatch, caplog):
    args = {"enforce_eager": True, "max_model_len": 64, "max_num_seqs": 4,
            "tensor_parallel_size": 1, "trust_remote_code": False}
    # gpu_memory_utilization sizes nothing on CPU (vLLM's CPU backend ignores it too): a
    # user's 0.5 once reserved half the RAM for a 135M model
    with caplog.at_level("WARNING", logger="rung.runtime.config"):
        roomy = LLM("tiny-llama", gpu_memory_utilization=0.5, **args).engine.stats()
    assert "gpu_memory_utilization=0.5 is ignored on CPU" in caplog.text
    assert roomy["kv_total_blocks"] == 4 * 64 // 16        # every sequence at full length
    # a sliver of KV space: the floor of one sequence at max_model_len
    monkeypatch.setenv("RUNG_CPU_KVCACHE_SPACE", "1e-9")
    tiny = LLM("tiny-llama", **args).engine.stats()
    assert tiny["kv_total_blocks"] == 64 // 16
    monkeypatch.setenv("RUNG_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="RUNG_CPU_KVCACHE_SPACE='lots' must be a positive"):
        LLM("tiny-llama", **args)


def test_llm_defaults_are_sized_for_a_cpu():
    llm = LLM("tiny-llama", device="cpu", max_model_len=32,
              compilation_config={"graph_backend": "emulated"})
    assert llm.engine.config.max_num_seqs == 16      # as the CLI; vLLM's 256 on CUDA
    assert llm.engine.runner.dispatcher.sizes == [1, 2, 4, 8, 16]


def test_capture_sizes_below_the_largest_batch_warn_which_batches_run_eagerly(caplog):
    with caplog.at_level("WARNING", logger="rung.runtime.engine"):
        LLM("tiny-llama", max_num_seqs=16, max_model_len=32,
            compilation_config={"cudagraph_capture_sizes": [1, 2],
                                "cudagraph_mode": "full_decode_only"})
    assert "batches of 3 to 16 tokens (max_num_seqs=16 x 1) run eagerly" in caplog.text
