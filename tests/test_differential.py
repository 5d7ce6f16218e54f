"""Randomized differential test: random schedules against eager without speculation.

A seeded generator drives one engine through arrivals, aborts and reused request ids, with
a KV pool small enough to preempt and a token budget small enough to chunk prefills, with
and without speculative decoding, under graphs and eagerly, in both debug modes. The
oracle is each request's greedy output from a roomy eager engine without speculation:
every request that was not aborted must end with exactly those tokens and that finish
reason; an aborted one must have produced a prefix of them.
"""

import collections
import random

import pytest

from rung.runtime import LLM, SamplingParams

ENGINE = {"max_num_seqs": 4, "max_model_len": 64, "block_size": 4, "dtype": "float32",
          "max_num_batched_tokens": 12,          # prompts up to 20 tokens: chunked prefill
          "num_gpu_blocks_override": 14}         # 56 slots for 4 requests of up to 36
GRAPHS = {"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 12]}}
NGRAM = {"method": "ngram", "num_speculative_tokens": 2}
MTP = {"method": "mtp", "model": "tiny-gemma4-mtp", "num_speculative_tokens": 3}
CONFIGS = {   # name: (model, engine kwargs)
    "llama-eager": ("tiny-llama", {"enforce_eager": True}),
    "llama-graphs-ngram": ("tiny-llama", {**GRAPHS, "speculative_config": NGRAM}),
    "llama-piecewise-ngram": ("tiny-llama", {
        "compilation_config": {"cudagraph_mode": "piecewise", "cudagraph_capture_sizes": [4, 12]},
        "speculative_config": {**NGRAM, "num_speculative_tokens": 3}}),
    "gemma4-graphs-mtp": ("tiny-gemma4", {**GRAPHS, "speculative_config": MTP}),
}
IDS = "abcdef"                   # a small pool, so ids are reused once their request ends


class Oracle:
    """Greedy outputs of a roomy eager engine without speculation, per (prompt, params)."""

    def __init__(self, model: str) -> None:
        self.llm = LLM(model, enforce_eager=True, max_num_seqs=8, max_model_len=64,
                       dtype="float32", debug_padding=False)
        self.cache: dict[tuple, tuple[list[int], str]] = {}

    def outputs(self, keys: list[tuple]) -> list[tuple[list[int], str]]:
        todo = [k for k in dict.fromkeys(keys) if k not in self.cache]
        if todo:
            outs = self.llm.generate([{"prompt_token_ids": list(p)} for p, _, _ in todo],
                                     [_params(k) for k in todo])
            for k, o in zip(todo, outs):
                self.cache[k] = (o.outputs[0].token_ids, o.outputs[0].finish_reason)
        return [self.cache[k] for k in keys]


def _params(key: tuple) -> SamplingParams:
    _, max_tokens, ignore_eos = key
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)


@pytest.fixture(scope="module")
def oracles():
    return collections.defaultdict(lambda: None)


def _oracle(oracles, model: str) -> Oracle:
    if oracles[model] is None:
        oracles[model] = Oracle(model)
    return oracles[model]


def run_schedule(engine, rng: random.Random, num_arrivals: int) -> tuple[dict, collections.Counter]:
    """Drive one random schedule to the end. Returns {instance: (key, tokens, reason)}
    (reason None when aborted) and what happened (aborts, reused ids, chunked prompts)."""
    seen: dict[int, tuple] = {}           # instance -> [key, tokens, reason]
    live: dict[str, int] = {}             # request id -> instance
    used: set[str] = set()
    happened: collections.Counter = collections.Counter()
    alphabet = rng.sample(range(3, 500), 5)   # few distinct tokens: n-gram drafts hit
    arrivals = 0
    for _ in range(500):
        if arrivals < num_arrivals and rng.random() < 0.6:
            free = [i for i in IDS if i not in live]
            if free:
                rid = rng.choice(free)
                happened["reused_id"] += rid in used
                prompt = tuple(rng.choice(alphabet) for _ in range(rng.randint(1, 20)))
                happened["chunked_prefill"] += len(prompt) > ENGINE["max_num_batched_tokens"]
                key = (prompt, rng.randint(1, 16), rng.random() < 0.7)
                engine.add_request(rid, {"prompt_token_ids": list(prompt)}, _params(key))
                seen[arrivals] = [key, [], None]
                live[rid] = arrivals
                used.add(rid)
                arrivals += 1
        if live and rng.random() < 0.04:
            rid = rng.choice(sorted(live))
            engine.abort_request(rid)
            seen[live.pop(rid)][2] = "abort"
            happened["abort"] += 1
        for out in engine.step():
            entry = seen[live[out.request_id]]
            entry[1] = out.outputs[0].token_ids
            if out.finished:
                entry[2] = out.outputs[0].finish_reason
                del live[out.request_id]
        if arrivals == num_arrivals and not live:
            break
    assert not live and not engine.has_unfinished_requests(), "schedule did not drain"
    return {i: tuple(v) for i, v in seen.items()}, happened


def check_against_oracle(oracle: Oracle, seen: dict) -> None:
    keys = [key for key, _, _ in seen.values()]
    for (i, (key, tokens, reason)), (want, want_reason) in zip(seen.items(),
                                                              oracle.outputs(keys)):
        if reason == "abort":
            assert tokens == want[:len(tokens)], f"instance {i}: aborted output diverged"
        else:
            assert (tokens, reason) == (want, want_reason), f"instance {i}, key {key}"


def _differential(config: str, seeds: range, oracles) -> None:
    model, kwargs = CONFIGS[config]
    llm = LLM(model, **ENGINE, **kwargs)
    engine = llm.engine
    happened: collections.Counter = collections.Counter()
    for seed in seeds:
        seen, what = run_schedule(engine, random.Random(seed), num_arrivals=10)
        happened.update(what)
        check_against_oracle(_oracle(oracles, model), seen)
        stats = engine.stats()
        assert stats["kv_free_blocks"] == stats["kv_total_blocks"], f"seed {seed}: KV leak"
    stats = engine.stats()
    # the schedules exercised what they exist for
    assert stats["preemptions"] > 0 and happened["reused_id"] > 0, (stats, happened)
    assert happened["abort"] > 0 and happened["chunked_prefill"] > 0, happened
    if "speculative_config" in kwargs:
        assert stats["spec"]["num_drafts"] > 0
    if "enforce_eager" not in kwargs:
        assert stats["graph_replays"], stats


@pytest.mark.parametrize("config", ["llama-eager", "llama-graphs-ngram", "gemma4-graphs-mtp"])
def test_random_schedules_match_eager_without_speculation(config, debug_padding, oracles):
    _differential(config, range(3), oracles)


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
def test_many_random_schedules_match_eager_without_speculation(config, debug_padding,
                                                               oracles):
    _differential(config, range(100, 130), oracles)
