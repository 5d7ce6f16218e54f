"""GGUF model files (llama.cpp's format): config, weights and tokenizer from one file.

A GGUF file holds key/value metadata (architecture, hyperparameters, vocabulary, chat
template) and named tensors, many of them block-quantized. ``GGUFModel`` maps the metadata
onto the HF-style config dict rung's models take, and streams the tensors, dequantized to
fp32 and renamed to HF names, into the model's ``load_weights``.
"""

from __future__ import annotations

import logging
import os
import re
import struct
from collections.abc import Iterator

import numpy as np
import torch

from rung.kernels.gguf_cpu import FILE_BLOCK, KERNEL_TYPES, GGUFBlockWeight
from rung.models.registry import GGUF_ARCHITECTURES, model_class

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"


# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                   "output": "lm_head"}

# Quant types rung dequantizes with the gguf package (all numpy); the first six also have
# rung's own numpy fallback for gguf releases without ``gguf.quants.dequantize``.
_FALLBACK_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
SUPPORTED_TYPES = _FALLBACK_TYPES + ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 3, 4


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf") or (os.path.isfile(path) and _read_magic(path) == GGUF_MAGIC)


def _read_magic(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def open_reader(path: str):
    """gguf.GGUFReader over ``path``; bad files raise ValueError naming what is wrong."""
    import gguf

    class Reader(gguf.GGUFReader):
        # NOTE: a plain ndarray view of the memory map (still mapped, not read): the reader
        # slices it ~250k times for SmolLM2's vocabulary, and every np.memmap slice runs
        # memmap.__array_finalize__ in Python (most of the time to open the file)
        data = property(lambda self: self._data,
                        lambda self, value: setattr(self, "_data", value.view(np.ndarray)))

    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path!r} does not exist")
    magic = _read_magic(path)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path!r} is not a GGUF file: it starts with {magic!r}, "
                         f"a GGUF file starts with {GGUF_MAGIC!r}")
    try:
        return Reader(path, "r")
    except ValueError as e:
        if "GGMLQuantizationType" in str(e):
            raise ValueError(f"GGUF file {path!r} has a tensor of an unknown quantization "
                             f"type ({e}); rung reads {', '.join(SUPPORTED_TYPES)}") from None
        raise ValueError(f"GGUF file {path!r} is truncated or corrupt ({e})") from None
    except (IndexError, OverflowError, KeyError, TypeError, UnicodeDecodeError,
            struct.error) as e:
        raise ValueError(f"GGUF file {path!r} is truncated or corrupt "
                         f"({type(e).__name__}: {e})") from None


