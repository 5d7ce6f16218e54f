"""A bounded soak of `rung serve` under every hostile attack at once.

Run: ``python dev/bench/serve_hostile.py --soak SECONDS [--model M]``. Starts the server as
serve_hostile.py does, records a victim's greedy text for three prompts, then for SECONDS
runs one hostile client cycling through every attack, 16 streams that never read, two
clients that hang up mid-stream, and the victim re-asking its prompts (each answer must be
byte-identical to the first). Every 10 s it samples the RSS of the HTTP process and of the
engine process. At the end it stops the attacks, waits for the server to drain, checks that
the KV pool is whole (every block free, cached ones counted free, as /health counts them),
that the victim's text is unchanged and that SIGTERM ends the server with status 0, and
prints the RSS series and a verdict.
"""

from __future__ import annotations

import argparse
import collections
import http.client
import itertools
import json
import os
import re
import signal
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request

from serve_hostile import _attacks, _non_reading_streams, _start_server

PROMPTS = ("The sky is", "Once upon a time", "def fib(n):")
SAMPLE_S = 10.0
SHUTDOWN_TIMEOUT_S = 30.0     # rung serve's default --shutdown-timeout
_MB = 1 << 20


class _Outcomes:
    """Requests answered, by client kind and status (or exception name)."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def add(self, kind: str, status: int | str) -> None:
        with self._lock:
            self.counts[(kind, status)] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {f"{k}:{s}": n for (k, s), n in sorted(self.counts.items(), key=str)}


def _complete(url: str, prompt: str) -> tuple[int, str]:
    body = json.dumps({"prompt": prompt, "max_tokens": 16, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())["choices"][0]["text"]
    except urllib.error.HTTPError as e:
        e.read()
        return e.code, ""


def _get_json(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def _statuses(result: object) -> list:
    """An attack's answer(s) as a flat list of statuses."""
    if isinstance(result, (tuple, list)):
        return [s for r in result for s in _statuses(r)]
    return [result]


def _hostile(url: str, port: int, stop: threading.Event, out: _Outcomes) -> None:
    attacks = [a for a in _attacks(url, port).values() if a is not None]
    for attack in itertools.cycle(attacks):
        if stop.is_set():
            return
        try:
            for status in _statuses(attack()):
                out.add("hostile", status)
        except (OSError, http.client.HTTPException) as e:   # a connection the server cut
            out.add("hostile", type(e).__name__)


def _never_read(port: int, stop: threading.Event, out: _Outcomes) -> None:
    while not stop.is_set():
        try:
            _non_reading_streams(port, stop)
        except OSError as e:
            out.add("never-read", type(e).__name__)


def _hang_up(url: str, stop: threading.Event, out: _Outcomes) -> None:
    """Open a long stream, read a few chunks, close it."""
    body = json.dumps({"prompt": "Tell me", "max_tokens": 200, "stream": True,
                       "ignore_eos": True, "logprobs": 5}).encode()
    while not stop.is_set():
        req = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                for _ in range(6):      # three events: data lines and blank lines
                    r.readline()
                out.add("hangup", r.status)
        except urllib.error.HTTPError as e:
            out.add("hangup", e.code)
        except (OSError, http.client.HTTPException) as e:
            out.add("hangup", type(e).__name__)


def _victim(url: str, want: dict[str, str], stop: threading.Event, out: _Outcomes,
            latencies: list[float], diffs: list[tuple[str, str]]) -> None:
    for prompt in itertools.cycle(PROMPTS):
        if stop.is_set():
            return
        t = time.perf_counter()
        status, text = _complete(url, prompt)
        latencies.append(time.perf_counter() - t)
        if status == 200 and text != want[prompt]:
            diffs.append((prompt, text))
            status = "mismatch"
        out.add("victim", status)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _engine_pid(server_pid: int) -> int:
    """The server's engine process: its spawned multiprocessing child."""
    for child in _children(server_pid):
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return child
    raise RuntimeError(f"server {server_pid} has no engine process")


def _rss_mb(pid: int) -> tuple[float, float]:
    """(resident MB outside shared memory, resident shared MB). NOTE: the engine's CPU KV
    cache is a shared anonymous map whose pages become resident as blocks are first
    used (rung.kernels.backend.allocate_kv_cache): its growth to the pool's size is not
    a leak, so it is counted apart."""
    with open(f"/proc/{pid}/status") as f:
        kb = dict(re.findall(r"^(VmRSS|RssShmem):\s+(\d+) kB", f.read(), re.M))
    return (int(kb["VmRSS"]) - int(kb["RssShmem"])) / 1024, int(kb["RssShmem"]) / 1024


def _sample(t: float, http_pid: int, engine_pid: int) -> tuple[float, float, float, float]:
    """(s, http MB, engine MB less its KV cache, engine KV cache MB resident)."""
    return (t, _rss_mb(http_pid)[0], *_rss_mb(engine_pid))


