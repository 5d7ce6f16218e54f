"""Gemma 4 GGUF files (llama.cpp's ``gemma4`` architecture): tiny Gemma 4 models written the
way llama.cpp's converter writes them, loaded by rung and held to the same weights loaded
from an HF folder and to HF transformers; the "gemma4" tokenizer; bad files refused."""

import numpy as np
import pytest
import torch
from helpers import assert_matches_hf, random_prompts, save_hf_model
from transformers import Gemma4ForCausalLM, Gemma4TextConfig, GemmaTokenizer

from rung.models.gguf import GGUFModel
from rung.models.loader import load_model
from rung.models.presets import PRESETS
from rung.runtime import LLM, SamplingParams

gguf = pytest.importorskip("gguf")

VOCAB = 512
NUM_TOKENS = 10


def _preset(name: str) -> dict:
    cfg = dict(PRESETS[name])
    cfg.pop("model_type")
    return cfg


# The tiny-gemma4 presets, and tiny-gemma4 with everything else the converter encodes: KV
# sharing with double-wide MLPs (per-layer FFN widths), full layers with keys as values and
# their own KV head count (per-layer KV heads, no attn_v), softcapping, an untied lm_head,
# own RoPE bases and a partial rotary factor of 0.5 (rope_freqs).
CONFIGS = {
    "tiny-gemma4": _preset("tiny-gemma4"),
    "tiny-gemma4-moe": _preset("tiny-gemma4-moe"),
    "shared-kv": dict(
        _preset("tiny-gemma4"),
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "sliding_attention", "sliding_attention", "full_attention"],
        num_kv_shared_layers=2, use_double_wide_mlp=True, attention_k_eq_v=True,
        num_global_key_value_heads=1, final_logit_softcapping=30.0, tie_word_embeddings=False,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                         "full_attention": {"rope_type": "proportional",
                                            "partial_rotary_factor": 0.5,
                                            "rope_theta": 10000.0}}),
}


def _hf_model(kwargs: dict) -> Gemma4ForCausalLM:
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**kwargs, initializer_range=0.1,
                                               attn_implementation="eager")).eval()
    gen = torch.Generator().manual_seed(1)
    for name, tensor in model.state_dict().items():   # away from 1, so a mis-load shows
        if name.endswith(("norm.weight", "layer_scalar", "router.scale", "per_expert_scale")):
            tensor.copy_(0.5 + torch.rand(tensor.shape, generator=gen))
    # NOTE: HF 5.24 skips prompt tokens in KV-shared layers unless hidden states are kept,
    # and that shortcut crashes without per-layer inputs (see test_hf_gemma4.py).
    model.config.output_hidden_states = bool(kwargs.get("num_kv_shared_layers"))
    # what the checkpoint's config.json says, as the converter reads it (HF 5.24 folds
    # global_head_dim and num_global_key_value_heads into per_layer_config on save)
    model.config_json = {**model.config.to_dict(), **kwargs}
    return model


# --- a "gemma4" vocabulary: specials, 256 byte-fallback tokens, letters and merges --------
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ["▁", "\n", "\n\n", "t", "h", "e", "a", "▁t", "he", "▁the", "▁a", "▁h", "▁ha", "é"]
MERGES = ["▁ t", "h e", "▁t he", "▁ a", "\n \n", "▁ h", "▁h a"]


def _vocab() -> list[str]:
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    return tokens + [f"<unused{i}>" for i in range(VOCAB - len(tokens))]


def _token_types(tokens: list[str]) -> list[int]:
    # llama.cpp's token types: 1 normal, 3 control, 6 byte
    return [3 if t in SPECIALS else 6 if t.startswith("<0x") else 1 for t in tokens]


def _gguf_tensor_name(name_map, hf_name: str) -> str:
    """HF tensor name -> GGUF name, as the converter's Gemma 4 class renames it."""
    match = name_map.get_name(hf_name.rsplit(".", 1)[0]) if hf_name.endswith(".weight") else None
    layer = hf_name.split(".")[2] if hf_name.startswith("model.layers.") else None
    if hf_name.endswith("router.scale"):
        return f"blk.{layer}.ffn_gate_inp.scale"
    if hf_name.endswith("router.per_expert_scale"):
        return f"blk.{layer}.ffn_down_exps.scale"
    if match is None:        # expert tensors and layer_scalar get ".weight" before mapping
        return name_map.get_name(hf_name) + ".weight"
    return match + ".weight"


