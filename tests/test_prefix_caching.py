"""Automatic prefix caching and sliding-window block freeing (runtime/kv_cache_manager.py).

The bookkeeping is held to exact block counts; the engine is held to the tokens of an
engine that caches nothing, under waves, preemption, aborts and reused request ids.
"""

import pytest
import torch

from rung.core.kv_cache_spec import KVCacheGroup, KVCacheSpec
from rung.runtime import LLM, SamplingParams
from rung.runtime.sched.kv_cache_manager import NULL_BLOCK, KVCacheManager
from rung.runtime.sched.request import Request

BS = 4
FULL = KVCacheSpec(BS, 1, 8, torch.float32)
SLIDING = KVCacheSpec(BS, 1, 4, torch.float32, sliding_window=6)


def _kv(specs, num_blocks=16, **kwargs) -> KVCacheManager:
    groups = [KVCacheGroup(i, s, (f"l{i}",)) for i, s in enumerate(specs)]
    return KVCacheManager(groups, num_blocks, **kwargs)


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, None, tokens, SamplingParams(), None, 0)


def _run(kv: KVCacheManager, req: Request) -> int:
    """Admit ``req`` as the scheduler does, compute its whole prompt, and return the hit."""
    hit = kv.take_cached_prefix(req)
    req.num_computed_tokens = hit
    assert kv.allocate(req.request_id, len(req.token_ids))
    req.num_computed_tokens = len(req.token_ids)
    kv.advance(req)
    return hit


def _balanced(kv: KVCacheManager) -> None:
    kv.check_consistency()
    for pool in kv.pools:
        assert pool.num_free + pool.num_used == pool.num_blocks - 1


def test_full_blocks_hit_and_one_prompt_token_is_always_computed():
    kv = _kv([FULL])
    a = _req("a", list(range(10)))                    # 2 full blocks + 2 tokens
    assert _run(kv, a) == 0
    kv.free("a")
    assert kv.num_cached_free_blocks == 2
    assert _run(kv, _req("b", list(range(9)) + [99])) == 8      # both full blocks
    assert _run(kv, _req("c", list(range(8)))) == 4  # all cached, but one token computes
    assert _run(kv, _req("d", [0, 1, 2, 7, 4, 5, 6, 7, 8])) == 0  # first block differs
    assert kv.prefix_stats.num_requests == 4
    assert kv.prefix_stats.num_hit_tokens == 12
    b_blocks, c_blocks = kv.block_ids("b")[0], kv.block_ids("c")[0]
    assert b_blocks[:1] == c_blocks[:1] and b_blocks[2] != c_blocks[1]
    assert kv.pools[0].ref_cnt[b_blocks[0]] == 2       # shared, read-only
    for rid in "bcd":
        kv.free(rid)
    _balanced(kv)


def test_freed_blocks_are_reused_unhashed_first_then_least_recently_freed():
    kv = _kv([FULL], num_blocks=10)                    # 9 usable blocks
    _run(kv, _req("a", list(range(9))))                # blocks 1,2 full (hashed), 3 partial
    _run(kv, _req("b", list(range(100, 109))))         # blocks 4,5 full, 6 partial
    kv.free("a")
    kv.free("b")
    assert kv.num_cached_free_blocks == 4
    # blocks without a hash go first (partial ones, then never used), cached ones survive
    assert kv.allocate("x", 5 * BS)
    assert kv.block_ids("x")[0] == [6, 3, 7, 8, 9]
    assert kv.num_cached_free_blocks == 4
    # one more: the least recently freed chain ("a") loses its tail block first
    assert kv.allocate("y", BS)
    assert kv.block_ids("y")[0] == [2]
    kv.free("x")
    kv.free("y")
    assert _run(kv, _req("b2", list(range(100, 109)))) == 2 * BS
    assert _run(kv, _req("a2", list(range(9)))) == BS          # head of "a" still hits
    assert kv.block_ids("a2")[0][0] == 1 and kv.block_ids("b2")[0][:2] == [4, 5]
    for rid in ("a2", "b2"):
        kv.free(rid)
    _balanced(kv)


