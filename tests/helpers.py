"""Helpers the tests share (tests import from here, never from another test module).

- HF transformers as the numerical oracle: tiny random models saved to a folder, greedy
  continuations and logprobs to hold rung to, and rung's own greedy run on such a folder;
- attention batches that keep the descriptor contract, for kernel tests;
- a Gemma 4 target with its MTP assistant (HF), and HF's drafter loop.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import (
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
)

from rung.core.attention_metadata import PAD_SLOT_ID, CommonAttentionMetadata, validate
from rung.core.descriptor import BatchExecutionDescriptor
from rung.core.graph_mode import CUDAGraphMode
from rung.kernels.backend import AttentionLayerSpec

PROMPT_LENS = [1, 7, 13, 22, 31, 40, 51, 60]


def save_hf_model(model, folder) -> str:
    model.save_pretrained(folder)
    return str(folder)


def random_prompts(vocab_size: int, lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lens]


def run_greedy(folder: str, prompts: list[list[int]], num_tokens: int, **kwargs):
    """(llm, outputs) of rung on an HF folder in fp32 on CPU: ``num_tokens`` greedy tokens
    per prompt with their logprobs, a 32-token step budget (so long prompts prefill in
    chunks); every KV block is back in the pool afterwards."""
    from rung.runtime import LLM, SamplingParams

    llm = LLM(folder, dtype="float32", device="cpu", max_num_seqs=4,
              max_num_batched_tokens=32, max_model_len=128, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=num_tokens, min_tokens=num_tokens,
                            logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    stats = llm.engine.stats()
    assert stats["kv_free_blocks"] == stats["kv_total_blocks"]
    return llm, outs


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """HF's greedy continuation of one prompt and each token's raw logprob."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens,
                         min_new_tokens=num_tokens, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def assert_matches_hf(hf_model, outputs, prompts, num_tokens: int, atol: float = 1e-4) -> None:
    for prompt, out in zip(prompts, outputs):
        want_tokens, want_lps = hf_greedy(hf_model, prompt, num_tokens)
        got = out.outputs[0]
        assert got.token_ids == want_tokens, (
            f"prompt of {len(prompt)} tokens: rung {got.token_ids} != HF {want_tokens}")
        got_lps = [next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob
                   for d, t in zip(got.logprobs, got.token_ids)]
        diff = max(abs(a - b) for a, b in zip(got_lps, want_lps))
        assert diff <= atol, f"prompt of {len(prompt)} tokens: logprob diff {diff:.2e} > {atol}"


# --- model families on the Llama layout (HF oracle, random weights) ----------------------
FAMILY_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    initializer_range=0.1, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
# HF model_type -> config kwargs that exercise what the family declares differently
FAMILY_CONFIGS = {
    "qwen2": dict(FAMILY_SMALL, tie_word_embeddings=True),
    # window 24 < the longest prompts (31..60 tokens): old keys leave the window mid-prompt
    "phi3": dict(FAMILY_SMALL, partial_rotary_factor=0.5, sliding_window=24, pad_token_id=0),
    # 5 sliding layers : 1 full, window 16 < the longest prompts; one KV head; an attention
    # scale that is not head_dim's; own local / global rope bases; final logit soft-cap
    "gemma3_text": dict(FAMILY_SMALL, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=32, query_pre_attn_scalar=24, sliding_window=16,
                        final_logit_softcapping=30.0, pad_token_id=0,
                        rope_parameters={"sliding_attention": {"rope_type": "default",
                                                               "rope_theta": 1000.0},
                                         "full_attention": {"rope_type": "default",
                                                            "rope_theta": 100000.0}}),
}


