"""rung's Gemma 4 assistant (MTP drafter) vs HF transformers on the same weights.

rung's target prefills its own paged KV cache through the torch reference backend; the
drafter then runs k greedy rounds at the fixed position p = len(prompt) against that cache
and must give HF's drafts and logits (HF's drafter loop after prefill, as
`SinglePositionMultiTokenCandidateGenerator` runs it). Prompts shorter and longer than the
sliding window; the lm_head and the ordered-embedding (centroid) heads; bind_target errors.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    MTP_PROMPT_LENS,
    MTP_VOCAB,
    MTP_WINDOW,
    hf_drafts,
    hf_gemma4_assistant,
    hf_gemma4_target,
    hf_prefill,
)

from rung.core.attention_metadata import CommonAttentionMetadata, validate
from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.forward_context import ForwardContext, forward_context
from rung.kernels.torch_backend import TorchBackend
from rung.models.gemma4 import Gemma4ForCausalLM as RungGemma4
from rung.models.gemma4_mtp import Gemma4AssistantModel
from rung.models.loader import load_model
from rung.models.presets import PRESETS
from rung.runtime.worker.model_runner import find_attention_layers

VOCAB, WINDOW, NUM_DRAFTS, BLOCK_SIZE = MTP_VOCAB, MTP_WINDOW, 3, 16
PROMPT_LENS = MTP_PROMPT_LENS
MAX_BLOCKS_PER_REQ = 4         # 64 positions per request
# 16 centroids of 32 tokens each; the top 4 centroids give 128 candidate tokens per row.
ORDERED = dict(use_ordered_embeddings=True, num_centroids=16, centroid_intermediate_top_k=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    """HF target and assistants, and rung's loads of the same folders (target bound)."""
    out = {"hf_target": hf_gemma4_target()}
    folder = tmp_path_factory.mktemp("target")
    out["hf_target"].save_pretrained(folder)
    out["target"] = load_model(str(folder)).model
    for head, extra in (("lm_head", {}), ("ordered", ORDERED)):
        hf = hf_gemma4_assistant(**extra)
        folder = tmp_path_factory.mktemp(f"assistant_{head}")
        hf.save_pretrained(folder)
        rung = load_model(str(folder)).model
        rung.bind_target(out["target"])
        out[head] = (hf, rung)
    return out


def _prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=gen) for n in PROMPT_LENS]


# --- rung, by hand: paged KV, metadata, forward context ----------------------------------
def _block_tables(num_reqs: int) -> torch.Tensor:
    """[num_reqs, MAX_BLOCKS_PER_REQ] int32: shuffled blocks, so the table must be followed."""
    gen = torch.Generator().manual_seed(6)
    blocks = torch.randperm(num_reqs * MAX_BLOCKS_PER_REQ, generator=gen) + 1   # 0: null
    return blocks.view(num_reqs, MAX_BLOCKS_PER_REQ).int()


