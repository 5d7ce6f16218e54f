"""`rung generate`: text from prompts, on one process or on data-parallel ranks."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from rung.cli.args import HelpFormatter, add_engine_args, build_llm, int_list


def add_generate(sub: Any) -> None:
    gen = sub.add_parser("generate", help="generate text from prompts",
                         formatter_class=HelpFormatter)
    add_engine_args(gen)
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
    gen.add_argument("--chat-template", default=None, metavar="FILE",
                     help="a Jinja chat template file for --chat (default: the model's own)")
    gen.set_defaults(func=cmd_generate)


def _prompts(args: argparse.Namespace) -> list[str | dict]:
    prompts: list[str | dict] = list(args.prompt)
    for text in args.prompt_token_ids or []:
        prompts.append({"prompt_token_ids": int_list(text, "--prompt-token-ids")})
    return prompts or ["The quick brown fox", "Once upon a time"]


def _check_prompts(args: argparse.Namespace, prompts: list[str | dict]) -> None:
    """Tokenizer, length and vocabulary checks before the model is built and captured."""
    from rung.models.loader import peek_model
    from rung.runtime.sampling_params import context_overflow

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
        overflow = context_overflow(len(ids), args.max_tokens, max_len)
        if overflow is not None:    # NOTE: as the server's 400; LLM.generate would stop there
            raise ValueError(f"prompt {i}: {overflow}")
        bad = [t for t in ids if not 0 <= t < cfg["vocab_size"]]
        if bad:
            raise ValueError(f"prompt {i}: token id {bad[0]} is out of the vocabulary "
                             f"[0, {cfg['vocab_size']})")


def _read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--chat-template {path!r}: {e.strerror}") from None


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


def _unbuilt_graphs_note(llm: Any, args: argparse.Namespace) -> str:
    """What becomes of the graphs this one-shot run did not bring live: a compile still
    running goes on after it exits (low priority, one per cache), else `rung warmup`."""
    pid = llm.engine.detach_graph_compile()
    if pid is not None:
        return (f"their compile goes on in the background (pid {pid}, low priority) and "
                "the next run starts on graphs")
    return f"`rung warmup --model {args.model}` builds them all before a run"


def _print_partial_outputs(llm: Any) -> None:
    """Ctrl-C: the text every unfinished request had so far, before the command exits."""
    tokenizer = llm.get_tokenizer()
    for req in list(llm.engine.requests.values()):
        ids = req.output_token_ids
        shown = repr(req.prompt) if req.prompt is not None else req.prompt_token_ids
        text = tokenizer.decode(ids) if tokenizer is not None else ids
        print(f"--- {shown} -> (interrupted after {len(ids)} tokens)\n{text}", flush=True)


def generate_report(rank: int | None, args: argparse.Namespace) -> str:
    """What `rung generate` prints. Under data parallel (``rank``: spawned rank, or None
    under torchrun) rank 0 prints the outputs and every rank its padding line."""
    params = _sampling_params(args)
    llm = build_llm(args)
    start = time.perf_counter()
    prompts = _prompts(args)
    try:
        if args.chat:   # each text prompt is one user message of its own conversation
            if any(not isinstance(p, str) for p in prompts):
                raise ValueError("--chat takes text prompts, not --prompt-token-ids")
            template = _read_chat_template(args.chat_template)
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                               chat_template=template)
        else:
            outputs = llm.generate(prompts, params)
    except KeyboardInterrupt:
        _print_partial_outputs(llm)
        raise
    elapsed = time.perf_counter() - start
    stats = llm.engine.stats()
    graphs = stats["graphs"]
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
    if graphs["pending"]:
        lines.append(f"graphs live: {len(graphs['live'])} of "
                     f"{len(graphs['live']) + len(graphs['pending'])} (the others were still "
                     f"building; {stats['eager_steps']} steps ran eagerly); "
                     + _unbuilt_graphs_note(llm, args))
    spec = stats.get("spec")
    if spec:
        lines.append(f"speculative: acceptance rate {spec['acceptance_rate']:.2f}, "
                     f"mean tokens per step {spec['mean_tokens_per_step']:.2f}")
    if dp is not None:
        lines.append(f"data parallel rank {dp['rank']}/{dp['world_size']}: {dp['steps']} "
                     f"steps, {dp['dummy_steps']} dummy, padding waste "
                     f"{100 * dp['padding_waste']:.1f}%")
    return "\n".join(lines)