def randomize_small_params(model: torch.nn.Module, seed: int) -> None:
    """Biases and norm weights away from HF's 0 / 1 init, so a mis-loaded one shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith(".bias"):
                tensor.copy_(0.5 * torch.randn(tensor.shape, generator=gen))
            elif name.endswith("norm.weight"):
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=gen))


def hf_family_model(model_type: str, vocab_size: int, **overrides):
    """HF's model of ``model_type`` with FAMILY_CONFIGS' config and random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab_size,
                               **{**FAMILY_CONFIGS[model_type], **overrides},
                               attn_implementation="eager")
    model = AutoModelForCausalLM.from_config(cfg).eval()
    randomize_small_params(model, 1)
    return model


# --- attention batches ---------------------------------------------------------------------
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_SPARE_BLOCKS = 3          # allocated in the cache, never handed to a request


@dataclasses.dataclass
class Batch:
    meta: CommonAttentionMetadata
    query: torch.Tensor        # [num_tokens_padded, num_heads, head_dim]
    key: torch.Tensor          # [num_tokens_padded, num_kv_heads, head_dim]
    value: torch.Tensor        # [num_tokens_padded, num_kv_heads, head_dim]
    kv_cache: torch.Tensor     # [2, num_blocks, block_size, num_kv_heads, head_dim]
    layer: AttentionLayerSpec

    @property
    def real_slots(self) -> torch.Tensor:
        return self.meta.slot_mapping[: self.meta.num_tokens]   # [num_tokens] int64


