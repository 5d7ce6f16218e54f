"""Token sampling on the device, batched over every sampled row of a step.

vLLM's order: min_tokens mask -> repetition / frequency / presence penalties -> greedy
argmax | temperature -> min_p -> top-k / top-p -> sample. Logprobs are the raw model's.

Randomness is keyed, not drawn: row r samples the token at sequence position ``pos`` of a
request with key ``key`` (its seed, or the engine's seed and its arrival) by the inverse
CDF of its distribution at ``u = hash(key, pos)`` (`uniforms`). A request's tokens thus
depend on neither its batch nor preemption, chunking or speculation: a draft at ``pos`` is
accepted exactly when the target's own sample there equals it (`rejection_sampler`).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from rung.runtime.sched.request import Request
from rung.runtime.structured import apply_bitmask

_EPS = 1e-5                    # temperature below it: greedy (vLLM's _SAMPLING_EPS)
_MASK64 = (1 << 64) - 1
STREAM_TARGET, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2   # independent uniforms per position


# --- keyed randomness (host, numpy) ---------------------------------------------------------
def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 (wrapping arithmetic): a bijective avalanche."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def request_key(req: Request, engine_seed: int) -> int:
    """The randomness key of a request: its seed, else (engine seed, arrival)."""
    if req.params.seed is not None:
        return req.params.seed & _MASK64
    mixed = _splitmix64(np.array([engine_seed & _MASK64], dtype=np.uint64))
    return int(_splitmix64(mixed ^ np.uint64(req.arrival))[0]) ^ (1 << 63)


def uniforms(keys: np.ndarray, positions: np.ndarray, stream: int = STREAM_TARGET
             ) -> np.ndarray:
    """u in (0, 1) per (key, position, stream), the same whatever else is computed.
    keys [R] uint64, positions [R] int64 -> [R] float64."""
    with np.errstate(over="ignore"):
        x = _splitmix64(_splitmix64(keys ^ np.uint64(stream * 0x632BE59BD9B4E019)) ^
                        positions.astype(np.uint64))
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


# --- what one step samples (built on the host, read on the device) --------------------------
def to_device(device: torch.device, array: np.ndarray) -> torch.Tensor:
    # NOTE: small per-step arrays; non_blocking so a CUDA host never waits on the copy
    return torch.from_numpy(array).to(device, non_blocking=True)


@dataclasses.dataclass
class SamplingBatch:
    """The sampled rows of one step: request j owns rows [starts[j], starts[j] + 1 + k_j),
    its k_j drafts verified at the first k_j of them. Device tensors unless noted.

    NOTE: a batch of ``argmax_only`` requests (greedy, no penalty, no min_tokens) samples
    by argmax alone: everything from ``keys`` on stays None (`Sampler` checks ``argmax``).
    """

    num_rows: int                  # host: sum of 1 + k_j
    row_req: np.ndarray            # host [num_rows] int64: request of each row
    starts: np.ndarray             # host [num_reqs] int64: first row of each request
    num_drafts: int                # k_max: the most drafts any request verifies
    drafts: torch.Tensor           # [num_reqs, k_max] int64, -1 past a request's k_j
    draft_rows: torch.Tensor       # [num_reqs, k_max + 1] int64: row of each position, 0 pads
    num_logprobs: list[int | None]  # host [num_reqs]
    argmax: bool = True            # every row greedy with nothing to process: argmax alone
    keys: np.ndarray | None = None         # host [num_rows] uint64
    positions: np.ndarray | None = None    # host [num_rows] int64: sequence position sampled
    uniform: torch.Tensor | None = None    # [num_rows] fp32, STREAM_TARGET
    greedy: torch.Tensor | None = None     # [num_rows] bool
    temperature: torch.Tensor | None = None    # [num_rows] fp32, 1 on greedy rows
    top_k: torch.Tensor | None = None      # [num_rows] int64, vocab for "all"; None: nobody asks
    top_p: torch.Tensor | None = None      # [num_rows] fp32; None: nobody asks
    min_p: torch.Tensor | None = None      # [num_rows] fp32; None: nobody asks
    banned: tuple[torch.Tensor, torch.Tensor] | None = None   # (rows, token ids): min_tokens
    penalties: Penalties | None = None
    all_greedy: bool = True
    # structured outputs: [num_rows, ceil(vocab / 32)] int32, a row's allowed tokens as set
    # bits (all set on a free row); None when no request in the batch has a grammar
    bitmask: torch.Tensor | None = None

    @classmethod
    def build(cls, reqs: list[Request], drafts: list[list[int]], engine_seed: int,
              vocab_size: int, device: torch.device) -> SamplingBatch:
        """``drafts[j]``: the drafts of request j verified this step ([] when none)."""
        num_drafts = np.array([len(d) for d in drafts], dtype=np.int64)        # [num_reqs]
        per_req = num_drafts + 1
        starts = np.concatenate([[0], np.cumsum(per_req)[:-1]]).astype(np.int64)
        row_req = np.repeat(np.arange(len(reqs)), per_req)                     # [num_rows]
        k_max = int(num_drafts.max(initial=0))
        padded = np.full((len(reqs), k_max), -1, dtype=np.int64)
        for j, d in enumerate(drafts):
            padded[j, :len(d)] = d
        grid = np.arange(k_max + 1)
        rows = np.where(grid <= num_drafts[:, None], starts[:, None] + grid, 0)
        batch = cls(len(row_req), row_req, starts, k_max, to_device(device, padded),
                    to_device(device, rows), [r.params.logprobs for r in reqs])
        if not all(r.argmax_only for r in reqs):         # NOTE: the one check
            _add_sampling(batch, reqs, drafts, engine_seed, vocab_size, device)
        if any(r.grammar is not None for r in reqs):
            batch.bitmask = _bitmask(reqs, drafts, starts, len(row_req), vocab_size, device)
        return batch


def _bitmask(reqs: list[Request], drafts: list[list[int]], starts: np.ndarray,
             num_rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """Each constrained request's allowed tokens at each of its rows, the matcher advanced
    along its drafts (`RequestGrammar.fill_along`): a draft is then accepted exactly when
    the masked target takes it, as without speculation."""
    mask = np.full((num_rows, (vocab_size + 31) // 32), -1, dtype=np.int32)
    for req, start, req_drafts in zip(reqs, starts.tolist(), drafts):
        if req.grammar is not None:
            req.grammar.fill_along(mask, start, req_drafts)
    return to_device(device, mask)


def _add_sampling(batch: SamplingBatch, reqs: list[Request], drafts: list[list[int]],
                  engine_seed: int, vocab_size: int, device: torch.device) -> None:
    """Fill in what sampling, penalties and min_tokens read (a batch not all argmax)."""
    row_req, params = batch.row_req, [r.params for r in reqs]
    within = np.arange(batch.num_rows) - batch.starts[row_req]  # [0, 1, .., k_j] per request
    base = np.array([r.num_tokens for r in reqs], dtype=np.int64)
    batch.positions = base[row_req] + within
    batch.keys = np.array([request_key(r, engine_seed) for r in reqs],
                          dtype=np.uint64)[row_req]
    greedy = np.array([p.temperature < _EPS for p in params])[row_req]
    temps = np.array([p.temperature for p in params], dtype=np.float32)[row_req]
    batch.argmax, batch.all_greedy = False, bool(greedy.all())
    batch.uniform = to_device(device, uniforms(batch.keys, batch.positions).astype(np.float32))
    batch.greedy = to_device(device, greedy)
    batch.temperature = to_device(device, np.where(greedy, 1, temps))
    batch.top_k = _per_row([p.top_k or vocab_size for p in params], np.int64, row_req,
                           device, any(0 < p.top_k < vocab_size for p in params))
    batch.top_p = _per_row([p.top_p for p in params], np.float32, row_req, device,
                           any(p.top_p < 1 for p in params))
    batch.min_p = _per_row([p.min_p for p in params], np.float32, row_req, device,
                           any(p.min_p > 0 for p in params))
    if any(r.processes_logits for r in reqs):         # NOTE: rare: one check
        batch.banned = _banned(reqs, within, row_req, device)
        batch.penalties = Penalties.build(reqs, drafts, within, row_req, vocab_size, device)


def _per_row(values: list, dtype: type, row_req: np.ndarray, device: torch.device,
             needed: bool) -> torch.Tensor | None:
    return to_device(device, np.asarray(values, dtype=dtype)[row_req]) if needed else None


def _banned(reqs: list[Request], within: np.ndarray, row_req: np.ndarray,
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) of EOS / stop tokens on rows below their request's min_tokens."""
    if all(r.num_output_tokens >= r.params.min_tokens for r in reqs):
        return None
    rows, ids = [], []
    for row, (j, offset) in enumerate(zip(row_req.tolist(), within.tolist())):
        req = reqs[j]
        p = req.params
        if req.num_output_tokens + offset >= p.min_tokens:
            continue
        stops = list(p.stop_token_ids)
        if req.eos_token_id is not None and not p.ignore_eos:
            stops.append(req.eos_token_id)
        rows += [row] * len(stops)
        ids += stops
    if not rows:
        return None
    return _index(device, rows, ids)