def test_failed_admission_gives_the_hit_back_and_counts_nothing():
    kv = _kv([FULL], num_blocks=5)                     # 4 usable blocks
    _run(kv, _req("a", list(range(9))))
    kv.free("a")
    big = _req("big", list(range(8)) + [50] * 20)     # hits 2 blocks, needs 5 more
    assert kv.take_cached_prefix(big) == 2 * BS
    assert not kv.allocate("big", len(big.token_ids))
    kv.free("big")
    assert kv.prefix_stats.num_requests == 1 and kv.num_cached_free_blocks == 2
    _balanced(kv)


def test_a_hit_needs_every_group_and_sliding_groups_only_their_window():
    kv = _kv([SLIDING, FULL], num_blocks=20)
    a = _req("a", list(range(26)))                     # 6 full blocks
    _run(kv, a)
    sliding, full = kv.block_ids("a")
    # keys a query at 26 may read: > 26 - 6 - 1, so blocks from (26 - 6) // 4 = 5 on
    assert sliding[:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in sliding[5:]
    assert NULL_BLOCK not in full
    assert kv.blocks_held("a") == [2, 7]
    kv.free("a")
    # the sliding group no longer holds blocks 0..4, yet 24 tokens hit: a query at 24
    # reads keys from 18 on, blocks 4 and 5; block 4 was freed but is still cached
    b = _req("b", list(range(25)))
    assert _run(kv, b) == 6 * BS
    assert kv.block_ids("b")[0][:4] == [NULL_BLOCK] * 4
    kv.free("b")
    # evict the full group's block 1 only: the sliding group could serve 24 tokens, the
    # full group just 4, so the hit is 4 tokens in both
    pool = kv.pools[1]
    victim = pool.lookup(b.block_hashes[1])
    pool._free.move_to_end(victim, last=False)         # next in line for eviction
    taken = pool.allocate(1)
    assert taken == [victim] and pool.lookup(b.block_hashes[1]) is None
    assert _run(kv, _req("c", list(range(25)))) == BS
    pool.free(taken)
    kv.free("c")
    _balanced(kv)


def test_sliding_blocks_are_freed_as_a_request_advances():
    kv = _kv([SLIDING, FULL], num_blocks=64, enable_prefix_caching=False)
    req = _req("a", [1])
    for num_tokens in range(2, 120):
        assert kv.allocate("a", num_tokens)
        req.num_computed_tokens = num_tokens - 1
        kv.advance(req)
        sliding, full = kv.blocks_held("a")
        assert sliding <= 6 // BS + 2 and full == -(-num_tokens // BS)
    assert kv.num_cached_free_blocks == 0
    kv.free("a")
    _balanced(kv)


@pytest.mark.parametrize("specs,caching", [([SLIDING, FULL], True), ([SLIDING, FULL], False),
                                           ([FULL], True), ([FULL], False)])
def test_a_step_below_advance_at_skips_no_kv_work(specs, caching):
    """Request.commit skips advance() below ``advance_at`` (and the scheduler skips
    allocate() within ``num_slots``): advance() there would change nothing, and from
    ``advance_at`` on it hashes or frees a block."""
    kv = _kv(specs, num_blocks=64, enable_prefix_caching=caching)
    req = _req("a", list(range(100)))
    kv.take_cached_prefix(req)

    def state():
        blocks = kv.block_ids("a")
        return blocks.version, [list(b) for b in blocks], [dict(p.cached) for p in kv.pools]

    for num_computed in range(1, 100):
        assert kv.allocate("a", num_computed + 1)
        assert kv.num_slots["a"] == len(kv.block_ids("a")[0]) * BS >= num_computed + 1
        req.num_computed_tokens = num_computed
        due, before = num_computed >= kv.advance_at["a"], state()
        kv.advance(req)
        assert due == (state() != before), num_computed
    kv.free("a")
    assert "a" not in kv.num_slots and "a" not in kv.advance_at
    _balanced(kv)


# --- the engine -----------------------------------------------------------------------
ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 96,
          "dtype": "float32"}
