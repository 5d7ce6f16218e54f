"""`rung bench serve`: `rung serve` under a bounded loopback load, next to `LLM.generate`.

One process builds the engine for `LLM.generate` and starts `rung serve` with the same
engine flags in a subprocess on 127.0.0.1. For each stream count (1, 8, 32 by default) and
each round, both run the same fresh prompts (``input_len`` random tokens, ``output_len``
greedy tokens, EOS ignored), one after the other (A B A B ...): `LLM.generate` on all of
them at once, and the server with as many concurrent streams as prompts, each a streamed
`/v1/completions`. A round's request count is fixed (the stream count) and the whole run
stops early at ``--time-cap``.

Reported per stream count: tokens/s (generated tokens / wall time of the round), the time
to first token and the inter-token latency of every stream (the server's as the client
sees them over HTTP; `LLM.generate`'s from a step listener) and the server's overhead,
1 - serve tokens/s / generate tokens/s. The client is a few lines of asyncio HTTP, so the
figure is the server's cost, not a heavy client's.

The server runs its engine in a process of its own (its default); ``--engine-in-process``
benchmarks a server with the engine on a thread of its own process instead, and
``--compare-engine-in-process`` runs both servers side by side, each round running
generate, then the two servers in an order that alternates from round to round.

``--baseline llama-server`` adds llama.cpp's own server on the same GGUF file
(bench/llama_server.py) as one more server of each round, in the same alternating order,
and reports rung's tokens/s over llama-server's (the median of each round's own ratio)
beside both servers' TTFT and ITL.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch

from rung.bench.llama_server import LlamaServerProcess, find_llama_server, llama_server_version
from rung.bench.report import environment, loadavg
from rung.bench.server_process import free_port, stop_process, wait_healthy
from rung.bench.stats import percentiles_ms
from rung.models.gguf import is_gguf
from rung.models.loader import resolve_model_path
from rung.runtime.api.llm import LLM
from rung.runtime.sampling_params import SamplingParams


def _streams(text: str) -> list[int]:
    try:
        counts = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--streams must be comma-separated integers, got {text!r}") from None
    if not counts or counts[0] < 1:
        raise ValueError(f"--streams {text!r}: every count must be >= 1")
    return counts


def run_serve_bench(args: argparse.Namespace, build_llm: Callable[..., LLM],
                    engine_argv: list[str]) -> int:
    """``engine_argv``: the engine flags of this command, handed to `rung serve`."""
    counts = _streams(args.streams)
    if counts[-1] > args.max_num_seqs:
        raise ValueError(f"--streams {counts[-1]} exceeds --max-num-seqs {args.max_num_seqs}: "
                         "the engine would queue streams generate runs at once")
    for name in ("input_len", "output_len", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    baseline = _llama_server_baseline(args, counts[-1])
    torch.set_num_threads(args.threads)
    env = environment(args)
    start = time.monotonic()
    llm = build_llm(args)
    vocab = llm.engine.runner.vocab_size
    # NOTE: a SIGTERM to the bench unwinds through `finally`, so the server goes too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    servers: dict[str, Any] = {}        # _ServerProcess or LlamaServerProcess, by name
    records = []
    try:
        for name, flags in _server_variants(args).items():
            servers[name] = _ServerProcess(engine_argv + flags, _server_threads(args, flags))
        if baseline is not None:
            servers["llama_server"] = baseline()
            argv = servers["llama_server"].argv
            env["llama_server"] = {"argv": argv, "version": llama_server_version(argv[0])}
        warm = _prompts(0, 2, args.input_len, vocab)
        _generate_round(llm, warm, 4)
        for server in servers.values():
            asyncio.run(_serve_round(server, warm, 4))
        for count in counts:
            rounds: list[dict[str, dict]] = []
            for r in range(args.rounds):
                if time.monotonic() - start > args.time_cap:
                    break
                prompts = _prompts(1000 * count + r + 1, count, args.input_len, vocab)
                rnd = {"generate": _generate_round(llm, prompts, args.output_len)}
                order = list(servers) if r % 2 == 0 else list(reversed(servers))
                for name in order:
                    rnd[name] = asyncio.run(_serve_round(servers[name], prompts,
                                                         args.output_len))
                rounds.append(rnd)
            if rounds:
                records.append(_record(count, rounds))
                print(_line(records[-1]), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    env["loadavg_end"] = loadavg()
    print(f"model {args.model}: input {args.input_len}, output {args.output_len}, "
          f"{args.rounds} rounds per stream count (generate, {', '.join(servers)} "
          f"interleaved), {args.threads} torch thread(s), {time.monotonic() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": env, "records": records}, f, indent=2)
    return 0


def _server_variants(args: argparse.Namespace) -> dict[str, list[str]]:
    """The servers to run, by the name their figures carry, and their extra flags."""
    if getattr(args, "compare_engine_in_process", False):
        return {"serve": [], "serve_in_process": ["--engine-in-process"]}
    if getattr(args, "engine_in_process", False):
        return {"serve": ["--engine-in-process"]}
    return {"serve": []}


def _server_threads(args: argparse.Namespace, flags: list[str]) -> int:
    """The torch threads of a rung server's engine with these extra flags."""
    if "--engine-in-process" not in flags and args.engine_process_threads:
        return args.engine_process_threads
    return args.threads


