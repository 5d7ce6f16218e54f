"""Engine configuration, built from LLM(...) keyword arguments."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from rung.core.graph_mode import CUDAGraphMode
from rung.models.layers import quant_kernel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def parse_device(device: str | torch.device) -> torch.device:
    """"auto" -> cuda when available, else cpu; otherwise "cpu", "cuda" or "cuda:N"."""
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not one of auto, cpu, cuda, cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def parse_dtype(dtype: str | torch.dtype, device: torch.device,
                quantization: str | None = None) -> torch.dtype:
    """``quantization`` "gguf": "auto" is the activation dtype of its kernel (fp32 for
    rung's CPU kernel, bfloat16 for torch's int4 one on CUDA or CPUs without AVX2)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        int4_bf16 = quantization == "gguf" and quant_kernel(device) == "torch_int4"
        return torch.bfloat16 if device.type == "cuda" or int4_bf16 else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


# NOTE: a CPU step's cost grows with its batch and every ladder size is a compile (or a
# forward) at start-up: a CPU engine batches what a CPU serves, a GPU engine what vLLM does.
DEFAULT_MAX_NUM_SEQS = {"cpu": 16, "cuda": 256}
# the KV cache on CPU: what max_num_seqs sequences of max_model_len need, at most this many
# GiB (vLLM's VLLM_CPU_KVCACHE_SPACE); gpu_memory_utilization sizes it on CUDA only
CPU_KVCACHE_SPACE_ENV = "RUNG_CPU_KVCACHE_SPACE"
DEFAULT_CPU_KVCACHE_SPACE_GIB = 4.0


def default_max_num_seqs(device: torch.device) -> int:
    return DEFAULT_MAX_NUM_SEQS["cuda" if device.type == "cuda" else "cpu"]


def cpu_kvcache_space_bytes() -> int:
    """The most bytes the CPU KV cache may take: $RUNG_CPU_KVCACHE_SPACE GiB, default 4 GiB
    but never more than a quarter of the machine's RAM."""
    raw = os.environ.get(CPU_KVCACHE_SPACE_ENV)
    if raw is None:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return min(int(DEFAULT_CPU_KVCACHE_SPACE_GIB * 2**30), ram // 4)
    try:
        gib = float(raw)
    except ValueError:
        gib = float("nan")
    if not gib > 0:
        raise ValueError(f"{CPU_KVCACHE_SPACE_ENV}={raw!r} must be a positive number of GiB")
    return int(gib * 2**30)


GRAPH_STARTUPS = ("auto", "background", "blocking")


@dataclasses.dataclass
class CompilationConfig:
    cudagraph_mode: CUDAGraphMode = CUDAGraphMode.FULL_AND_PIECEWISE
    cudagraph_capture_sizes: list[int] | None = None   # None -> the default ladder
    backend: str = "eager"            # how pieces compile: "eager" (FX) or "inductor"
    # "auto": "cuda" on CUDA, "compiled" on CPU (env RUNG_GRAPH_BACKEND overrides);
    # "emulated": CPU replays re-run the forward (the poisoning oracle of the tests)
    graph_backend: str = "auto"       # "cuda" | "compiled" | "emulated" | "auto"
    # largest padded token count a graph is captured for; None -> 512 for the default
    # ladder (batches above it run eagerly), no cap for sizes the user lists
    max_cudagraph_capture_size: int | None = None
    # compiled CPU graphs persist here; None -> $RUNG_CACHE_DIR or ~/.cache/rung; "" -> off
    cache_dir: str | None = None
    # "background": LLM(...) returns once eager can serve; graphs go live one by one between
    # steps (compiled CPU graphs compile in a subprocess). "blocking": every graph is live
    # before LLM(...) returns. "auto": the capture backend's own policy (its
    # ``auto_startup``: blocking for emulated graphs, the tests' oracle) and blocking under
    # data parallel (ranks must agree on the graphs they replay).
    graph_startup: str = "auto"
    # compiled CPU graphs: one artifact per decoder-layer kind, called once per layer, so
    # the compile grows with neither depth nor ladder; or False: the whole forward in one
    # artifact (a far longer cold compile for the same step; docs/performance.md)
    per_layer_graphs: bool = True
    # compiled CPU graphs: the threads their kernels are generated for (part of the cache
    # key); None -> torch.get_num_threads() of the engine. A background compile's subprocess
    # runs on one thread and is handed the serving engine's count.
    compile_threads: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> CompilationConfig:
        raw = dict(raw or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown compilation_config keys {sorted(unknown)}; "
                             f"known: {sorted(known)}")
        if "cudagraph_mode" in raw:
            raw["cudagraph_mode"] = CUDAGraphMode.parse(raw["cudagraph_mode"])
        if raw.get("backend", "eager") not in ("eager", "inductor"):
            raise ValueError(f"compilation_config backend {raw['backend']!r} not in "
                             "('eager', 'inductor')")
        if raw.get("graph_startup", "auto") not in GRAPH_STARTUPS:
            raise ValueError(f"compilation_config graph_startup {raw['graph_startup']!r} not in "
                             f"{GRAPH_STARTUPS}")
        cap = raw.get("max_cudagraph_capture_size")
        if cap is not None and (not _is_int(cap) or cap < 1):
            raise ValueError(f"compilation_config max_cudagraph_capture_size={cap!r} must be "
                             "a positive integer")
        threads = raw.get("compile_threads")
        if threads is not None and (not _is_int(threads) or threads < 1):
            raise ValueError(f"compilation_config compile_threads={threads!r} must be a "
                             "positive integer")
        return cls(**raw)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# NOTE: every verify step runs 1 + k tokens per request and the capture ladder is rounded
# to multiples of 1 + k; past a few tokens acceptance falls off and steps only get wider.
MAX_NUM_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass
class SpeculativeConfig:
    method: str                      # "mtp" | "ngram"
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 1       # n-gram: shortest suffix to match
    prompt_lookup_max: int = 4       # n-gram: longest suffix to match

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> SpeculativeConfig | None:
        if not raw:
            return None
        raw = dict(raw)
        method = raw.pop("method", None)
        if method == "none" and not raw.get("num_speculative_tokens") and not raw.get("model"):
            return None
        if method not in ("mtp", "ngram"):
            raise ValueError(f"speculative_config method {method!r} not in ('mtp', 'ngram'); "
                             "leave speculative_config out for no speculation")
        k = raw.pop("num_speculative_tokens", None)
        if not _is_int(k) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens={k!r} must be an integer from 1 to "
                             f"{MAX_NUM_SPECULATIVE_TOKENS}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown speculative_config keys {sorted(unknown)}; "
                             f"known: {sorted(known | {'method'})}")
        cfg = cls(method, k, **raw)
        if method == "mtp" and not cfg.model:
            raise ValueError("speculative_config method 'mtp' needs a draft 'model'")
        if method == "ngram" and not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise ValueError(f"n-gram prompt_lookup_min={cfg.prompt_lookup_min} and "
                             f"prompt_lookup_max={cfg.prompt_lookup_max} must satisfy "
                             "1 <= min <= max")
        return cfg


