"""Structured outputs through `rung serve` on SmolLM2-135M (a real tokenizer), driven by the
official openai client: OpenAI's ``response_format`` (json_schema, json_object) and vLLM's
``structured_outputs`` extra body (json, regex, choice, grammar) on both endpoints, greedy
and sampled, n=2 and streamed; bad specs are 400s naming the field."""

from __future__ import annotations

import concurrent.futures
import json
import re

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("fastapi")

from test_server import Server  # noqa: E402

MODEL = "smollm2-135m"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "object",
                            "properties": {"sku": {"type": "string", "maxLength": 6},
                                           "qty": {"type": "integer", "minimum": 1,
                                                   "maximum": 9}},
                            "required": ["sku", "qty"], "additionalProperties": False}},
        "paid": {"type": "boolean"},
    },
    "required": ["id", "items", "paid"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 16},
        "location": {"type": "object",
                     "properties": {"country": {"type": "string", "maxLength": 12},
                                    "continent": {"enum": ["Europe", "Asia", "Africa",
                                                           "America", "Oceania"]}},
                     "required": ["country", "continent"], "additionalProperties": False},
    },
    "required": ["city", "location"],
    "additionalProperties": False,
}
SCHEMAS = [("person", PERSON, "Describe a user of a web site as JSON."),
           ("order", ORDER, "Write a shop order as JSON."),
           ("city", CITY, "Name a big city and where it is, as JSON.")]
MAX_TOKENS = 90


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("structured"), "--max-num-seqs", "16",
               model=MODEL, max_model_len=512)
    yield s
    s.stop()


def _chat(client, content: str, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS,
        **kw)


def test_20_json_schema_chats_greedy_and_sampled_validate(server):
    client = server.client()
    jobs = []
    for i in range(20):
        name, schema, ask = SCHEMAS[i % len(SCHEMAS)]
        sampling = {"temperature": 0} if i < 10 else {"temperature": 0.8, "seed": i}
        jobs.append((schema, ask, sampling, name))
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda job: _chat(
            client, job[1], response_format={"type": "json_schema", "json_schema": {
                "name": job[3], "schema": job[0], "strict": True}}, **job[2]), jobs))
    for (schema, *_), answer in zip(jobs, answers):
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_n2_and_streamed(server):
    client = server.client()
    answer = _chat(client, "Give me a small JSON object with a cat's name and age.",
                   temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(answer.choices[0].message.content), dict)
    answer = _chat(client, SCHEMAS[0][2], n=2, temperature=0.9, seed=3,
                   response_format={"type": "json_schema", "json_schema": {
                       "name": "person", "schema": PERSON}})
    assert len(answer.choices) == 2
    for choice in answer.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = _chat(client, SCHEMAS[0][2], stream=True, temperature=0,
                   extra_body={"structured_outputs": {"json": PERSON}})
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) > 2
    jsonschema.validate(json.loads("".join(pieces)), PERSON)


def test_completions_regex_choice_and_grammar(server):
    client = server.client()
    regex = r"[0-9]{3}-[0-9]{4}"
    got = client.completions.create(model=MODEL, prompt="Phone number: ", max_tokens=20,
                                     temperature=0,
                                     extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, got.choices[0].text), got.choices[0].text
    got = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:",
                                     max_tokens=10, n=2, temperature=1.0, seed=1,
                                     extra_body={"structured_outputs": {
                                         "choice": ["yes", "no", "maybe"]}})
    assert {c.text for c in got.choices} <= {"yes", "no", "maybe"}
    answer = _chat(client, "What is 2+3?", temperature=0, extra_body={
        "structured_outputs": {"grammar": 'start: "The answer is " NUM "."\nNUM: /[0-9]+/'}})
    assert re.fullmatch(r"The answer is [0-9]+\.", answer.choices[0].message.content)


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "x"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_bad_specs_are_400s_naming_the_field(server, body, param):
    status, answer = server.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer


def test_tokenize_and_detokenize_as_vllm_shapes_them(server):
    status, got = server.post("/tokenize", {"model": MODEL, "prompt": "Hello world"})
    assert status == 200 and got["count"] == len(got["tokens"]) > 1
    assert got["max_model_len"] == 512 and got["token_strs"] is None
    status, back = server.post("/detokenize", {"model": MODEL, "tokens": got["tokens"]})
    assert status == 200 and back["prompt"].strip() == "Hello world"
    status, chat = server.post("/tokenize", {"messages": [{"role": "user", "content": "Hi"}],
                                             "return_token_strs": True})
    assert status == 200 and chat["count"] > got["count"]
    assert "".join(chat["token_strs"]).count("Hi") == 1
    status, err = server.post("/detokenize", {"tokens": [10 ** 9]})
    assert status == 400 and err["error"]["param"] == "tokens"
    status, err = server.post("/tokenize", {})
    assert status == 400


