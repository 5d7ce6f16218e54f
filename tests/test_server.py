"""`rung serve`: the real server in a subprocess on 127.0.0.1, driven by the official openai
client; its greedy text is held to `LLM.generate` on the same preset in this process.

Two servers per module: the main one (tiny-llama, eager, with an engine fault that a
marked prompt triggers) and a small one with an API key, one sequence and no queue (401,
503, SIGTERM).
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
# FAULT_PROMPT (an engine failure the server must survive)
_SERVE_WITH_FAULT = f"""
import sys
from rung.runtime.worker.model_runner import ModelRunner
_execute = ModelRunner.execute
def execute(self, sched, *args, **kwargs):
    if any(s.request.prompt_token_ids == {FAULT_PROMPT} for s in sched.scheduled):
        raise RuntimeError("injected fault")
    return _execute(self, sched, *args, **kwargs)
ModelRunner.execute = execute
from rung.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp_path, *flags: str, fault: bool = False) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        code = ["-c", _SERVE_WITH_FAULT] if fault else ["-m", "rung.cli.main"]
        self.log = open(tmp_path / f"server-{self.port}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, *code, "serve", "--model", MODEL, "--enforce-eager",
             "--max-model-len", str(MAX_MODEL_LEN), "--port", str(self.port), *flags],
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
                    self.stop()
                    raise RuntimeError(f"server did not start:\n{self.output()}") from None
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

    def client(self, api_key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                             timeout=60)

    def health(self) -> dict:
        return json.loads(self.get("/health"))

    def metric(self, name: str) -> float:
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
    assert len([c for c in chunks if c.choices]) > 2          # streamed, not one piece
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
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
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3)
    assert out.usage.completion_tokens >= 1


def test_api_key_full_queue_and_sigterm(tmp_path):
    s = Server(tmp_path, "--api-key", "secret", "--max-num-seqs", "1", "--max-queue", "0",
               "--shutdown-timeout", "0.2")
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
