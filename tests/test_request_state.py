"""One writer for a request's state: its transitions (runtime/sched/request.py) are the only code
in rung that assigns or mutates a field of a Request, output fields included; every field is
listed here with the methods that write it, and a new field or a new writer fails the test
until it is listed."""

import ast
import pathlib

import pytest

from rung.runtime.outputs import Logprob
from rung.runtime.sampling_params import RequestOutputKind, SamplingParams
from rung.runtime.sched.request import Request, RequestStatus

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ("core", "kernels", "models", "graphs", "runtime", "bench", "server", "cli")
OWNER = ROOT / "runtime" / "sched" / "request.py"
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse",
            "update", "setdefault"}
# every field of a Request -> the methods that write it (besides __init__); () = fixed
FIELDS: dict[str, set[str]] = {
    "request_id": set(), "prompt": set(), "prompt_token_ids": set(),
    "num_prompt_tokens": set(), "params": set(), "processes_logits": set(),
    "argmax_only": set(), "eos_token_id": set(), "arrival": set(), "max_model_len": set(),
    "decode_token": set(), "detokenizer": set(),
    "token_ids": {"commit"}, "num_tokens": {"commit"}, "num_output_tokens": {"commit"},
    "num_computed_tokens": {"take_cached_prefix", "commit", "preempt"},
    "spec_token_ids": {"commit", "set_drafts", "drop_drafts", "preempt", "finish"},
    "block_hashes": {"hash_blocks"},
    "status": {"start", "preempt", "finish"},
    "is_finished": {"finish"}, "finish_reason": {"finish"}, "error": {"finish"},
    "stop_reason": {"_stop_reason", "_hits_stop_string"},
    "logprobs": {"commit"}, "cumulative_logprob": {"commit"},
    "prompt_logprobs": {"add_prompt_logprobs"},
    "num_sent_tokens": {"mark_sent"}, "num_sent_chars": {"mark_sent"},
    "num_preemptions": {"preempt"}, "num_cached_tokens": {"start"},
    "grammar": {"constrain"},
}


def _written(node: ast.AST) -> list[ast.expr]:
    """The expressions ``node`` assigns, deletes or mutates in place."""
    if isinstance(node, (ast.Assign, ast.Delete)):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr in MUTATORS):
        targets = [node.func.value]
    else:
        return []
    found = []
    for target in targets:
        for part in (target.elts if isinstance(target, ast.Tuple) else [target]):
            while isinstance(part, ast.Subscript):          # x.attr[i] writes x.attr
                part = part.value
            found.append(part)
    return found


def _other_classes_attributes() -> set[str]:
    """Attribute names some other class of the library has too (``status``, ``error``...)."""
    names = set()
    for path in _library_files():
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef) or path == OWNER:
                continue
            for node in ast.walk(cls):
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)              # a dataclass field
                for part in _written(node):
                    if isinstance(part, ast.Attribute) and _is_name(part.value, "self"):
                        names.add(part.attr)
    return names


def _is_name(node: ast.AST, *names: str) -> bool:
    return isinstance(node, ast.Name) and node.id in names


def _looks_like_a_request(node: ast.AST) -> bool:
    """``req``, ``request``, ``x_req``, ``s.request``, ``reqs[i]``, ``self.requests[i]``."""
    if isinstance(node, ast.Name):
        return node.id in ("req", "request") or node.id.endswith("_req")
    if isinstance(node, ast.Attribute):
        return node.attr == "request"
    if isinstance(node, ast.Subscript):
        seq = node.value
        name = seq.id if isinstance(seq, ast.Name) else getattr(seq, "attr", "")
        return name in ("reqs", "requests")
    return False


