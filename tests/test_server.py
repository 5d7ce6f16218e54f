"""`rung serve`: the real server in a subprocess on 127.0.0.1, driven by the official openai
client; its greedy text is held to `LLM.generate` on the same preset in this process.

Three servers per module: the main one (tiny-llama, eager, with an engine fault that a
marked prompt triggers, default operator limits), one that trusts request chat templates
with small limits (what a hostile client may try), and a small one with an API key, one
sequence and no queue (401, 503, SIGTERM).
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from rung.runtime import LLM, SamplingParams  # noqa: E402

MODEL = "tiny-llama"
MAX_MODEL_LEN = 256
FAULT_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]      # token ids whose step fails in the main server
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
# the main server: rung's CLI, with ModelRunner.execute failing on batches that hold
# FAULT_PROMPT (an engine failure the server must survive). NOTE: a script file, its patch
# at the top level: the engine's spawned process imports it again as its main module
_SERVE_WITH_FAULT = f"""
import sys
from rung.runtime.worker.model_runner import ModelRunner
_execute = ModelRunner.execute
def execute(self, sched, *args, **kwargs):
    if any(s.request.prompt_token_ids == {FAULT_PROMPT} for s in sched.scheduled):
        raise RuntimeError("injected fault")
    return _execute(self, sched, *args, **kwargs)