class GGUFModel:
    """One GGUF file: ``config`` (HF-style dict), ``weights()``, ``tokenizer()``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.reader = open_reader(path)
        self.arch = self._str("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF file {path!r} has architecture {self.arch!r}; rung "
                             f"loads GGUF architectures {', '.join(sorted(GGUF_ARCHITECTURES))}")
        # the model class declares what its GGUF differs in (see models/llama.py)
        self.family = model_class({"model_type": GGUF_ARCHITECTURES[self.arch]})
        self._check_tensor_types()
        self.config = self._config()

    # --- metadata -------------------------------------------------------------------------
    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def _str(self, key: str) -> str:
        value = self.field(key)
        if not isinstance(value, str):
            raise ValueError(f"GGUF file {self.path!r} lacks the metadata key {key!r}")
        return value

    def arch_field(self, key: str, default=None):
        return self.field(f"{self.arch}.{key}", default)

    def generation_stop_ids(self) -> tuple[int, ...]:
        """End-of-turn / end-of-message ids llama.cpp also stops on (EOT, EOM), if any."""
        ids = (self.field("tokenizer.ggml.eot_token_id"),
               self.field("tokenizer.ggml.eom_token_id"))
        return tuple(int(i) for i in ids if i is not None)

    def special_token_ids(self) -> dict:
        return {"bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
                "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
                "pad_token_id": self.field("tokenizer.ggml.padding_token_id")}

    def _config(self) -> dict:
        """GGUF metadata -> the HF config dict of the matching rung model."""
        if self.arch == "gemma4":
            from rung.models import gguf_gemma4

            return gguf_gemma4.text_config(self)
        if hasattr(self.family, "gguf_config"):
            return self.family.gguf_config(self)
        hidden = self.required("embedding_length")
        num_heads = self.required("attention.head_count")
        names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in names:
            raise ValueError(f"GGUF file {self.path!r} carries rope_freqs (Llama 3 rope "
                             "scaling), which rung's GGUF loader does not map yet")
        tokens = self.field("tokenizer.ggml.tokens")
        head_dim = int(self.arch_field("attention.key_length", hidden // num_heads))
        rotary_dim = int(self.arch_field("rope.dimension_count", head_dim))
        return {
            "model_type": GGUF_ARCHITECTURES[self.arch],
            "vocab_size": int(self.arch_field("vocab_size", len(tokens or ()))),
            "hidden_size": int(hidden),
            "intermediate_size": int(self.required("feed_forward_length")),
            "num_hidden_layers": int(self.required("block_count")),
            "num_attention_heads": int(num_heads),
            "num_key_value_heads": int(self.arch_field("attention.head_count_kv", num_heads)),
            "head_dim": head_dim,
            "partial_rotary_factor": rotary_dim / head_dim,
            "sliding_window": self.arch_field("attention.sliding_window"),
            "rms_norm_eps": float(self.required("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.arch_field("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.arch_field("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in names,
            **self.special_token_ids(),
        }

    def required(self, key: str):
        value = self.arch_field(key)
        if value is None:
            raise ValueError(f"GGUF file {self.path!r} lacks the metadata key "
                             f"{self.arch + '.' + key!r}")
        return value

    # --- tensors --------------------------------------------------------------------------
    def _tensor(self, name: str):
        for t in self.reader.tensors:
            if t.name == name:
                return t
        raise ValueError(f"GGUF file {self.path!r} lacks the tensor {name!r}")

    def tensor_rows(self, name: str) -> int:
        """Outermost dimension of a tensor (rows of a matrix), read from its header."""
        return _numpy_shape(self._tensor(name))[0]

    def tensor_array(self, name: str) -> np.ndarray:
        t = self._tensor(name)
        return dequantize(t.data, t.tensor_type.name, _numpy_shape(t))

    def _check_tensor_types(self) -> None:
        supported = SUPPORTED_TYPES if _gguf_dequantize() else _FALLBACK_TYPES
        for t in self.reader.tensors:
            if t.tensor_type.name not in supported:
                raise ValueError(f"GGUF tensor {t.name!r} is quantized as "
                                 f"{t.tensor_type.name}; rung reads {', '.join(supported)}")

    def tensor_types(self) -> dict[str, str]:
        """HF name -> GGUF type name (``F32``, ``Q4_1``, ...) of every tensor of the file."""
        return {self._hf_name(t.name): t.tensor_type.name for t in self.reader.tensors
                if not (self.arch == "gemma4" and t.name == "rope_freqs.weight")}

    def weights(self, block_names: frozenset[str] = frozenset()
                ) -> Iterator[tuple[str, torch.Tensor | GGUFBlockWeight]]:
        """(HF name, tensor in HF layout) for every tensor of the file: a
        ``GGUFBlockWeight`` for the block-quantized tensors named in ``block_names``, fp32
        for every other. A tied head named there ("lm_head.weight", absent from the file)
        comes as the blocks of the embedding; the embedding, if named too, as the same
        blocks (one copy serves both), else in fp32 for its gather."""
        for t in self.reader.tensors:
            if self.arch == "gemma4" and t.name == "rope_freqs.weight":
                continue            # NOTE: read into the config as the partial rotary factor
            name = self._hf_name(t.name)
            shape = _numpy_shape(t)
            data = t.data
            if getattr(self.family, "gguf_permuted_qk", False):
                data = self._unpermute_qk(name, data)
            blocks = None
            if name == "model.embed_tokens.weight" and "lm_head.weight" in block_names \
                    and self.config.get("tie_word_embeddings"):
                blocks = block_weight(data, t.tensor_type.name, shape)
                yield "lm_head.weight", blocks
            if name in block_names:
                # a tied embedding's lookups share the head's very rows
                yield name, blocks or block_weight(data, t.tensor_type.name, shape)
                continue
            array = np.ascontiguousarray(dequantize(data, t.tensor_type.name, shape),
                                         dtype=np.float32)
            offset = getattr(self.family, "gguf_norm_offset", 0.0)
            if offset and name.endswith("norm.weight"):
                array = array - np.float32(offset)
            yield name, torch.from_numpy(array if array.flags.writeable else array.copy())

    def _hf_name(self, name: str) -> str:
        if self.arch == "gemma4":
            from rung.models import gguf_gemma4

            return gguf_gemma4.hf_name(name)
        stem, _, suffix = name.rpartition(".")
        if stem in _GLOBAL_TENSORS:
            return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
        layer_tensors = {**_LAYER_TENSORS, **getattr(self.family, "gguf_layer_tensors", {})}
        if match and match.group(2) in layer_tensors:
            return f"model.layers.{match.group(1)}.{layer_tensors[match.group(2)]}.{suffix}"
        raise ValueError(f"GGUF tensor {name!r} has no counterpart in rung's "
                         f"{self.config['model_type']} model")

    def _unpermute_qk(self, name: str, data: np.ndarray) -> np.ndarray:
        """Undo llama.cpp's q/k row permutation (interleaved -> half-split rope pairs) on
        a tensor's raw rows (each row's blocks move whole, quantized or not).

        llama.cpp stores each head's rows as (d/2 pairs, 2) where HF has (2, d/2):
        rows [0, d/2, 1, d/2+1, ...] -> [0, 1, ..., d-1] per head.
        """
        if ".self_attn.q_proj." in name:
            num_heads = self.config["num_attention_heads"]
        elif ".self_attn.k_proj." in name:
            num_heads = self.config["num_key_value_heads"]
        else:
            return data
        rows = data.shape[0]
        return (data.reshape(num_heads, rows // num_heads // 2, 2, *data.shape[1:])
                .swapaxes(1, 2).reshape(data.shape))

    # --- tokenizer ------------------------------------------------------------------------
    def tokenizer(self):
        from rung.models.tokenizer import HFTokenizer

        model = self.field("tokenizer.ggml.model")
        tokens, merges = self.field("tokenizer.ggml.tokens"), self.field("tokenizer.ggml.merges")
        token_types = self.field("tokenizer.ggml.token_type")
        if model == "gpt2":
            tok = _byte_level_bpe(tokens, merges or [], token_types,
                                  self.field("tokenizer.ggml.pre", "default"))
        elif model == "gemma4":
            tok = _sentencepiece_bpe(tokens, merges or [], token_types)
        elif model == "llama" and self.arch == "gemma3":
            tok = _sentencepiece_bpe(*_spm_vocab_merges(tokens, token_types),
                                     split_newlines=False)
        else:
            raise ValueError(f"GGUF file {self.path!r} has tokenizer model {model!r}; rung "
                             "builds BPE tokenizers (tokenizer.ggml.model 'gpt2' or 'gemma4', "
                             "or 'llama' in a gemma3 file)")
        return HFTokenizer(tok, eos_token_id=self.config["eos_token_id"],
                           bos_token_id=self.config["bos_token_id"],
                           add_bos_token=bool(self.field("tokenizer.ggml.add_bos_token", False)),
                           chat_template=self.field("tokenizer.chat_template"))


def _numpy_shape(tensor) -> tuple[int, ...]:
    """GGUF lists dims innermost first; numpy (and torch) want them outermost first."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


