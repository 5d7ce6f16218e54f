"""Compiled CPU graphs (graph_backend="compiled"): replays give eager's greedy tokens.

Each size is an inductor compile (tens of seconds on a small CPU): the default suite
compiles one size of tiny-llama; the other models are slow tests.
"""

import json
import subprocess
import sys

import pytest
import torch

import rung.graphs.cpu_compiled.artifacts as compiled_graphs
from rung.graphs.cpu_compiled.direct_call import SizeTensors
from rung.models.llama import LlamaDecoderLayer
from rung.runtime import LLM, SamplingParams


@pytest.fixture(autouse=True)
def _python_wrapper(monkeypatch):
    # NOTE: the Python wrapper compiles faster than the C++ one and computes the same
    monkeypatch.setattr(compiled_graphs, "INDUCTOR_OPTIONS", {})


PROMPTS = [[1, 72, 105, 33], [1, 5, 9, 200, 17, 3, 41, 8, 77], [1, 300]]


def _tokens(llm: LLM, num_prompts: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:num_prompts]], params)
    return [o.outputs[0].token_ids for o in outs]


KWARGS = dict(max_num_seqs=4, max_model_len=64, num_gpu_blocks_override=24)


def _compiled(model: str, sizes: list[int], cache_dir: str | None = None) -> LLM:
    return LLM(model, compilation_config={"cudagraph_mode": "full_decode_only",
                                          "cudagraph_capture_sizes": sizes,
                                          "graph_backend": "compiled", "cache_dir": cache_dir,
                                          "graph_startup": "blocking"},
               **KWARGS)


def _compiled_matches_eager(model: str, sizes: list[int], num_prompts: int) -> LLM:
    compiled = _compiled(model, sizes)
    eager = LLM(model, enforce_eager=True, **KWARGS)
    graphs = compiled.engine.runner.graphs
    assert graphs.capture_backend.name == "compiled"
    poisoned = []
    if compiled.engine.config.debug_padding:       # replays must ignore garbage in pad rows
        real_poison = graphs._poison_pads
        for graph in graphs.full_graphs.values():
            graph.poison = lambda: (poisoned.append(1), real_poison())
    assert _tokens(compiled, num_prompts) == _tokens(eager, num_prompts)
    assert bool(poisoned) == compiled.engine.config.debug_padding
    replays = compiled.engine.stats()["graph_replays"]
    assert replays and set(replays) <= {f"FULL:{s}" for s in sizes}, replays
    return compiled


def test_compiled_full_decode_matches_eager_llama():
    # 1 and 2 decoding requests both replay the size-2 graph (one pad row, then none)
    compiled = _compiled_matches_eager("tiny-llama", [2], num_prompts=2)
    # every layer is called past inductor's wrappers (graphs.cpu_compiled.artifacts.direct_call)
    direct = compiled.engine.runner.graphs.capture_backend.direct_calls
    assert direct and None not in direct.values()


@pytest.mark.slow
def test_cpp_wrapper_layers_called_directly_match_eager(monkeypatch):
    """The production wrapper (C++): layers called directly, sizes as 0-dim tensors."""
    monkeypatch.setattr(compiled_graphs, "INDUCTOR_OPTIONS",
                        {"config_patches": {"cpp_wrapper": True}})
    compiled = _compiled_matches_eager("tiny-llama", [1, 2], num_prompts=2)
    # the decoder layer's artifact and the epilogue's (norm and lm head), both called
    # through their C++ wrappers (sizes as 0-dim tensors)
    direct = list(compiled.engine.runner.graphs.capture_backend.direct_calls.values())
    assert None not in direct and len(direct) == 2
    assert {type(d.size_of) for d in direct} == {SizeTensors}


_WARM_START = """
import json, sys
import torch
torch.set_num_threads(int(sys.argv[3]))   # the kernels' thread count is part of the key
from rung.runtime import LLM, SamplingParams
llm = LLM("tiny-llama", compilation_config={"cudagraph_mode": "full_decode_only",
          "cudagraph_capture_sizes": [1, 2], "graph_backend": "compiled",
          "cache_dir": sys.argv[1], "graph_startup": "blocking"},
          max_num_seqs=4, max_model_len=64, num_gpu_blocks_override=24)
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])], params)
print(json.dumps({"records": [[r.compile_s, r.load_s] for r in llm.engine.runner.graphs.records],
                  "replays": llm.engine.stats()["graph_replays"],
                  "tokens": [o.outputs[0].token_ids for o in outs],
                  "inductor": sorted(m for m in sys.modules if m.startswith(("torch._inductor",
                                                                              "torch._dynamo")))}))
"""


