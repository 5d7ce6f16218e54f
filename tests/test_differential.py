"""Randomized differential test: random schedules against eager without speculation.

A seeded generator drives one engine through arrivals, aborts and reused request ids (some
shaped like the ids of ``n > 1`` samples, next to ``n = 2`` requests), stop strings that the
last allowed token completes, and params changed after add_request, with a KV pool small
enough to preempt and a token budget small enough to chunk prefills, with and without
speculative decoding, under graphs and eagerly, in both debug modes. The oracle is each
request's greedy output from a roomy eager engine without speculation, run past the
request's max_tokens and cut there: every request that was not aborted must end with
exactly those tokens, that finish reason and stop reason (each sample of an ``n = 2`` one);
an aborted one must have produced a prefix of them.
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
    # NOTE: 12 blocks (48 slots) keep these schedules preempting
    "gemma4-graphs-mtp": ("tiny-gemma4", {**GRAPHS, "speculative_config": MTP,
                                          "num_gpu_blocks_override": 12}),
}
# a small pool, so ids are reused once their request ends; "0_a" / "1_b" are shaped like
# the samples of "a" / "b"
IDS = ["a", "b", "c", "d", "0_a", "1_b"]
ROOMY_TOKENS = 20                # the oracle runs this far, past any max_tokens here


class Oracle:
    """Greedy outputs of a roomy eager engine without speculation, per (prompt, ignore_eos,
    stop), run to ROOMY_TOKENS; ``expected`` cuts one at a request's max_tokens."""

    def __init__(self, model: str) -> None:
        self.llm = LLM(model, enforce_eager=True, max_num_seqs=8, max_model_len=64,
                       dtype="float32", debug_padding=False)
        self.cache: dict[tuple, tuple] = {}

    def roomy(self, keys: list[tuple]) -> list[tuple]:
        """(tokens, finish reason, stop reason) per (prompt, ignore_eos, stop)."""
        todo = [k for k in dict.fromkeys(keys) if k not in self.cache]
        if todo:
            params = [_params(ROOMY_TOKENS, ignore_eos, stop) for _, ignore_eos, stop in todo]
            outs = self.llm.generate([{"prompt_token_ids": list(p)} for p, _, _ in todo],
                                     params, use_tqdm=False)
            for k, o in zip(todo, outs):
                c = o.outputs[0]
                self.cache[k] = (c.token_ids, c.finish_reason, c.stop_reason)
        return [self.cache[k] for k in keys]

    def expected(self, key: tuple) -> tuple:
        """What a request of ``key`` = (prompt, max_tokens, ignore_eos, stop) must end with:
        the roomy output if it stopped within max_tokens, else its first max_tokens."""
        prompt, max_tokens, ignore_eos, stop = key
        tokens, reason, stop_reason = self.roomy([(prompt, ignore_eos, stop)])[0]
        if reason == "stop" and len(tokens) <= max_tokens:
            return tokens, reason, stop_reason
        return tokens[:max_tokens], "length", None

    def stop_at(self, prompt: tuple, max_tokens: int) -> str | None:
        """A one-character stop string that output token ``max_tokens`` completes first
        (None when that token adds no such character)."""
        tokens = self.roomy([(prompt, True, None)])[0][0]
        decode = self.llm.get_tokenizer().decode
        before, upto = decode(tokens[:max_tokens - 1]), decode(tokens[:max_tokens])
        new = upto[len(before):]
        if len(new) == 1 and new.isprintable() and new not in before:
            return new
        return None


def _params(max_tokens: int, ignore_eos: bool, stop: str | None, n: int = 1
            ) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                          stop=[stop] if stop else None, n=n)


@pytest.fixture(scope="module")
def oracles():
    return collections.defaultdict(lambda: None)


def _oracle(oracles, model: str) -> Oracle:
    if oracles[model] is None:
        oracles[model] = Oracle(model)
    return oracles[model]