# --- dequantization ---------------------------------------------------------------------
def _gguf_dequantize():
    try:
        from gguf.quants import dequantize as fn
    except ImportError:
        return None
    return fn


def dequantize(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Raw tensor data of GGUF type ``type_name`` -> fp32 array of ``shape``."""
    import gguf

    fn = _gguf_dequantize()
    if fn is not None:
        out = fn(data, gguf.GGMLQuantizationType[type_name])
    else:
        out = dequantize_numpy(data, type_name)
    return out.astype(np.float32, copy=False).reshape(shape)


# Block layouts (32 weights a block): Q8_0 = f16 d, 32 x int8;  Q4_0 = f16 d, 16 bytes of
# nibbles (low nibbles are weights 0..15, high ones 16..31), w = d * (q - 8);
# Q4_1 = f16 d, f16 m, 16 bytes of nibbles, w = d * q + m.
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def dequantize_numpy(data: np.ndarray, type_name: str) -> np.ndarray:
    """rung's own numpy dequantizer for the types in ``_FALLBACK_TYPES``."""
    raw = np.ascontiguousarray(data)
    if type_name == "F32":
        return raw.view(np.float32)
    if type_name == "F16":
        return raw.view(np.float16).astype(np.float32)
    if type_name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if type_name not in _BLOCK_BYTES:
        raise ValueError(f"rung's numpy dequantizer reads {', '.join(_FALLBACK_TYPES)}, "
                         f"not {type_name}")
    blocks = raw.view(np.uint8).reshape(-1, _BLOCK_BYTES[type_name])
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)            # [num_blocks, 1]
    if type_name == "Q8_0":
        return (d * blocks[:, 2:].view(np.int8).astype(np.float32)).reshape(-1)
    packed = blocks[:, -16:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)  # [nb, 32]
    if type_name == "Q4_0":
        return (d * (q - 8.0)).reshape(-1)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    return (d * q + m).reshape(-1)


