"""Graph replays equal eager, for every mode and every partial batch on the ladder.

Engines run with poison on (conftest): every buffer is garbage before each step's inputs
are written, and pad input rows are garbage at every replay.
"""

import logging

import pytest
import torch

from rung.cli.main import main as cli_main
from rung.core.graph_mode import GraphSupport
from rung.kernels import selector
from rung.kernels.torch_backend import TorchBackend
from rung.runtime import LLM, SamplingParams
from rung.runtime.sched.kv_cache_manager import NULL_BLOCK
from rung.runtime.tools.verify import guard_kv, verify_engine
from rung.runtime.worker.input_batch import InputBatch

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


@pytest.mark.parametrize("mode", ["full_and_piecewise", "piecewise", "full", "full_decode_only"])
def test_every_partial_batch_replays_like_eager(mode, eager_llm):
    # the same check `rung verify` runs: every size x num_reqs, pads poisoned, KV guarded
    graph_llm = _graph_llm(mode)
    guard_kv(graph_llm.engine)
    cells = verify_engine(graph_llm.engine, eager_llm.engine)
    assert [c for c in cells if c.status == "fail"] == []
    decode_mode = {"piecewise": "PIECEWISE"}.get(mode, "FULL")
    # every size replayed the uniform batch at every fill level 1..size
    decode = [c for c in cells if c.mode == decode_mode and c.status != "n/a"]
    assert [c for c in decode if c.status != "pass"] == []
    assert len(decode) == sum(SIZES)
    if mode in ("full_and_piecewise", "piecewise"):
        assert any(c.mode == "PIECEWISE" and c.status == "pass" for c in cells)


def test_verify_catches_a_pad_row_that_reads_live_kv(eager_llm, monkeypatch):
    """A pad() that forgets to zero seq_lens of pad rows must fail the matching cells."""
    graph_llm = _graph_llm("full", sizes=[4], debug_padding=True)   # as `rung verify` runs
    pad = InputBatch.pad

    def forgetful_pad(self, desc):
        pad(self, desc)
        self.seq_lens.np[desc.num_reqs:desc.num_reqs_padded] = 7
        self.block_tables[0].np[desc.num_reqs:desc.num_reqs_padded] = 1

    monkeypatch.setattr(InputBatch, "pad", forgetful_pad)
    cells = verify_engine(graph_llm.engine, eager_llm.engine)
    failed = [c for c in cells if c.status == "fail"]
    assert [(c.mode, c.size, c.num_reqs) for c in failed] == [("FULL", 4, 1)]
    assert "step" in failed[0].detail


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


def test_full_with_a_backend_that_cannot_capture_downgrades(caplog, monkeypatch, eager_llm):
    monkeypatch.setitem(selector._BACKENDS, _NoGraphBackend.name, _NoGraphBackend)
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


def guard_shared_blocks(engine):
    """Fail if a step writes into a cached (hashed, shareable) block, or if a real row's
    block table differs from the request's blocks (freed sliding entries -> null block)."""
    runner, kv = engine.runner, engine.kv
    execute = runner.execute
    seen = {"rows_with_freed_blocks": 0}

    def checked(sched, block_ids):
        cached = [[b for b in range(1, p.num_blocks) if p.block_hash[b] is not None]
                  for p in kv.pools]
        before = {name: runner.kv_caches[name][:, cached[g]].clone()
                  for g, group in enumerate(runner.kv_groups) for name in group.layer_names}
        out = execute(sched, block_ids)
        for g, group in enumerate(runner.kv_groups):
            table = runner.input_batch.block_tables[g].np
            for row, blocks in enumerate(block_ids):
                assert table[row, :len(blocks[g])].tolist() == list(blocks[g])
                seen["rows_with_freed_blocks"] += NULL_BLOCK in blocks[g]
            for name in group.layer_names:
                after = runner.kv_caches[name][:, cached[g]]
                assert torch.equal(after, before[name]), f"{name}: a cached block was written"
        return out

    runner.execute = checked
    return seen


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma4"])
def test_prefix_hits_evictions_and_freed_sliding_blocks_replay_like_eager(model):
    """Hits, partial hits (sliding groups serve only their window), evictions (a small
    pool) and sliding blocks freed mid-request, under FULL and PIECEWISE replays with
    poisoned pads: tokens equal an eager engine that caches nothing."""
    system = [3 + (7 * j) % 500 for j in range(48)]
    prompts = [system[:(16, 32, 48, 40)[i % 4]] + [5 + (13 * i + j) % 400
                                                    for j in range(1 + (3 * i) % 7)]
               for i in range(12)]
    params = [SamplingParams(temperature=0, max_tokens=6 + (5 * i) % 30, ignore_eos=True)
              for i in range(12)]

    def run(llm):
        engine, done, step = llm.engine, {}, 0
        pending = list(enumerate(prompts))
        while pending or engine.has_unfinished_requests():
            while pending and pending[0][0] <= step // 2:      # one arrival every 2 steps
                i, prompt = pending.pop(0)
                engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, params[i])
            done.update({o.request_id: o.outputs[0].token_ids
                         for o in engine.step() if o.finished})
            step += 1
        engine.kv.check_consistency()
        return done

    want = run(LLM(model, enforce_eager=True, enable_prefix_caching=False, **ENGINE))
    llm = LLM(model, num_gpu_blocks_override=16, **ENGINE,
              compilation_config={"cudagraph_mode": "full_and_piecewise",
                                  "cudagraph_capture_sizes": SIZES})
    guard_kv(llm.engine)
    seen = guard_shared_blocks(llm.engine)
    assert run(llm) == want
    assert (seen["rows_with_freed_blocks"] > 0) == (model == "tiny-gemma4")
    stats = llm.engine.stats()
    assert stats["prefix_cache"]["hit_tokens"] > 0 and stats["prefix_cache"]["evicted_blocks"]
    assert any(k.startswith("FULL:") for k in stats["graph_replays"])
    assert any(k.startswith("PIECEWISE:") for k in stats["graph_replays"])
