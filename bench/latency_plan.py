"""What `rung bench latency` measures: its flags, the plan they make, and the engine flags
of each mode's cell.

NOTE: no torch at the top: the CLI builds its parser from ``add_latency_args`` /
``add_prefix_args`` on every command, `rung --help` included.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.util

from rung.core.graph_mode import CUDAGraphMode

# --modes name -> cudagraph_mode policy (None: enforce_eager).
# NOTE: "full" is FULL_DECODE_ONLY: decode steps replay exactly the FULL graph that
# FULL_AND_PIECEWISE would, while prefill runs eagerly as under "none", so the full column
# differs from "none" by the decode graph alone and its capture cost is FULL graphs only
# (the piecewise column reports piecewise capture separately).
MODE_POLICIES: dict[str, str | None] = {"none": None, "piecewise": "piecewise",
                                        "full": "full_decode_only"}
BASELINES = ("none", "hf", "llama.cpp")


@dataclasses.dataclass
class LatencyPlan:
    num_reqs_list: list[int]          # sorted, distinct: the --batch-sizes
    modes: list[str]                  # --modes labels, in order
    input_len: int
    output_len: int
    iters: int
    warmup_iters: int
    baseline: str
    prefill_len: int = 0              # one prompt's prefill timed per round (0: none)

    @property
    def max_num_reqs(self) -> int:
        return self.num_reqs_list[-1]

    @property
    def max_len(self) -> int:
        """The longest sequence a round runs: a decode round's or the prefill prompt's."""
        return max(self.input_len + self.output_len, self.prefill_len + 1)

    def prompts(self, num_reqs: int, vocab_size: int) -> list[list[int]]:
        """The same random prompts for rung and HF, for a given request count."""
        import torch

        gen = torch.Generator().manual_seed(1000 + num_reqs)
        ids = torch.randint(3, vocab_size, (num_reqs, self.input_len), generator=gen)
        return ids.tolist()

    def prefill_prompt(self, vocab_size: int) -> list[int]:
        """The same random ``prefill_len``-token prompt for rung and the baseline."""
        import torch

        gen = torch.Generator().manual_seed(2000 + self.prefill_len)
        return torch.randint(3, vocab_size, (self.prefill_len,), generator=gen).tolist()


# --- arguments ---------------------------------------------------------------------------
def add_latency_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64",
                   help="comma-separated request counts, one decode batch each")
    p.add_argument("--modes", default="none,piecewise,full",
                   help="comma-separated: none, piecewise, full (= full_decode_only), "
                        "or any cudagraph mode name")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    p.add_argument("--prefill-len", type=int, default=512,
                   help="also time the prefill of one prompt this long (to its first "
                        "token) per round, rung and the baseline; 0 skips it")
    p.add_argument("--iters", type=int, default=3,
                   help="measured rounds per cell (each gives output-len - 1 decode steps)")
    p.add_argument("--warmup-iters", type=int, default=1, help="untimed rounds per cell")
    p.add_argument("--baseline", default="none", choices=BASELINES,
                   help="also time HF transformers generate on the same weights, or "
                        "llama.cpp (pip install 'rung[llamacpp]') on the same GGUF file")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's own)")
    p.add_argument("--json", default=None, help="write env + one record per cell here")
    p.add_argument("--plot", default=None, help="draw latency vs requests to this image")
    # NOTE: None = sized from the run: max_num_seqs from the largest batch, max_model_len
    # from input + output (a FULL graph's attention reads max_model_len keys).
    p.set_defaults(max_num_seqs=None, max_model_len=None)


def add_prefix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shared-prefix", type=int, default=None, metavar="TOKENS",
                   help="instead of decode latency: requests sharing a system prompt of "
                        "this many tokens; reports TTFT with and without prefix caching")
    p.add_argument("--prefix-requests", type=int, default=32,
                   help="requests per round of the shared-prefix workload")
    p.add_argument("--suffix-len", type=int, default=8,
                   help="tokens of each request's own after the shared prefix")


def _positive_ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    bad = [v for v in values if v < 1]
    if not values or bad:
        raise ValueError(f"{flag} must be positive integers, got {text!r}")
    return sorted(set(values))


def _modes(text: str) -> list[str]:
    labels = [m.strip().lower() for m in text.split(",") if m.strip()]
    if not labels or len(set(labels)) != len(labels):
        raise ValueError(f"--modes must be distinct mode names, got {text!r}")
    for label in labels:
        if label not in MODE_POLICIES:
            CUDAGraphMode.parse(label)     # ValueError naming every valid mode
    return labels


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def make_plan(args: argparse.Namespace) -> LatencyPlan:
    """Validate the arguments; every error a user can cause is a ValueError."""
    require(not args.enforce_eager and not args.mode,
             "rung bench latency takes --modes (e.g. none,full), not --mode / --enforce-eager")
    require(args.input_len >= 1, f"--input-len must be >= 1, got {args.input_len}")
    require(args.output_len >= 2, f"--output-len must be >= 2 (one decode step), "
             f"got {args.output_len}")
    require(args.iters >= 1, f"--iters must be >= 1, got {args.iters}")
    require(args.prefill_len >= 0, f"--prefill-len must be >= 0, got {args.prefill_len}")
    require(args.warmup_iters >= 0, f"--warmup-iters must be >= 0, got {args.warmup_iters}")
    require(args.threads is None or args.threads >= 1, f"--threads must be >= 1, "
             f"got {args.threads}")
    plan = LatencyPlan(_positive_ints(args.batch_sizes, "--batch-sizes"), _modes(args.modes),
                       args.input_len, args.output_len, args.iters, args.warmup_iters,
                       args.baseline, args.prefill_len)
    require(args.max_num_seqs is None or args.max_num_seqs >= plan.max_num_reqs,
             f"--max-num-seqs {args.max_num_seqs} is below the largest batch size "
             f"{plan.max_num_reqs}")
    need = plan.max_len
    require(args.max_model_len is None or args.max_model_len >= need,
             f"--max-model-len {args.max_model_len} is below input + output (or the "
             f"prefill prompt + 1) = {need}")
    require(args.max_num_batched_tokens is None
            or args.max_num_batched_tokens >= plan.prefill_len,
            f"--max-num-batched-tokens {args.max_num_batched_tokens} is below "
            f"--prefill-len {plan.prefill_len} (the prefill is timed as one step)")
    require(not args.plot or importlib.util.find_spec("matplotlib") is not None,
             "--plot needs matplotlib: pip install 'rung[plot]'")
    return plan


def engine_namespace(args: argparse.Namespace, plan: LatencyPlan,
                      label: str) -> argparse.Namespace:
    ns = copy.copy(args)
    policy = MODE_POLICIES.get(label, label)
    ns.enforce_eager = policy is None or CUDAGraphMode.parse(policy) == CUDAGraphMode.NONE
    ns.mode = None if ns.enforce_eager else policy
    ns.max_num_seqs = args.max_num_seqs or plan.max_num_reqs
    if args.max_model_len is None:
        need = plan.max_len
        ns.max_model_len = -(-need // args.block_size) * args.block_size
    return ns