def _slots(block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor
           ) -> torch.Tensor:
    """Cache slot of each (request row, position) -> [num_tokens] int64."""
    blocks = block_table[rows, positions // BLOCK_SIZE].long()
    return blocks * BLOCK_SIZE + positions % BLOCK_SIZE


def _empty_cache(layer, num_blocks: int) -> torch.Tensor:
    s = layer.spec
    return torch.zeros(2, num_blocks, BLOCK_SIZE, s.num_kv_heads, s.head_dim)


def _metadata(seq_lens: list[int], query_lens: list[int], block_table: torch.Tensor,
              slot_mapping: torch.Tensor) -> CommonAttentionMetadata:
    num_tokens = sum(query_lens)
    desc = BatchExecutionDescriptor.eager(len(seq_lens), num_tokens)
    qsl = torch.tensor([0] + query_lens).cumsum(0).int()                 # [num_reqs + 1]
    meta = CommonAttentionMetadata(desc, qsl, torch.tensor(seq_lens, dtype=torch.int32),
                                   block_table, slot_mapping, BLOCK_SIZE, max(query_lens),
                                   max(seq_lens))
    validate(meta)
    return meta


def _run(model: torch.nn.Module, meta: CommonAttentionMetadata, fn, *args):
    layers = find_attention_layers(model)
    ctx = ForwardContext(meta.desc, {name: meta for name in layers}, layers)
    with forward_context(ctx):
        return fn(*args)


@torch.no_grad()
def _caches_from_hf(hf_target, prompts: list[torch.Tensor], block_table: torch.Tensor
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """HF's prefill KV paged into caches of the target layers that HF stores it from
    -> (target layer name -> cache, first sampled token [R], target hidden [R, backbone])."""
    cfg = hf_target.config
    store = {cfg.layer_types[i]: i for i, m in enumerate(cfg.kv_sharing_modes) if m == "store"}
    num_blocks = 1 + block_table.numel()
    caches: dict[str, torch.Tensor] = {}
    tokens, hiddens = [], []
    for row, prompt in enumerate(prompts):
        token, hidden, shared_kv = hf_prefill(hf_target, prompt)
        tokens.append(token[0, 0])
        hiddens.append(hidden[0, 0])
        positions = torch.arange(prompt.shape[0])
        slots = _slots(block_table, torch.full_like(positions, row), positions)
        for layer_type, (k, v) in shared_kv.items():                    # [1, kvh, L, hd]
            name = f"model.layers.{store[layer_type]}.self_attn.attn"
            cache = caches.setdefault(name, k.new_zeros(2, num_blocks, BLOCK_SIZE,
                                                        k.shape[1], k.shape[-1]))
            flat = cache.view(2, -1, *cache.shape[3:])                  # [2, slots, kvh, hd]
            flat[0, slots], flat[1, slots] = k[0].transpose(0, 1), v[0].transpose(0, 1)
    return caches, torch.stack(tokens), torch.stack(hiddens)


@torch.no_grad()
def _rung_prefill(target: RungGemma4, prompts: list[torch.Tensor], block_table: torch.Tensor
                  ) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """rung's target prefills every prompt into fresh per-layer caches -> (layer name ->
    cache, first sampled token [R], target hidden of each prompt's last token [R, H])."""
    num_blocks = 1 + block_table.numel()
    for layer in find_attention_layers(target).values():
        layer.bind(TorchBackend, _empty_cache(layer, num_blocks))
    lens = [p.shape[0] for p in prompts]
    positions = torch.cat([torch.arange(n) for n in lens])               # [num_tokens]
    rows = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
    meta = _metadata(lens, lens, block_table, _slots(block_table, rows, positions))
    hidden = _run(target, meta, target, torch.cat(prompts), positions)   # [num_tokens, H]
    last = hidden[torch.tensor(lens).cumsum(0) - 1]                      # [R, backbone]
    caches = {n: layer.kv_cache for n, layer in find_attention_layers(target).items()}
    return caches, target.compute_logits(last).argmax(-1), last


@torch.no_grad()
def _rung_drafts(drafter: Gemma4AssistantModel, caches: dict[str, torch.Tensor],
                 token: torch.Tensor, hidden: torch.Tensor, lens: list[int],
                 block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k greedy rounds, one query per request at position p = len
    -> (drafts [R, k], logits [R, k, vocab])."""
    for layer in find_attention_layers(drafter).values():
        layer.bind(TorchBackend, caches[layer.kv_sharing_target])
    before = {n: c.clone() for n, c in caches.items()}
    positions = torch.tensor(lens)                                       # [R]
    # NOTE: the last sampled token (position p) is not in the KV yet: seq_len = p.
    meta = _metadata(lens, [1] * len(lens), block_table, torch.full((len(lens),), -1))
    tokens, logits = [], []
    for _ in range(NUM_DRAFTS):
        last_hidden, hidden = _run(drafter, meta, drafter, token, hidden, positions)
        logits.append(drafter.compute_logits(last_hidden))               # [R, vocab] fp32
        token = logits[-1].argmax(-1)
        tokens.append(token)
    assert all(torch.equal(before[n], c) for n, c in caches.items()), "drafter wrote KV"
    return torch.stack(tokens, dim=1), torch.stack(logits, dim=1)


def _assert_matches_hf(models: dict, hf_assistant, prompts: list[torch.Tensor],
                       tokens: torch.Tensor, logits: torch.Tensor, atol: float) -> None:
    for i, prompt in enumerate(prompts):
        want_tokens, want_logits = hf_drafts(models["hf_target"], hf_assistant, prompt,
                                             NUM_DRAFTS)
        assert tokens[i].tolist() == want_tokens, (
            f"prompt of {prompt.shape[0]} tokens: rung drafts {tokens[i].tolist()} != HF "
            f"{want_tokens}")
        diff = (logits[i] - want_logits).abs().max().item()
        assert diff <= atol, f"prompt of {prompt.shape[0]} tokens: logit diff {diff:.2e}"


@pytest.mark.parametrize("head", ["lm_head", "ordered"])
def test_drafts_match_hf_on_hf_target_kv(models, head):
    """The drafter alone: HF's prefill KV and hidden state in, HF's k drafts out."""
    hf_assistant, drafter = models[head]
    prompts, block_table = _prompts(), _block_tables(len(PROMPT_LENS))
    caches, token, hidden = _caches_from_hf(models["hf_target"], prompts, block_table)
    tokens, logits = _rung_drafts(drafter, caches, token, hidden, list(PROMPT_LENS),
                                  block_table)
    _assert_matches_hf(models, hf_assistant, prompts, tokens, logits, atol=1e-4)


@pytest.mark.parametrize("head", ["lm_head", "ordered"])
def test_drafts_match_hf_after_rung_prefill(models, head):
    """End to end: rung's target writes the KV the drafter reads."""
    hf_assistant, drafter = models[head]
    prompts, block_table = _prompts(), _block_tables(len(PROMPT_LENS))
    caches, token, hidden = _rung_prefill(models["target"], prompts, block_table)
    tokens, logits = _rung_drafts(drafter, caches, token, hidden, list(PROMPT_LENS),
                                  block_table)
    # NOTE: the target's fp32 rounding (~1e-5 in its hidden state) grows through the k
    # rounds, each feeding its output hidden state to the next: 1e-3, not 1e-4.
    _assert_matches_hf(models, hf_assistant, prompts, tokens, logits, atol=1e-3)


def test_ordered_head_keeps_only_top_centroid_tokens(models):
    """Unselected tokens get one value below every selected logit (graph-safe fill)."""
    _, drafter = models["ordered"]
    hidden = torch.randn(2, 64, generator=torch.Generator().manual_seed(7))
    logits = drafter.compute_logits(hidden)                              # [2, vocab]
    for row in logits:
        fill = row.min()
        num_selected = int((row > fill).sum())
        assert num_selected == (ORDERED["centroid_intermediate_top_k"] * VOCAB
                                // ORDERED["num_centroids"])
        assert torch.isclose(row[row > fill].min() - 1.0, fill)


def test_bind_target_reads_last_own_kv_layer_of_each_type(models):
    _, drafter = models["lm_head"]
    layers = find_attention_layers(drafter)
    assert {n: (layer.kv_sharing_target, layer.spec.writes_kv, layer.spec.sliding_window)
            for n, layer in layers.items()} == {
        "draft.model.layers.0.self_attn.attn": ("model.layers.4.self_attn.attn", False,
                                                WINDOW + 1),
        "draft.model.layers.1.self_attn.attn": ("model.layers.5.self_attn.attn", False, None)}
    assert drafter._target is models["target"]
    assert not [n for n in drafter.state_dict() if n.startswith("_target")], (
        "the target must not be a submodule of the drafter")


def _preset_pair(**changes) -> tuple[RungGemma4, Gemma4AssistantModel]:
    cfg = dict(PRESETS["tiny-gemma4-mtp"])
    text = {**cfg["text_config"], **changes.pop("text", {})}
    return RungGemma4(PRESETS["tiny-gemma4"]), Gemma4AssistantModel({**cfg, **changes,
                                                                     "text_config": text})


@pytest.mark.parametrize("changes, message", [
    ({"backbone_hidden_size": 64}, "backbone_hidden_size=64 != target hidden_size=128"),
    ({"text": {"vocab_size": 256}}, "vocab_size=256 != target vocab_size=512"),
    ({"text": {"global_head_dim": 32}}, "head_dim 32 .* target layer 5 .* head_dim 64"),
    ({"text": {"layer_types": ["full_attention", "full_attention"]}}, None),
])
def test_bind_target_rejects_mismatched_target(changes, message):
    target, drafter = _preset_pair(**changes)
    if message is None:          # all-full drafters only need the target's full layer
        drafter.bind_target(target)
        return
    with pytest.raises(ValueError, match=message):
        drafter.bind_target(target)


@pytest.mark.parametrize("text, field", [
    ({"num_kv_shared_layers": 1}, "num_kv_shared_layers=1"),
    ({"hidden_size_per_layer_input": 8}, "hidden_size_per_layer_input=8"),
    ({"enable_moe_block": True}, "enable_moe_block needs num_experts"),
    ({"use_double_wide_mlp": True}, "use_double_wide_mlp=True"),
])
def test_rejects_unsupported_config(text, field):
    with pytest.raises(ValueError, match=field):
        _preset_pair(text=text)


def test_preset_drafts_for_tiny_gemma4():
    target, drafter = load_model("tiny-gemma4").model, load_model("tiny-gemma4-mtp").model
    drafter.bind_target(target)
    block_table = _block_tables(len(PROMPT_LENS))
    caches, token, hidden = _rung_prefill(target, _prompts(), block_table)
    tokens, logits = _rung_drafts(drafter, caches, token, hidden, list(PROMPT_LENS),
                                  block_table)
    assert tokens.shape == (len(PROMPT_LENS), NUM_DRAFTS)
    assert logits.dtype == torch.float32 and bool(logits.isfinite().all())
