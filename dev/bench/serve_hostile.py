"""A victim's latency on `rung serve` while one hostile client attacks it.

Starts the server (tiny-llama unless --model), times a victim's 16-token greedy completion
alone, then while one hostile client runs each attack in a loop, and prints the ratio per
attack. Run: ``python dev/bench/serve_hostile.py [--model M] [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import IO

LOOP_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(10000) %}{% endfor %}"
                 "{% endfor %}x")


def _post(url: str, body: dict | bytes, timeout: float = 120) -> int:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def _non_reading_streams(port: int, stop: threading.Event) -> None:
    """16 streaming clients with logprobs that never read, reopened when they end."""
    body = json.dumps({"prompt": "Go", "max_tokens": 200, "logprobs": 20, "stream": True,
                       "ignore_eos": True}).encode()
    while not stop.is_set():
        socks = []
        for _ in range(16):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
            s.connect(("127.0.0.1", port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                      b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            socks.append(s)
        stop.wait(5)
        for s in socks:
            s.close()


def _attacks(url: str, port: int) -> dict:
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    big = json.dumps({"prompt": "hello world " * 600_000}).encode()
    return {
        "1 template loop": lambda: _post(url + "/v1/chat/completions",
                                         {**chat, "chat_template": LOOP_TEMPLATE}),
        "2 n=1e6 / n=max": lambda: (_post(url + "/v1/completions",
                                          {"prompt": "x", "n": 1_000_000, "max_tokens": 1}),
                                    _post(url + "/v1/completions",
                                          {"prompt": "x", "n": 128, "max_tokens": 1})),
        "2 many prompts": lambda: _post(url + "/v1/completions",
                                        {"prompt": ["x"] * 209_000, "max_tokens": 1}),
        "3 7 MB prompt": lambda: _post(url + "/v1/completions", big),
        "4 top_logprobs chat": lambda: _post(url + "/v1/chat/completions",
                                             {**chat, "logprobs": True, "top_logprobs": 49152}),
        "4 16 non-reading": None,      # a thread of its own
        "5 random 404s": lambda: [_post(url + f"/v1/x{time.monotonic_ns()}", {})
                                  for _ in range(100)],
        "7 stop lists": lambda: _post(url + "/v1/completions", {
            "prompt": "x", "max_tokens": 16, "stop": ["y" * 1024] * 64,
            "stop_token_ids": list(range(3, 259))}),
    }


def _start_server(args: argparse.Namespace, log: IO[bytes]) -> tuple[subprocess.Popen, str]:
    """`rung serve` on ``args.model`` (eager), answering /health; its output to ``log``."""
    url = f"http://127.0.0.1:{args.port}"
    proc = subprocess.Popen([sys.executable, "-m", "rung.cli.main", "serve", "--model",
                             args.model, "--enforce-eager", "--port", str(args.port),
                             "--trust-request-chat-template"],
                            stdout=log, stderr=subprocess.STDOUT)
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return proc, url
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}") from None
            time.sleep(0.3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--port", type=int, default=8377)
    ap.add_argument("--soak", type=float, default=None, metavar="SECONDS",
                    help="run every attack at once for this long and check the server "
                    "after (serve_soak.py)")
    args = ap.parse_args()
    if args.soak is not None:
        from serve_soak import soak
        return soak(args)
    proc, url = _start_server(args, subprocess.DEVNULL)
    try:
        victim = {"prompt": "The sky is", "max_tokens": 16, "temperature": 0,
                  "ignore_eos": True}

        def victim_s() -> float:
            t = time.perf_counter()
            assert _post(url + "/v1/completions", victim) == 200
            return time.perf_counter() - t

        for _ in range(3):
            victim_s()                 # warm
        alone = statistics.median(victim_s() for _ in range(args.rounds))
        print(f"victim alone: {alone * 1e3:.0f} ms (median of {args.rounds})")
        for name, attack in _attacks(url, args.port).items():
            stop = threading.Event()

            def hostile(attack=attack, stop=stop) -> None:
                if attack is None:
                    _non_reading_streams(args.port, stop)
                    return
                while not stop.is_set():
                    attack()

            thread = threading.Thread(target=hostile, daemon=True)
            thread.start()
            time.sleep(1.0)
            under = statistics.median(victim_s() for _ in range(args.rounds))
            stop.set()
            thread.join(30)
            print(f"{name:22s} victim {under * 1e3:6.0f} ms = {under / alone:4.2f}x alone")
            time.sleep(1.0)
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
