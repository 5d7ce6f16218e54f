"""Train the `tiny-gemma4-mtp` drafter by self-distillation on `tiny-gemma4`.

    python -m rung.bench.train_mtp [--out models/weights/tiny-gemma4-mtp] [--steps 600]

The target writes its own training data: prompts of random tokens, continued by the target
itself (greedy, and sampled at temperature 1 for variety), then one dense pass over every
sequence gives, per position, the target's hidden state, its greedy next token and the K/V
of the two layers the drafter reads. The drafter then learns to predict the target's greedy
tokens the way the runtime drafts (`MtpProposer`): at position p, round 1 reads the last
token x_p and the target's hidden state h_{p-1}; round r > 1 reads round r-1's token and
projected hidden state, still at position p; every round attends to the target's K/V of
positions < p. Rounds are teacher-forced with the target's greedy tokens, which is exactly
the path on which a draft is accepted, and a round counts only where the sequence really is
the target's greedy chain. The result is saved in HF's names (`model.safetensors`), the form
`load_model` reads for the preset; evaluation runs the real engine and reports acceptance.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
from torch import nn

from rung.kernels.attention import Attention
from rung.kernels.backend import AttentionLayerSpec
from rung.kernels.torch_backend import visible_keys
from rung.models.layers import STACKED_PARAMS, init_random_weights
from rung.models.loader import DRAFT_WEIGHT_SEED, WEIGHT_SEED, WEIGHTS_DIR
from rung.models.presets import PRESETS
from rung.models.registry import model_class

TARGET, DRAFTER = "tiny-gemma4", "tiny-gemma4-mtp"
DEFAULT_OUT = os.path.join(WEIGHTS_DIR, DRAFTER)


# --- dense attention for whole sequences ---------------------------------------------------
@dataclasses.dataclass
class SequenceBatch:
    """What dense attention needs besides q/k/v: the batch shape and the target's K/V."""

    num_seqs: int
    seq_len: int
    kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)


class DenseAttention(nn.Module):
    """Attention over whole sequences with the reference backend's mask, differentiable.

    A query whose last visible key is at index ``last`` sees keys ``last - window < j <= last``
    (no window: all ``j <= last``). Target layers: ``last = p`` over their own K/V, which they
    also record; draft layers: ``last = p - 1`` over the K/V their target layer recorded.
    """

    def __init__(self, attn: Attention, batch: SequenceBatch) -> None:
        super().__init__()
        self.spec: AttentionLayerSpec = attn.spec
        self.layer_name, self.source = attn.layer_name, attn.kv_sharing_target
        self.batch = batch

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query [B*T, heads*hd], key/value [B*T, kv_heads*hd] -> [B*T, heads*hd]."""
        s, b = self.spec, self.batch
        q = query.view(b.num_seqs, b.seq_len, s.num_heads, s.head_dim)
        if self.source is None:
            k = key.view(b.num_seqs, b.seq_len, s.num_kv_heads, s.head_dim)
            v = value.view(b.num_seqs, b.seq_len, s.num_kv_heads, s.head_dim)
            b.kv[self.layer_name] = (k, v)
            shift = 0
        else:
            k, v = b.kv[self.source]
            shift = 1
        last = torch.arange(b.seq_len, device=query.device) - shift          # [T]
        mask = visible_keys(last + 1, last, b.seq_len, s)                       # [T, T]
        group = s.num_heads // s.num_kv_heads
        k, v = (t.repeat_interleave(group, dim=2).transpose(1, 2) for t in (k, v))  # [B,H,T,hd]
        scores = q.transpose(1, 2) @ k.transpose(-1, -2) * s.scale                  # [B,H,T,T]
        scores = scores.masked_fill(~mask, float("-inf"))
        # NOTE: a draft query at p = 0 sees no key; its row is all -inf, zeroed here and
        # never counted in the loss.
        probs = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(q.dtype)
        out = (probs @ v).transpose(1, 2)                                           # [B,T,H,hd]
        return out.reshape(b.num_seqs * b.seq_len, s.num_heads * s.head_dim)


def use_dense_attention(model: nn.Module, batch: SequenceBatch) -> None:
    """Swap every paged Attention of ``model`` for DenseAttention over ``batch``."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Attention):
                setattr(module, name, DenseAttention(child, batch))
            elif isinstance(child, DenseAttention):
                child.batch = batch


# --- models ---------------------------------------------------------------------------------
def build(preset: str, seed: int) -> nn.Module:
    cfg = dict(PRESETS[preset])
    cls = model_class(cfg)
    model = cls(getattr(cls, "text_config", lambda c: c)(cfg))
    init_random_weights(model, seed)
    return model