def write_gemma4_gguf(path, hf_model, *, qtype: str = "F32", drop_keys=(), extra_keys=None,
                      extra_tensors=None, extra_strings=None) -> str:
    """A GGUF file of ``hf_model`` (a Gemma4ForCausalLM) the way llama.cpp's converter
    writes one: metadata per layer type, rope_freqs for proportional RoPE, gguf's own
    tensor-name map, router scales renamed, norms as they are (no +1); matrices and expert
    stacks in ``qtype``, vectors in F32."""
    hp = hf_model.config_json
    arch = "gemma4"
    w = gguf.GGUFWriter(str(path), arch)
    num_layers, shared = hp["num_hidden_layers"], hp.get("num_kv_shared_layers") or 0
    swa = [t == "sliding_attention" for t in hp["layer_types"]]
    ffn = hp["intermediate_size"]
    if hp.get("use_double_wide_mlp"):
        ffn = [ffn if i < num_layers - shared else 2 * ffn for i in range(num_layers)]
    kv = hp["num_key_value_heads"]
    if hp.get("num_global_key_value_heads") is not None:
        kv = [kv if s else hp["num_global_key_value_heads"] for s in swa]
    rope, head_dim, global_head_dim = hp["rope_parameters"], hp["head_dim"], hp["global_head_dim"]
    keys = {
        "block_count": num_layers, "context_length": hp["max_position_embeddings"],
        "embedding_length": hp["hidden_size"], "feed_forward_length": ffn,
        "attention.head_count": hp["num_attention_heads"], "attention.head_count_kv": kv,
        "rope.freq_base": float(rope["full_attention"]["rope_theta"]),
        "rope.freq_base_swa": float(rope["sliding_attention"]["rope_theta"]),
        "attention.layer_norm_rms_epsilon": float(hp["rms_norm_eps"]),
        "attention.key_length": global_head_dim, "attention.value_length": global_head_dim,
        "attention.key_length_swa": head_dim, "attention.value_length_swa": head_dim,
        "attention.sliding_window": hp["sliding_window"],
        "attention.shared_kv_layers": shared, "embedding_length_per_layer_input": 0,
        "attention.sliding_window_pattern": swa,
        "rope.dimension_count": global_head_dim, "rope.dimension_count_swa": head_dim,
    }
    if hp.get("final_logit_softcapping"):
        keys["final_logit_softcapping"] = float(hp["final_logit_softcapping"])
    if hp.get("enable_moe_block"):
        keys.update({"expert_count": hp["num_experts"], "expert_used_count": hp["top_k_experts"],
                     "expert_feed_forward_length": hp["moe_intermediate_size"]})
    keys.update(extra_keys or {})
    for key, value in keys.items():
        if key in drop_keys:
            continue
        full_key = f"{arch}.{key}"
        if isinstance(value, list):
            w.add_array(full_key, value)
        elif isinstance(value, float):
            w.add_float32(full_key, value)
        else:
            w.add_uint32(full_key, value)
    tokens = _vocab()
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(_token_types(tokens))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_add_space_prefix(False)
    w.add_add_bos_token(True)
    for key, value in (extra_strings or {}).items():
        w.add_string(key, value)
    # proportional RoPE of full layers: divisor 1 for rotated pairs, 1e30 for the others
    rotated = int(global_head_dim * rope["full_attention"]["partial_rotary_factor"] / 2)
    w.add_tensor("rope_freqs.weight", np.array(
        [1.0] * rotated + [1e30] * (global_head_dim // 2 - rotated), np.float32))
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA4, num_layers)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and hp["tie_word_embeddings"]:
            continue                 # a tied checkpoint holds no lm_head
        data, gguf_name = tensor.float().numpy(), _gguf_tensor_name(name_map, name)
        if data.ndim >= 2 and qtype != "F32":
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gguf_name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            w.add_tensor(gguf_name, data)
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _llm(model: str) -> LLM:
    return LLM(model, dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=32,
               max_model_len=96, enforce_eager=True)


def _generate(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS,
                            logprobs=0)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def _convert(name: str, tmp_path_factory):
    """(name, HF model, HF folder, GGUF path) of one config."""
    hf_model = _hf_model(CONFIGS[name])
    tmp = tmp_path_factory.mktemp(name)
    folder = save_hf_model(hf_model, tmp / "hf")
    return name, hf_model, folder, write_gemma4_gguf(tmp / "m.gguf", hf_model)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def converted(request, tmp_path_factory):
    return _convert(request.param, tmp_path_factory)


def test_gguf_matches_hf_folder_and_transformers(converted):
    """The GGUF loads to the same model as the HF folder: identical greedy tokens and
    logprobs, both held to HF transformers."""
    _, hf_model, folder, path = converted
    prompts = random_prompts(VOCAB, lens=[1, 9, 23])
    llm = _llm(path)
    assert len(llm.engine.runner.kv_groups) == 2       # sliding and full head dims
    from_gguf, from_folder = _generate(llm, prompts), _generate(_llm(folder), prompts)
    for a, b in zip(from_gguf, from_folder):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lps = [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in (a, b)]
        np.testing.assert_allclose(*lps, atol=1e-5)
    assert_matches_hf(hf_model, from_gguf, prompts, NUM_TOKENS)


def test_config_maps_every_field(converted):
    name, hf_model, _, path = converted
    cfg, want = GGUFModel(path).config, hf_model.config_json
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
                "sliding_window", "layer_types", "num_kv_shared_layers", "use_double_wide_mlp",
                "attention_k_eq_v", "final_logit_softcapping", "tie_word_embeddings",
                "enable_moe_block"):
        assert cfg[key] == want[key], key
    assert cfg["rope_parameters"] == want["rope_parameters"]
    if name == "shared-kv":          # the full layers' own head dim and single KV head
        assert cfg["per_layer_config"] == {"1": {"head_dim": 64, "num_key_value_heads": 1},
                                           "5": {"head_dim": 64, "num_key_value_heads": 1}}
    if name == "tiny-gemma4-moe":
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            assert cfg[key] == want[key], key


def test_graphs_match_eager(tmp_path_factory):
    """Under (emulated) graphs a GGUF-loaded Gemma 4 gives the eager tokens."""
    _, _, folder, path = _convert("shared-kv", tmp_path_factory)
    prompts = random_prompts(VOCAB, lens=[1, 9, 23])
    llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=96, compilation_config={"cudagraph_capture_sizes": [1, 2, 4]})
    graphs = _generate(llm, prompts)
    assert llm.engine.stats()["graph_replays"], "no step replayed a graph"
    eager = _generate(_llm(folder), prompts)
    assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]