@pytest.mark.slow
def test_a_warm_start_loads_the_cpp_wrapper_without_inductor(tmp_path, monkeypatch):
    """The production wrapper (C++): a second start, in a new process, compiles nothing,
    binds both sizes to the cached wrapper library without importing inductor (seconds of
    a warm start), and replays eager's tokens."""
    monkeypatch.setattr(compiled_graphs, "INDUCTOR_OPTIONS",
                        {"config_patches": {"cpp_wrapper": True}})
    first = _compiled("tiny-llama", [1, 2], str(tmp_path))
    assert [r.compile_s is not None for r in first.engine.runner.graphs.records] == [True, False]
    # every artifact (the layer kind, the epilogue) keeps its wrapper library
    entries = list(tmp_path.glob("compiled/*/meta.json"))
    assert len(entries) == 2 and len(list(tmp_path.glob("compiled/*/wrapper-*.so"))) == 2
    want = _tokens(LLM("tiny-llama", enforce_eager=True, **KWARGS), 2)
    proc = subprocess.run([sys.executable, "-c", _WARM_START, str(tmp_path),
                           json.dumps(PROMPTS[:2]), str(torch.get_num_threads())],
                          capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warm = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [compile_s for compile_s, _ in warm["records"]] == [None, None]
    assert all(load_s is not None for _, load_s in warm["records"])
    assert warm["inductor"] == []
    assert warm["tokens"] == want
    assert warm["replays"] and set(warm["replays"]) <= {"FULL:1", "FULL:2"}, warm["replays"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-gemma4"])
def test_compiled_full_decode_matches_eager(model):
    # Gemma 4: sliding window and logit softcap inside the compiled attention
    _compiled_matches_eager(model, [1, 4], num_prompts=3)


@pytest.mark.slow
def test_second_start_loads_and_a_corrupt_entry_is_rebuilt(tmp_path):
    first = _compiled("tiny-llama", [2], str(tmp_path))
    want = _tokens(first, 2)
    [record] = first.engine.runner.graphs.records
    assert record.compile_s > 0 and record.load_s is None
    second = _compiled("tiny-llama", [2], str(tmp_path))
    [record] = second.engine.runner.graphs.records
    assert record.compile_s is None and record.load_s > 0
    assert _tokens(second, 2) == want
    # every entry (the layer kind, the epilogue) corrupt: its wrapper library, if it has
    # one, does not load, nor does the artifact inductor would load instead
    entries = list(tmp_path.glob("compiled/*/meta.json"))
    assert len(entries) == 2
    for entry in entries:
        for built in [*entry.parent.glob("wrapper-*.so"), entry.parent / "artifact.bin"]:
            built.write_bytes(b"not an artifact")
    third = _compiled("tiny-llama", [2], str(tmp_path))
    [record] = third.engine.runner.graphs.records
    assert record.compile_s > 0 and record.load_s is None     # rebuilt, never used
    assert _tokens(third, 2) == want


# NOTE: the suite runs on one torch thread (conftest), so every other compiled test checks
# one-thread artifacts beside eager already; the one-thread case here is slow
@pytest.mark.parametrize("threads", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_a_cached_artifact_that_disagrees_with_eager_is_rebuilt(tmp_path, monkeypatch, threads):
    """A size goes live only once every layer's artifact reproduced the eager layer on the
    capture batch: the cached artifact of a layer that now computes something else (same
    key: rung's source hash reads its files, not this patch) is dropped and compiled again.
    The check runs eager beside one-thread artifacts, and after each layer of two-thread
    ones (they would wait for the core eager holds)."""
    config = {"cudagraph_mode": "full_decode_only", "cudagraph_capture_sizes": [2],
              "graph_backend": "compiled", "cache_dir": str(tmp_path),
              "graph_startup": "blocking", "compile_threads": threads}
    first = LLM("tiny-llama", compilation_config=config, **KWARGS)
    [record] = first.engine.runner.graphs.records
    assert record.compile_s is not None
    forward = LlamaDecoderLayer.forward
    monkeypatch.setattr(LlamaDecoderLayer, "forward",
                        lambda self, rope, hidden: forward(self, rope, hidden) * 1.01)
    second = LLM("tiny-llama", compilation_config=config, **KWARGS)
    [record] = second.engine.runner.graphs.records
    assert record.compile_s is not None and record.load_s is None    # the entry went unused
    assert _tokens(second, 2) == _tokens(LLM("tiny-llama", enforce_eager=True, **KWARGS), 2)
    assert second.engine.stats()["graph_replays"].get("FULL:2", 0) > 0


def test_engines_that_differ_in_kv_and_batch_limits_share_the_artifact(tmp_path):
    """The cache key holds what the compiled code depends on: another max_num_seqs,
    max_model_len or KV cache size (a benchmark's --output-len) loads, never recompiles."""
    sizes = {"cudagraph_mode": "full_decode_only", "cudagraph_capture_sizes": [2],
             "graph_backend": "compiled", "cache_dir": str(tmp_path),
             "graph_startup": "blocking"}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    first = LLM("tiny-llama", compilation_config=sizes, max_num_seqs=2, max_model_len=64,
                num_gpu_blocks_override=24)
    [record] = first.engine.runner.graphs.records
    assert record.compile_s is not None
    other = dict(max_num_seqs=8, max_model_len=128, num_gpu_blocks_override=40)
    second = LLM("tiny-llama", compilation_config=sizes, **other)
    [record] = second.engine.runner.graphs.records
    assert record.compile_s is None and record.load_s is not None
    want = LLM("tiny-llama", enforce_eager=True, **other).generate(prompts, params)
    got = second.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert second.engine.stats()["graph_replays"].get("FULL:2", 0) > 0
    # one decoder-layer kind and one epilogue (tiny-llama's untied head has no row branch)
    assert len(list(tmp_path.glob("compiled/*/artifact.bin"))) == 2
    # inductor writes the thread count into the kernels it generates: an engine replaying
    # on another count compiles its own (a one-thread prefetch subprocess compiles for the
    # serving engine's count instead, test_graph_startup)
    threads = {**sizes, "compile_threads": torch.get_num_threads() + 1}
    third = LLM("tiny-llama", compilation_config=threads, **other)
    [record] = third.engine.runner.graphs.records
    assert record.compile_s is not None
    assert len(list(tmp_path.glob("compiled/*/artifact.bin"))) == 4


def test_second_start_with_mtp_loads_the_verify_graph(tmp_path):
    """Gemma 4 (two KV cache groups) with its MTP drafter: the verify-shaped FULL graph is
    loaded from the disk cache on the second start and replays eager's tokens. Each group's
    metadata holds its own view of seq_lens; a loaded graph once cut only the first group's
    block table and crashed on the size check."""
    spec = {"method": "mtp", "model": "tiny-gemma4-mtp", "num_speculative_tokens": 3}
    # NOTE: 4 blocks per request, so a short context cuts the tables below their width
    engine = dict(speculative_config=spec, max_num_seqs=1, max_model_len=64,
                  num_gpu_blocks_override=24)
    compiled = {"cudagraph_mode": "full_decode_only", "cudagraph_capture_sizes": [4],
                "graph_backend": "compiled", "cache_dir": str(tmp_path),
             "graph_startup": "blocking"}
    prompt = [{"prompt_token_ids": [1, 5, 9, 200, 17]}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = LLM("tiny-gemma4", enforce_eager=True, **engine).generate(prompt, params)
    for start in ("compiles", "loads"):
        llm = LLM("tiny-gemma4", compilation_config=compiled, **engine)
        [record] = llm.engine.runner.graphs.records
        assert (record.load_s is not None) == (start == "loads"), start
        got = llm.generate(prompt, params)
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids, start
        assert llm.engine.stats()["graph_replays"].get("FULL:4", 0) > 0, start


@pytest.mark.slow
def test_mtp_drafter_graphs_are_compiled_rounds_with_eager_tokens(tmp_path):
    """tiny-gemma4 + its MTP drafter, every graph compiled: the draft steps replay one
    round's inductor artifact (never the eager drafter), built on two rows and bound on one,
    and the tokens (and drafts, so acceptance) equal an eager engine's."""
    spec = {"method": "mtp", "model": "tiny-gemma4-mtp", "num_speculative_tokens": 3}
    engine = dict(speculative_config=spec, max_num_seqs=2, max_model_len=64,
                  num_gpu_blocks_override=24)
    # target sizes 4 and 8 (1 + k tokens a request), draft sizes 1 and 2 (requests)
    compiled = {"cudagraph_mode": "full_decode_only", "cudagraph_capture_sizes": [1, 2, 4, 8],
                "graph_backend": "compiled", "cache_dir": str(tmp_path),
                "graph_startup": "blocking"}
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    # NOTE: one request outlives the other, so both draft sizes replay
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (8, 24)]
    eager = LLM("tiny-gemma4", enforce_eager=True, **engine)
    want = eager.generate(prompts, params)
    llm = LLM("tiny-gemma4", compilation_config=compiled, **engine)
    draft = {r.num_reqs_padded: r for r in llm.engine.runner.graphs.records
             if r.mode == "DRAFT_FULL"}
    assert sorted(draft) == [1, 2]
    assert draft[2].compile_s is not None and draft[1].load_s is not None   # one artifact
    assert draft[1].artifact == draft[2].artifact
    drafter = llm.engine.proposer.drafter
    eager_calls = []
    forward = drafter.forward
    drafter.forward = lambda *a: (eager_calls.append(1), forward(*a))[1]
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = llm.engine.stats()
    assert stats["spec"] == eager.engine.stats()["spec"]        # the same drafts accepted
    draft_stats = stats["graphs"]["draft"]
    assert draft_stats["replay"] == "compiled" and draft_stats["live"] == [1, 2]
    assert draft_stats["pending"] == [] and draft_stats["artifacts"] == [draft[1].artifact]
    assert set(draft_stats["steps"]) == {"FULL:1", "FULL:2"}, draft_stats
    assert eager_calls == []                 # every draft step replayed the artifact
    warm = LLM("tiny-gemma4", compilation_config=compiled, **engine)    # loads from disk
    assert all(r.compile_s is None and r.load_s is not None
               for r in warm.engine.runner.graphs.records)
    got = warm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert warm.engine.stats()["spec"] == eager.engine.stats()["spec"]


@pytest.mark.slow
def test_logits_from_the_graph_match_eager_either_side_of_the_transposed_head(monkeypatch):
    """A per-layer FULL graph ends in the final norm and the lm head (its epilogue), and
    the runner samples from its logits. tiny-qwen3's tied head takes its W^T copy up to
    MAX_ROWS_TRANSPOSED_HEAD rows and the tall GEMM past it: one size-8 graph replays 3 and 6
    requests, one on each side, with eager's tokens and logprobs; with the W^T copy
    negated (in both engines) they still agree, so each side reads the weights eager's
    branch reads. (The head's BLAS path: where rung's float32 GEMV cannot build.)"""
    from rung.models import layers
    monkeypatch.setattr(layers, "gguf_cpu_available", lambda: "no C compiler (test)")
    kwargs = dict(max_num_seqs=8, max_model_len=64, num_gpu_blocks_override=40)
    compiled = LLM("tiny-qwen3", compilation_config={
        "cudagraph_mode": "full_decode_only", "cudagraph_capture_sizes": [8],
        "graph_backend": "compiled", "cache_dir": "", "graph_startup": "blocking"}, **kwargs)
    eager = LLM("tiny-qwen3", enforce_eager=True, **kwargs)
    model = compiled.engine.runner.model
    eager_heads = []
    real_logits = model.compute_logits
    monkeypatch.setattr(model, "compute_logits",
                        lambda hidden: (eager_heads.append(hidden.shape[0]),
                                        real_logits(hidden))[1])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    for negated in (False, True):
        if negated:
            for llm in (compiled, eager):
                llm.engine.runner.model.lm_head.weight_t.neg_()
        for num_reqs in (3, 6):                 # MAX_ROWS_TRANSPOSED_HEAD is 3
            prompts = [{"prompt_token_ids": [1, 7 + i, 9, 200 + i]} for i in range(num_reqs)]
            got = compiled.generate(prompts, params)
            want = eager.generate(prompts, params)
            for g, w in zip(got, want):
                assert g.outputs[0].token_ids == w.outputs[0].token_ids
                for lp_g, lp_w in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                    assert lp_g.keys() == lp_w.keys()
                    for t in lp_g:
                        assert abs(lp_g[t].logprob - lp_w[t].logprob) < 1e-4
    replays = compiled.engine.stats()["graph_replays"]
    assert replays.get("FULL:8", 0) >= 4 * 5, replays
    # only the prefills ran the eager head (one step per batch); every decode step sampled
    # from the graph's logits
    assert eager_heads == [3, 6, 3, 6], eager_heads
