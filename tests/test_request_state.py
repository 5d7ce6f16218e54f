"""One writer for a request's state: its transitions (runtime/sched/request.py) are the only code
in runtime/ that assigns or mutates its tokens, computed count or drafts. (Its status is
written there alone too, but other objects in runtime/ have a ``status`` of their own.)"""

import ast
import pathlib

import pytest

from rung.runtime.sampling_params import SamplingParams
from rung.runtime.sched.request import Request, RequestStatus

RUNTIME = pathlib.Path(__file__).resolve().parents[1] / "runtime"
OWNER = RUNTIME / "sched" / "request.py"
# NOTE: num_tokens is a count of token_ids written in commit too, but other objects in
# runtime/ have a num_tokens of their own (as with status)
OWNED = {"token_ids", "num_computed_tokens", "spec_token_ids", "num_output_tokens",
         "is_finished"}
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"}


def _owned_attribute(node: ast.AST) -> str | None:
    """The owned attribute ``node`` writes through: ``x.attr``, ``x.attr[i]``."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute) and node.attr in OWNED:
        return node.attr
    return None


def writes_outside_the_owner(source: str) -> list[tuple[int, str]]:
    """(line, attribute) of every write to an owned attribute in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in MUTATORS):
            targets = [node.func.value]
        for target in targets:
            for part in (target.elts if isinstance(target, ast.Tuple) else [target]):
                attr = _owned_attribute(part)
                if attr is not None:
                    found.append((node.lineno, attr))
    return found


def test_only_the_request_writes_its_tokens_computed_count_and_drafts():
    offenders = [f"{path.relative_to(RUNTIME.parent)}:{line}: {attr}"
                 for path in sorted(RUNTIME.rglob("*.py")) if path != OWNER
                 for line, attr in writes_outside_the_owner(path.read_text())]
    assert not offenders, ("write these through Request's transitions (runtime/sched/request.py):\n"
                           + "\n".join(offenders))


def test_the_scan_sees_every_kind_of_write():
    source = ("req.token_ids.append(1)\nreq.num_computed_tokens += 1\n"
              "r.spec_token_ids = []\nreq.token_ids[0:1] = [2]\na.token_ids, b = [], 2\n"
              "del req.spec_token_ids[0]\n")
    assert [attr for _, attr in sorted(writes_outside_the_owner(source))] == [
        "token_ids", "num_computed_tokens", "spec_token_ids", "token_ids", "token_ids",
        "spec_token_ids"]


class _KV:
    """Records what the request looked like when the KV cache was told to advance."""

    advance_at: dict[str, int] = {}     # no threshold: told at every commit

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def advance(self, req: Request) -> None:
        self.seen.append((req.num_tokens, req.num_computed_tokens))


def _running(prompt_len: int = 4) -> Request:
    req = Request("r", None, list(range(10, 10 + prompt_len)), SamplingParams(), None, 0)
    req.take_cached_prefix(0)
    req.start()
    return req


def test_commit_puts_tokens_in_before_the_kv_cache_sees_them():
    req, kv = _running(), _KV()
    req.commit([7], 4, kv, lambda token: None)           # prefill: 4 computed, 1 sampled
    req.set_drafts([8, 9, 10])
    num_kept, reason = req.commit([8, 9, 3], 3, kv, lambda token: None)   # 2 accepted + bonus
    assert (num_kept, reason) == (3, None)
    assert kv.seen == [(5, 4), (8, 7)]                   # computed <= tokens at every advance
    assert req.spec_token_ids == [] and req.output_token_ids == [7, 8, 9, 3]


def test_commit_stops_at_the_token_that_ends_the_request():
    req, kv = _running(), _KV()
    req.commit([7], 4, kv, lambda token: None)
    num_kept, reason = req.commit([8, 9, 3], 3, kv, lambda t: "stop" if t == 8 else None)
    assert (num_kept, reason) == (1, "stop")
    assert req.output_token_ids == [7, 8] and req.num_computed_tokens == req.num_tokens
    assert (req.num_tokens, req.num_output_tokens) == (len(req.token_ids), 2)


def test_transitions_refuse_a_request_in_the_wrong_state():
    req = Request("r", None, [1, 2], SamplingParams(), None, 0)
    with pytest.raises(RuntimeError, match="'r' is waiting; .*running"):
        req.commit([3], 2, _KV(), lambda token: None)
    req.start()
    req.preempt()
    assert (req.status, req.num_computed_tokens, req.num_preemptions) == (
        RequestStatus.PREEMPTED, 0, 1)
    with pytest.raises(RuntimeError, match="preempted"):
        req.set_drafts([1])