CAPTURE = {"compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8]}}
SYSTEM = [3 + (7 * j) % 500 for j in range(40)]


def _mtp() -> dict:
    return {"method": "mtp", "model": "tiny-gemma4-mtp", "num_speculative_tokens": 3}


def _prompt(i: int) -> dict:
    prefix = SYSTEM[:(16, 32, 40, 35, 0)[i % 5]]
    tail = [3 + (11 * i + j) % 500 for j in range(1 + (5 * i) % 9)]
    return {"prompt_token_ids": prefix + tail}


def _scenario(engine) -> dict[str, list[int]]:
    """Waves of requests sharing prefixes of 1, 2 and 2.5 blocks; an exact repeat of a
    block-aligned prompt; an abort and the aborted id reused; every run ends balanced."""
    waves = {0: range(0, 4), 2: range(4, 10), 9: range(10, 16), 14: range(16, 20)}
    params = [SamplingParams(temperature=0, max_tokens=3 + (7 * i) % 11, ignore_eos=True)
              for i in range(20)]
    done: dict[str, list[int]] = {}
    for step in range(400):
        for i in waves.get(step, []):
            engine.add_request(f"r{i}", _prompt(i), params[i])
        if step == 4:
            engine.add_request("exact", {"prompt_token_ids": SYSTEM[:32]}, params[1])
        if step == 6:
            engine.abort_request("r5")
        if step == 7:          # the aborted id again, a different prompt sharing the prefix
            engine.add_request("r5", {"prompt_token_ids": SYSTEM[:33] + [7, 7]}, params[5])
        done.update({o.request_id: o.outputs[0].token_ids
                     for o in engine.step() if o.finished})
        if step > 14 and not engine.has_unfinished_requests():
            break
    _assert_balanced(engine)
    return done


def _assert_balanced(engine) -> None:
    engine.kv.check_consistency()
    stats = engine.stats()
    assert not engine.kv.req_blocks
    assert stats["kv_used_blocks"] == 0
    assert stats["kv_free_blocks"] + stats["kv_used_blocks"] == stats["kv_total_blocks"]


@pytest.fixture(scope="module")
def references():
    """Tokens of engines that cache nothing, per model."""
    refs = {}
    for model in ("tiny-llama", "tiny-gemma4"):
        llm = LLM(model, enforce_eager=True, enable_prefix_caching=False, **ENGINE)
        refs[model] = _scenario(llm.engine)
        assert llm.engine.stats()["prefix_cache"]["hit_tokens"] == 0
    return refs


VARIANTS = {
    "llama-eager": ("tiny-llama", {"enforce_eager": True}),
    "llama-graphs": ("tiny-llama", CAPTURE),
    "gemma4-eager": ("tiny-gemma4", {"enforce_eager": True}),
    "gemma4-graphs": ("tiny-gemma4", CAPTURE),
    "gemma4-mtp-graphs": ("tiny-gemma4", {"speculative_config": _mtp(), **CAPTURE}),
    # NOTE: 7 blocks: the trained drafter's accepted drafts finish requests sooner, and with
    # 8 or more blocks this scenario no longer preempts anyone.
    "gemma4-mtp-eager-preempt": ("tiny-gemma4", {"speculative_config": _mtp(),
                                                 "enforce_eager": True,
                                                 "num_gpu_blocks_override": 7}),
    "llama-graphs-preempt": ("tiny-llama", {"num_gpu_blocks_override": 10, **CAPTURE}),
}


@pytest.mark.parametrize("debug_padding", [True, False], ids=["poison", "plain"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tokens_match_an_engine_without_prefix_caching(variant, debug_padding, references):
    model, kwargs = VARIANTS[variant]
    llm = LLM(model, debug_padding=debug_padding, **ENGINE, **kwargs)
    got = _scenario(llm.engine)
    assert got == references[model]
    stats = llm.engine.stats()
    assert stats["prefix_cache"]["hit_tokens"] >= 5 * 16, stats["prefix_cache"]
    if "preempt" in variant:
        assert stats["preemptions"] > 0


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "mtp"])
def test_long_gemma4_request_holds_only_its_window_of_sliding_blocks(speculative):
    """10x the sliding window (16): the sliding group ends holding <= 16 / 16 + 2 blocks;
    tokens equal an engine that frees nothing."""
    extra = {"speculative_config": _mtp()} if speculative else {}
    engine_args = {**ENGINE, "max_model_len": 192, **extra}

    def run(free_sliding: bool) -> tuple[list[int], list[int]]:
        llm = LLM("tiny-gemma4", enforce_eager=True, **engine_args)
        engine = llm.engine
        if not free_sliding:
            engine.kv.lookback = [None] * len(engine.kv.groups)
        sliding = [g.group_id for g in engine.kv.groups if g.spec.sliding_window][0]
        engine.add_request("long", {"prompt_token_ids": [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]},
                           SamplingParams(temperature=0, max_tokens=150, ignore_eos=True))
        held, tokens = [], None
        while engine.has_unfinished_requests():
            if "long" in engine.kv.req_blocks:
                held.append(engine.kv.blocks_held("long")[sliding])
            for out in engine.step():
                tokens = out.outputs[0].token_ids
        _assert_balanced(engine)
        return tokens, held

    want, held_all = run(free_sliding=False)
    got, held = run(free_sliding=True)
    assert got == want and len(got) == 150
    assert max(held_all) >= 10                        # 160 tokens, every block kept
    assert held[-1] <= 16 // 16 + 2 and max(held[1:]) <= 16 // 16 + 2, held


def test_bench_shared_prefix_reports_both_variants_side_by_side(tmp_path, capsys):
    from rung.cli.main import main

    path = tmp_path / "prefix.json"
    assert main(["bench", "latency", "--shared-prefix", "200", "--prefix-requests", "16",
                 "--output-len", "2", "--iters", "1", "--warmup-iters", "0",
                 "--enforce-eager", "--json", str(path)]) == 0
    import json

    report = json.loads(path.read_text())
    rows = report["variants"]
    # 16 x 208 tokens without caching; with it the first request computes 208 and each
    # later one the 8 tokens after the 12 cached blocks plus its own 8
    assert rows["no_prefix_caching"]["prefill_tokens_per_round"] == 16 * 208
    assert rows["prefix_caching"]["prefill_tokens_per_round"] == 208 + 15 * 16
    assert report["prefill_tokens_reduction"] >= 0.85 and report["tokens_identical"]
    assert "TTFT p50" in capsys.readouterr().out


def test_reset_prefix_cache_forgets_cached_blocks_only_when_none_is_held(caplog):
    """vLLM's LLM.reset_prefix_cache: refused while a request holds blocks; afterwards the
    same prompt hits nothing, its tokens are unchanged and the hit statistics start over."""
    llm = LLM("tiny-llama", enforce_eager=True, max_model_len=128, max_num_seqs=4)
    prompt = {"prompt_token_ids": [3 + i % 50 for i in range(40)]}        # 2 full blocks
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("held", prompt, params)
    engine.step()
    assert engine.stats()["prefix_cache"]["hit_tokens"] > 0
    assert llm.reset_prefix_cache() is False and "still held" in caplog.text
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.reset_prefix_cache() is True
    assert engine.kv.num_cached_free_blocks == 0
    assert engine.stats()["prefix_cache"]["queries"] == 0
    again = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert again == first
    assert engine.stats()["prefix_cache"]["hit_tokens"] == 0
    engine.kv.check_consistency()
