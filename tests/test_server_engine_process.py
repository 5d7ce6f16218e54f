"""`rung serve` with the engine in a process of its own: the engine's death is every
in-flight request's 500, /health's 503 and the server's non-zero exit; SIGTERM leaves no
engine process behind; a failed engine start is a clear error. Real servers in
subprocesses (tests/test_server.py's `Server`); the other server tests run through the
engine process too, since it is the default.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from test_server import GREEDY, MODEL, Server, _greedy  # noqa: E402

from rung.runtime import LLM  # noqa: E402


def _engine_pid(server_pid: int) -> int:
    """The pid of the server's engine process (a spawned child of the server)."""
    for _ in range(50):
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if ppid == server_pid and b"spawn_main" in cmdline:
                return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"server {server_pid} has no engine process")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _health(server: Server) -> tuple[int, dict] | None:
    """/health's status and body; None when nothing answers."""
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except (urllib.error.URLError, ConnectionError):
        return None


def test_the_engine_process_serves_generates_text_and_its_death_ends_the_server(tmp_path):
    s = Server(tmp_path, "--max-num-seqs", "8")
    try:
        engine = _engine_pid(s.proc.pid)
        client = s.client()
        # the new path: greedy text as LLM.generate's, concurrent streams batched
        prompts = [f"Request {i}: {'y' * i}" for i in range(6)]
        llm = LLM(MODEL, enforce_eager=True, max_model_len=256, max_num_seqs=8)
        want = _greedy(llm, prompts)

        def stream(prompt: str) -> str:
            chunks = client.completions.create(model=MODEL, prompt=prompt, stream=True,
                                               **GREEDY)
            return "".join(c.choices[0].text for c in chunks)

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            assert list(pool.map(stream, prompts)) == want
        # a hang-up reaches the engine: its KV blocks come back
        chunks = client.completions.create(model=MODEL, prompt="A long one", max_tokens=200,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(chunks))
        assert s.health()["kv_used_blocks"] > 0
        chunks.close()
        deadline = time.monotonic() + 20
        while s.health()["kv_used_blocks"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert s.health()["kv_used_blocks"] == 0

        # two requests in flight, one streamed, one not; then the engine is killed
        long = dict(model=MODEL, prompt="Go on", max_tokens=240, temperature=0,
                    extra_body={"ignore_eos": True})
        streamed = client.completions.create(stream=True, **long)
        next(iter(streamed))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            plain = pool.submit(client.completions.create, **long)
            while s.health()["num_running"] < 2:
                time.sleep(0.02)
            os.kill(engine, signal.SIGKILL)
            t = time.monotonic()
            seen = None
            while seen is None or seen[0] == 200:
                seen = _health(s)
                assert seen is not None, "the server exited before /health answered 503"
            assert seen[0] == 503 and "engine process died" in seen[1]["error"]
            with pytest.raises(openai.APIError, match="engine process died"):
                list(streamed)
            with pytest.raises(openai.InternalServerError) as e:
                plain.result()
            assert "engine process died" in e.value.body["message"]
        code = s.proc.wait(10)
        took = time.monotonic() - t
        assert code != 0, s.output()[-2000:]
        assert took < 5, f"the server took {took:.1f} s to exit after its engine died"
        assert "Traceback" not in s.output(), s.output()[-3000:]
    finally:
        s.stop()


def test_sigterm_stops_the_engine_process_within_the_shutdown_timeout(tmp_path):
    s = Server(tmp_path, "--shutdown-timeout", "1", "--max-model-len", "2048")
    try:
        engine = _engine_pid(s.proc.pid)
        # NOTE: 2000 tokens outlast the 1 s drain even on a quiet machine
        long = s.client().completions.create(model=MODEL, prompt="Go on", max_tokens=2000,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        next(iter(long))
        t = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        rest = list(long)
        assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "abort"
        assert s.proc.wait(30) == 0
        took = time.monotonic() - t
        assert took < 1 + 5, f"shutdown took {took:.1f} s"
        assert not _alive(engine), "the engine process outlived the server"
    finally:
        s.stop()


def test_the_engine_process_dies_with_a_killed_server(tmp_path):
    s = Server(tmp_path)
    try:
        engine = _engine_pid(s.proc.pid)
        s.proc.kill()
        s.proc.wait(10)
        deadline = time.monotonic() + 10
        while _alive(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(engine), "the engine process outlived a killed server"
    finally:
        s.stop()


def test_a_failed_engine_start_is_a_clear_error_and_a_non_zero_exit():
    out = subprocess.run([sys.executable, "-m", "rung.cli.main", "serve", "--model", MODEL,
                          "--enforce-eager", "--max-model-len", "100000", "--port", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert ("error: the engine process failed to start: ValueError: max_model_len=100000 "
            "exceeds") in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