ModelRunner.execute = execute
if __name__ == "__main__":
    from rung.cli.main import main
    sys.exit(main(sys.argv[1:]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp_path, *flags: str, fault: bool = False, model: str = MODEL,
                 max_model_len: int = MAX_MODEL_LEN) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        code = ["-m", "rung.cli.main"]
        if fault:
            script = tmp_path / "serve_with_fault.py"
            script.write_text(_SERVE_WITH_FAULT)
            code = [str(script)]
        self.log = open(tmp_path / f"server-{self.port}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, *code, "serve", "--model", model, "--enforce-eager",
             "--max-model-len", str(max_model_len), "--port", str(self.port), *flags],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                self.get("/health")
                return
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    output = self.output()      # NOTE: stop() closes the log
                    self.stop()
                    raise RuntimeError(f"server did not start:\n{output}") from None
                time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as r:
            return r.read().decode()

    def post_raw(self, path: str, data: bytes) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        return self.post_raw(path, json.dumps(body).encode())

    def get_status(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def health_latency_while(self, work) -> tuple[float, object]:
        """The longest /health answer while ``work()`` runs in another thread, and what
        ``work`` returned."""
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(work)
            worst = 0.0
            while not future.done():
                t = time.perf_counter()
                self.get("/health")
                worst = max(worst, time.perf_counter() - t)
                time.sleep(0.02)
            return worst, future.result()

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                             timeout=60)

    def health(self) -> dict:
        return json.loads(self.get("/health"))

    def metric(self, name: str, label: str = "") -> float:
        """The first sample of ``name`` whose labels contain ``label`` (e.g.
        'finished_reason="abort"'); 0 when there is none yet."""
        if label:
            m = re.search(rf"^{re.escape(name)}{{[^}}]*{re.escape(label)}[^}}]*}} (\S+)$",
                          self.get("/metrics"), re.M)
            return 0.0 if m is None else float(m.group(1))
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", self.get("/metrics"), re.M)
        assert m is not None, f"{name} not in /metrics"
        return float(m.group(1))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve"), "--max-num-seqs", "32",
               "--chat-template", _template_file(tmp_path_factory), fault=True)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A server that trusts request templates, with small limits a test can pass."""
    s = Server(tmp_path_factory.mktemp("hostile"), "--trust-request-chat-template",
               "--chat-template-timeout", "1", "--max-request-body-bytes", "100000",
               "--request-body-timeout", "1", "--request-header-timeout", "1",
               "--max-n", "4", "--max-prompts-per-request", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, enforce_eager=True, max_model_len=MAX_MODEL_LEN, max_num_seqs=32)


def _template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return str(path)


def _greedy(llm: LLM, prompts, max_tokens: int = 12, **kw) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def test_completion_streamed_and_not_is_generates_greedy_text_with_usage(server, llm):
    client = server.client()
    want = _greedy(llm, ["The sky is"])[0]
    out = client.completions.create(model=MODEL, prompt="The sky is", **GREEDY)
    assert out.choices[0].text == want
    assert out.choices[0].finish_reason == "length"
    num_prompt = len(llm.get_tokenizer().encode("The sky is"))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens,
            out.usage.total_tokens) == (num_prompt, 12, num_prompt + 12)

    chunks = list(client.completions.create(model=MODEL, prompt="The sky is", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    # streamed, not one piece: a reader that falls behind gets the deltas it missed merged
    # (by design), so 12 tiny-llama tokens may all arrive at once on a loaded machine; a
    # 200-token stream outlasts any such stall
    long = client.completions.create(model=MODEL, prompt="The sky is", stream=True,
                                     temperature=0, max_tokens=200,
                                     extra_body={"ignore_eos": True})
    assert len([c for c in long if c.choices]) > 2
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_renders_the_chat_template_streamed_and_not(server, llm):
    client = server.client()
    messages = [{"role": "user", "content": "Hi there"}]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = llm.chat(messages, params, use_tqdm=False, chat_template=TEMPLATE)[0]
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                         max_tokens=10, extra_body={"ignore_eos": True})
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want.outputs[0].text
    assert out.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages,
                                                 temperature=0, max_tokens=10, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text


def test_n_stop_strings_logprobs_and_seed(server, llm):
    client = server.client()
    full = _greedy(llm, ["Once upon"], max_tokens=16)[0]
    # a stop string of plain characters from the middle of the greedy text
    stop = next(full[i:i + 2] for i in range(2, len(full) - 1)
                if full[i:i + 2].isascii() and full[i:i + 2].isprintable()
                and full[i:i + 2] not in full[:i + 1])
    out = client.completions.create(model=MODEL, prompt="Once upon", temperature=0,
                                    max_tokens=16, stop=[stop], n=2)
    assert [c.index for c in out.choices] == [0, 1]
    want = full[:full.index(stop)]
    assert [c.text for c in out.choices] == [want, want]
    assert [c.finish_reason for c in out.choices] == ["stop", "stop"]
    ref = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=16, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert ref.text == want
    assert out.usage.completion_tokens == 2 * len(ref.token_ids)

    seeded = dict(model=MODEL, prompt="Once upon", temperature=1.0, max_tokens=8, seed=3,
                  n=2, extra_body={"ignore_eos": True})
    a, b = client.completions.create(**seeded), client.completions.create(**seeded)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]

    lp = client.completions.create(model=MODEL, prompt="Once upon", temperature=0,
                                   max_tokens=4, logprobs=2, extra_body={"ignore_eos": True})
    logprobs = lp.choices[0].logprobs
    ref = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=4, logprobs=2,
                                                   ignore_eos=True), use_tqdm=False)
    ref = ref[0].outputs[0]
    assert logprobs.token_logprobs == pytest.approx(
        [lp[t].logprob for t, lp in zip(ref.token_ids, ref.logprobs)], abs=1e-4)
    # greedy: the sampled token is the most likely one
    assert all(abs(max(top.values()) - x) < 1e-6
               for top, x in zip(logprobs.top_logprobs, logprobs.token_logprobs))


def test_bad_requests_get_openai_errors_naming_the_field(server):
    client = server.client()
    too_long = list(range(5, 5 + MAX_MODEL_LEN + 1))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=too_long, max_tokens=1)
    assert e.value.body["param"] == "prompt" and "max_model_len" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                               "content": "Hi"}],
                                       temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", logit_bias={"5": 10})
    assert e.value.body["param"] == "logit_bias"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="Hi")
    assert e.value.body["param"] == "model"
    status, body = server.post_raw("/v1/completions", b'{"model": "tiny-llama", "prompt": ')
    assert status == 400 and "JSON" in body["error"]["message"]


def test_an_engine_failure_answers_500_and_the_server_keeps_serving(server, llm):
    client = server.client()
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt=FAULT_PROMPT, max_tokens=4)
    assert "injected fault" in e.value.body["message"]
    with pytest.raises(openai.APIError, match="injected fault"):
        list(client.completions.create(model=MODEL, prompt=FAULT_PROMPT, max_tokens=4,
                                       stream=True))
    out = client.completions.create(model=MODEL, prompt="The sky is", **GREEDY)
    assert out.choices[0].text == _greedy(llm, ["The sky is"])[0]
    health = server.health()
    assert health["kv_free_blocks"] == health["kv_total_blocks"]


def test_24_concurrent_streams_each_get_generates_greedy_text(server, llm):
    prompts = [f"Request {i}: tell me about {'x' * (i % 5)}" for i in range(24)]
    want = _greedy(llm, prompts)
    client = server.client()

    def stream(prompt: str) -> str:
        chunks = client.completions.create(model=MODEL, prompt=prompt, stream=True, **GREEDY)
        return "".join(c.choices[0].text for c in chunks)

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        got = list(pool.map(stream, prompts))
    assert got == want
    assert server.metric("rung:generation_tokens_total") >= 24 * 12


def test_a_client_that_hangs_up_mid_stream_frees_its_kv_blocks(server):
    client = server.client()
    aborted = server.metric("rung:request_success_total", 'finished_reason="abort"')
    chunks = client.completions.create(model=MODEL, prompt="Tell me a long story",
                                       max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(chunks):
        if i == 3:
            break
    assert server.metric("rung:kv_cache_used_blocks") > 0      # it is still running
    chunks.close()
    deadline = time.monotonic() + 20
    while server.metric("rung:kv_cache_used_blocks") > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    health = server.health()
    assert health["num_running"] == 0 and health["kv_free_blocks"] == health["kv_total_blocks"]
    assert server.metric("rung:kv_cache_free_blocks") == server.metric(
        "rung:kv_cache_total_blocks")
    assert server.metric("rung:request_success_total",       # the hang-up counts as an abort
                         'finished_reason="abort"') == aborted + 1
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    assert out.usage.completion_tokens >= 1


def test_api_key_full_queue_and_sigterm(tmp_path):
    # NOTE: the engine on the server's own thread (--engine-in-process) keeps that path tested
    s = Server(tmp_path, "--api-key", "secret", "--max-num-seqs", "1", "--max-queue", "0",
               "--shutdown-timeout", "0.2", "--engine-in-process")
    try:
        with pytest.raises(openai.AuthenticationError):
            s.client().models.list()
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        client = s.client("secret")
        long = client.completions.create(model=MODEL, prompt="Go on", max_tokens=240,
                                         temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
        first = next(iter(long))                # the one slot is taken
        assert first.choices[0].finish_reason is None
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert e.value.status_code == 503

        s.proc.send_signal(signal.SIGTERM)     # the running stream is cut after 0.2 s
        rest = list(long)
        assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "abort"
        assert s.proc.wait(30) == 0
        assert "cut 1 request(s)" in s.output()
    finally:
        s.stop()


@pytest.mark.slow          # a third engine and a third server: ~20 s quiet, ~45 s busy
def test_bench_serve_runs_both_sides_on_the_same_load(tmp_path):
    out = tmp_path / "serve.json"
    run = subprocess.run([sys.executable, "-m", "rung.cli.main", "bench", "serve", "--model",
                          MODEL, "--enforce-eager", "--streams", "1,2", "--rounds", "1",
                          "--input-len", "8", "--output-len", "4", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    records = json.loads(out.read_text())["records"]
    assert [r["streams"] for r in records] == [1, 2]
    for r in records:
        assert r["generate_num_tokens"] == r["serve_num_tokens"] == 4 * r["streams"]
        assert r["serve_tokens_per_s"] > 0 and r["serve_ttft_ms_p50"] > 0
    assert "2 streams: tokens/s generate" in run.stdout


# --- a hostile client ----------------------------------------------------------------------------
def _refused(server: Server, path: str, body: dict) -> dict:
    status, out = server.post(path, body)
    assert status == 400, (status, out)
    return out["error"]


def _answer(sock: socket.socket) -> bytes:
    """One whole HTTP answer (headers and a Content-Length body) from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
    while len(body) < length:
        body += sock.recv(4096)
    return head + b"\r\n\r\n" + body


