"""`rung bench serve --baseline llama-server` (bench/llama_server.py, bench/serve.py):
clear errors for a missing binary or a model that is not a GGUF file; llama-server gets
the thread count of rung's engine and a slot per stream; its stream's token count and
token times are read right, and a short stream is an error; end to end where a
llama-server binary and the SmolLM2 weights are on the machine."""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import sys
import types

import pytest

pytest.importorskip("fastapi")

from rung.bench.llama_server import carries_tokens, find_llama_server  # noqa: E402
from rung.bench.serve import _line, _llama_server_baseline, _record, _serve_round  # noqa: E402
from rung.cli.main import main, make_parser  # noqa: E402

TINY = ["bench", "serve", "--model", "tiny-llama", "--streams", "1", "--rounds", "1",
        "--input-len", "8", "--output-len", "4"]


def test_a_missing_binary_is_a_clear_error_naming_it(capsys):
    assert main([*TINY, "--baseline", "llama-server", "--llama-server", "/no/llama-server"]) == 2
    err = capsys.readouterr().err
    assert "--llama-server '/no/llama-server' is not an executable file" in err
    assert "--target llama-server" in err        # how to build one


def test_no_binary_anywhere_says_where_it_looked(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("RUNG_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main([*TINY, "--baseline", "llama-server"]) == 2
    err = capsys.readouterr().err
    assert "no llama-server on PATH" in err and "$RUNG_LLAMA_SERVER" in err


def test_the_environment_names_the_binary(capsys, monkeypatch):
    monkeypatch.setenv("RUNG_LLAMA_SERVER", "/no/env/llama-server")
    assert main([*TINY, "--baseline", "llama-server"]) == 2
    assert "$RUNG_LLAMA_SERVER '/no/env/llama-server' is not" in capsys.readouterr().err


def test_a_model_that_is_not_a_gguf_file_is_a_clear_error(capsys, tmp_path):
    binary = _script(tmp_path / "llama-server", "exit 0")
    assert main([*TINY, "--baseline", "llama-server", "--llama-server", binary]) == 2
    assert "serves a GGUF file's own weights; 'tiny-llama' is not" in capsys.readouterr().err


def test_llama_server_without_the_baseline_is_refused(capsys):
    assert main([*TINY, "--llama-server", "/bin/true"]) == 2
    assert "needs --baseline llama-server" in capsys.readouterr().err


def test_llama_server_gets_the_engines_threads_and_a_slot_per_stream(tmp_path):
    """The baseline runs the same file with the threads rung's server engine gets; a
    llama-server that exits at start is an error quoting its log."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    seen = tmp_path / "argv"
    binary = _script(tmp_path / "llama-server",
                     f'echo "$@" > {seen}; echo "cannot load the model" >&2; exit 3')
    args = make_parser().parse_args(
        ["bench", "serve", "--model", str(model), "--baseline", "llama-server",
         "--llama-server", binary, "--threads", "2", "--engine-process-threads", "1",
         "--input-len", "8", "--output-len", "4"])
    start = _llama_server_baseline(args, 8)
    with pytest.raises(RuntimeError, match="exited with 3(.|\n)*cannot load the model"):
        start()
    argv = seen.read_text().split()
    flags = dict(zip(argv[::2], argv[1::2]))
    assert flags["--model"] == str(model)
    assert flags["--threads"] == flags["--threads-batch"] == "1"   # the engine process's
    assert flags["--parallel"] == "8"
    assert int(flags["--ctx-size"]) >= 8 * (8 + 4)                # every slot's prompt + output
    assert flags["--n-gpu-layers"] == "0" and flags["--host"] == "127.0.0.1"

    args.engine_in_process = True          # then the engine runs at --threads
    with pytest.raises(RuntimeError):
        _llama_server_baseline(args, 8)()
    assert "--threads 2 --threads-batch 2" in seen.read_text()


def test_both_rung_sides_measure_live_graphs(monkeypatch):
    """Graphs built in the background would be compiling while rounds run: the bench
    starts generate and the server with every graph live, unless told otherwise."""
    seen = {}

    def fake_run(args, build_llm, engine_argv):
        seen.update(startup=args.graph_startup, argv=engine_argv)
        return 0

    monkeypatch.setattr("rung.bench.serve.run_serve_bench", fake_run)
    assert main(TINY) == 0
    assert seen["startup"] == "blocking"
    assert "--graph-startup blocking" in " ".join(seen["argv"])
    assert main([*TINY, "--graph-startup", "background"]) == 0
    assert seen["startup"] == "background"


# --- llama-server's stream, as its tools/server writes it --------------------------------------
def _chunk(body: dict | str) -> bytes:
    data = f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _fake_llama_server(num_tokens: int, final_delay_s: float):
    """An HTTP server answering one streamed /v1/completions as llama-server does: a
    chunk per token, then an empty final chunk with usage (late by ``final_delay_s``)."""

    async def answer(reader, writer):
        while (await reader.readline()).strip():
            pass
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for _ in range(num_tokens):
            writer.write(_chunk({"choices": [{"text": "a", "index": 0, "logprobs": None,
                                              "finish_reason": None}]}))
            await writer.drain()
            await asyncio.sleep(0.01)
        await asyncio.sleep(final_delay_s)
        writer.write(_chunk({"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                             "usage": {"completion_tokens": num_tokens}}))
        writer.write(_chunk("[DONE]") + b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", 0)


def _round_against_fake(num_tokens: int, output_len: int, final_delay_s: float = 0.0):
    async def run():
        server = await _fake_llama_server(num_tokens, final_delay_s)
        fake = types.SimpleNamespace(port=server.sockets[0].getsockname()[1],
                                     name="llama-server", carries_tokens=carries_tokens)
        async with server:
            return await _serve_round(fake, [[5, 6, 7]], output_len)

    return asyncio.run(run())


def test_the_final_usage_chunk_is_no_token_of_the_inter_token_latency():
    rnd = _round_against_fake(num_tokens=5, output_len=5, final_delay_s=0.5)
    assert rnd["num_tokens"] == 5
    assert rnd["itl"][0] < 0.1             # 10 ms apart; counting the final chunk gives > 0.1


def test_a_stream_short_of_its_tokens_is_an_error():
    with pytest.raises(RuntimeError, match=r"llama-server streamed \[3\] tokens in 1 of 1 "
                                           r"streams; asked for 4"):
        _round_against_fake(num_tokens=3, output_len=4)


def test_the_record_reports_rung_over_llama_server_per_round():
    def rnd(gen: float, serve: float, lcpp: float) -> dict:
        return {name: {"tokens_per_s": tps, "num_tokens": 64, "ttft": [0.1], "itl": [0.02]}
                for name, tps in (("generate", gen), ("serve", serve), ("llama_server", lcpp))}

    rec = _record(8, [rnd(100, 90, 60), rnd(100, 80, 100), rnd(50, 40, 80)])
    assert rec["serve_over_llama_server_per_round"] == [1.5, 0.8, 0.5]
    assert rec["serve_over_llama_server"] == 0.8
    assert "llama_server_overhead" not in rec          # llama-server is no rung server
    line = _line(rec)
    assert "llama_server 80.0 (serve / llama-server 0.80)" in line
    assert "TTFT p50 ms generate 100.0 serve 100.0 llama_server 100.0" in line


# --- end to end ----------------------------------------------------------------------------------
@pytest.mark.slow       # SmolLM2 in rung, in rung serve and in llama-server: ~1 min
def test_bench_serve_against_llama_server_end_to_end(tmp_path):
    from rung.models.loader import resolve_model_path

    try:
        binary = find_llama_server(None)
    except ValueError as e:
        pytest.skip(f"no llama-server binary ({e})")
    try:
        resolve_model_path("smollm2-135m")
    except ValueError as e:
        pytest.skip(f"SmolLM2 weights not installed ({e})")
    out = tmp_path / "serve.json"
    run = subprocess.run([sys.executable, "-m", "rung.cli.main", "bench", "serve", "--model",
                          "smollm2-135m", "--enforce-eager", "--baseline", "llama-server",
                          "--llama-server", binary, "--streams", "1,3", "--rounds", "2",
                          "--input-len", "8", "--output-len", "4", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["streams"] for r in result["records"]] == [1, 3]
    for r in result["records"]:
        assert r["llama_server_num_tokens"] == r["serve_num_tokens"] == 2 * 4 * r["streams"]
        assert r["serve_over_llama_server"] > 0 and r["llama_server_ttft_ms_p50"] > 0
    assert "--parallel" in result["env"]["llama_server"]["argv"]
    assert "serve / llama-server" in run.stdout


def _script(path, body: str) -> str:
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)

