"""`rung serve` (the OpenAI-compatible server) and `rung bench serve`."""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

from rung.cli.args import HelpFormatter, add_engine_args, build_llm, check_output_path, importable


def add_serve(sub: Any) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, "
                           "/v1/chat/completions, /v1/models, /health, /metrics)",
                           formatter_class=HelpFormatter)
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: --model)")
    serve.add_argument("--api-key", default=os.environ.get("RUNG_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1 (default: "
                            "$RUNG_API_KEY; none: no auth)")
    serve.add_argument("--max-queue", type=int, default=None,
                       help="sequences that may wait beyond --max-num-seqs; more get 503 "
                            "(default: no limit)")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template file, instead of the model's own")
    serve.add_argument("--engine-in-process", action="store_true",
                       help="run the engine on a thread of the HTTP server's process "
                            "(debugging; vLLM: VLLM_ENABLE_V1_MULTIPROCESSING=0) instead of "
                            "a process of its own")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds running requests get to finish after SIGTERM before "
                            "they are cut (finish_reason 'abort')")
    _add_limit_args(serve)
    serve.add_argument("--uvicorn-log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's log level (access lines at info)")
    serve.set_defaults(func=cmd_serve)


def _add_limit_args(serve: argparse.ArgumentParser) -> None:
    """Operator limits (rung.server.limits): a request over one is a 400 naming it."""
    d = _limit_defaults()
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="allow a request's own chat_template (rendered in a sandbox "
                            "under --chat-template-timeout); refused otherwise")
    serve.add_argument("--chat-template-timeout", type=float,
                       default=d.chat_template_timeout_s,
                       help="seconds a request's chat template may take to render")
    serve.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                       help="most logprobs / top_logprobs / prompt_logprobs per token")
    serve.add_argument("--max-n", type=int, default=d.max_n, help="most choices (n) per request")
    serve.add_argument("--max-prompts-per-request", type=int,
                       default=d.max_prompts_per_request,
                       help="most prompts in one /v1/completions request")
    serve.add_argument("--max-stop", type=int, default=d.max_stop,
                       help="most stop strings per request")
    serve.add_argument("--max-stop-str-len", type=int, default=d.max_stop_str_len,
                       help="most characters in one stop string")
    serve.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids,
                       help="most stop_token_ids per request")
    serve.add_argument("--max-messages", type=int, default=d.max_messages,
                       help="most chat messages per request")
    serve.add_argument("--max-request-body-bytes", type=int,
                       default=d.max_request_body_bytes,
                       help="largest request body, checked before it is parsed")
    serve.add_argument("--request-body-timeout", type=float,
                       default=d.request_body_timeout_s,
                       help="seconds a request body may take to arrive")
    serve.add_argument("--request-header-timeout", type=float,
                       default=d.request_header_timeout_s,
                       help="seconds a connection may take to send a request's head")
    serve.add_argument("--limit-concurrency", type=int, default=512,
                       help="most open connections and tasks (uvicorn's); more get 503")
    serve.add_argument("--timeout-keep-alive", type=float, default=5.0,
                       help="seconds an idle keep-alive connection stays open (uvicorn's)")


def _limit_defaults():
    from rung.server.limits import ServerLimits

    return ServerLimits()


def add_bench_serve(bench_sub: Any) -> None:
    serve = bench_sub.add_parser("serve", help="rung serve under a bounded loopback load, "
                                 "next to LLM.generate on the same prompts",
                                 formatter_class=HelpFormatter)
    add_engine_args(serve)
    _add_serve_bench_args(serve)
    serve.set_defaults(func=cmd_bench_serve)


def _add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", default="1,8,32",
                   help="comma-separated concurrent stream counts")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    p.add_argument("--rounds", type=int, default=3,
                   help="measured rounds per stream count (each: generate, then serve)")
    p.add_argument("--time-cap", type=float, default=600.0,
                   help="seconds after which no further round starts")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, here and in the server")
    p.add_argument("--json", default=None, help="also write every figure here")
    p.add_argument("--engine-in-process", action="store_true",
                   help="benchmark a server whose engine runs on a thread of its own process")
    p.add_argument("--compare-engine-in-process", action="store_true",
                   help="run both servers (engine process, engine in process) round by round")
    p.add_argument("--engine-process-threads", type=int, default=None,
                   help="torch threads of a server's engine process (default: --threads); "
                        "e.g. one less, to see what a core left to its HTTP process "
                        "(RUNG_NUM_RESERVED_CORES=1) costs or gains")
    p.add_argument("--baseline", default="none", choices=["none", "llama-server"],
                   help="llama-server: also run llama.cpp's own server on the same GGUF "
                        "file in every round (as many slots as the largest --streams, the "
                        "threads of rung's engine, no GPU layers) and report rung's tokens/s "
                        "over its")
    p.add_argument("--llama-server", default=None,
                   help="the llama-server binary (default: $RUNG_LLAMA_SERVER, else "
                        "llama-server on PATH)")
    p.set_defaults(max_num_seqs=32)