def make_batch(gen: torch.Generator, q_lens: list[int], seq_lens: list[int], *,
               num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 32,
               block_size: int = 4, dtype: torch.dtype = torch.float32,
               num_pad_reqs: int = 0, num_pad_tokens: int = 0,
               uniform_query_len: int | None = None, max_seq_len: int | None = None,
               max_query_len: int | None = None, sliding_window: int | None = None,
               logit_softcap: float | None = None, device: torch.device = DEVICE) -> Batch:
    """A batch whose query tokens are the last q_len of seq_len tokens per request.

    Pads follow the descriptor contract: a FULL descriptor, pad rows with seq_len 0 and
    block-table rows 0 (the null block), query_start_loc flat, pad tokens with slot -1.
    """
    num_reqs, num_tokens = len(q_lens), sum(q_lens)
    num_reqs_padded, num_tokens_padded = num_reqs + num_pad_reqs, num_tokens + num_pad_tokens
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + NUM_SPARE_BLOCKS
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()   # block 0 is null
    block_table = torch.zeros(num_reqs_padded, max(blocks_per_req) + 1, dtype=torch.int32)
    slots = []
    for row, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        for col in range(blocks_per_req[row]):
            block_table[row, col] = free.pop()
        for pos in range(seq_len - q_len, seq_len):
            slots.append(int(block_table[row, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots + [PAD_SLOT_ID] * num_pad_tokens, dtype=torch.int64)
    query_start_loc = torch.tensor([0] + q_lens + [0] * num_pad_reqs).cumsum(0).to(torch.int32)
    mode = CUDAGraphMode.FULL if num_pad_reqs or num_pad_tokens else CUDAGraphMode.NONE
    desc = BatchExecutionDescriptor(mode, num_reqs, num_reqs_padded, num_tokens,
                                    num_tokens_padded, uniform_query_len)
    meta = CommonAttentionMetadata(
        desc, query_start_loc.to(device),
        torch.tensor(seq_lens + [0] * num_pad_reqs, dtype=torch.int32, device=device),
        block_table.to(device), slot_mapping.to(device), block_size,
        max_query_len or max(q_lens), max_seq_len or max(seq_lens))
    validate(meta)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    layer = AttentionLayerSpec(num_heads, num_kv_heads, head_dim, head_dim ** -0.5,
                               sliding_window, logit_softcap)
    return Batch(meta, randn(num_tokens_padded, num_heads, head_dim),
                 randn(num_tokens_padded, num_kv_heads, head_dim),
                 randn(num_tokens_padded, num_kv_heads, head_dim),
                 randn(2, num_blocks, block_size, num_kv_heads, head_dim), layer)


# --- Gemma 4 + MTP assistant (HF) ----------------------------------------------------------
MTP_VOCAB, MTP_WINDOW = 512, 16
MTP_PROMPT_LENS = (5, 40)      # inside and beyond the sliding window
GEMMA4_TARGET = dict(vocab_size=MTP_VOCAB, hidden_size=128, intermediate_size=256,
                     num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2,
                     head_dim=32, global_head_dim=64, sliding_window=MTP_WINDOW,
                     hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                     initializer_range=0.1)
GEMMA4_ASSISTANT_TEXT = dict(vocab_size=MTP_VOCAB, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=32, global_head_dim=64, sliding_window=MTP_WINDOW,
                             hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                             num_kv_shared_layers=2, initializer_range=0.1,
                             layer_types=["sliding_attention", "full_attention"])


def _randomize_norms(model: torch.nn.Module, seed: int) -> None:
    """Norm weights and layer scalars away from 1, so a mis-loaded one shows."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in model.state_dict().items():
        if name.endswith("norm.weight") or name.endswith("layer_scalar"):
            tensor.copy_(0.5 + torch.rand(tensor.shape, generator=gen))


def hf_gemma4_target() -> Gemma4ForCausalLM:
    torch.manual_seed(0)
    model = Gemma4ForCausalLM(Gemma4TextConfig(**GEMMA4_TARGET, attn_implementation="eager")).eval()
    _randomize_norms(model, 1)
    return model


def hf_gemma4_assistant(**extra) -> Gemma4AssistantForCausalLM:
    torch.manual_seed(2)
    text = Gemma4TextConfig(**GEMMA4_ASSISTANT_TEXT, attn_implementation="eager")
    cfg = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=128, **extra)
    model = Gemma4AssistantForCausalLM(cfg).eval()
    _randomize_norms(model, 3)
    if model.masked_embedding is not None:
        gen = torch.Generator().manual_seed(4)
        model.masked_embedding.token_ordering.copy_(torch.randperm(MTP_VOCAB, generator=gen))
    return model


@torch.no_grad()
def hf_prefill(target, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """-> (sampled token [1, 1] at position L, its target hidden [1, 1, backbone],
    shared_kv_states: layer type -> (k, v) [1, kvh, L, hd])."""
    out = target(prompt[None], output_hidden_states=True, return_shared_kv_states=True)
    return out.logits[:, -1:].argmax(-1), out.hidden_states[-1][:, -1:], out.shared_kv_states


@torch.no_grad()
def hf_drafts(target, assistant, prompt: torch.Tensor, num_drafts: int
              ) -> tuple[list[int], torch.Tensor]:
    """HF's drafter loop right after the target prefilled ``prompt`` and sampled one token:
    -> (k draft tokens, their logits [k, vocab])."""
    token, hidden, shared_kv = hf_prefill(target, prompt)
    position = torch.tensor([[prompt.shape[0]]])
    mask = torch.ones(1, prompt.shape[0] + 1, dtype=torch.long)
    tokens, logits = [], []
    for _ in range(num_drafts):
        embeds = torch.cat((target.get_input_embeddings()(token), hidden), dim=-1)
        step = assistant(inputs_embeds=embeds, position_ids=position, attention_mask=mask,
                         shared_kv_states=shared_kv, use_cache=False)
        token, hidden = step.logits.argmax(-1), step.last_hidden_state
        tokens.append(int(token))
        logits.append(step.logits[0, 0])
    return tokens, torch.stack(logits)


# --- host transfers ------------------------------------------------------------------------
def conversions_in_steps(engine, add_requests) -> list[int]:
    """Tensor-to-host conversions (tolist, item, cpu, numpy, int/float/bool) of each
    ``engine.step()`` until every request added by ``add_requests(engine)`` finished."""
    from rung.bench.host_syncs import conversions_per_step

    return [sum(c.values()) for c in conversions_per_step(engine, add_requests)]
