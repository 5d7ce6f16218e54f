"""Data parallel with 2 gloo ranks on CPU, spawned by each test (bounded by a timeout).

Every engine validates its target and draft metadata at every step (debug_padding), and
each test compares every rank's tokens with one process running all requests without
speculation.
"""

from __future__ import annotations

import time

import pytest
import torch
from helpers import random_prompts

from rung.runtime import LLM, SamplingParams
from rung.runtime.dist.data_parallel import route_requests, spawn_ranks

WORLD = 2
TIMEOUT_S = 900
VOCAB = 512
COMMON = dict(dtype="float32", device="cpu", max_num_seqs=16, max_model_len=128,
              max_num_batched_tokens=128, debug_padding=True)
# Uneven waves: wave 1 puts 12 requests on rank 0 (short) and 13 on rank 1 (long), so
# rank 0 pads 12 requests to rank 1's 13 and then idles while rank 1 finishes; wave 2
# gives rank 0 nothing at all.
WAVE1_RANKS = [0] * 12 + [1] * 13
WAVE2_RANKS = [1] * 5


def _waves() -> list[tuple[list[dict], list[SamplingParams], list[int]]]:
    lens1 = [3 + (7 * i) % 29 for i in range(25)]
    prompts1 = [{"prompt_token_ids": p} for p in random_prompts(VOCAB, lens=lens1, seed=1)]
    params1 = [SamplingParams(temperature=0, max_tokens=8 + i % 4 if r == 0 else 16 + i % 5,
                              ignore_eos=True) for i, r in enumerate(WAVE1_RANKS)]
    prompts2 = [{"prompt_token_ids": p} for p in random_prompts(VOCAB, lens=[4, 9, 17, 2, 30],
                                                                seed=2)]
    params2 = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True)
               for i in range(5)]
    return [(prompts1, params1, WAVE1_RANKS), (prompts2, params2, WAVE2_RANKS)]


def _record_drafts(proposer, out: list) -> None:
    """Wrap ``proposer._run`` to append the shape of every draft descriptor it runs."""
    inner = proposer._run

    def wrapper(draft_desc, *args):
        out.append(_shape(draft_desc))
        return inner(draft_desc, *args)

    proposer._run = wrapper


def _shape(desc) -> tuple:
    return (desc.mode.name, desc.num_reqs, desc.num_reqs_padded, desc.num_tokens,
            desc.num_tokens_padded, desc.num_tokens_across_dp)


def _rank_worker(rank: int, kwargs: dict) -> dict:
    """One rank: both waves; its tokens, descriptors and KV state."""
    torch.set_num_threads(1)
    llm = LLM(**kwargs, data_parallel_size=WORLD)
    engine = llm.engine
    target, drafts = [], []
    engine.add_step_listener(lambda result: target.append(_shape(result.desc)))
    if hasattr(engine.proposer, "_run"):
        _record_drafts(engine.proposer, drafts)
    tokens = []
    for prompts, params, ranks in _waves():
        outs = llm.generate(prompts, params, data_parallel_ranks=ranks)
        tokens.append([o.outputs[0].token_ids for o in outs])
    pools = [(p.num_free, p.num_blocks - 1) for p in engine.kv.pools]
    return {"tokens": tokens, "target": target, "drafts": drafts, "pools": pools,
            "stats": engine.stats(), "debug_padding": engine.config.debug_padding}


