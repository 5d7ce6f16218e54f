"""Graphs without the wait: LLM(...) serves eagerly from its first step while graphs go
live one at a time between steps; tokens never change across the eager -> graph switch."""

import json
import time

import pytest
import torch

from rung.runtime import LLM, SamplingParams
from rung.server.engine_loop import IDLE_GRAPH_POLL_S

KWARGS = dict(max_num_seqs=4, max_model_len=64, num_gpu_blocks_override=32)
PROMPTS = [[1, 72, 105, 33], [1, 5, 9, 200, 17, 3, 41, 8, 77], [1, 300], [1, 7, 7, 7, 2]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_requests_start_eager_and_finish_on_graphs_with_the_same_tokens(debug_padding):
    want = _tokens(LLM("tiny-llama", enforce_eager=True, **KWARGS))
    llm = LLM("tiny-llama", compilation_config={"graph_startup": "background",
                                                "cudagraph_capture_sizes": [1, 2, 4]},
              **KWARGS)
    stats = llm.engine.stats()
    assert stats["graphs"]["live"] == [] and not stats["graphs"]["done"]
    assert stats["graphs"]["pending"]
    assert _tokens(llm) == want
    stats = llm.engine.stats()
    # the same requests ran eagerly first, then on graphs that went live meanwhile
    assert stats["eager_steps"] > 0 and stats["graphs"]["live"]
    assert llm.wait_for_graphs(timeout=120)
    stats = llm.engine.stats()
    assert stats["graphs"]["done"] and stats["graphs"]["pending"] == []
    assert "FULL:4" in stats["graphs"]["live"]
    assert _tokens(llm) == want
    assert llm.engine.stats()["graph_replays"].get("FULL:4", 0) > 0


def test_an_idle_engine_brings_its_graphs_live():
    llm = LLM("tiny-llama", compilation_config={"graph_startup": "background",
                                                "cudagraph_capture_sizes": [1, 2]}, **KWARGS)
    engine = llm.engine
    assert engine.stats()["graphs"]["live"] == []
    deadline = time.monotonic() + 60
    while engine.advance_graphs():          # what a server's idle engine owner calls
        assert time.monotonic() < deadline
        time.sleep(IDLE_GRAPH_POLL_S)
    graphs = engine.stats()["graphs"]
    assert graphs["done"] and set(graphs["live"]) >= {"FULL:1", "FULL:2"}
    assert engine.stats()["eager_steps"] == 0 and not engine.has_unfinished_requests()


def test_blocking_startup_has_every_graph_live_before_it_returns():
    llm = LLM("tiny-llama", compilation_config={"graph_startup": "blocking",
                                                "cudagraph_capture_sizes": [1, 2]}, **KWARGS)
    graphs = llm.engine.stats()["graphs"]
    assert graphs["done"] and set(graphs["live"]) >= {"FULL:1", "FULL:2"}


def test_graph_startup_is_checked():
    with pytest.raises(ValueError, match="graph_startup 'lazy'"):
        LLM("tiny-llama", compilation_config={"graph_startup": "lazy"}, **KWARGS)


@pytest.fixture
def two_torch_threads(monkeypatch):
    monkeypatch.setenv("RUNG_NUM_THREADS", "2")     # whatever the free cores at start-up
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_compiled_graphs_build_in_a_subprocess_while_eager_serves(tmp_path, monkeypatch,
                                                                   two_torch_threads):
    """The CPU default: artifacts compile in a subprocess into the disk cache; the serving
    engine binds each one (checked against eager) between steps. The engine runs on two
    threads and the subprocess on one, which must generate (and key) the kernels for two.

    NOTE: the subprocess compiles with the default INDUCTOR_OPTIONS (part of the key), so
    this test cannot switch to the faster Python wrapper as other compiled tests do.
    """
    monkeypatch.setenv("RUNG_GRAPH_BACKEND", "compiled")
    want = _tokens(LLM("tiny-llama", enforce_eager=True, **KWARGS))
    llm = LLM("tiny-llama", compilation_config={"cudagraph_mode": "full_decode_only",
                                                "cudagraph_capture_sizes": [1, 2, 4],
                                                "cache_dir": str(tmp_path)}, **KWARGS)
    assert llm.engine.graph_builder.prefetch is not None
    assert llm.engine.stats()["graphs"]["live"] == []
    assert _tokens(llm) == want                       # eager while the subprocess compiles
    assert llm.wait_for_graphs(timeout=1500)
    records = llm.engine.runner.graphs.records
    # every size bound an artifact the subprocess built; sizes >= 2 share one
    assert all(r.compile_s is None and r.load_s is not None for r in records), records
    assert len({r.artifact for r in records if r.num_reqs_padded >= 2}) == 1
    assert _tokens(llm) == want
    assert llm.engine.stats()["graph_replays"].get("FULL:4", 0) > 0
    # a warm start spawns no compile beside the serving engine, and binds every size
    again = LLM("tiny-llama", compilation_config={"cudagraph_mode": "full_decode_only",
                                                  "cudagraph_capture_sizes": [1, 2, 4],
                                                  "cache_dir": str(tmp_path)}, **KWARGS)
    assert again.engine.graph_builder.prefetch is None
    assert again.wait_for_graphs(timeout=300)
    assert all(r.compile_s is None for r in again.engine.runner.graphs.records)
    assert _tokens(again) == want


def test_the_gpu_checks_live_switch_stage_decodes_through_every_switch(tmp_path, capsys):
    """`python -m rung.bench.live_switch` (gpu_check's stage for captures between steps; on
    CPU here, emulated graphs): every size goes live in a step of its own while requests
    decode, and their tokens are an enforce_eager engine's."""
    from rung.bench import live_switch

    out = tmp_path / "live_switch.json"
    assert live_switch.main(["--num-reqs", "4", "--max-tokens", "6", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["tokens_match_eager"] and got["pending"] == []
    assert {"FULL:1", "FULL:2", "FULL:4"} <= set(got["live"])
    assert sorted(s["went_live"] for s in got["switch_steps"]) == [[g] for g in sorted(got["live"])]
    assert "tokens match enforce_eager" in capsys.readouterr().out


def test_a_cache_of_another_model_does_not_pass_for_a_warm_one(tmp_path):
    """A blocking start prepares inductor beside the model load unless the cache looks
    warm for THIS model (seconds of its cold compile otherwise): entries of another model,
    torch or machine do not count."""
    from rung.graphs.cpu_compiled.artifact_cache import (
        holds_loadable_build,
        machine_signature,
        source_hash,
    )

    def entry(name: str, origin: str, torch_version: str = torch.__version__,
              machine: str = machine_signature()) -> None:
        folder = tmp_path / "compiled" / name
        folder.mkdir(parents=True)
        meta = {"input_names": [], "origin": origin,
                "wrapper": {"file": "w.so", "machine": machine},
                "model": {"torch": torch_version, "rung_source": source_hash()}}
        (folder / "meta.json").write_text(json.dumps(meta))

    assert not holds_loadable_build(tmp_path, "tiny-llama")            # no cache at all
    entry("a", "smollm2-135m")
    entry("b", "tiny-llama", torch_version="0.0.1")
    entry("c", "tiny-llama", machine="another-cpu")
    assert not holds_loadable_build(tmp_path, "tiny-llama")
    assert holds_loadable_build(tmp_path, "smollm2-135m")
    entry("d", "tiny-llama")
    assert holds_loadable_build(tmp_path, "tiny-llama")