def _server_5xx(url: str) -> int:
    """5xx answers the server counted (streams whose client never read included)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return int(sum(float(v) for v in re.findall(
        r'^rung:requests_total\{[^}]*status_code="5\d\d"[^}]*\} (\S+)$', text, re.M)))


def _drain(url: str, timeout_s: float = 120.0) -> dict:
    """Wait until nothing runs, waits or holds a KV block; /health's last answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = _get_json(url + "/health")
        idle = not (health["num_running"] or health["num_waiting"]
                    or health["kv_used_blocks"])
        if idle or time.monotonic() > deadline:
            return health
        time.sleep(0.5)


def _p(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


def soak(args: argparse.Namespace) -> int:
    log = tempfile.NamedTemporaryFile(prefix="rung-soak-", suffix=".log", delete=False)
    proc, url = _start_server(args, log)
    http_pid, engine_pid = proc.pid, _engine_pid(proc.pid)
    print(f"server {http_pid}, engine {engine_pid}, log {log.name}, "
          f"load {os.getloadavg()[0]:.1f}", flush=True)
    try:
        want = {p: _complete(url, p)[1] for p in PROMPTS}
        t = time.perf_counter()
        for p in PROMPTS:
            _complete(url, p)
        alone_ms = (time.perf_counter() - t) / len(PROMPTS) * 1e3
        out, latencies, diffs, stop = _Outcomes(), [], [], threading.Event()
        threads = [threading.Thread(target=f, args=a, daemon=True) for f, a in [
            (_hostile, (url, args.port, stop, out)),
            (_never_read, (args.port, stop, out)),
            (_hang_up, (url, stop, out)), (_hang_up, (url, stop, out)),
            (_victim, (url, want, stop, out, latencies, diffs))]]
        for thread in threads:
            thread.start()
        series = []                     # _sample's
        start = time.monotonic()
        while (elapsed := time.monotonic() - start) < args.soak:
            stop.wait(min(SAMPLE_S, args.soak - elapsed))
            series.append(_sample(time.monotonic() - start, http_pid, engine_pid))
            recent = latencies[-20:] or [float("nan")]
            print(f"{series[-1][0]:6.0f} s  http {series[-1][1]:7.1f} MB  engine "
                  f"{series[-1][2]:7.1f} MB + KV {series[-1][3]:7.1f} MB  victim p50 "
                  f"{statistics.median(recent) * 1e3:5.0f} ms  {out.snapshot()}", flush=True)
        stop.set()
        for thread in threads:
            thread.join(180)
        health = _drain(url)
        after = [_complete(url, p) for p in PROMPTS]
        series.append(_sample(time.monotonic() - start, http_pid, engine_pid))
        num_5xx = _server_5xx(url)
        t = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(SHUTDOWN_TIMEOUT_S + 10)
        exit_s = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    warm = min(60.0, args.soak / 2)
    base = next(s for s in series if s[0] >= warm - 1)
    half = next(s for s in series if s[0] >= args.soak / 2 - 1)
    counts = out.snapshot()
    mismatches = counts.get("victim:mismatch", 0) + sum(
        a != (200, want[p]) for p, a in zip(PROMPTS, after))
    client_5xx = sum(n for k, n in counts.items() if re.search(r":5\d\d$", k))
    with open(log.name) as f:
        tracebacks = f.read().count("Traceback")
    print("\nRSS series (s, http MB, engine MB less KV cache, engine KV cache MB):")
    for row in series:
        print(f"  {row[0]:6.0f}" + "".join(f"  {mb:7.1f}" for mb in row[1:]))
    for i, name in ((1, "http"), (2, "engine less KV cache")):
        print(f"RSS {name}: {base[i]:.1f} MB at {base[0]:.0f} s -> {series[-1][i]:.1f} MB at "
              f"the end ({series[-1][i] - base[i]:+.1f} MB, "
              f"{(series[-1][i] / base[i] - 1) * 100:+.1f}%), max "
              f"{max(s[i] for s in series if s[0] >= base[0]):.1f} MB after warm-up; "
              f"{series[-1][i] - half[i]:+.1f} MB over the last half")
    whole = (health["kv_free_blocks"] == health["kv_total_blocks"]
             and health["kv_used_blocks"] == 0 and health["num_running"] == 0)
    print(f"KV pool whole: {'yes' if whole else 'NO'} ({health})")
    print(f"engine KV cache resident at the end: {series[-1][3]:.1f} MB (its pages, touched "
          f"as blocks are first used, up to the pool's size)")
    print(f"greedy mismatches: {mismatches} of {counts.get('victim:200', 0) + mismatches + 3}")
    for prompt, text in dict(diffs).items():
        print(f"  {prompt!r}: want {want[prompt]!r}, got {text!r}")
    print(f"5xx: {num_5xx} counted by the server, {client_5xx} seen by clients")
    print(f"victim latency: p50 {_p(latencies, 50) * 1e3:.0f} ms, p99 "
          f"{_p(latencies, 99) * 1e3:.0f} ms over {len(latencies)} requests ({alone_ms:.0f} ms "
          f"alone, before the soak)")
    print(f"outcomes: {counts}")
    print(f"SIGTERM: exit status {code} after {exit_s:.1f} s; tracebacks in the log: "
          f"{tracebacks}; load {os.getloadavg()[0]:.1f}")
    ok = whole and not mismatches and not num_5xx and not client_5xx and code == 0
    return 0 if ok else 1
