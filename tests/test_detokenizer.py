"""Incremental detokenization and stop strings: streamed text never holds a broken character,
grows by deltas that add up to the full decode, and stop strings cost a short decode per token
(not a decode of the whole output)."""

import random

import pytest

from rung.models.tokenizer import ByteTokenizer
from rung.runtime import LLM, RequestOutputKind, SamplingParams
from rung.runtime.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, find_stop_string

MULTILINGUAL = ["héllo wörld, ça va?", "日本語のテキストです。", "emoji 🙂🚀 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
                "Ελληνικά, русский, العربية", "mixed: a€b£c¥d 中 🙂 z"]


def _stream(tokenizer, output_ids: list[int], prompt_ids=(1,)) -> tuple[list[str], str]:
    """Feed ``output_ids`` one at a time: (the text after each token, the final text)."""
    token_ids = list(prompt_ids)
    detok = IncrementalDetokenizer(tokenizer.decode, token_ids, len(prompt_ids))
    texts = []
    for i, token in enumerate(output_ids):
        token_ids.append(token)
        detok.update(i + 1)
        texts.append(detok.text)
    return texts, detok.finish()


def _check_stream(tokenizer, output_ids: list[int], whole_characters: bool) -> None:
    texts, final = _stream(tokenizer, output_ids)
    assert final == tokenizer.decode(output_ids)
    for text in texts:
        assert final.startswith(text)
        if whole_characters:
            assert REPLACEMENT_CHAR not in text


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_byte_tokenizer_streams_whole_characters(text):
    tok = ByteTokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    texts, final = _stream(tok, ids)
    assert final == text
    assert all(REPLACEMENT_CHAR not in t for t in texts)
    # a 4-byte character shows up only once its last byte arrived
    if "🙂" in text:
        first = text.index("🙂")
        num_bytes = len(text[:first].encode()) + 4
        assert texts[num_bytes - 2] == text[:first] and texts[num_bytes - 1].endswith("🙂")


def test_byte_tokenizer_invalid_bytes_end_as_full_decode():
    tok = ByteTokenizer()
    rng = random.Random(0)
    for _ in range(50):
        ids = [3 + rng.randrange(256) for _ in range(rng.randrange(1, 40))]
        _check_stream(tok, ids, whole_characters=False)


@pytest.fixture(scope="module")
def smol_tokenizer():
    from rung.models.loader import peek_model

    try:
        return peek_model("smollm2-135m")[1]
    except ValueError as e:
        pytest.skip(f"SmolLM2 GGUF not installed ({e})")


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_smollm2_byte_level_bpe_streams_whole_characters(smol_tokenizer, text):
    ids = smol_tokenizer.encode(text, add_special_tokens=False)
    assert smol_tokenizer.decode(ids) == text
    _check_stream(smol_tokenizer, ids, whole_characters=True)


def test_smollm2_random_ids_end_as_full_decode(smol_tokenizer):
    rng = random.Random(1)
    vocab = smol_tokenizer.vocab_size
    for _ in range(30):      # random pieces, special tokens among them
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        _check_stream(smol_tokenizer, ids, whole_characters=False)


def test_find_stop_string_searches_only_where_new_text_can_complete_one():
    # "END" straddles the old text and the 2 new characters
    assert find_stop_string("abcEN" + "D!", 2, ["END"], False) == ("END", 3)
    assert find_stop_string("abcEN" + "D!", 2, ["END"], True) == ("END", 6)
    # an occurrence wholly in the old text is not this token's: it was seen before
    assert find_stop_string("END..." + "xy", 2, ["END"], False) is None
    # the earliest occurrence wins, whatever the list order
    assert find_stop_string("..." + "b;a;", 4, ["a;", "b;"], False) == ("b;", 3)
    assert find_stop_string("abc", 0, ["c"], False) is None


def test_stop_buffer_holds_back_what_may_start_a_stop_string():
    tok = ByteTokenizer()
    token_ids = [1]
    detok = IncrementalDetokenizer(tok.decode, token_ids, 1, stop_buffer_length=2)
    for i, token in enumerate(tok.encode("hello", add_special_tokens=False)):
        token_ids.append(token)
        detok.update(i + 1)
    assert detok.text == "hello" and detok.streamed_text() == "hel"
    assert detok.text_at(5, final=True) == "hello"


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", enforce_eager=True, max_num_seqs=4, max_model_len=128)


class _CountingTokenizer:
    """A tokenizer that counts the token ids it is asked to decode."""

    def __init__(self, inner):
        self.inner, self.num_decoded = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def decode(self, token_ids):
        self.num_decoded += len(token_ids)
        return self.inner.decode(token_ids)


