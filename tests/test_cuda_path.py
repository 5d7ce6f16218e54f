"""The CUDA path's start-up and replay rules, held on CPU: the emulated backend run with
CUDA's start-up policy (captures on the serving thread, "auto" in the background), a
capture that raises, and a CUDA graph object faked around its replay."""

import contextlib
import logging

import pytest
import torch

from rung.graphs import capture as capture_mod
from rung.graphs.backends import make_capture_backend
from rung.graphs.capture import CudaGraph, CudaGraphBackend, EmulatedGraphBackend
from rung.graphs.manager import GraphManager
from rung.runtime import LLM, SamplingParams

# NOTE: on CPU on every machine: these hold the CUDA policy on the emulated backend
KWARGS = dict(max_num_seqs=4, max_model_len=64, num_gpu_blocks_override=32, dtype="float32",
              device="cpu")
PROMPTS = [[1, 72, 105, 33], [1, 5, 9, 200, 17, 3, 41, 8, 77], [1, 300], [1, 7, 7, 7, 2]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SIZES = [1, 2, 4]


def cuda_startup_policy(monkeypatch) -> None:
    """The emulated backend starts up as CUDA graphs do (as the suite sees them)."""
    for name in ("auto_startup", "serving_thread_captures"):
        monkeypatch.setattr(EmulatedGraphBackend, name, getattr(CudaGraphBackend, name))


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def eager_tokens():
    return _tokens(LLM("tiny-llama", enforce_eager=True, **KWARGS))


def test_a_capture_that_raises_leaves_serving_up_and_that_size_eager(
        debug_padding, eager_tokens, monkeypatch, caplog):
    cuda_startup_policy(monkeypatch)
    real = EmulatedGraphBackend.capture

    def capture(self, fn, inputs):
        if inputs[0].shape[0] == 2:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        return real(self, fn, inputs)

    monkeypatch.setattr(EmulatedGraphBackend, "capture", capture)
    llm = LLM("tiny-llama", compilation_config={"graph_startup": "background",
                                                "cudagraph_mode": "full_decode_only",
                                                "cudagraph_capture_sizes": SIZES}, **KWARGS)
    with caplog.at_level(logging.WARNING, logger="rung.graphs.builder"):
        assert _tokens(llm) == eager_tokens         # serving went on through the failure
        assert llm.wait_for_graphs(timeout=60)
    graphs = llm.engine.stats()["graphs"]
    assert graphs["done"] and set(graphs["live"]) == {"FULL:1", "FULL:4"}
    assert any("FULL 2" in r.message and "operation not permitted" in r.message
               for r in caplog.records), [r.message for r in caplog.records]
    assert _tokens(llm) == eager_tokens             # two-request batches run eagerly
    replays = llm.engine.stats()["graph_replays"]
    assert replays.get("FULL:4", 0) > 0 and "FULL:2" not in replays


def test_the_first_step_of_a_background_start_runs_no_trace_and_no_capture(
        debug_padding, eager_tokens, monkeypatch):
    cuda_startup_policy(monkeypatch)
    events: list[str] = []
    real_capture, real_traced = GraphManager._capture, GraphManager.note_traced

    def _capture(self, desc):
        events.append(f"capture {desc.mode.name}:{desc.num_tokens_padded}")
        return real_capture(self, desc)

    def note_traced(self):
        events.append("trace")
        real_traced(self)

    monkeypatch.setattr(GraphManager, "_capture", _capture)
    monkeypatch.setattr(GraphManager, "note_traced", note_traced)
    llm = LLM("tiny-llama", compilation_config={"graph_startup": "background",
                                                "cudagraph_mode": "full_and_piecewise",
                                                "cudagraph_capture_sizes": SIZES}, **KWARGS)
    engine = llm.engine
    assert events == []
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, PARAMS)
    engine.step()
    assert events == []                  # the first step ran eagerly, nothing else
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.wait_for_graphs(timeout=120)
    # no FULL capture ran through the torch.compile wrapper of eager pieces: every trace
    # is a PIECEWISE capture's
    traced_by = [events[i - 1] for i, e in enumerate(events) if e == "trace"]
    assert traced_by and all(e.startswith("capture PIECEWISE") for e in traced_by), events
    assert _tokens(llm) == eager_tokens
    assert llm.engine.stats()["graph_replays"].get("FULL:4", 0) > 0


