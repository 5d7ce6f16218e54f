"""Going live costs the serving thread one swap: FULL CPU graphs are built (loaded, bound,
checked against eager) on a worker thread while requests decode, and the serving thread
only swaps a ready graph into the dispatch table between two steps."""

import threading

import pytest

import rung.graphs.cpu_compiled.artifacts as compiled_graphs
from rung.graphs.capture import EmulatedGraphBackend
from rung.graphs.cpu_compiled import per_layer as layered
from rung.graphs.cpu_compiled.artifact_cache import ArtifactCache
from rung.runtime import LLM, SamplingParams

KWARGS = dict(max_num_seqs=4, max_model_len=64, num_gpu_blocks_override=32)
PROMPTS = [[1, 72, 105, 33], [1, 5, 9, 200, 17, 3, 41, 8, 77], [1, 300], [1, 7, 7, 7, 2]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SIZES = [1, 2, 4]


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _background(**compilation) -> LLM:
    return LLM("tiny-llama", compilation_config={"graph_startup": "background",
                                                "cudagraph_mode": "full_decode_only",
                                                "cudagraph_capture_sizes": SIZES,
                                                **compilation}, **KWARGS)


def _spy(monkeypatch, cls: type, name: str, threads: list[str], fail_at: int | None = None):
    """Record the thread of every call of ``cls.name``; raise in the call of a capture
    batch of ``fail_at`` tokens."""
    real = getattr(cls, name)

    def spy(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        if fail_at is not None and args[1][0].shape[0] == fail_at:
            raise RuntimeError("a build that fails")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, spy)


def test_the_serving_thread_runs_no_capture_while_graphs_go_live(debug_padding, monkeypatch):
    want = _tokens(LLM("tiny-llama", enforce_eager=True, **KWARGS))
    captures: list[str] = []
    _spy(monkeypatch, EmulatedGraphBackend, "capture", captures)
    llm = _background()
    assert _tokens(llm) == want
    assert llm.wait_for_graphs(timeout=120)
    assert _tokens(llm) == want
    graphs = llm.engine.stats()["graphs"]
    assert graphs["done"] and set(graphs["live"]) == {f"FULL:{s}" for s in SIZES}
    assert llm.engine.stats()["graph_replays"].get("FULL:4", 0) > 0
    # every capture (two eager forwards on a capture batch) ran on the builder's thread
    assert len(captures) == len(SIZES)
    assert threading.current_thread().name not in captures, captures


def test_a_size_whose_build_fails_never_goes_live_and_serving_goes_on(monkeypatch):
    want = _tokens(LLM("tiny-llama", enforce_eager=True, **KWARGS))
    _spy(monkeypatch, EmulatedGraphBackend, "capture", [], fail_at=2)
    llm = _background()
    assert llm.wait_for_graphs(timeout=120)
    graphs = llm.engine.stats()["graphs"]
    assert graphs["done"] and graphs["pending"] == []
    assert set(graphs["live"]) == {"FULL:1", "FULL:4"}
    assert _tokens(llm) == want          # two-request batches run eagerly


@pytest.mark.slow
def test_a_warm_start_loads_and_checks_compiled_graphs_off_the_serving_thread(
        tmp_path, monkeypatch):
    """Compiled CPU graphs, warm cache: the artifact loads and the layer-by-layer check
    against eager all run on the builder's thread."""
    monkeypatch.setattr(compiled_graphs, "INDUCTOR_OPTIONS", {})   # faster compile
    cache = {"graph_backend": "compiled", "cache_dir": str(tmp_path)}
    want = _tokens(LLM("tiny-llama", enforce_eager=True, **KWARGS))
    LLM("tiny-llama", compilation_config={"graph_startup": "blocking",
                                          "cudagraph_mode": "full_decode_only",
                                          "cudagraph_capture_sizes": SIZES, **cache}, **KWARGS)
    checks: list[str] = []
    loads: list[str] = []
    real_check = layered._Teacher.__call__
    monkeypatch.setattr(layered._Teacher, "__call__", lambda self, *a: (
        checks.append(threading.current_thread().name), real_check(self, *a))[1])
    for name in ("load", "load_wrapper"):
        real = getattr(ArtifactCache, name)
        monkeypatch.setattr(ArtifactCache, name, lambda self, *a, _real=real: (
            loads.append(threading.current_thread().name), _real(self, *a))[1])
    llm = _background(**cache)
    assert llm.engine.graph_builder.prefetch is None            # warm: nothing to compile
    assert _tokens(llm) == want
    assert llm.wait_for_graphs(timeout=300)
    assert _tokens(llm) == want
    assert set(llm.engine.stats()["graphs"]["live"]) == {f"FULL:{s}" for s in SIZES}
    assert all(r.compile_s is None for r in llm.engine.runner.graphs.records)
    serving = threading.current_thread().name
    assert checks and loads and serving not in checks + loads, (checks, loads)