@dataclasses.dataclass
class EngineConfig:
    model: str
    dtype: torch.dtype
    device: torch.device
    seed: int = 0
    max_num_seqs: int = 256
    max_model_len: int | None = None       # None -> the model's max_position_embeddings
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    # share of free device memory for the KV cache on CUDA (None -> half); ignored on CPU,
    # where the cache follows max_num_seqs x max_model_len up to $RUNG_CPU_KVCACHE_SPACE
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False
    compilation: CompilationConfig = dataclasses.field(default_factory=CompilationConfig)
    attention_backend: str = "auto"
    speculative: SpeculativeConfig | None = None
    load_format: str = "auto"
    quantization: str | None = "auto"      # models.loader.QUANTIZATIONS
    data_parallel_size: int = 1
    data_parallel_timeout_s: float = 120.0    # a collective waiting longer fails the rank
    enable_prefix_caching: bool = True
    # every linear layer computes each row with a GEMM of one shape, so a request's logits
    # (its greedy and seeded tokens) do not depend on its batch; default $RUNG_BATCH_INVARIANT
    batch_invariant: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("RUNG_BATCH_INVARIANT", "0") == "1")
    debug_padding: bool = dataclasses.field(
        default_factory=lambda: os.environ.get("RUNG_DEBUG_PADDING", "0") == "1")

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "data_parallel_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        verify_len = 1 + self.num_spec_tokens
        if self.max_num_batched_tokens < verify_len:
            # NOTE: as vLLM does: one request's verify step (1 + k tokens) must fit the budget
            logger.warning("max_num_batched_tokens=%d is below 1 + num_speculative_tokens=%d; "
                           "raised to %d so a verify step fits", self.max_num_batched_tokens,
                           verify_len, verify_len)
            self.max_num_batched_tokens = verify_len
        if self.max_model_len is not None and (not _is_int(self.max_model_len)
                                               or self.max_model_len < 1):
            raise ValueError(f"max_model_len={self.max_model_len!r} must be a positive integer "
                             "(or None for the model's own maximum)")
        share = self.gpu_memory_utilization
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0 < share <= 1):
            raise ValueError(f"gpu_memory_utilization={share!r} must be a number in (0, 1]")
        if share is not None and self.device.type == "cpu":
            logger.warning("gpu_memory_utilization=%s is ignored on CPU (as in vLLM): the KV "
                           "cache takes what max_num_seqs x max_model_len needs, at most "
                           "$%s GiB (%.1f GiB now)", share, CPU_KVCACHE_SPACE_ENV,
                           cpu_kvcache_space_bytes() / 2**30)
            self.gpu_memory_utilization = None
        if not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} must be an integer")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be "
                             f">= max_num_seqs={self.max_num_seqs}")

    @property
    def num_spec_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative else 0
