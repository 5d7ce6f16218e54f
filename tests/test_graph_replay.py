"""Graph replays equal eager, for every mode and every partial batch on the ladder.

Engines run with poison on (conftest): every buffer is garbage before each step's inputs
are written, and pad input rows are garbage at every replay.
"""

import logging

import pytest
import torch

from rung.core.graph_mode import GraphSupport
from rung.kernels.selector import register_backend
from rung.kernels.torch_backend import TorchBackend
from rung.runtime import LLM, SamplingParams
from rung.runtime.cli import main as cli_main

SIZES = [1, 2, 4, 8]
ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 96,
          "dtype": "float32"}  # fp32 on a GPU too: replays are held to 1e-5
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _graph_llm(mode, sizes=SIZES, **kwargs):
    args = {**ENGINE, **kwargs}
    return LLM("tiny-llama", compilation_config={"cudagraph_mode": mode,
                                                 "cudagraph_capture_sizes": sizes}, **args)


@pytest.fixture(scope="module")
def eager_llm():
    return LLM("tiny-llama", enforce_eager=True, **ENGINE)


def guard_kv(runner):
    """Fail if a step writes any KV slot outside its real tokens' slots (null block aside)."""
    execute = runner.execute

    def checked(sched, block_ids):
        before = {name: cache.clone() for name, cache in runner.kv_caches.items()}
        out = execute(sched, block_ids)
        num_tokens = runner.last_desc.num_tokens
        for group in runner.kv_groups:
            slots = torch.from_numpy(
                runner.input_batch.slot_mappings[group.group_id].np[:num_tokens].copy())
            for name in group.layer_names:
                cache = runner.kv_caches[name]
                changed = (cache != before[name]).flatten(3).any(-1).any(0).flatten()
                allowed = torch.zeros_like(changed)
                allowed[slots] = True
                allowed[:cache.shape[2]] = True        # the null block takes pad writes
                assert not bool((changed & ~allowed).any()), f"{name}: KV written off-slot"
        return out

    runner.execute = checked


def _scenario(num_reqs):
    """Steps of (requests to add before the step). Ends with every request finished."""
    prompt = lambda i: {"prompt_token_ids": [3 + (7 * i + j) % 500  # noqa: E731
                                             for j in range(2 + (5 * i) % 9)]}
    first = [(f"r{num_reqs}-{i}", prompt(i)) for i in range(num_reqs - 1)]
    last = [(f"r{num_reqs}-last", prompt(num_reqs + 3))]
    # prefill, decode n-1, then a mixed step (n-1 decodes + 1 prefill), then decodes of n
    return [first, [], last] if first else [last]


def _drive(llm, num_reqs):
    engine, logits, tokens, modes = llm.engine, [], {}, []
    steps = _scenario(num_reqs)
    i = 0
    while i < len(steps) or engine.has_unfinished_requests():
        for rid, prompt in steps[i] if i < len(steps) else []:
            engine.add_request(rid, prompt, GREEDY)
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        logits.append(engine.runner.last_logits.clone())
        modes.append(engine.runner.last_desc)
        i += 1
    return logits, tokens, modes


@pytest.mark.parametrize("mode", ["full_and_piecewise", "piecewise", "full", "full_decode_only"])
def test_every_partial_batch_replays_like_eager(mode, eager_llm):
    graph_llm = _graph_llm(mode)
    guard_kv(graph_llm.engine.runner)
    replayed = set()
    for num_reqs in range(1, SIZES[-1] + 1):
        want_logits, want_tokens, _ = _drive(eager_llm, num_reqs)
        got_logits, got_tokens, descs = _drive(graph_llm, num_reqs)
        assert got_tokens == want_tokens, f"{mode}, {num_reqs} requests"
        for step, (got, want) in enumerate(zip(got_logits, want_logits)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5,
                                       msg=f"{mode}, {num_reqs} requests, step {step}")
        replayed |= {(d.mode.name, d.num_reqs, d.num_reqs_padded) for d in descs}
    decode_mode = {"piecewise": "PIECEWISE"}.get(mode, "FULL")
    # every num_reqs in (p, s] ran padded to s at least once
    for num_reqs in range(1, SIZES[-1] + 1):
        assert any(m == decode_mode and n == num_reqs for m, n, _ in replayed), num_reqs
    assert any(n < n_pad for _, n, n_pad in replayed) or decode_mode == "PIECEWISE"
    if mode in ("full_and_piecewise", "piecewise"):
        assert any(m == "PIECEWISE" for m, _, _ in replayed)


def test_staggered_arrivals_match_eager_and_replay_at_several_sizes():
    prompts = [{"prompt_token_ids": [3 + (11 * i + j) % 400 for j in range(1 + (5 * i) % 6)]}
               for i in range(13)]
    params = [SamplingParams(temperature=0, max_tokens=5 + i % 6, ignore_eos=True)
              for i in range(13)]

    def run(llm):
        engine, done, step = llm.engine, {}, 0
        pending = list(enumerate(prompts))
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][0] <= step:      # one arrival per step
                i, prompt = pending.pop(0)
                engine.add_request(f"p{i}", prompt, params[i])
            done.update({o.request_id: o.outputs[0].token_ids
                         for o in engine.step() if o.finished})
            step += 1
        return done

    graph_llm = _graph_llm("full_and_piecewise")
    got = run(graph_llm)
    assert got == run(LLM("tiny-llama", enforce_eager=True, **ENGINE))
    replays = graph_llm.engine.stats()["graph_replays"]
    assert len([k for k in replays if k.startswith("FULL:")]) >= 3, replays
    assert any(k.startswith("PIECEWISE:") for k in replays), replays


def test_batch_above_the_largest_size_runs_eagerly_with_the_same_tokens(eager_llm):
    prompts = [f"request {i}" for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=2 + 2 * i, ignore_eos=True)
              for i in range(6)]
    small = _graph_llm("full_and_piecewise", sizes=[1, 2])
    got = [o.outputs[0].token_ids for o in small.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in eager_llm.generate(prompts, params)]
    assert got == want
    stats = small.engine.stats()
    assert stats["eager_steps"] > 0 and stats["graph_replays"]


class _NoGraphBackend(TorchBackend):
    name = "NOGRAPH"
    graph_support = GraphSupport.NEVER


def test_full_with_a_backend_that_cannot_capture_downgrades(caplog, eager_llm):
    register_backend(_NoGraphBackend)
    with caplog.at_level(logging.WARNING, logger="rung.graphs"):
        llm = _graph_llm("full", attention_backend="nograph")
    assert "downgraded to PIECEWISE" in caplog.text
    prompts = ["one", "two", "three"]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in eager_llm.generate(prompts, params)]
    assert all(k.startswith("PIECEWISE") for k in llm.engine.stats()["graph_replays"])


@pytest.mark.parametrize("args, code, message", [
    (["--mode", "sideways"], 2, "unknown cudagraph mode 'sideways'"),
    (["--capture-sizes", "0,4"], 2, "capture size 0"),
    (["--capture-sizes", "4,4096"], 2, "4096 exceeds max_num_batched_tokens"),
])
def test_warmup_bad_input(args, code, message, capsys):
    assert cli_main(["warmup", "--model", "tiny-llama", *args]) == code
    assert message in capsys.readouterr().err
