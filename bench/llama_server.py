"""llama.cpp's own HTTP server (`llama-server`): the baseline process of
`rung bench serve --baseline llama-server`, from finding its binary to stopping it.

It serves the same GGUF file as `rung serve`, on 127.0.0.1, CPU only (``-ngl 0``), with
the thread count of rung's engine for decode and prompt (``-t`` / ``-tb``), one slot per
concurrent stream of the largest count (``-np``: llama.cpp's continuous batching over that
many sequences) and a context of ``num_slots`` times one slot's tokens (``-c``: without
``--kv-unified`` each slot gets ``-c / -np``). The benchmark streams `/v1/completions` to
it with the client it uses for rung (token-id prompts, ``max_tokens``, ``ignore_eos``).

Its stream differs from rung's in one way the client must know (tools/server of the
llama.cpp that llama-cpp-python vendors): one chunk per sampled token with
``finish_reason`` null, then a final chunk with empty text, ``finish_reason`` set and
``usage`` (sent with or without ``stream_options``), then ``[DONE]``. That final chunk
carries no token, so its arrival is no token's (`carries_tokens`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from typing import Any

from rung.bench.server_process import free_port, stop_process, wait_healthy

BINARY_ENV = "RUNG_LLAMA_SERVER"
_BUILD_HINT = ("build it from llama-cpp-python's sdist (its vendor/llama.cpp: cmake -B build "
               "-DGGML_NATIVE=ON -DLLAMA_CURL=OFF && cmake --build build --target "
               "llama-server -j2; docs/performance.md, Serving)")
_START_TIMEOUT_S = 300.0


def find_llama_server(path: str | None) -> str:
    """The llama-server binary: ``path`` (--llama-server), else $RUNG_LLAMA_SERVER, else
    `llama-server` on PATH; a ValueError naming what is missing."""
    given = path or os.environ.get(BINARY_ENV)
    if given:
        flag = "--llama-server" if path else f"${BINARY_ENV}"
        if not (os.path.isfile(given) and os.access(given, os.X_OK)):
            raise ValueError(f"{flag} {given!r} is not an executable file; {_BUILD_HINT}")
        return given
    found = shutil.which("llama-server")
    if found is None:
        raise ValueError(f"--baseline llama-server: no llama-server on PATH and neither "
                         f"--llama-server nor ${BINARY_ENV} given; {_BUILD_HINT}")
    return found


def llama_server_argv(binary: str, model_path: str, port: int, num_threads: int,
                      num_slots: int, slot_tokens: int) -> list[str]:
    """``slot_tokens``: the most tokens one stream holds (its prompt and its output)."""
    return [binary, "--model", model_path, "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(num_threads), "--threads-batch", str(num_threads),
            "--parallel", str(num_slots), "--ctx-size", str(num_slots * slot_tokens),
            "--n-gpu-layers", "0"]


def carries_tokens(chunk: dict[str, Any]) -> bool:
    """Whether one `/v1/completions` stream chunk of llama-server holds sampled tokens."""
    choices = chunk.get("choices")
    return bool(choices) and choices[0].get("finish_reason") is None


class LlamaServerProcess:
    """One llama-server on a free loopback port, ready (its /health answers 200) once
    constructed; its log goes to a temporary file, quoted when it fails."""

    name = "llama-server"
    carries_tokens = staticmethod(carries_tokens)

    def __init__(self, binary: str, model_path: str, num_threads: int, num_slots: int,
                 slot_tokens: int) -> None:
        self.port = free_port()
        self.argv = llama_server_argv(binary, model_path, self.port, num_threads, num_slots,
                                      slot_tokens)
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.proc, self.port, _START_TIMEOUT_S, "llama-server",
                         lambda: f": {' '.join(self.argv)}\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def log_tail(self, num_lines: int = 20) -> str:
        self._log.seek(0)
        return b"\n".join(self._log.read().splitlines()[-num_lines:]).decode(errors="replace")

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


def llama_server_version(binary: str) -> str:
    """What `llama-server --version` says (its build number and commit), for the record."""
    try:
        run = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    lines = [ln for ln in (run.stdout + run.stderr).splitlines() if ln.startswith("version")]
    return lines[0] if lines else "unknown"