def run_schedule(engine, oracle: Oracle, rng: random.Random, num_arrivals: int
                 ) -> tuple[dict, collections.Counter]:
    """Drive one random schedule to the end. Returns {instance: [key, n, completions,
    reason]} (completions: index -> (tokens, finish reason, stop reason); reason "abort"
    when aborted) and what happened (aborts, reused ids, chunked prompts, ...)."""
    seen: dict[int, list] = {}
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
                happened["sample_shaped_id"] += "_" in rid
                prompt = tuple(rng.choice(alphabet) for _ in range(rng.randint(1, 20)))
                happened["chunked_prefill"] += len(prompt) > ENGINE["max_num_batched_tokens"]
                max_tokens, n = rng.randint(1, 16), 2 if rng.random() < 0.25 else 1
                stop = oracle.stop_at(prompt, max_tokens) if rng.random() < 0.3 else None
                happened["stop_at_max_tokens"] += stop is not None
                key = (prompt, max_tokens, stop is not None or rng.random() < 0.7, stop)
                params = _params(max_tokens, key[2], stop, n)
                engine.add_request(rid, {"prompt_token_ids": list(prompt)}, params)
                if rng.random() < 0.5:            # the caller's object, changed later
                    params.max_tokens, params.ignore_eos = 40, not params.ignore_eos
                    params.stop_token_ids.append(alphabet[0])
                    happened["params_mutated"] += 1
                happened["n_samples"] += n > 1
                seen[arrivals] = [key, n, {}, None]
                live[rid] = arrivals
                used.add(rid)
                arrivals += 1
        if live and rng.random() < 0.04:
            rid = rng.choice(sorted(live))
            engine.abort_request(rid)
            seen[live.pop(rid)][3] = "abort"
            happened["abort"] += 1
        for out in engine.step():
            entry = seen[live[out.request_id]]
            for c in out.outputs:
                entry[2][c.index] = (c.token_ids, c.finish_reason, c.stop_reason)
            if out.finished:
                entry[3] = "done"
                del live[out.request_id]
        if arrivals == num_arrivals and not live:
            break
    assert not live and not engine.has_unfinished_requests(), "schedule did not drain"
    return seen, happened


def check_against_oracle(oracle: Oracle, seen: dict) -> None:
    for i, (key, n, completions, reason) in seen.items():
        want = oracle.expected(key)
        if reason == "abort":
            for tokens, _, _ in completions.values():
                assert tokens == want[0][:len(tokens)], f"instance {i}: aborted output diverged"
        else:
            assert sorted(completions) == list(range(n)), f"instance {i}: samples missing"
            for index, got in completions.items():
                assert got == want, f"instance {i}, sample {index}, key {key}"


def _differential(config: str, seeds: range, oracles) -> None:
    model, kwargs = CONFIGS[config]
    llm = LLM(model, **{**ENGINE, **kwargs})
    engine = llm.engine
    happened: collections.Counter = collections.Counter()
    for seed in seeds:
        oracle = _oracle(oracles, model)
        seen, what = run_schedule(engine, oracle, random.Random(seed), num_arrivals=10)
        happened.update(what)
        check_against_oracle(oracle, seen)
        stats = engine.stats()
        assert stats["kv_free_blocks"] == stats["kv_total_blocks"], f"seed {seed}: KV leak"
    stats = engine.stats()
    # the schedules exercised what they exist for
    assert stats["preemptions"] > 0 and happened["reused_id"] > 0, (stats, happened)
    assert happened["abort"] > 0 and happened["chunked_prefill"] > 0, happened
    # NOTE: tiny-gemma4's output ids rarely decode to a fresh printable character, so
    # stop strings at the limit are drawn on tiny-llama (ByteTokenizer) only
    wanted = ["sample_shaped_id", "n_samples", "params_mutated"]
    wanted += ["stop_at_max_tokens"] if model == "tiny-llama" else []
    for what in wanted:
        assert happened[what] > 0, (what, happened)
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


def _turn_hits(llm: LLM, rng: random.Random, num_turns: int) -> tuple[list, list]:
    """A conversation, one turn at a time: each prompt is the last prompt, its greedy
    output and a few new tokens. Returns each turn's output and prefix-cache hit tokens."""
    engine, prompt = llm.engine, []
    outputs, hits = [], []
    for _ in range(num_turns):
        # NOTE: a repeating pattern, so n-gram drafts are accepted and blocks fill mid-draft
        prompt = prompt + [5, 6, 7, 8] * rng.randint(1, 3) + [rng.randint(3, 500)]
        before = engine.stats()["prefix_cache"]["hit_tokens"]
        out = llm.generate({"prompt_token_ids": prompt},
                           _params(rng.randint(8, 16), True, None), use_tqdm=False)[0]
        outputs.append(out.outputs[0].token_ids)
        hits.append(engine.stats()["prefix_cache"]["hit_tokens"] - before)
        prompt = prompt + outputs[-1]
    return outputs, hits


def test_prefix_cache_hits_do_not_depend_on_speculation(debug_padding):
    """The same greedy conversation with and without n-gram drafts: the same tokens, and
    prefix-cache hits within one block per request (drafts only change which tokens a
    step verifies, never which full blocks get hashed)."""
    args = {**ENGINE, "enforce_eager": True, "max_num_seqs": 2, "max_model_len": 128,
            "num_gpu_blocks_override": 64}
    plain = LLM("tiny-llama", **args)
    spec = LLM("tiny-llama", **args, speculative_config={**NGRAM, "num_speculative_tokens": 3})
    for seed in range(3):
        want, want_hits = _turn_hits(plain, random.Random(seed), num_turns=4)
        got, got_hits = _turn_hits(spec, random.Random(seed), num_turns=4)
        assert got == want, f"seed {seed}"
        assert all(abs(a - b) <= ENGINE["block_size"] for a, b in zip(got_hits, want_hits)), (
            seed, got_hits, want_hits)
        assert sum(want_hits) > 0
    assert spec.engine.stats()["spec"]["num_accepted_tokens"] > 0
