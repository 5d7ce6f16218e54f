"""`rung` command line: generate, warmup, bench."""

from __future__ import annotations

import argparse
import sys
import time

from rung.runtime.llm import LLM
from rung.runtime.sampling_params import SamplingParams


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", help="preset name or local HF folder")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--mode", default=None, help="cudagraph mode, e.g. full_and_piecewise")
    p.add_argument("--capture-sizes", default=None, help="comma-separated, e.g. 1,2,4,8")
    p.add_argument("--compile-backend", default="eager", choices=["eager", "inductor"])
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--speculative-model", default=None)
    p.add_argument("--speculative-method", default=None, choices=[None, "mtp", "ngram"])
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--debug-padding", action="store_true",
                   help="poison padded buffers and validate metadata at every step")


def build_llm(args: argparse.Namespace, capture_progress=None) -> LLM:
    compilation: dict = {"backend": args.compile_backend}
    if args.mode:
        compilation["cudagraph_mode"] = args.mode
    if args.capture_sizes:
        compilation["cudagraph_capture_sizes"] = _int_list(args.capture_sizes, "--capture-sizes")
    spec = None
    if args.speculative_method or args.speculative_model:
        spec = {"method": args.speculative_method or "mtp",
                "num_speculative_tokens": args.num_speculative_tokens or 3}
        if args.speculative_model:
            spec["model"] = args.speculative_model
    return LLM(args.model, dtype=args.dtype, device=args.device, seed=args.seed,
               max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
               max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
               enforce_eager=args.enforce_eager, compilation_config=compilation,
               attention_backend=args.attention_backend, speculative_config=spec,
               debug_padding=args.debug_padding or None, capture_progress=capture_progress)


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: {flag} must be comma-separated integers, got {text!r}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    llm = build_llm(args)
    prompts = args.prompt or ["The quick brown fox", "Once upon a time"]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed,
                            ignore_eos=args.ignore_eos)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    for out in outputs:
        c = out.outputs[0]
        print(f"--- {out.prompt!r} -> ({len(c.token_ids)} tokens, {c.finish_reason})")
        print(c.text)
    print(f"{num_tokens} tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tokens/s")
    spec = llm.engine.stats().get("spec")
    if spec:
        print(f"speculative: acceptance rate {spec['acceptance_rate']:.2f}, "
              f"mean tokens per step {spec['mean_tokens_per_step']:.2f}")
    return 0


def cmd_warmup(args: argparse.Namespace) -> int:
    from rung.runtime.warmup import run_warmup

    return run_warmup(args, build_llm)


def cmd_bench(args: argparse.Namespace) -> int:
    from rung.bench.latency import run_latency

    return run_latency(args)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rung", description="CUDA-graph-first LLM runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from prompts")
    _engine_args(gen)
    gen.add_argument("prompt", nargs="*")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(func=cmd_generate)
    warm = sub.add_parser("warmup", help="capture every graph on the ladder and report")
    _engine_args(warm)
    warm.add_argument("--json", default=None, help="write the capture table as JSON here")
    warm.set_defaults(func=cmd_warmup)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    latency = bench_sub.add_parser("latency", help="decode latency vs HF and the matmul floor")
    _engine_args(latency)
    try:
        from rung.bench.latency import add_latency_args
    except ImportError:
        add_latency_args = None
    if add_latency_args is not None:
        add_latency_args(latency)
    latency.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