@pytest.mark.parametrize("qtype", ["F16", "Q8_0"])
def test_quantized_experts_dequantize(tmp_path, qtype):
    """Quantized expert stacks (3D) and matrices load as gguf's own dequantization."""
    hf_model = _hf_model(CONFIGS["tiny-gemma4-moe"])
    path = write_gemma4_gguf(tmp_path / "q.gguf", hf_model, qtype=qtype)
    experts = load_model(path).model.model.layers[1].experts
    kind = gguf.GGMLQuantizationType[qtype]
    for name in ("gate_up_proj", "down_proj"):
        want = hf_model.state_dict()[f"model.layers.1.experts.{name}"].numpy()
        want = gguf.quants.dequantize(gguf.quants.quantize(want, kind), kind)
        np.testing.assert_array_equal(getattr(experts, name).detach().numpy(), want)


def test_chat_uses_gguf_template(tmp_path, dense_model):
    template = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    path = write_gemma4_gguf(tmp_path / "chat.gguf", dense_model,
                             extra_strings={"tokenizer.chat_template": template})
    llm = _llm(path)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    out, = llm.chat([{"role": "user", "content": "the"}], params)
    assert out.prompt == "<bos><start_of_turn>user\nthe<end_of_turn>\n<start_of_turn>model\n"
    tokens = _vocab()
    assert out.prompt_token_ids[:3] == [2, tokens.index("<start_of_turn>"), tokens.index("<0x75>")]
    assert len(out.outputs[0].token_ids) == 4