def test_the_suites_engines_replay_graphs_under_cudas_startup_policy(eager_tokens,
                                                                     monkeypatch):
    """An engine built as the graph tests build theirs (no graph_startup) has every graph
    live before the test asserts replays, with CUDA's start-up policy (conftest)."""
    cuda_startup_policy(monkeypatch)
    llm = LLM("tiny-llama", compilation_config={"cudagraph_mode": "full_decode_only",
                                                "cudagraph_capture_sizes": SIZES}, **KWARGS)
    graphs = llm.engine.stats()["graphs"]
    assert graphs["done"] and set(graphs["live"]) == {f"FULL:{s}" for s in SIZES}
    assert _tokens(llm) == eager_tokens
    stats = llm.engine.stats()
    assert stats["graph_replays"].get("FULL:4", 0) > 0


class _FakeCudaGraph:
    def __init__(self, events: list[str]) -> None:
        self.events = events

    def replay(self) -> None:
        self.events.append("replay")


def test_a_cuda_replay_poisons_pads_and_checks_inputs_in_debug_mode_only():
    events: list[str] = []
    inputs = [torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)]
    out = torch.ones(4, 8)
    debug = CudaGraph(_FakeCudaGraph(events), inputs, out, 0,
                      poison=lambda: events.append("poison"))
    assert debug.replay(inputs) is out
    assert events == ["poison", "replay"]
    with pytest.raises(Exception, match="other addresses or shapes"):
        debug.replay([inputs[0], torch.zeros(4, dtype=torch.long)])
    events.clear()
    production = CudaGraph(_FakeCudaGraph(events), inputs, out, 0)
    # NOTE: no identity check per input outside debug mode (a 30-layer PIECEWISE step
    # replays ~60 pieces)
    assert production.replay([torch.zeros(4, dtype=torch.long)] * 2) is out
    assert events == ["replay"]


def test_the_cuda_backend_is_built_with_the_poison_hook(monkeypatch):
    monkeypatch.setattr(capture_mod.torch.cuda, "graph_pool_handle", lambda: (0, 1))
    monkeypatch.setattr(capture_mod.torch.cuda, "Stream", lambda: None)

    def hook():
        return None

    backend = make_capture_backend("cuda", torch.device("cuda"), hook)
    assert isinstance(backend, CudaGraphBackend) and backend.poison_hook is hook
    assert make_capture_backend("cuda", torch.device("cuda"), None).poison_hook is None


def test_torch_attention_leaves_the_null_block_unchanged_for_pad_rows():
    """Pad rows carry garbage keys (a PIECEWISE capture's piece outputs are never
    computed): their write must leave slot 0 of the null block as it was."""
    from rung.kernels.torch_backend import write_kv

    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(2, 4, 8, 2, 16, generator=gen)     # [K/V, blocks, block, heads, dim]
    before = kv_cache.clone()
    key = torch.randn(5, 2, 16, generator=gen)
    value = torch.randn(5, 2, 16, generator=gen)
    key[3:], value[3:] = float("nan"), float("nan")            # two pad rows
    slot_mapping = torch.tensor([9, 10, 17, -1, -1])
    write_kv(kv_cache, key, value, slot_mapping)
    assert torch.equal(kv_cache[:, 0], before[:, 0])          # the null block
    flat = kv_cache.flatten(1, 2)
    assert torch.equal(flat[0, [9, 10, 17]], key[:3]) and torch.equal(flat[1, [9, 10, 17]],
                                                                      value[:3])
    assert not kv_cache.isnan().any()


def test_compiled_cpu_graphs_are_refused_on_cuda():
    with pytest.raises(ValueError, match="graph_backend 'compiled' is for CPU graphs, got "
                                         "device cuda"):
        make_capture_backend("compiled", torch.device("cuda"), None)