def test_operator_limits_refuse_with_a_400_naming_the_field_and_the_limit(server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    cmpl = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    cases = [  # (path, body, param, limit in the message)
        ("/v1/completions", {**cmpl, "n": 129}, "n", "128"),
        ("/v1/completions", {**cmpl, "prompt": ["x"] * 257}, "prompt", "256"),
        ("/v1/completions", {**cmpl, "logprobs": 21}, "logprobs", "20"),
        ("/v1/completions", {**cmpl, "prompt_logprobs": 21}, "prompt_logprobs", "20"),
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 21},
         "top_logprobs", "20"),
        ("/v1/completions", {**cmpl, "stop": [str(i) for i in range(65)]}, "stop", "64"),
        ("/v1/completions", {**cmpl, "stop": "x" * 1025}, "stop", "1024"),
        ("/v1/completions", {**cmpl, "stop_token_ids": [5] * 257}, "stop_token_ids", "256"),
        ("/v1/chat/completions", {**chat, "chat_template": "{{ 'x' }}"}, "chat_template",
         "--trust-request-chat-template"),
    ]
    for path, body, param, limit in cases:
        error = _refused(server, path, body)
        assert error["param"] == param and limit in error["message"], (param, error)
    # the defaults still serve what they allow
    out = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
        logprobs=True, top_logprobs=20, n=2)
    assert len(out.choices) == 2
    assert len(out.choices[0].logprobs.content[0].top_logprobs) == 20