def _reference(model: str) -> list[list[list[int]]]:
    """One process, every request, no speculation, eager."""
    llm = LLM(model, enforce_eager=True, **COMMON)
    return [[o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            for prompts, params, _ in _waves()]


def _check_ranks(results: list[dict], want: list) -> None:
    for rank, res in enumerate(results):
        assert res["debug_padding"], "metadata must be validated at every step"
        assert res["tokens"] == want, f"rank {rank} tokens differ from one process"
        assert all(free == total for free, total in res["pools"]), (
            f"rank {rank} leaked KV blocks: {res['pools']}")
        dp = res["stats"]["data_parallel"]
        assert dp["world_size"] == WORLD and dp["rank"] == rank
    # rank 0 idles: it runs dummy steps for rank 1's sake, never the other way round
    assert results[0]["stats"]["data_parallel"]["dummy_steps"] >= 5
    assert results[1]["stats"]["data_parallel"]["dummy_steps"] == 0


def test_moe_mtp_expert_parallel_seed_shape():
    """tiny-gemma4-moe (experts split over the ranks) + its MoE MTP drafter, k=3, graphs on:
    the rank with 12 requests drafts 12 real rows while its drafter's inputs (and MoE
    collectives) pad to the other rank's 13 (the DeepSeek-V3.2 DP8 + MTP failure)."""
    kwargs = dict(COMMON, model="tiny-gemma4-moe",
                  compilation_config={"cudagraph_capture_sizes": [4, 8],
                                      "cudagraph_mode": "full_decode_only"},
                  speculative_config={"method": "mtp", "model": "tiny-gemma4-moe-mtp",
                                      "num_speculative_tokens": 3})
    results = spawn_ranks(_rank_worker, WORLD, (kwargs,), timeout_s=TIMEOUT_S)
    _check_ranks(results, _reference("tiny-gemma4-moe"))
    r0, r1 = results
    # the seed shape: 12 real draft rows, token rows padded to 13, metadata at 12 rows
    assert ("NONE", 12, 12, 12, 13, (13, 13)) in r0["drafts"]
    assert ("NONE", 13, 13, 13, 13, (13, 13)) in r1["drafts"]
    # the target's verify step pads 12 x 4 tokens to rank 1's 13 x 4 the same way
    print("rank 0 target", r0["target"], "\nrank 0 drafts", r0["drafts"])
    assert ("NONE", 12, 12, 48, 52, (52, 52)) in r0["target"]
    # some steps replay graphs with DP padding, on both ranks
    for res in results:
        assert any(d[0] == "FULL" and d[5] is not None for d in res["target"] + res["drafts"])
    assert r0["stats"]["spec"]["num_drafts"] > 0 and r1["stats"]["spec"]["num_drafts"] > 0


def test_ngram_dense_uneven_loads():
    kwargs = dict(COMMON, model="tiny-llama",
                  compilation_config={"cudagraph_capture_sizes": [4, 8, 16, 32, 64],
                                      "cudagraph_mode": "full_decode_only"},
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    results = spawn_ranks(_rank_worker, WORLD, (kwargs,), timeout_s=TIMEOUT_S)
    _check_ranks(results, _reference("tiny-llama"))
    for res in results:
        assert res["stats"]["graph_replays"], "no step replayed a graph"


def _mismatch_worker(rank: int) -> str:
    torch.set_num_threads(1)
    sizes = [4, 8] if rank == 0 else [4, 16]
    try:
        LLM("tiny-llama", data_parallel_size=WORLD,
            compilation_config={"cudagraph_capture_sizes": sizes}, **COMMON)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_ranks_that_disagree_fail_fast_on_every_rank():
    errors = spawn_ranks(_mismatch_worker, WORLD, timeout_s=TIMEOUT_S)
    for message in errors:
        assert "disagree on cudagraph_capture_sizes" in message
        assert "rank 0=[4, 8]" in message and "rank 1=[4, 16]" in message


def _dead_rank_worker(rank: int) -> str:
    torch.set_num_threads(1)
    llm = LLM("tiny-llama", data_parallel_size=WORLD, enforce_eager=True,
              data_parallel_timeout_s=20, **COMMON)
    if rank == 1:
        return "left"          # leaves without stepping, as a crashed rank would
    start = time.monotonic()
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4,
                     SamplingParams(max_tokens=64, ignore_eos=True))
    except RuntimeError as e:
        return f"error after {time.monotonic() - start:.0f} s: {e}"
    return "no error"


def test_a_dead_rank_makes_the_others_fail():
    survivor, _ = spawn_ranks(_dead_rank_worker, WORLD, timeout_s=TIMEOUT_S)
    assert survivor.startswith("error after"), survivor


def test_routing_policies():
    assert route_requests([5, 5, 5], 2) == [0, 1, 0]
    assert route_requests([100, 1, 1, 1], 2, "least_tokens") == [0, 1, 1, 1]
    with pytest.raises(ValueError, match="policy 'random'"):
        route_requests([1], 2, "random")


def test_data_parallel_needs_ranks():
    with pytest.raises(ValueError, match="torchrun"):
        LLM("tiny-llama", data_parallel_size=2, enforce_eager=True, **COMMON)


def test_dp_table_shows_padding_per_rank():
    from rung.bench.dp_latency import format_dp_table

    row = dict(mode="full", num_reqs=1, steps=4, step_ms_p50=1.5)
    table = format_dp_table([dict(row, rank=1, rank_num_reqs=0, dummy_steps=4,
                                  padding_waste=1.0),
                             dict(row, rank=0, rank_num_reqs=1, dummy_steps=0,
                                  padding_waste=0.0)])
    lines = table.splitlines()
    assert "padding_waste" in lines[0] and len(lines) == 3
    assert lines[1].split()[2:4] == ["0", "1"] and lines[1].endswith("0.0%")
    assert lines[2].split()[2:4] == ["1", "0"] and lines[2].endswith("100.0%")


@pytest.mark.slow
def test_cli_bench_latency_spawns_ranks(capsys):
    from rung.cli.main import main

    assert main(["bench", "latency", "--model", "tiny-llama", "--data-parallel-size", "2",
                 "--batch-sizes", "1,3", "--modes", "none", "--input-len", "4",
                 "--output-len", "3", "--iters", "1", "--warmup-iters", "0"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] == ["none"]]
    # (num_reqs, rank) -> padding waste: 1 request leaves rank 1 all padding
    waste = {(r[1], r[2]): r[-1] for r in rows}
    assert waste[("1", "0")] == "0.0%" and waste[("1", "1")] == "100.0%"
    assert set(waste) == {("1", "0"), ("1", "1"), ("3", "0"), ("3", "1")}


@pytest.mark.slow
def test_spawned_ranks_leak_nothing_and_the_bar_counts_every_rank():
    """`rung generate --data-parallel-size 2`: ranks exit cleanly (no semaphore a killed
    rank leaks, as tqdm's lock did) and rank 0's bar counts both ranks' prompts."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "rung.cli.main", "generate", "--model", "tiny-llama",
           "--enforce-eager", "--data-parallel-size", "2", "--max-tokens", "2",
           "--max-model-len", "32", "--max-num-seqs", "4", "a", "b", "c", "d"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "leaked" not in run.stderr, run.stderr[-2000:]
    assert "4/4" in run.stderr, run.stderr[-2000:]