# --- data -----------------------------------------------------------------------------------
def make_sequences(num_seqs: int, seq_len: int, temperature: float, seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random-token prompts (1..seq_len/3 tokens) continued by the target
    -> (sequences [N, T] int64, prompt lengths [N])."""
    from rung.runtime import LLM, SamplingParams

    gen = torch.Generator().manual_seed(seed)
    vocab = PRESETS[TARGET]["vocab_size"]
    lens = torch.randint(1, seq_len // 3 + 1, (num_seqs,), generator=gen).tolist()
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (n,), generator=gen).tolist()}
               for n in lens]
    params = [SamplingParams(temperature=temperature, max_tokens=seq_len - n, ignore_eos=True,
                             seed=seed + i) for i, n in enumerate(lens)]
    llm = LLM(TARGET, enforce_eager=True, max_model_len=seq_len + 8, max_num_seqs=64,
              enable_prefix_caching=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    sequences = torch.tensor([p["prompt_token_ids"] + o.outputs[0].token_ids
                              for p, o in zip(prompts, outs)])
    return sequences, torch.tensor(lens)


@dataclasses.dataclass
class TargetPass:
    hidden: torch.Tensor       # [N, T, backbone] the target's last hidden state per position
    greedy: torch.Tensor       # [N, T] int64, the target's greedy token after each position
    kv: dict[str, tuple[torch.Tensor, torch.Tensor]]   # layer -> K, V [N, T, kv_heads, hd]


@torch.no_grad()
def run_target(target: nn.Module, sequences: torch.Tensor, chunk: int = 64) -> TargetPass:
    parts = []
    for start in range(0, len(sequences), chunk):
        ids = sequences[start:start + chunk]
        batch = SequenceBatch(*ids.shape)
        use_dense_attention(target, batch)
        positions = torch.arange(ids.shape[1]).repeat(ids.shape[0])
        hidden = target(ids.reshape(-1), positions)                            # [B*T, H]
        greedy = target.compute_logits(hidden).argmax(-1)
        parts.append((hidden.view(*ids.shape, -1), greedy.view(ids.shape), batch.kv))
    kv = {name: tuple(torch.cat([p[2][name][i] for p in parts]) for i in range(2))
          for name in parts[0][2]}
    return TargetPass(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), kv)


# --- loss -----------------------------------------------------------------------------------
def round_targets(sequences: torch.Tensor, greedy: torch.Tensor, num_rounds: int
                  ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per round r (1-based): (input ids, label, counted) each [N, T], for queries at p.

    label = greedy[p + r - 1]; round r > 1 reads greedy[p + r - 2]. A round counts where
    p >= 1, p + r - 1 < T and x[j] == greedy[j - 1] for p < j < p + r: the drafts before it
    are the target's own tokens, as on the accepted path.
    """
    num_seqs, seq_len = sequences.shape
    on_chain = torch.zeros_like(sequences, dtype=torch.bool)               # x[j] == g[j-1]
    on_chain[:, 1:] = sequences[:, 1:] == greedy[:, :-1]
    p = torch.arange(seq_len)
    counted = (p >= 1).expand(num_seqs, seq_len).clone()
    out = []
    for r in range(1, num_rounds + 1):
        label = _shift(greedy, r - 1)
        inputs = sequences if r == 1 else _shift(greedy, r - 2)
        counted = counted & (p + r - 1 < seq_len)
        if r > 1:
            counted = counted & _shift(on_chain, r - 1)
        out.append((inputs, label, counted.clone()))
    return out


def _shift(t: torch.Tensor, by: int) -> torch.Tensor:
    """t[:, p + by] at column p (the last columns repeat the final value; never counted)."""
    if by == 0:
        return t
    return torch.cat([t[:, by:], t[:, -1:].expand(-1, by)], dim=1)


def draft_loss(drafter: nn.Module, data: TargetPass, sequences: torch.Tensor,
               rows: torch.Tensor, num_rounds: int) -> tuple[torch.Tensor, list[float]]:
    """Mean cross-entropy over counted rounds; per-round accuracy on the counted rows."""
    seqs = sequences[rows]
    num_seqs, seq_len = seqs.shape
    batch = SequenceBatch(num_seqs, seq_len,
                          {name: (k[rows], v[rows]) for name, (k, v) in data.kv.items()})
    use_dense_attention(drafter, batch)
    positions = torch.arange(seq_len).repeat(num_seqs)
    hidden = _shift_right(data.hidden[rows]).reshape(num_seqs * seq_len, -1)  # h[p-1] at p
    total, count, accuracy = 0.0, 0, []
    for inputs, label, counted in round_targets(seqs, data.greedy[rows], num_rounds):
        last, hidden = drafter(inputs.reshape(-1), hidden, positions)
        logits = drafter.compute_logits(last)                                 # [B*T, V]
        keep = counted.reshape(-1)
        losses = nn.functional.cross_entropy(logits[keep], label.reshape(-1)[keep],
                                             reduction="sum")
        total, count = total + losses, count + int(keep.sum())
        hits = logits[keep].argmax(-1) == label.reshape(-1)[keep]
        accuracy.append(hits.float().mean().item() if keep.any() else float("nan"))
    return total / max(count, 1), accuracy


def _shift_right(t: torch.Tensor) -> torch.Tensor:
    """[N, T, H] -> row p holds t[p - 1] (row 0: zeros, never counted)."""
    return torch.cat([torch.zeros_like(t[:, :1]), t[:, :-1]], dim=1)


# --- save -----------------------------------------------------------------------------------
def hf_state_dict(drafter: nn.Module) -> dict[str, torch.Tensor]:
    """rung's parameters under HF's names: fused q/k/v and gate/up split into their shards,
    a tied lm_head left out (HF ties it on load)."""
    out = {}
    for name, param in drafter.state_dict().items():
        if name == "lm_head.weight" and drafter.tied:
            continue
        module_name, _, leaf = name.rpartition(".")
        module = drafter.get_submodule(module_name) if module_name else drafter
        shards = getattr(module, "shard_sizes", None)
        if shards is None:
            out[name] = param.detach().clone().contiguous()
            continue
        parent, _, fused = module_name.rpartition(".")
        names = [hf for fused_name, hf, _ in STACKED_PARAMS if fused_name == fused][:len(shards)]
        for hf_name, part in zip(names, param.split(shards, dim=0)):
            out[f"{parent}.{hf_name}.{leaf}"] = part.detach().clone().contiguous()
    return out


def save(drafter: nn.Module, folder: str) -> str:
    """``folder``/model.safetensors and the preset's config.json: an HF-style folder."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(PRESETS[DRAFTER], f, indent=2)
    path = os.path.join(folder, "model.safetensors")
    save_file(hf_state_dict(drafter), path, metadata={"format": "pt"})
    return path


# --- evaluation -----------------------------------------------------------------------------
def evaluate(folder: str, num_prompts: int, max_tokens: int, num_rounds: int, seed: int) -> dict:
    """Acceptance of the saved drafter in the real engine (eager), on held-out prompts."""
    from rung.runtime import LLM, SamplingParams

    gen = torch.Generator().manual_seed(seed)
    vocab = PRESETS[TARGET]["vocab_size"]
    prompts = [{"prompt_token_ids": torch.randint(3, vocab, (int(n),), generator=gen).tolist()}
               for n in torch.randint(1, 40, (num_prompts,), generator=gen)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    spec = {"method": "mtp", "model": folder, "num_speculative_tokens": num_rounds}
    llm = LLM(TARGET, enforce_eager=True, max_model_len=256, speculative_config=spec)
    llm.generate(prompts, params, use_tqdm=False)
    return llm.engine.stats()["spec"]


def _agreement(sequences: torch.Tensor, prompt_lens: torch.Tensor,
               greedy: torch.Tensor) -> float:
    """Share of generated tokens the dense pass predicts too: checks the training forward."""
    p = torch.arange(sequences.shape[1])
    generated = p[None, 1:] >= prompt_lens[:, None]                     # token x[j], j >= len
    same = sequences[:, 1:] == greedy[:, :-1]
    return same[generated].float().mean().item()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for model.safetensors")
    p.add_argument("--num-greedy", type=int, default=1024, help="greedy training sequences")
    p.add_argument("--num-sampled", type=int, default=256,
                   help="temperature-1 training sequences")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--rounds", type=int, default=3, help="draft rounds trained (k)")
    p.add_argument("--seed", type=int, default=0)
    # NOTE: one thread: the tensors are small, and on a shared machine more threads wait on
    # each other.
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    start = time.perf_counter()

    greedy, prompt_lens = make_sequences(args.num_greedy, args.seq_len, 0.0, args.seed)
    sampled, _ = make_sequences(args.num_sampled, args.seq_len, 1.0, args.seed + 1)
    sequences = torch.cat([greedy, sampled])
    target = build(TARGET, WEIGHT_SEED).requires_grad_(False)
    data = run_target(target, sequences)
    agreement = _agreement(greedy, prompt_lens, data.greedy[:len(greedy)])
    print(f"data: {len(sequences)} sequences x {args.seq_len} tokens "
          f"({time.perf_counter() - start:.0f} s); the dense target pass gives "
          f"{agreement:.4f} of the engine's greedy tokens")

    drafter = build(DRAFTER, DRAFT_WEIGHT_SEED)
    drafter.bind_target(target)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=args.steps,
                                                   pct_start=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    for step in range(args.steps):
        rows = torch.randint(0, len(sequences), (args.batch,), generator=gen)
        loss, accuracy = draft_loss(drafter, data, sequences, rows, args.rounds)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss {loss.item():.3f} accuracy per round "
                  + " ".join(f"{a:.2f}" for a in accuracy), flush=True)

    path = save(drafter, args.out)
    print(f"saved {path} ({os.path.getsize(path) / 2**10:.0f} KiB, "
          f"{time.perf_counter() - start:.0f} s)")
    stats = evaluate(args.out, 32, 64, args.rounds, args.seed + 100)
    print(f"engine, held-out prompts, k={args.rounds}: acceptance rate "
          f"{stats['acceptance_rate']:.3f}, mean tokens per step "
          f"{stats['mean_tokens_per_step']:.2f}, per position "
          f"{[round(a, 3) for a in stats['acceptance_per_position']]}")


if __name__ == "__main__":
    main()