def request_writes(source: str, shared: set[str]) -> list[tuple[int, str]]:
    """(line, field) of every write to a Request field in ``source``: any write to a field
    no other class has, and a write to a shared field through something named a request."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for part in _written(node):
            if (isinstance(part, ast.Attribute) and part.attr in FIELDS
                    and not _is_name(part.value, "self")
                    and (part.attr not in shared or _looks_like_a_request(part.value))):
                found.append((node.lineno, part.attr))
    return found


def _library_files() -> list[pathlib.Path]:
    return [path for package in LIBRARY for path in sorted((ROOT / package).rglob("*.py"))]


def test_only_the_request_writes_its_fields():
    shared = _other_classes_attributes()
    offenders = [f"{path.relative_to(ROOT)}:{line}: {attr}"
                 for path in _library_files() if path != OWNER
                 for line, attr in request_writes(path.read_text(), shared)]
    assert not offenders, ("write these through Request's transitions (runtime/sched/request.py):\n"
                           + "\n".join(offenders))


def test_the_scan_sees_every_kind_of_write():
    source = ("req.token_ids.append(1)\nreq.num_computed_tokens += 1\n"
              "r.spec_token_ids = []\nreq.token_ids[0:1] = [2]\na.token_ids, b = [], 2\n"
              "del req.spec_token_ids[0]\nreq.logprobs.append({})\n"
              "s.request.stop_reason = 3\nreqs[0].error = 'x'\nout.error = 'y'\n"
              "req.cumulative_logprob += 1.0\nself.num_sent_chars = 2\n")
    assert [attr for _, attr in sorted(request_writes(source, {"error", "stop_reason"}))] == [
        "token_ids", "num_computed_tokens", "spec_token_ids", "token_ids", "token_ids",
        "spec_token_ids", "logprobs", "stop_reason", "error", "cumulative_logprob"]


def test_every_field_is_listed_with_its_writers():
    req = Request("r", None, [1, 2], SamplingParams(logprobs=1, prompt_logprobs=1), None, 0)
    fields = {name for name in Request.__slots__ if hasattr(req, name)}
    assert fields == set(Request.__slots__), "every field is set at construction"
    assert fields == set(FIELDS), "list a new Request field in FIELDS, with its writers"
    writers: dict[str, set[str]] = {name: set() for name in fields}
    cls = next(node for node in ast.parse(OWNER.read_text()).body
               if isinstance(node, ast.ClassDef) and node.name == "Request")
    for method in cls.body:
        if not isinstance(method, ast.FunctionDef) or method.name == "__init__":
            continue
        for node in ast.walk(method):
            for part in _written(node):
                if isinstance(part, ast.Attribute) and _is_name(part.value, "self"):
                    writers.setdefault(part.attr, set()).add(method.name)
    assert writers == FIELDS


class _KV:
    """Records what the request looked like when the KV cache was told to advance."""

    advance_at: dict[str, int] = {}     # no threshold: told at every commit

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def advance(self, req: Request) -> None:
        self.seen.append((req.num_tokens, req.num_computed_tokens))


def _running(prompt_len: int = 4, tokenizer=None, max_model_len: int | None = None,
             **params) -> Request:
    req = Request("r", None, list(range(10, 10 + prompt_len)), SamplingParams(**params), None,
                  0, tokenizer, max_model_len)
    req.take_cached_prefix(0)
    req.start()
    return req


def test_commit_puts_tokens_in_before_the_kv_cache_sees_them():
    req, kv = _running(), _KV()
    req.commit([7], 4, kv)                               # prefill: 4 computed, 1 sampled
    req.set_drafts([8, 9, 10])
    num_kept, reason = req.commit([8, 9, 3], 3, kv)     # 2 accepted + bonus
    assert (num_kept, reason) == (3, None)
    assert kv.seen == [(5, 4), (8, 7)]                   # computed <= tokens at every advance
    assert req.spec_token_ids == [] and req.output_token_ids == [7, 8, 9, 3]


def test_commit_stops_at_the_token_that_ends_the_request():
    req, kv = _running(stop_token_ids=[8]), _KV()
    req.commit([7], 4, kv)
    num_kept, reason = req.commit([8, 9, 3], 3, kv)
    assert (num_kept, reason, req.stop_reason) == (1, "stop", 8)
    assert req.output_token_ids == [7, 8] and req.num_computed_tokens == req.num_tokens
    assert (req.num_tokens, req.num_output_tokens) == (len(req.token_ids), 2)


def test_transitions_refuse_a_request_in_the_wrong_state():
    req = Request("r", None, [1, 2], SamplingParams(), None, 0)
    with pytest.raises(RuntimeError, match="'r' is waiting; .*running"):
        req.commit([3], 2, _KV())
    req.start()
    req.preempt()
    assert (req.status, req.num_computed_tokens, req.num_preemptions) == (
        RequestStatus.PREEMPTED, 0, 1)
    with pytest.raises(RuntimeError, match="preempted"):
        req.set_drafts([1])


class _Tokenizer:
    def decode(self, ids: list[int], **kwargs) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def _entry(token: int, logprob: float) -> dict[int, Logprob]:
    return {token: Logprob(logprob, 1)}


def test_commit_records_the_logprobs_of_the_tokens_it_keeps_decoded():
    req = _running(tokenizer=_Tokenizer(), logprobs=0, stop_token_ids=[8])
    req.commit([7, 8, 9], 4, _KV(), [_entry(7, -0.5), _entry(8, -0.25), _entry(9, -2.0)])
    assert req.output_token_ids == [7, 8]
    assert req.logprobs == [{7: Logprob(-0.5, 1, "h")}, {8: Logprob(-0.25, 1, "i")}]
    assert req.cumulative_logprob == -0.75


def test_a_request_without_logprobs_keeps_none():
    req = _running()
    req.commit([7], 4, _KV(), [_entry(7, -0.5)])
    assert (req.logprobs, req.cumulative_logprob) == (None, 0.0)


def test_a_stop_string_ends_the_request_and_cuts_the_text():
    req = _running(tokenizer=_Tokenizer(), stop=["ij"])
    num_kept, reason = req.commit([7, 8, 9, 10], 4, _KV())     # "h", "i", "j", "k"
    assert (num_kept, reason, req.stop_reason) == (3, "stop", "ij")
    assert req.detokenizer.text_at(req.num_output_tokens, True) == "h"


def test_length_limits_end_the_request():
    assert _running(max_tokens=2).commit([7, 8, 9], 4, _KV()) == (2, "length")
    req = _running(max_model_len=6, max_tokens=None)
    assert req.commit([7, 8, 9], 4, _KV()) == (2, "length")
    assert req.num_tokens == 6 and req.stop_reason is None


def test_finish_keeps_the_first_reason_and_the_error():
    req = _running()
    req.finish("error", "it never fits")
    assert (req.status, req.is_finished, req.finish_reason, req.error) == (
        RequestStatus.FINISHED, True, "error", "it never fits")
    req.finish("abort")
    assert req.finish_reason == "error"


def test_prompt_logprobs_add_only_positions_not_yet_seen():
    req = _running(prompt_logprobs=0)
    req.add_prompt_logprobs(1, [_entry(11, -1.0), _entry(12, -2.0)])
    req.add_prompt_logprobs(1, [_entry(11, -9.0), _entry(12, -9.0), _entry(13, -3.0)])
    assert req.prompt_logprobs == [None, _entry(11, -1.0), _entry(12, -2.0), _entry(13, -3.0)]


def test_a_delta_stream_records_what_it_sent():
    req = _running(output_kind=RequestOutputKind.DELTA)
    req.mark_sent(3, 5)
    assert (req.num_sent_tokens, req.num_sent_chars) == (3, 5)


def test_block_hashes_are_computed_once_each():
    req, calls = _running(prompt_len=8), []

    def hash_block(parent, ids):
        calls.append(ids)
        return bytes([len(calls)])

    assert req.hash_blocks(1, 4, hash_block) == [b"\x01"]
    assert req.hash_blocks(2, 4, hash_block) == [b"\x01", b"\x02"]
    assert calls == [[10, 11, 12, 13], [14, 15, 16, 17]]


def test_only_a_waiting_request_takes_a_grammar():
    req = Request("r", None, [1, 2], SamplingParams(), None, 0)
    req.constrain(None)
    req.start()
    with pytest.raises(RuntimeError, match="running"):
        req.constrain(None)