@dataclasses.dataclass
class Penalties:
    """vLLM's penalties: repetition over prompt and output tokens, frequency and presence
    over output tokens (a row's drafts before it count as output)."""

    repetition: torch.Tensor       # [num_rows, 1] fp32, 1 = off
    frequency: torch.Tensor        # [num_rows, 1] fp32, 0 = off
    presence: torch.Tensor         # [num_rows, 1] fp32, 0 = off
    output_counts: torch.Tensor    # [num_rows, vocab] fp32: occurrences in the output
    seen: torch.Tensor             # [num_rows, vocab] bool: in the prompt or the output

    @classmethod
    def build(cls, reqs: list[Request], drafts: list[list[int]], within: np.ndarray,
              row_req: np.ndarray, vocab_size: int, device: torch.device
              ) -> Penalties | None:
        params = [r.params for r in reqs]
        if all(p.repetition_penalty == 1 and p.frequency_penalty == 0 and
               p.presence_penalty == 0 for p in params):
            return None
        out_rows, out_ids, prompt_rows, prompt_ids = [], [], [], []
        for row, (j, offset) in enumerate(zip(row_req.tolist(), within.tolist())):
            output = reqs[j].output_token_ids + drafts[j][:offset]
            out_rows += [row] * len(output)
            out_ids += output
            if params[j].repetition_penalty != 1:
                prompt_rows += [row] * reqs[j].num_prompt_tokens
                prompt_ids += reqs[j].prompt_token_ids
        num_rows = len(row_req)
        counts = torch.zeros(num_rows, vocab_size, device=device)
        counts.index_put_(_index(device, out_rows, out_ids),
                          torch.ones(len(out_ids), device=device), accumulate=True)
        seen = counts > 0
        seen[_index(device, prompt_rows, prompt_ids)] = True

        def column(values: list[float]) -> torch.Tensor:
            return to_device(device, np.asarray(values, dtype=np.float32)[row_req][:, None])

        return cls(column([p.repetition_penalty for p in params]),
                   column([p.frequency_penalty for p in params]),
                   column([p.presence_penalty for p in params]), counts, seen)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [num_rows, vocab] fp32 -> penalised logits (a new tensor)."""
        scaled = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
        logits = torch.where(self.seen, scaled, logits)
        return logits - self.frequency * self.output_counts - self.presence * (
            self.output_counts > 0)


def _index(device: torch.device, rows: list[int], ids: list[int]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    return (to_device(device, np.asarray(rows, dtype=np.int64)),
            to_device(device, np.asarray(ids, dtype=np.int64)))


# --- the sampler (device) -------------------------------------------------------------------
def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """min_tokens mask and penalties: what greedy takes the argmax of. [R, V] fp32."""
    logits = logits.float()
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, logits.new_full((), float("-inf")))
    if batch.penalties is not None:
        logits = batch.penalties.apply(logits)
    return logits


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Probabilities after temperature, min_p, top-k and top-p. logits [R, V] processed."""
    logits = logits / batch.temperature.unsqueeze(1)
    if batch.min_p is not None:
        probs = torch.softmax(logits, dim=-1)
        floor = batch.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    if batch.top_k is not None or batch.top_p is not None:
        logits = _top_k_top_p(logits, batch.top_k, batch.top_p)
    return torch.softmax(logits, dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                 top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's top_k tokens, then the smallest prefix holding top_p of their mass."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)    # [R, V]
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    drop = (ranks >= top_k.unsqueeze(1) if top_k is not None
            else torch.zeros_like(sorted_logits, dtype=torch.bool))
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs                       # mass strictly before
        drop |= before >= top_p.unsqueeze(1)                        # NOTE: rank 0 always kept
    masked = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, masked)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token at which each row's CDF (vocabulary order) first reaches u * total.
    probs [R, V], u [R] in (0, 1) -> [R] int64; a token of probability 0 is never taken."""
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[1] - 1)


@dataclasses.dataclass
class SamplerOutput:
    """What the sampler made of one step's logits, still on the device."""

    batch: SamplingBatch
    tokens: torch.Tensor                 # [num_rows] int64, the target's token per row
    logprobs: torch.Tensor | None        # [num_rows, 2 + 2 * num_top] (`token_logprobs`)
    # when a request asked for logprobs, else None