def test_echo_with_logprobs_and_max_tokens_0_gives_the_prompts_logprobs(server):
    """lm-evaluation-harness's local-completions loglikelihood request: the echoed prompt's
    token logprobs are the engine's own prompt logprobs for those tokens (the embedded
    API's ``prompt_logprobs``, the same weights in the same process kind)."""
    from rung import LLM, SamplingParams

    client = server.client()
    prompt = "The capital of France is"
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3,
                                       temperature=0, logprobs=1)
    full = prompt + greedy.choices[0].text
    got = client.completions.create(model=MODEL, prompt=full, max_tokens=0, echo=True,
                                    logprobs=1, temperature=0)
    (c,) = got.choices
    assert c.text == full
    lps = c.logprobs
    assert lps.token_logprobs[0] is None and all(
        isinstance(x, float) for x in lps.token_logprobs[1:])
    # NOTE: not compared with the logprobs the greedy decode gave these tokens: a quantized
    # model (smollm2's default) rounds its activations to int8, so the prefill's and the
    # decode's attention, equal to float rounding, can round an activation apart (0.04 nats
    # here); the oracle is the engine scoring the same prompt
    llm = LLM(MODEL, enforce_eager=True, max_model_len=512)
    ids = llm.get_tokenizer().encode(full)
    (ref,) = llm.generate([{"prompt_token_ids": ids}],
                          SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert len(lps.token_logprobs) == len(ids)
    for pos, (have, top) in enumerate(zip(lps.token_logprobs[1:], lps.top_logprobs[1:]), 1):
        want = ref.prompt_logprobs[pos]
        assert abs(want[ids[pos]].logprob - have) < 1e-4
        assert abs(max(top.values()) - max(lp.logprob for lp in want.values())) < 1e-4
    assert got.usage.completion_tokens == 0
    assert got.usage.prompt_tokens == len(lps.tokens)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, echo=True,
                                       temperature=0)
    assert echoed.choices[0].text.startswith(prompt)
    assert len(echoed.choices[0].text) > len(prompt)


def test_usage_reports_prefix_cache_hits_as_cached_tokens(server):
    client = server.client()
    prompt = "A long shared system prompt about the history of tea. " * 6
    first = client.completions.create(model=MODEL, prompt=prompt + "One", max_tokens=2,
                                      temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt + "Two", max_tokens=2,
                                       temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens and cached % 16 == 0
    stream = client.completions.create(model=MODEL, prompt=prompt + "Three", max_tokens=2,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    last = [chunk for chunk in stream][-1]
    assert last.usage.prompt_tokens_details.cached_tokens == cached


WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]


def test_tool_choice_required_and_named_give_tool_calls_that_validate(server):
    client = server.client()
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    got = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS,
                                         tool_choice="required", max_tokens=60,
                                         temperature=0)
    (c,) = got.choices
    assert c.finish_reason == "tool_calls"
    (call,) = c.message.tool_calls
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    got = client.chat.completions.create(
        model=MODEL, messages=ask, tools=TOOLS, max_tokens=60, temperature=0.8, seed=2, n=2,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    for c in got.choices:
        assert c.message.tool_calls[0].function.name == "get_time"
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), TIME)
    # the call goes back into the conversation with the tool's answer
    follow = ask + [{"role": "assistant", "content": None,
                     "tool_calls": [c.message.tool_calls[0].model_dump()]},
                    {"role": "tool", "tool_call_id": c.message.tool_calls[0].id,
                     "content": "12:00"}]
    got = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS,
                                         tool_choice="none", max_tokens=8, temperature=0)
    assert got.choices[0].message.tool_calls is None


def test_streamed_tool_call_arrives_in_the_last_delta(server):
    stream = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60, temperature=0, stream=True)
    chunks = [c for c in stream if c.choices]
    calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_bad_tool_requests_are_400s(server):
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for body, param in [({"tools": TOOLS, "tool_choice": {"type": "function",
                                                          "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tools": [{"type": "function"}]}, "tools"),
                        ({"tool_choice": "required"}, "tool_choice")]:
        status, answer = server.post("/v1/chat/completions", {**base, **body})
        assert status == 400 and answer["error"]["param"] == param, (body, answer)


def test_auto_reads_tool_call_blocks():
    from rung.server.tools import parse, plan

    auto = plan(TOOLS, None)
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Oslo", "unit": "celsius"}}\n</tool_call>')
    content, calls = parse(auto, text)
    assert content == "Let me check."
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "celsius"}
    assert parse(auto, "Just text.") == ("Just text.", [])


def test_under_ngram_speculation_json_and_tool_calls_validate(tmp_path):
    """A server drafting with n-gram lookup: constrained answers still validate, and the
    greedy JSON is the one the non-speculative server gives (drafts are checked against
    the grammar, so speculation changes no token).

    NOTE: both servers run the fp32 model (--quantization none): the quantized default
    rounds activations to int8, so a verify row's attention (several query tokens) and a
    decode row's (one), equal to float rounding, can round an activation apart and flip a
    near-tie; token identity across the two paths is a property of the fp32 model."""
    fp32 = ("--quantization", "none", "--max-num-seqs", "4")
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}
    spec = Server(tmp_path, *fp32, "--speculative-method", "ngram",
                  "--num-speculative-tokens", "3", model=MODEL, max_model_len=512)
    try:
        client = spec.client()
        got = _chat(client, SCHEMAS[1][2], temperature=0, response_format=fmt)
        jsonschema.validate(json.loads(got.choices[0].message.content), ORDER)
        call = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0)
        (tool_call,) = call.choices[0].message.tool_calls
        schema = {"get_weather": WEATHER, "get_time": TIME}[tool_call.function.name]
        jsonschema.validate(json.loads(tool_call.function.arguments), schema)
    finally:
        spec.stop()
    plain = Server(tmp_path, *fp32, model=MODEL, max_model_len=512)
    try:
        want = _chat(plain.client(), SCHEMAS[1][2], temperature=0, response_format=fmt)
    finally:
        plain.stop()
    assert got.choices[0].message.content == want.choices[0].message.content