def _llama_server_baseline(args: argparse.Namespace, max_streams: int
                           ) -> Callable[[], LlamaServerProcess] | None:
    """With ``--baseline llama-server``: what starts it, once its binary and the GGUF
    file are known to be there (checked before any engine is built)."""
    if args.baseline != "llama-server":
        if args.llama_server is not None:
            raise ValueError(f"--llama-server {args.llama_server!r} needs --baseline "
                             "llama-server")
        return None
    binary = find_llama_server(args.llama_server)
    path = resolve_model_path(args.model)
    if not is_gguf(path) or args.load_format == "dummy":
        raise ValueError(f"--baseline llama-server serves a GGUF file's own weights; "
                         f"{args.model!r} is not a GGUF file (or --load-format dummy "
                         "replaces its weights)")
    # NOTE: llama.cpp's threads are those of the first rung server's engine ("serve")
    threads = _server_threads(args, next(iter(_server_variants(args).values())))
    # NOTE: a slot stops early ("truncated") when its context fills; the margin keeps
    # input + output clear of that edge
    return functools.partial(LlamaServerProcess, binary, path, threads, max_streams,
                             args.input_len + args.output_len + 16)


def _prompts(seed: int, count: int, input_len: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, input_len), generator=gen).tolist()


def _params(output_len: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)


# --- LLM.generate ------------------------------------------------------------------------
def _generate_round(llm: LLM, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """One `LLM.generate` of every prompt; token times come from a step listener."""
    times: dict[str, list[float]] = {}

    def listen(result) -> None:
        now = time.perf_counter()
        for rid, tokens in result.sampled.items():
            times.setdefault(rid, []).extend([now] * len(tokens))

    remove = llm.engine.add_step_listener(listen)
    try:
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(output_len),
                            use_tqdm=False)
        wall = time.perf_counter() - t0
    finally:
        remove()
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return _round(wall, num_tokens, t0, [(t, len(t)) for t in times.values()])


# --- the server ----------------------------------------------------------------------------
class _ServerProcess:
    name = "rung serve"

    def __init__(self, engine_argv: list[str], threads: int) -> None:
        self.port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": str(threads),
               "RUNG_LOGGING_LEVEL": os.environ.get("RUNG_LOGGING_LEVEL", "WARNING")}
        self.proc = subprocess.Popen([sys.executable, "-m", "rung.cli.main", "serve",
                                      *engine_argv, "--port", str(self.port)], env=env)
        try:
            wait_healthy(self.proc, self.port, 600, "rung serve")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop_process(self.proc)

    @staticmethod
    def carries_tokens(chunk: dict[str, Any]) -> bool:
        """Every chunk with a choice holds tokens (its text may be empty)."""
        return bool(chunk.get("choices"))


async def _serve_round(server: Any, prompts: list[list[int]], output_len: int
                       ) -> dict[str, Any]:
    """``server``: its ``port``, ``name`` and ``carries_tokens(chunk)``. Every stream must
    bring ``output_len`` tokens (EOS is ignored)."""
    t0 = time.perf_counter()
    results = await asyncio.gather(*[_stream(server, p, output_len) for p in prompts])
    wall = time.perf_counter() - t0
    short = [n for n, _ in results if n != output_len]
    if short:
        raise RuntimeError(f"{server.name} streamed {short} tokens in {len(short)} of "
                           f"{len(results)} streams; asked for {output_len} each")
    return _round(wall, sum(n for n, _ in results), t0, [(t, n) for n, t in results])