def test_a_body_over_the_limit_or_trickled_is_refused_before_it_is_parsed(hostile):
    error = _refused(hostile, "/v1/completions", {"model": MODEL, "prompt": "x" * 100_001})
    assert "100000" in error["message"]
    # no Content-Length: the limit holds on the bytes as they come
    with socket.create_connection(("127.0.0.1", hostile.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 60_000
        for _ in range(2):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        assert sock.recv(4096).startswith(b"HTTP/1.1 400")
    # a body that never finishes arriving is cut after --request-body-timeout
    with socket.create_connection(("127.0.0.1", hostile.port), timeout=10) as sock:
        t = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        answer = _answer(sock)
        assert answer.startswith(b"HTTP/1.1 400") and b"request-body-timeout" in answer
        assert time.monotonic() - t < 5
    # and a request head that never ends is closed after --request-header-timeout
    with socket.create_connection(("127.0.0.1", hostile.port), timeout=10) as sock:
        t = time.monotonic()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert sock.recv(4096) == b""                  # closed by the server
        assert time.monotonic() - t < 5


def test_a_request_template_that_loops_is_cut_and_the_server_keeps_answering(hostile):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
            "chat_template": "{% for i in range(100000) %}{% for j in range(10000) %}"
                             "{% endfor %}{% endfor %}x"}
    t = time.monotonic()
    worst, (status, out) = hostile.health_latency_while(
        lambda: hostile.post("/v1/chat/completions", body))
    assert status == 400 and out["error"]["param"] == "chat_template", out
    assert "--chat-template-timeout" in out["error"]["message"]
    assert time.monotonic() - t < 10
    assert worst < 0.5, f"/health took {worst:.2f} s while the template ran"
    # a template that fails at run time is the client's error, not the server's
    error = _refused(hostile, "/v1/chat/completions", {**body, "chat_template": "{{ 1/0 }}"})
    assert error["param"] == "chat_template" and "ZeroDivisionError" in error["message"]
    # one C call that builds 4 GB: the renderer's memory cap, not the server's, is hit
    error = _refused(hostile, "/v1/chat/completions",
                     {**body, "chat_template": "{{ 'x' * 4000000000 }}"})
    assert error["param"] == "chat_template" and "Memory" in error["message"]
    # and a trusted template that works renders the request
    out = hostile.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"chat_template": TEMPLATE})
    assert out.usage.prompt_tokens == len("<user>Hi\n<assistant>")


def test_a_large_prompt_is_tokenized_off_the_event_loop(server):
    prompt = "hello world " * 600_000            # 7.2 MB, under the default body limit
    worst, (status, out) = server.health_latency_while(
        lambda: server.post("/v1/completions", {"model": MODEL, "prompt": prompt}))
    assert status == 400 and "max_model_len" in out["error"]["message"]
    assert worst < 0.4, f"/health took {worst:.2f} s while the prompt was tokenized"