def test_stop_strings_do_not_redecode_the_whole_output(llm, monkeypatch):
    counting = _CountingTokenizer(llm.engine.tokenizer)
    monkeypatch.setattr(llm.engine, "tokenizer", counting)
    num_tokens = 100
    out = llm.generate("Once upon", SamplingParams(temperature=0, max_tokens=num_tokens,
                                                   ignore_eos=True, stop="\x00never"),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == num_tokens
    assert out.text == llm.engine.tokenizer.inner.decode(out.token_ids)
    # a decode of the whole output per token would be num_tokens^2 / 2 = 5000 ids
    assert counting.num_decoded < 8 * num_tokens


def _step_all(engine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_cumulative_stream_grows_to_the_full_decode(llm):
    engine = llm.engine
    engine.add_request("c", "Hi", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    outs = _step_all(engine)
    final = outs[-1].outputs[0]
    assert outs[-1].finished and final.text == engine.tokenizer.decode(final.token_ids)
    for out in outs:
        assert final.text.startswith(out.outputs[0].text)
    # an output read after later steps still holds its own step's text
    assert outs[3].outputs[0].text == _stream(engine.tokenizer, final.token_ids[:4])[0][-1]


@pytest.mark.parametrize("include", [False, True])
def test_delta_stream_adds_up_and_never_shows_a_hidden_stop_string(llm, include):
    engine = llm.engine
    free = llm.generate("Once", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop = next((free.text[i:i + 3] for i in range(6, len(free.text) - 2)
                 if REPLACEMENT_CHAR not in free.text[i:i + 3]), None)
    if stop is None:
        pytest.skip("greedy output holds no 3 whole characters")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop,
                            include_stop_str_in_output=include,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("d", "Once", params)
    outs = _step_all(engine)
    end = free.text.index(stop) + (len(stop) if include else 0)
    assert "".join(o.outputs[0].text for o in outs) == free.text[:end]
    ids = sum((o.outputs[0].token_ids for o in outs), [])
    assert ids == free.token_ids[:len(ids)] and len(ids) < 40
    assert outs[-1].finished and outs[-1].outputs[0].stop_reason == stop
    assert [o.finished for o in outs].count(True) == 1


def test_final_only_reports_once(llm):
    engine = llm.engine
    engine.add_request("f", "Hi", SamplingParams(max_tokens=5, ignore_eos=True,
                                                 output_kind=RequestOutputKind.FINAL_ONLY))
    outs = _step_all(engine)
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 5


def test_delta_stream_of_n_samples(llm):
    engine = llm.engine
    engine.add_request("p", "Hi", SamplingParams(n=2, max_tokens=6, seed=3, ignore_eos=True,
                                                 output_kind=RequestOutputKind.DELTA))
    outs = _step_all(engine)
    assert {o.request_id for o in outs} == {"p"}
    for index in (0, 1):
        ids = sum((c.token_ids for o in outs for c in o.outputs if c.index == index), [])
        assert len(ids) == 6
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    assert not engine.requests


def test_outputs_gathered_across_ranks_carry_their_text(llm):
    import pickle

    from rung.runtime.api.llm import _with_text

    out = llm.generate("Hi", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0]
    copy = pickle.loads(pickle.dumps(_with_text(out)))
    assert copy.text == out.text and copy.token_ids == out.token_ids


@pytest.mark.slow      # loading the GGUF takes most of it
def test_smollm2_streams_deltas_that_add_up_to_the_full_decode(smol_tokenizer):
    llm = LLM("smollm2-135m", dtype="float32", device="cpu", enforce_eager=True,
              max_model_len=128, max_num_seqs=2)
    engine, tok = llm.engine, llm.get_tokenizer()
    prompt = "Translate to Japanese and French: good morning, my friend."
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=24,
                                                   output_kind=RequestOutputKind.DELTA))
    outs = _step_all(engine)
    ids = sum((o.outputs[0].token_ids for o in outs), [])
    deltas = [o.outputs[0].text for o in outs]
    assert "".join(deltas) == tok.decode(ids) and len(ids) > 4
    assert all(REPLACEMENT_CHAR not in d for d in deltas[:-1])


class _KV:
    advance_at: dict = {}        # no threshold: told at every commit

    def advance(self, req) -> None:
        pass


@pytest.mark.parametrize("kwargs, text", [
    ({}, "HI"),
    ({"skip_special_tokens": False}, "H </s> I"),
    ({"skip_special_tokens": False, "spaces_between_special_tokens": False}, "H</s>I")])
def test_special_tokens_in_the_text_follow_the_sampling_params(kwargs, text):
    from rung.runtime.sched.request import Request

    req = Request("r", None, [1], SamplingParams(**kwargs), None, 0, ByteTokenizer())
    req.start()
    req.commit([ord("H") + 3, 2, ord("I") + 3], 1, _KV())
    assert req.detokenizer.text_at(req.num_output_tokens, True) == text