def cmd_serve_check() -> None:
    missing = [m for m in ("fastapi", "uvicorn", "prometheus_client") if not importable(m)]
    if missing:
        raise ImportError(f"rung serve needs {', '.join(missing)}: pip install 'rung[serve]'")


def cmd_serve(args: argparse.Namespace) -> int:
    cmd_serve_check()
    if args.data_parallel_size > 1:
        raise ValueError(f"rung serve runs one engine: drop --data-parallel-size "
                         f"{args.data_parallel_size}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port {args.port} must be in [1, 65535]")
    if args.max_queue is not None and args.max_queue < 0:
        raise ValueError(f"--max-queue {args.max_queue} must be >= 0")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout {args.shutdown_timeout} must be >= 0")
    template = None
    if args.chat_template is not None:
        with open(args.chat_template) as f:
            template = f.read()
    from rung.server.app import ServerConfig, run_server

    config = ServerConfig(model_name=args.served_model_name or args.model,
                          api_key=args.api_key or None, max_queue=args.max_queue,
                          chat_template=template, shutdown_timeout_s=args.shutdown_timeout,
                          limits=_limits(args))
    transport = _engine_transport(args)
    return run_server(transport, config, args.host, args.port, args.uvicorn_log_level,
                      limit_concurrency=args.limit_concurrency,
                      timeout_keep_alive=args.timeout_keep_alive)


def _engine_transport(args: argparse.Namespace) -> Any:
    """The engine, ready: in a process of its own (the default) or in this one."""
    if args.engine_in_process:
        from rung.server.engine_loop import ThreadTransport

        return ThreadTransport(build_llm(args).engine)
    from rung.server.engine_process import EngineProcess

    engine = EngineProcess(functools.partial(build_engine, args))
    try:
        engine.wait_ready()
    except BaseException:
        engine.stop(5.0)
        raise
    return engine


def build_engine(args: argparse.Namespace) -> Any:
    """The engine process's engine (a module-level function: it is pickled to the child)."""
    return build_llm(args).engine


def _limits(args: argparse.Namespace):
    from rung.server.limits import ServerLimits

    values = dict(max_request_body_bytes=args.max_request_body_bytes, max_n=args.max_n,
                  max_prompts_per_request=args.max_prompts_per_request,
                  max_logprobs=args.max_logprobs, max_stop=args.max_stop,
                  max_stop_str_len=args.max_stop_str_len,
                  max_stop_token_ids=args.max_stop_token_ids, max_messages=args.max_messages)
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"--{name.replace('_', '-')} {value} must be >= 0")
    for flag, value in (("--chat-template-timeout", args.chat_template_timeout),
                        ("--request-body-timeout", args.request_body_timeout),
                        ("--request-header-timeout", args.request_header_timeout),
                        ("--timeout-keep-alive", args.timeout_keep_alive)):
        if value <= 0:
            raise ValueError(f"{flag} {value} must be > 0")
    if args.limit_concurrency < 1:
        raise ValueError(f"--limit-concurrency {args.limit_concurrency} must be >= 1")
    return ServerLimits(**values, trust_request_chat_template=args.trust_request_chat_template,
                        chat_template_timeout_s=args.chat_template_timeout,
                        request_body_timeout_s=args.request_body_timeout,
                        request_header_timeout_s=args.request_header_timeout)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    cmd_serve_check()
    args.graph_startup = args.graph_startup or "blocking"   # measures live graphs
    check_output_path(args.json, "--json")
    from rung.bench.serve import run_serve_bench

    return run_serve_bench(args, build_llm, engine_argv(args))


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` that differ from their defaults, as a command line."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_args(parser)
    argv: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        argv += [flag] if isinstance(action, argparse._StoreTrueAction) else [flag, str(value)]
    return argv