# --- tokenizer -----------------------------------------------------------------------------
TEXTS = ["the the", " a ha\n\nthe", "héllo ✓ 42\nthe", "<start_of_turn>the<end_of_turn>\n"]


@pytest.fixture(scope="module")
def gemma4_tokenizer(tmp_path_factory):
    path = write_gemma4_gguf(tmp_path_factory.mktemp("tok") / "t.gguf",
                             _hf_model(CONFIGS["tiny-gemma4"]))
    return load_model(path).tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_hf_gemma_tokenizer(gemma4_tokenizer, text):
    """The file's own vocabulary and merges tokenize as HF's Gemma tokenizer does on the
    same vocabulary: spaces as U+2581, merges over words, unknown bytes as <0xNN>."""
    tokens = _vocab()
    hf = GemmaTokenizer(vocab={t: i for i, t in enumerate(tokens)},
                        merges=[tuple(m.split(" ")) for m in MERGES])
    hf.add_special_tokens({"additional_special_tokens": SPECIALS[5:]})
    want = [2] + hf(text, add_special_tokens=False)["input_ids"]     # the file adds <bos>
    got = gemma4_tokenizer.encode(text)
    assert got == want
    assert gemma4_tokenizer.decode(got) == hf.decode(want, skip_special_tokens=True)


def test_tokenizer_ids(gemma4_tokenizer):
    tokens = _vocab()
    assert gemma4_tokenizer.encode("the the", add_special_tokens=False) == \
        [tokens.index("t"), tokens.index("he"), tokens.index("▁the")]
    ids = gemma4_tokenizer.encode("✓", add_special_tokens=False)
    assert ids == [tokens.index(f"<0x{b:02X}>") for b in "✓".encode()]
    assert (gemma4_tokenizer.bos_token_id, gemma4_tokenizer.eos_token_id) == (2, 1)


def test_text_prompt_runs(converted, gemma4_tokenizer):
    _, _, _, path = converted
    out, = _llm(path).generate("the the", SamplingParams(temperature=0, max_tokens=3,
                                                         ignore_eos=True))
    assert out.prompt_token_ids == gemma4_tokenizer.encode("the the")
    assert len(out.outputs[0].token_ids) == 3


# --- bad input -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dense_model():
    return _hf_model(CONFIGS["tiny-gemma4"])


@pytest.mark.parametrize("kwargs, match", [
    (dict(extra_tensors={"blk.0.attn_gate.weight": np.zeros((4, 4), np.float32)}),
     "'blk.0.attn_gate.weight' has no counterpart in rung's Gemma 4"),
    (dict(extra_tensors={"per_layer_token_embd.weight": np.zeros((4, 4), np.float32)}),
     "per-layer input embeddings"),
    (dict(extra_keys={"attention.scale": 0.125}),
     "metadata 'gemma4.attention.scale' that rung's Gemma 4 loader does not know"),
    (dict(extra_keys={"embedding_length_per_layer_input": 256}),
     "embedding_length_per_layer_input=256"),
    (dict(drop_keys=("attention.key_length_swa",)),
     "lacks the metadata key 'gemma4.attention.key_length_swa'"),
    (dict(extra_keys={"attention.sliding_window_pattern": [True] * 6}),
     "makes the last layer sliding"),
    (dict(extra_keys={"rope.dimension_count_swa": 16}), "rope.dimension_count_swa=16"),
    (dict(extra_keys={"feed_forward_length": [256, 256, 256, 256, 256, 300]}),
     "feed_forward_length"),
])
def test_bad_gemma4_files_rejected(tmp_path, dense_model, kwargs, match):
    path = write_gemma4_gguf(tmp_path / "bad.gguf", dense_model, **kwargs)
    with pytest.raises(ValueError, match=match):
        load_model(path)