async def _stream(server: Any, prompt: list[int], output_len: int
                  ) -> tuple[int, list[float]]:
    """One streamed completion over a bare HTTP/1.1 connection: (completion tokens from
    usage, the arrival time of every chunk that holds tokens)."""
    body = json.dumps({"prompt": prompt, "max_tokens": output_len, "temperature": 0,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nConnection: close\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"{server.name} answered {status!r}: {await reader.read()!r}")
    while (await reader.readline()).strip():
        pass                                    # headers
    times: list[float] = []
    num_tokens = 0
    async for event in _sse(reader):
        if event == "[DONE]":
            break
        data = json.loads(event)
        if data.get("usage"):
            num_tokens = data["usage"]["completion_tokens"]
        if server.carries_tokens(data):
            times.append(time.perf_counter())
    writer.close()
    return num_tokens, times


async def _sse(reader: asyncio.StreamReader):
    """`data:` payloads of a chunked event stream."""
    buffer = b""
    while True:
        size = int((await reader.readline()).strip(), 16)
        if size == 0:
            return
        buffer += (await reader.readexactly(size + 2))[:-2]     # the chunk, then CRLF
        *events, buffer = buffer.split(b"\n\n")
        for e in events:
            if e.startswith(b"data: "):
                yield e[6:].decode()


# --- figures ------------------------------------------------------------------------------
def _round(wall: float, num_tokens: int, t0: float,
           token_times: list[tuple[list[float], int]]) -> dict[str, Any]:
    """tokens/s, and each stream's TTFT and mean inter-token latency; ``token_times``:
    per stream, the arrival times of its outputs and its number of tokens."""
    ttft = [t[0] - t0 for t, _ in token_times if t]
    # NOTE: per token, as vLLM's TPOT: a stream's chunks may carry several tokens each
    itl = [(t[-1] - t[0]) / (n - 1) for t, n in token_times if t and n > 1]
    return {"wall_s": wall, "num_tokens": num_tokens, "tokens_per_s": num_tokens / wall,
            "ttft": ttft, "itl": itl}


def _record(count: int, rounds: list[dict[str, dict]]) -> dict[str, Any]:
    """``rounds``: per round, each variant's figures by name ("generate", "serve", ...,
    "llama_server")."""
    rec: dict[str, Any] = {"streams": count, "rounds": len(rounds)}
    for name in rounds[0]:
        part = [r[name] for r in rounds]
        rec[f"{name}_tokens_per_s"] = statistics.median(p["tokens_per_s"] for p in part)
        rec[f"{name}_num_tokens"] = sum(p["num_tokens"] for p in part)
        rec.update(percentiles_ms([x for p in part for x in p["ttft"]], f"{name}_ttft"))
        itl = [x for p in part for x in p["itl"]]
        if itl:
            rec.update(percentiles_ms(itl, f"{name}_itl"))
    # NOTE: each ratio is the median over rounds of each round's own ratio (A B pairs)
    for name in _rung_servers(rounds[0]):
        per_round = [1 - r[name]["tokens_per_s"] / r["generate"]["tokens_per_s"]
                     for r in rounds]
        rec[f"{name}_overhead_per_round"] = per_round
        rec[f"{name}_overhead"] = statistics.median(per_round)
        if "llama_server" in rounds[0]:
            per_round = [r[name]["tokens_per_s"] / r["llama_server"]["tokens_per_s"]
                         for r in rounds]
            rec[f"{name}_over_llama_server_per_round"] = per_round
            rec[f"{name}_over_llama_server"] = statistics.median(per_round)
    return rec


def _rung_servers(names: dict[str, Any]) -> list[str]:
    return [n for n in names if n not in ("generate", "llama_server")]


def _line(r: dict[str, Any]) -> str:
    def ms(key: str) -> str:
        return f"{r.get(key, float('nan')):.1f}"

    parts = [f"{r['streams']:>3} streams: tokens/s generate {r['generate_tokens_per_s']:.1f}"]
    names = [k[:-len("_overhead")] for k in r if k.endswith("_overhead")]
    for name in names:
        parts.append(f"{name} {r[f'{name}_tokens_per_s']:.1f} (overhead "
                     f"{100 * r[f'{name}_overhead']:+.1f}%)")
    if "llama_server_tokens_per_s" in r:
        ratios = " ".join(f"{n} / llama-server {r[f'{n}_over_llama_server']:.2f}"
                          for n in names)
        parts.append(f"llama_server {r['llama_server_tokens_per_s']:.1f} ({ratios})")
        names.append("llama_server")
    ttft = " ".join(f"{n} {ms(f'{n}_ttft_ms_p50')}" for n in ["generate", *names])
    itl = " ".join(f"{n} {ms(f'{n}_itl_ms_p50')}" for n in ["generate", *names])
    return f"{', '.join(parts)} | TTFT p50 ms {ttft} | ITL p50 ms {itl}"