class _FakeCuda:
    """What CudaGraphBackend calls of torch.cuda, counted; a capture allocates 100 bytes
    in the pool."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.reserved = 1000

    def install(self, monkeypatch) -> None:
        cuda, fake = capture_mod.torch.cuda, self

        class Graph:
            def __init__(self, keep_graph=False):
                pass

            def capture_begin(self, pool):
                fake.calls.append(f"capture_begin {pool}")

            def capture_end(self):
                fake.calls.append("capture_end")
                fake.reserved += 100

            def instantiate(self):
                pass

            def replay(self):
                fake.calls.append("replay")

        class Stream:
            def wait_stream(self, other):
                pass

            def synchronize(self):
                fake.calls.append("stream.synchronize")

        for name, value in {
                "graph_pool_handle": lambda: (7, 0), "Stream": Stream, "CUDAGraph": Graph,
                "stream": lambda s: contextlib.nullcontext(), "current_stream": Stream,
                "synchronize": lambda: self.calls.append("synchronize"),
                "empty_cache": lambda: self.calls.append("empty_cache"),
                "memory_reserved": lambda: self.reserved,
                "memory_snapshot": lambda: []}.items():
            monkeypatch.setattr(cuda, name, value)


def test_a_piecewise_sizes_captures_stall_once_and_share_one_pool(monkeypatch):
    fake = _FakeCuda()
    fake.install(monkeypatch)
    backend = CudaGraphBackend()
    inputs = (torch.ones(4),)
    with backend.capture_batch() as batch:
        graphs = [backend.capture(lambda x: x * 2, inputs) for _ in range(3)]   # 3 pieces
    stalls = [c for c in fake.calls if c in ("synchronize", "empty_cache",
                                             "stream.synchronize")]
    assert stalls == ["synchronize", "empty_cache"] * 2     # one reading before, one after
    assert fake.calls.count("capture_begin (7, 0)") == 3    # every piece in the one pool
    assert batch.nbytes == 300 and backend.meter.per_graph == [300]
    assert all(torch.equal(g.outputs, inputs[0] * 2) for g in graphs)
    fake.calls.clear()
    alone = backend.capture(lambda x: x + 1, inputs)         # a drafter's graph: its own
    assert alone.nbytes == 100 and fake.calls.count("synchronize") == 2


def test_a_blocking_cuda_start_captures_each_mode_largest_first(monkeypatch):
    cuda_startup_policy(monkeypatch)
    order: list[str] = []
    real = GraphManager._capture

    def _capture(self, desc):
        order.append(f"{desc.mode.name}:{desc.num_tokens_padded}")
        return real(self, desc)

    monkeypatch.setattr(GraphManager, "_capture", _capture)
    LLM("tiny-llama", compilation_config={"graph_startup": "blocking",
                                          "cudagraph_mode": "full_and_piecewise",
                                          "cudagraph_capture_sizes": SIZES}, **KWARGS)
    assert order == ["FULL:4", "FULL:2", "FULL:1", "PIECEWISE:4", "PIECEWISE:2",
                     "PIECEWISE:1"]


def test_a_recompile_during_serving_is_reported(monkeypatch, caplog):
    """recompile_limit is raised for the tests' many engines: a trace during a step (here:
    dynamo's cache dropped) must still be visible."""
    mixed = [{"prompt_token_ids": [1, 72]}, {"prompt_token_ids": [1]}]   # one PIECEWISE:4 step

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(mixed, PARAMS, use_tqdm=False)]

    want = tokens(LLM("tiny-llama", enforce_eager=True, **KWARGS))
    llm = LLM("tiny-llama", compilation_config={"graph_startup": "blocking",
                                                "cudagraph_mode": "full_and_piecewise",
                                                "cudagraph_capture_sizes": SIZES}, **KWARGS)
    with caplog.at_level(logging.WARNING, logger="rung.graphs.manager"):
        assert tokens(llm) == want
        assert "PIECEWISE:4" in llm.engine.stats()["graph_replays"]
        assert not [r for r in caplog.records if "recompile" in r.message]
        torch._dynamo.reset()
        assert tokens(llm) == want
    assert [r for r in caplog.records if "traced the model during a step" in r.message]