# Types that stay in their blocks (``GGUFBlockWeight``): the legacy 4-bit ones on every
# kernel, every type of rung's CPU kernel there.
INT4_TYPES = ("Q4_0", "Q4_1")
BLOCK_TYPES = KERNEL_TYPES


def block_weight(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> GGUFBlockWeight:
    """Raw data of a block-quantized matrix ``shape`` [N, K] -> its ``GGUFBlockWeight``:
    the file's bytes, regrouped per row out of the memory map (``dequantize_reference`` of
    it is ``dequantize`` of the same data)."""
    if type_name not in BLOCK_TYPES or len(shape) != 2:
        raise ValueError(f"block weights come from 2-D {' / '.join(BLOCK_TYPES)} tensors, "
                         f"not a {len(shape)}-D {type_name} one")
    num_rows, num_cols = shape
    block_bytes, groups = FILE_BLOCK[type_name]
    if num_cols % (32 * groups):
        raise ValueError(f"a {type_name} matrix's rows hold whole blocks of {32 * groups} "
                         f"weights; {num_cols} is not a multiple of it")
    # NOTE: a writable copy: torch refuses to wrap the read-only memory map silently
    blocks = np.array(data, dtype=np.uint8, copy=True).reshape(
        num_rows, num_cols // (32 * groups) * block_bytes)
    return GGUFBlockWeight.from_file_blocks(torch.from_numpy(blocks), type_name)


# --- tokenizer --------------------------------------------------------------------------
# llama.cpp pre-tokenizer names whose splitting rung reproduces with `tokenizers`.
_DIGIT_SPLIT_PRE = ("smollm",)
_BYTE_LEVEL_PRE = ("default", "gpt2", "smollm", "starcoder", "refact", "olmo")
_SPACE = "\u2581"             # SentencePiece's visible space


def _byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int] | None,
                    pre: str):
    """A `tokenizers.Tokenizer` for a GPT-2 style byte-level BPE vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if pre not in _BYTE_LEVEL_PRE:
        logger.warning("GGUF pre-tokenizer %r is not one rung knows (%s); splitting text "
                       "like GPT-2", pre, ", ".join(_BYTE_LEVEL_PRE))
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    _add_special_tokens(tok, tokens, token_types)
    return tok


def _add_special_tokens(tok, tokens: list[str], token_types: list[int] | None) -> None:
    """Control tokens match whole and are skipped when decoding; user-defined ones match
    whole and are kept (llama.cpp splits text on both before BPE)."""
    from tokenizers import AddedToken

    types = token_types or []
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == _TOKEN_CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED])


def _spm_vocab_merges(tokens: list[str], token_types: list[int] | None
                      ) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a SentencePiece BPE vocabulary stored without
    merges (llama.cpp's "llama" tokenizer model in a gemma3 file).

    SentencePiece BPE joins, at each step, the adjacent pair whose joined piece ranks best;
    Gemma's rank is the piece's place in the vocabulary (its scores do not follow it). So
    every split of a normal piece into two vocabulary pieces is a merge, ranked by the
    joined piece's id. Runs of spaces are stored as user-defined pieces spelled with real
    spaces; the normalizer writes spaces as U+2581, so they are respelled to match and
    merged like normal pieces.
    """
    types = list(token_types or [_TOKEN_NORMAL] * len(tokens))
    tokens = list(tokens)
    for i, token in enumerate(tokens):
        if token and not token.strip(" "):
            tokens[i], types[i] = _SPACE * len(token), _TOKEN_NORMAL
    ids = {t: i for i, t in enumerate(tokens) if types[i] == _TOKEN_NORMAL}
    merges = []
    for token in sorted(ids, key=ids.__getitem__):
        splits = [(ids[token[:k]], ids[token[k:]], token[:k], token[k:])
                  for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
        merges += [f"{left} {right}" for _, _, left, right in sorted(splits)]
    return tokens, merges, types


def _sentencepiece_bpe(tokens: list[str], merges: list[str], token_types: list[int] | None,
                       split_newlines: bool = True):
    """A `tokenizers.Tokenizer` for a SentencePiece BPE vocabulary: BPE over raw UTF-8
    with spaces written as U+2581, bytes outside the vocabulary as ``<0xNN>`` tokens, and
    with ``split_newlines`` newline runs split off (llama.cpp's gemma4 pre-tokenizer)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, byte_fallback=True, fuse_unk=False,
                               unk_token="<unk>" if "<unk>" in vocab else None))
    tok.normalizer = normalizers.Replace(" ", _SPACE)
    if split_newlines:
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    _add_special_tokens(tok, tokens, token_types)
    return tok