def _peak_rss_growth_mb(pid: int, work):
    """How far the process's resident memory peaked above where it stood, while ``work()``
    ran; and what ``work`` returned."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")                # Linux: the peak (VmHWM) starts again from now
    except OSError as e:
        pytest.skip(f"cannot reset the peak RSS: {e}")

    def status() -> dict[str, int]:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(v) for k, v in re.findall(r"^(VmHWM|VmRSS):\s+(\d+) kB", f.read(),
                                                     re.M)}

    before = status()["VmRSS"]
    result = work()
    return (status()["VmHWM"] - before) / 1024, result


def test_a_prompt_far_over_max_model_len_is_refused_before_it_is_all_tokenized(server):
    # 7.2 MB: 7.2M tokens of tiny-llama's byte tokenizer, a 58 MB list of ids when it was
    # all tokenized (smollm2's tokenizer: 1.2M tokens, 15 s, +770 MB peak)
    prompt = "hello world " * 600_000
    grew, (status, out) = _peak_rss_growth_mb(
        server.proc.pid, lambda: server.post("/v1/completions", {"model": MODEL,
                                                                 "prompt": prompt}))
    assert status == 400 and out["error"]["param"] == "prompt"
    assert grew < 40, f"the HTTP process's peak RSS grew {grew:.0f} MB for one prompt"
    assert f"more than {MAX_MODEL_LEN} tokens" in out["error"]["message"]
    # the chat path too, and a prompt at the limit is still counted exactly
    status, out = server.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": prompt}]})
    assert status == 400 and f"more than {MAX_MODEL_LEN} tokens" in out["error"]["message"]
    status, out = server.post("/v1/completions", {"model": MODEL, "prompt": "x" * 1000,
                                                  "max_tokens": 1})
    assert status == 400 and "has 1001 tokens" in out["error"]["message"]


def test_client_mistakes_are_openai_400s_and_404s_not_500s(server):
    chat = {"model": MODEL, "max_tokens": 1}
    raw = [b'{"model": "tiny-llama", "prompt": "\\ud800", "max_tokens": 1}',
           b'{"model": "\\ud800", "prompt": "Hi", "max_tokens": 1}']
    for body in raw:
        status, out = server.post_raw("/v1/completions", body)
        assert status == 400 and "error" in out, out
    status, out = server.post_raw(
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udc00"}], "max_tokens": 1}')
    assert status == 400 and "error" in out, out
    error = _refused(server, "/v1/chat/completions", {**chat, "messages": [
        {"role": "user", "content": [{"type": "text", "text": 5}]}]})
    assert error["param"] == "messages"
    # strict types: nothing is coerced
    assert _refused(server, "/v1/completions", {"prompt": "Hi", "max_tokens": "4"}
                    )["param"] == "max_tokens"
    assert _refused(server, "/v1/completions", {"prompt": [True, False], "max_tokens": 1}
                    )["param"] == "prompt"
    # max_completion_tokens=0 is not ignored in favour of max_tokens
    error = _refused(server, "/v1/chat/completions", {
        **chat, "max_completion_tokens": 0, "messages": [{"role": "user", "content": "Hi"}]})
    assert error["param"] == "max_completion_tokens"
    status, out = server.get_status("/v1/no-such-route")
    assert status == 404 and out["error"]["code"] == 404
    assert server.get_status("/v1/completions")[1]["error"]["code"] == 405


def test_metrics_label_routes_not_raw_paths(server):
    for i in range(5):
        server.get_status(f"/v1/made-up-{i}")
    text = server.get("/metrics")
    assert "made-up" not in text
    assert re.search(r'rung:requests_total\{[^}]*endpoint="unmatched"[^}]*status_code="404"',
                     text)


def test_prompt_logprobs_are_returned_as_vllm_does(server, llm):
    out = server.client().completions.create(model=MODEL, prompt="The sky is", max_tokens=1,
                                             extra_body={"prompt_logprobs": 2})
    got = out.choices[0].model_extra["prompt_logprobs"]
    ref = llm.generate("The sky is", SamplingParams(max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert len(got) == len(ref.prompt_token_ids) and got[0] is None
    for entry, want, token in zip(got[1:], ref.prompt_logprobs[1:], ref.prompt_token_ids[1:]):
        assert str(token) in entry                  # the actual token, plus the top 2
        assert entry[str(token)]["logprob"] == pytest.approx(want[token].logprob, abs=1e-4)


def test_clients_that_do_not_read_neither_hold_shutdown_nor_crash_it(tmp_path):
    s = Server(tmp_path, "--shutdown-timeout", "1")
    body = json.dumps({"prompt": "Go", "max_tokens": 240, "n": 16, "logprobs": 20,
                       "stream": True, "ignore_eos": True, "temperature": 0}).encode()
    socks = []
    try:
        for _ in range(2):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)   # and never read
            sock.connect(("127.0.0.1", s.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            socks.append(sock)
        time.sleep(6)                  # the server's send buffers fill
        t = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 0
        took = time.monotonic() - t       # NOTE: waiting on the stuck sends takes 5 s each
        assert took < 1 + 6, f"shutdown took {took:.1f} s: it waited on clients that do not read"
        assert "Traceback" not in s.output(), s.output()[-3000:]
    finally:
        for sock in socks:
            sock.close()
        s.stop()


def test_a_schema_driven_fuzz_run_finds_no_5xx_and_no_contract_breach(hostile, tmp_path):
    """schemathesis against /openapi.json: bounded, deterministic examples; every check
    but positive_data_acceptance, since a schema-valid request may still be refused for
    what the schema cannot say (its token count against max_model_len)."""
    pytest.importorskip("schemathesis")
    run = subprocess.run(
        [sys.executable, "-m", "schemathesis.cli", "run", hostile.url + "/openapi.json",
         "--max-examples", "20", "--generation-deterministic", "--request-timeout", "60",
         "--checks", "all", "--exclude-checks", "positive_data_acceptance"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)   # it writes a cache
    assert run.returncode == 0, run.stdout[-6000:]
    spec = json.loads(hostile.get("/openapi.json"))
    num_operations = sum(len(methods) for methods in spec["paths"].values())
    assert f"Tested: {num_operations}" in run.stdout       # every operation, none skipped