class Sampler:
    """Every sampled row's target token, on the logits' device, in one batched pass."""

    def sample(self, logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]],
               engine_seed: int, vocab_size: int, device: torch.device) -> SamplerOutput:
        """The sampling batch of ``reqs`` (``drafts[j]``: request j's drafts to verify),
        its tokens, and their logprobs where a request asked. logits [num_rows, V]."""
        batch = SamplingBatch.build(reqs, drafts, engine_seed, vocab_size, device)
        tokens = self(logits, batch)                              # [num_rows] int64
        num_top = max((n for n in batch.num_logprobs if n is not None), default=None)
        lps = token_logprobs(logits, tokens, num_top) if num_top is not None else None
        return SamplerOutput(batch, tokens, lps)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [R, V] -> tokens [R] int64 (row r: the target's sample at its position)."""
        if batch.bitmask is not None:
            logits = apply_bitmask(logits, batch.bitmask)
        if batch.argmax:
            return greedy_tokens(logits)
        logits = processed_logits(logits, batch)
        tokens = greedy_tokens(logits)
        if batch.all_greedy:
            return tokens
        sampled = inverse_cdf(sampling_probs(logits, batch), batch.uniform)
        return torch.where(batch.greedy, tokens, sampled)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits [R, V] -> each row's first index of its maximum [R] int64: argmax's answer.
    NOTE: max, not argmax: torch's CPU argmax is a scalar loop, several times max's time
    over a large vocabulary (docs/performance.md, "Greedy's argmax on CPU")."""
    return logits.max(dim=-1).indices


# --- logprobs (device) ----------------------------------------------------------------------
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: int) -> torch.Tensor:
    """Raw-model logprob and rank of each row's token, then its top ``num_top``.
    logits [R, V], tokens [R] -> [R, 2 + 2 * num_top] fp32: lp, rank, top lps, top ids."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.unsqueeze(1))                          # [R, 1]
    rank = (lp > chosen).sum(dim=-1, keepdim=True) + 1
    top_vals, top_ids = lp.topk(num_top, dim=-1)
    return torch.cat([chosen, rank.float(), top_vals, top_ids.float()], dim=1)
