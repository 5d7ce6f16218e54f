"""The device sampler and rejection sampler on synthetic logits, held to plain torch
references written here: distributions (chi-square), penalties, min_p, keyed seeds."""

import pytest
import torch

from rung.runtime.sampling_params import SamplingParams
from rung.runtime.sched.request import Request
from rung.runtime.worker.rejection_sampler import num_accepted, rejection_sample_with_probs
from rung.runtime.worker.sampler import (
    Sampler,
    SamplingBatch,
    processed_logits,
    sampling_probs,
    token_logprobs,
)

CPU = torch.device("cpu")
LOGITS = torch.tensor([2.0, 1.5, 0.3, -0.4, 1.0, -2.0])          # vocab 6
CHI2_P001 = {1: 10.8, 2: 13.8, 3: 16.3, 4: 18.5, 5: 20.5}         # chi-square, p = 0.001


class _NoKV:
    advance_at: dict[str, int] = {}

    def advance(self, req: Request) -> None:
        pass


def _req(params: SamplingParams, prompt=(1, 2), output=(), arrival: int = 0) -> Request:
    req = Request("r", None, list(prompt), params, None, arrival)
    if output:                       # through its transitions, as the engine does
        req.take_cached_prefix(0)
        req.start()
        req.commit(list(output), len(prompt), _NoKV())
    return req


def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int = 0,
                     top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """vLLM's definitions, one row, written out plainly."""
    z = logits / temperature
    probs = torch.softmax(z, -1)
    keep = probs >= min_p * probs.max()
    order = torch.argsort(z, descending=True).tolist()
    if top_k:
        for t in order[top_k:]:
            keep[t] = False
    kept = [t for t in order if keep[t]]
    mass = torch.softmax(z[kept], -1)
    total = 0.0
    for i, t in enumerate(kept):
        if total >= top_p:
            keep[t] = False
        total += float(mass[i])
    z = z.masked_fill(~keep, float("-inf"))
    return torch.softmax(z, -1)


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled outside the support: {counts.tolist()}"
    n = counts.sum()
    expected = n * probs[support]
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


@pytest.mark.parametrize("kwargs", [{"temperature": 0.8, "top_p": 0.9},
                                    {"temperature": 1.3, "top_k": 3},
                                    {"temperature": 1.0, "min_p": 0.2},
                                    {"temperature": 0.7, "top_k": 4, "top_p": 0.8}])
def test_sampled_tokens_follow_the_processed_softmax(kwargs):
    """4000 requests (seeds 0..3999) share one batch: their tokens' histogram is the
    softmax after temperature / min_p / top-k / top-p."""
    trials = 4000
    reqs = [_req(SamplingParams(seed=s, **kwargs)) for s in range(trials)]
    batch = SamplingBatch.build(reqs, [[]] * trials, 0, 6, CPU)
    tokens = Sampler()(LOGITS.repeat(trials, 1), batch)
    want = _reference_probs(LOGITS, **kwargs)
    chi2, dof = _chi2(torch.bincount(tokens, minlength=6).float(), want)
    assert chi2 < CHI2_P001[dof], f"chi2 {chi2:.1f} at {dof} dof for {kwargs}"


@pytest.mark.parametrize("drafts", [[1, 1], [0, 2], [4, 0]])
def test_verified_tokens_follow_the_target_at_every_position(drafts):
    """Deterministic drafts, k = 2: the first emitted token and (given the first draft
    was kept) the second follow the target's processed softmax at their positions."""
    trials, params = 4000, {"temperature": 0.9, "top_p": 0.95}
    second = torch.tensor([0.1, 2.0, 1.0, 1.5, -1.0, 0.5])
    logits = torch.stack([LOGITS, second, LOGITS]).repeat(trials, 1)      # [trials * 3, V]
    reqs = [_req(SamplingParams(seed=s, **params)) for s in range(trials)]
    batch = SamplingBatch.build(reqs, [drafts] * trials, 0, 6, CPU)
    tokens = Sampler()(logits, batch)
    accepted = num_accepted(tokens, batch)
    first = tokens[batch.starts]
    chi2, dof = _chi2(torch.bincount(first, minlength=6).float(),
                      _reference_probs(LOGITS, **params))
    assert chi2 < CHI2_P001[dof], f"first token: chi2 {chi2:.1f}"
    kept = accepted >= 1
    assert abs(float(kept.float().mean()) - float(_reference_probs(LOGITS, **params)[
        drafts[0]])) < 0.03
    later = tokens[torch.from_numpy(batch.starts)[kept] + 1]
    chi2, dof = _chi2(torch.bincount(later, minlength=6).float(),
                      _reference_probs(second, **params))
    assert chi2 < CHI2_P001[dof], f"second token: chi2 {chi2:.1f}"


def test_drafts_with_probabilities_keep_the_target_distribution():
    """The classic accept / residual rule for a drafter with q: the first token is p's."""
    trials = 4000
    target = torch.tensor([0.5, 0.1, 0.3, 0.1])
    q = torch.tensor([0.1, 0.6, 0.1, 0.2])
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q, trials * 2, replacement=True, generator=gen).view(trials, 2)
    reqs = [_req(SamplingParams(seed=s, temperature=1.0)) for s in range(trials)]
    batch = SamplingBatch.build(reqs, drafts.tolist(), 0, 4, CPU)
    logits = torch.log(target).repeat(trials * 3, 1)
    probs = sampling_probs(processed_logits(logits, batch), batch)
    tokens, accepted = rejection_sample_with_probs(probs, Sampler()(logits, batch),
                                                   q.repeat(trials, 2, 1), batch)
    chi2, dof = _chi2(torch.bincount(tokens[batch.starts], minlength=4).float(), target)
    assert chi2 < CHI2_P001[dof], f"chi2 {chi2:.1f}"
    assert 0 < float(accepted.float().mean()) < 2


def test_greedy_verification_keeps_the_matching_prefix():
    logits = torch.full((12, 6), -5.0)
    for row, token in enumerate([3, 1, 4, 2] * 3):
        logits[row, token] = 5.0
    reqs = [_req(SamplingParams(temperature=0)) for _ in range(3)]
    batch = SamplingBatch.build(reqs, [[3, 1, 4], [3, 5, 4], [0, 1, 4]], 0, 6, CPU)
    tokens = Sampler()(logits, batch)
    assert num_accepted(tokens, batch).tolist() == [3, 1, 0]
    assert tokens.view(3, 4)[:, 0].tolist() == [3, 3, 3]


def test_a_seeded_row_ignores_its_batch_and_varies_with_position():
    """The same (seed, position) gives the same token alone or among other requests;
    another position or seed gives other tokens."""
    logits = torch.zeros(1, 64)
    params = SamplingParams(seed=11, temperature=1.0)
    alone = Sampler()(logits, SamplingBatch.build([_req(params)], [[]], 0, 64, CPU))
    crowd = [_req(SamplingParams(temperature=1.0), arrival=i) for i in range(5)]
    crowd.insert(3, _req(params))
    batched = Sampler()(logits.repeat(6, 1),
                        SamplingBatch.build(crowd, [[]] * 6, 0, 64, CPU))
    assert int(batched[3]) == int(alone[0])
    later = [_req(params, output=[5] * i) for i in range(1, 9)]
    tokens = Sampler()(logits.repeat(8, 1), SamplingBatch.build(later, [[]] * 8, 0, 64, CPU))
    assert len(set(tokens.tolist() + alone.tolist())) > 4


def _reference_penalties(logits, prompt, output, rep, freq, pres):
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= freq * output.count(t) + pres
    return out


def test_penalties_follow_vllm_definitions():
    """repetition over prompt + output, frequency / presence over output; a row's drafts
    before it count as output; min_tokens masks EOS and stop ids."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 10, generator=gen) * 2
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4,
                            presence_penalty=-0.3, temperature=0)
    prompt, output, drafts = [1, 2, 2, 7], [2, 3, 3], [4, 3]
    req = _req(params, prompt, output)
    plain = _req(SamplingParams(temperature=0, min_tokens=9, stop_token_ids=[6]), prompt)
    plain.eos_token_id = 8
    batch = SamplingBatch.build([req, plain], [drafts, [9]], 0, 10, CPU)
    got = processed_logits(logits, batch)
    for row in range(3):
        want = _reference_penalties(logits[row], prompt, output + drafts[:row], 1.3, 0.4, -0.3)
        torch.testing.assert_close(got[row], want)
    for row in (3, 4):
        want = logits[row].clone()
        want[[6, 8]] = float("-inf")
        torch.testing.assert_close(got[row], want)
    assert Sampler()(logits, batch)[:3].tolist() == got[:3].argmax(-1).tolist()


def test_logprobs_are_the_raw_models_with_rank_and_top():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 12, generator=gen)
    tokens = torch.tensor([5, 0, 11])
    got = token_logprobs(logits, tokens, 3)                          # [3, 2 + 6]
    lp = torch.log_softmax(logits, -1)
    for row, t in enumerate(tokens.tolist()):
        assert got[row, 0] == pytest.approx(float(lp[row, t]))
        assert int(got[row, 1]) == sorted(lp[row].tolist(), reverse=True).index(
            float(lp[row, t])) + 1
        assert got[row, 5:8].long().tolist() == lp[row].topk(3).indices.tolist()


def test_greedy_takes_the_first_of_tied_maxima_as_argmax_does():
    """Greedy's token is torch.argmax's: the first index of a row's maximum, ties included,
    for a Gemma-sized vocabulary."""
    from rung.runtime.worker.sampler import greedy_tokens

    logits = torch.randn(3, 262144, generator=torch.Generator().manual_seed(0))
    logits[0, [7, 90000, 262143]] = 50.0          # a three-way tie: index 7
    logits[1, 262143] = 60.0                      # the last word
    logits[2, 0] = logits[2, 1] = 70.0            # the first word, tied with the second
    assert greedy_tokens(logits).tolist() == [7, 262143, 0]
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
